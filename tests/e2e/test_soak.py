"""The soak, CI-sized: clients, disconnects and faults for a few seconds; nothing may be left over.

It asserts the guarantee, not speed: no leaked blocks, requests or leases, no
hung stream, no process outliving the group (``python -m benchmarks.soak`` runs it long);
that decode's KV pulls went through the faulted proxy in front of prefill's KV port; that
every answer was right and every damaged pull caught; and issue 53's goals (the soak's
exit status says whether each was met).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.quick_benchmarks import run_quick


def test_a_quick_soak_leaves_nothing_behind(tmp_path: Path) -> None:
    completed, out = run_quick("benchmarks.soak", tmp_path, timeout=300)
    print(completed.stdout, completed.stderr)
    assert out.exists(), completed.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["requests"] > 0
    assert result["faults_total"] > 0
    assert result["kv_connections_proxied"] > 0  # decode pulled KV through the faulted port
    assert result["healthy_again"]
    assert result["leaks"] == {}, result["leaks"]
    assert result["hung"] == [], result["hung"]
    assert result["processes"]["left_behind"] == []
    # the corrupting decode damaged pulls, and each was caught: no wrong answer
    assert result["kv_digest"]["corrupted_pulls"] > 0
    assert result["kv_digest"]["digest_mismatches"] >= result["kv_digest"]["corrupted_pulls"]
    assert sum(row["wrong"] for row in result["per_fault"].values()) == 0
    missed = [goal["goal"] for goal in result["goals"] if not goal["met"]]
    assert missed == [], completed.stdout
    assert completed.returncode == 0, completed.stdout
