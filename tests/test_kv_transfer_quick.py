"""``python -m benchmarks.kv_transfer --quick``: it runs to the end, every pull's bytes are
checked (by the benchmark itself), and each setup moved its KV the way it says.

Structure only: no bandwidth or latency figure is compared with anything (the machine
is shared).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.quick_benchmarks import run_quick


def test_quick_run_measures_every_size_and_setup(tmp_path: Path) -> None:
    completed, out = run_quick("benchmarks.kv_transfer", tmp_path, timeout=400)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-8000:]
    assert "KV pull bandwidth, GB/s" in completed.stdout

    report = json.loads(out.read_text())
    bandwidth = report["bandwidth"]
    assert [row["size_mib"] for row in bandwidth] == [1, 16, 64, 256]
    for row in bandwidth:
        for name in ("nixl_read", "nixl_pull", "tcp_pull", "copy_cold", "copy_hot"):
            assert row[f"{name}_gbps"] > 0, (name, row)

    handoff = {row["setup"]: row for row in report["handoff"]}
    assert set(handoff) == {"nixl", "tcp", "colocated"}
    assert handoff["nixl"]["pulled_over"] == "nixl"
    assert handoff["tcp"]["pulled_over"] == "tcp"
    assert handoff["colocated"]["pulled_over"] == ""  # nothing to pull
    assert all(row["second_token_ms"] > row["ttft_ms"] > 0 for row in handoff.values())
    assert set(report["idle_cpu_percent"]) == {
        "nixl prefill",
        "nixl decode",
        "tcp prefill",
        "tcp decode",
    }
