"""``python -m benchmarks.abandoned_prefill --quick``: clients that leave during prefill, a
stalled prefill link and a stopped prefill worker leave both workers idle, no lease expired.

What the workers' statistics say only: no timing figure is compared with anything (the
machine is shared).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.quick_benchmarks import run_quick


def test_quick_run_leaves_nothing_pinned(tmp_path: Path) -> None:
    completed, out = run_quick("benchmarks.abandoned_prefill", tmp_path, timeout=400)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    assert "until both workers idle" in completed.stdout

    report = json.loads(out.read_text())
    for case in ("storm", "storm_stalled", "sigstop"):
        row = report[case]
        assert row["idle_after_s"] is not None, (case, row["stats"])
        assert row["leases_expired"] == 0, case
        assert all(stats["kv_leases"] == 0 for stats in row["stats"]), case
    # every stopped prefill's client got an answer (the link timed out: 503)
    assert sum(report["sigstop"]["answers"].values()) == report["plan"]["stopped_clients"]
