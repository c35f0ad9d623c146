"""``python -m benchmarks.router_cost --quick`` runs end to end and reports every row.

Structure only: no figure is compared with anything (the machine is shared).
"""

from __future__ import annotations

import json
import numbers
from pathlib import Path

from benchmarks.router_cost import QUICK, plan
from tests.quick_benchmarks import run_quick

_RUN_KEYS = {
    "server",
    "app",
    "load",
    "clients",
    "max_tokens",
    "window_s",
    "tokens",
    "requests",
    "failures",
    "failures_total",
    "incomplete",
    "router_cpu_s",
    "router_ms_per_request",
    "router_us_per_token",
    "ttft_p50_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "itl_token_p99_ms",
    "decode_own_itl_p99_ms",
    "added_itl_p99_ms",
    "pace",
    "offered_tokens_per_s",
}


def test_quick_run_reports_every_row(tmp_path: Path) -> None:
    completed, out = run_quick("benchmarks.router_cost", tmp_path, timeout=300)
    assert completed.returncode == 0, completed.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["quick"] is True

    # one run per (server, load) of the plan, each with its figures
    expected = {(server.key, load.key) for server, loads in plan(QUICK) for load in loads}
    runs = report["runs"]
    assert {(r["server"], r["load"]) for r in runs} == expected
    assert len(runs) == len(expected)
    for r in runs:
        assert _RUN_KEYS <= r.keys(), (r["server"], r["load"])
        assert r["window_s"] > 0 and r["router_cpu_s"] >= 0
        assert isinstance(r["tokens"], int) and isinstance(r["failures_total"], dict)
    # paced pdtrio runs read the decode worker directly too
    paced = [r for r in runs if r["app"] == "pdtrio" and r["step_ms"] > 0]
    assert paced and all("decode_own_samples" in r for r in paced)

    # the table: six columns, a row for every load of the issue
    rows = report["rows"]
    assert rows and all(len(cells) == 6 for cells in rows)
    loads = [cells[0] for cells in rows if cells[0]]
    # short x2, one token, paced x2 x egress on/off, paced against grouped events, fast x2,
    # two routers
    assert len(loads) == 2 + 1 + 4 + 1 + 2 + 1
    assert any("two router processes" in label for label in loads)

    # goals: each one named, with a verdict (or none when nothing was measured)
    goals = report["goals"]
    assert len(goals) == 8
    for g in goals:
        assert g["goal"] and g["pass"] in (True, False, None)
        assert g["value"] is None or isinstance(g["value"], numbers.Real)

    # what hypercorn-trio itself does, beside each goal (the trivial app's floor)
    assert len(report["floors"]) == 3 and all(report["floors"])
    grouped = next(r for r in runs if r["server"] == "trivial_grouped")
    assert grouped["tokens_per_event"] > 1

    # the printed report: the markdown table and the goals
    assert (
        "| load | measure | pdtrio | trivial app | pdtrio vs trivial | goal |" in completed.stdout
    )
    assert "goals:" in completed.stdout
