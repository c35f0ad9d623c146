"""``python -m benchmarks.discovery --quick`` runs end to end and prints every table.

Structure only: no timing is compared with anything (the machine is shared).
"""

from __future__ import annotations

import json
from pathlib import Path

from pdtrio.testing.etcd import require_etcd
from tests.quick_benchmarks import run_quick


def test_quick_run_prints_the_tables_and_the_goals(tmp_path: Path) -> None:
    require_etcd()
    completed, out = run_quick("benchmarks.discovery", tmp_path, timeout=240)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    printed = completed.stdout
    for heading in ("## 1. cost", "## 2. churn under load", "## 3. etcd outages"):
        assert heading in printed
    assert "| measure | (a) static list | (b) etcd | (b)/(a) |" in printed
    assert "| event | n | measure | p50 / max ms |" in printed
    for goal in (
        "0 failed requests from graceful joins/leaves",
        "only the killed worker's in-flight requests fail",
        "0 failed during the etcd outage",
        "discovery adds no CPU per request",
    ):
        assert goal in printed

    report = json.loads(out.read_text())
    assert {"static", "etcd"} <= report["cost"].keys()
    events = {e["event"] for e in report["churn"]["events"]}
    assert events == {"join prefill", "join decode", "leave prefill", "leave decode", "kill decode"}
    assert len(report["outages"]["outages"]) == 1
    assert [g["pass"] for g in report["goals"][:3]] == [True, True, True]
