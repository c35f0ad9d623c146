"""Every benchmark's ``--quick`` mode, run as a user runs it, so that none can rot unseen.

``python -m <benchmark> --quick --json FILE`` from the repository root: it must exit 0,
and what it prints and writes must have the shape its report promises.  Structure and
correctness only: no timing, bandwidth or memory figure is compared with anything (the
machine is shared).  Each ``--quick`` is sized to take well under two minutes on a
2-core machine (see ``QUICK``); :func:`test_every_benchmark_is_run_quick` keeps the list
whole: a new benchmark without an entry here fails it.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from pdtrio.testing.etcd import require_etcd
from tests.quick_benchmarks import ROOT, run_quick

Check = Callable[[str, Any], None]


# --- what each report must say --------------------------------------------------------------


def _big_inputs(printed: str, report: Any) -> None:
    assert "RSS at the end vs. the start" in printed
    rows = {row["kind"].split(" ", 1)[1]: row for row in report["rows"]}
    assert set(rows) == {"token ids", "messages", "MB prompt"}, rows
    # each huge request is refused, none is served, and /health answered all along
    assert all(row["status"] == 400 for row in rows.values()), rows
    assert rows["token ids"]["code"] == rows["messages"]["code"] == "context_length_exceeded"
    assert all(row["probes"] > 0 for row in rows.values())
    assert set(report["memory"]) == {
        "router_rss_start_mb",
        "router_rss_end_mb",
        "prefill_rss_start_mb",
        "prefill_rss_end_mb",
    }


def _capacity(printed: str, report: Any) -> None:
    assert "TTFT p50 ms" in printed
    streamed, burst = report
    # the first run: every request waits its turn and completes
    assert streamed["ok"] == streamed["requests"] > 0, streamed
    assert streamed["ttft_p99_ms"] >= streamed["ttft_p50_ms"] > 0
    # the burst: completed or refused at once, never a 200 followed by an error
    assert burst["200_then_error"] == 0, burst
    assert burst["ok"] + burst["429"] == burst["requests"], burst
    assert burst["ok"] > 0 and burst["429"] > 0, burst


def _pd_vs_colocated(printed: str, report: Any) -> None:
    assert "TTFT p50 ms" in printed and "steps/s" in printed
    assert report["benchmark"] == "pd_vs_colocated"
    (case,) = report["results"]  # quick: tiny-random ISL 128 only
    assert case["model"] == "tiny-random" and case["isl"] == 128
    for mode in ("pd", "colocated"):
        figures = case[mode]
        assert figures["ttft_ms"] > 0 and figures["tpot_ms"] > 0, (mode, figures)
        assert figures["steps_per_s"] > 0 and figures["itl_p50_ms"] > 0, (mode, figures)
    for key in ("ttft_diff_pct", "tpot_diff_pct", "itl_diff_pct"):
        assert isinstance(case[key], numbers.Real)


def _token_path(printed: str, report: Any) -> None:
    for heading in ("1. ingest", "2. end to end", "3. light load"):
        assert heading in printed
    assert report["quick"] is True
    assert report["ingest"] and all(row["tokens_per_cpu_s"] > 0 for row in report["ingest"])
    assert all(row["overflows"] == 0 for row in report["ingest"])
    for row in report["e2e"]:
        assert row["failures"] == {}, row
        # requests that ended within the measured window, clients streaming back to back
        assert row["requests_done"] > 0 and row["tokens"] > 0, row
    assert {row["coalesce"] for row in report["latency"]} == {True, False}
    assert all(row["samples"] > 0 for row in report["latency"])


def _hostile_bytes(printed: str, report: Any) -> None:
    assert "goals: all met" in printed or "goals: MISSED" in printed
    # every process kept serving, every over-cap declaration got its 413, nothing logged a
    # traceback
    assert all(row["serves"] for row in report["upgrades"]), report["upgrades"]
    assert {row["target"] for row in report["upgrades"]} == {
        "router",
        "prefill-0",
        "decode-0",
        "decode-1",
    }
    assert set(report["declared_20_mb"]["statuses"]) == {"413"}, report["declared_20_mb"]
    assert all(row["tracebacks"] == 0 and row["serves"] for row in report["unsent_bodies"])
    assert report["serves_at_the_end"]
    # under a stopped decode, requests sent after the stop did not wait for its SIGCONT
    for stopped in report["stopped_decode"].values():
        for name, row in stopped["rows"].items():
            assert row["requests"] > 0, (name, row)
            assert row["stall_max_s"] < stopped["sigcont_after_s"] - 1, (name, row)
    moved = report["stopped_decode"]["two decodes: streams move"]["rows"]
    assert all(row["completed"] == row["requests"] for row in moved.values()), moved


def _worker_limits(printed: str, report: Any) -> None:
    assert "unauthenticated: nothing but refusals" in printed
    unauth = report["unauthenticated"]
    probes = unauth["probes"]
    posts = probes.pop("posts")
    # each answered after its headers alone, none of its body sent yet
    assert [post["status"] for post in posts] == [401] * 8
    assert set(probes) == {
        "/pd/link on decode",
        "/pd/link on prefill",
        "KV port, zero proof",
        "POST /pd/release of a live request",
    }
    assert all(probe["refused"] for probe in probes.values()), probes
    assert "HTTP 403" in probes["/pd/link on prefill"]["answer"]
    assert probes["POST /pd/release of a live request"]["answer"] == "HTTP 401"
    assert unauth["kv_blocks_after"] == unauth["kv_blocks_before"] > 0
    assert unauth["kv_leases_after"] == unauth["kv_leases_before"] == 1
    assert unauth["freed_with_secret_without_grant"] is False

    # a flood of silent HTTP connections: the worker keeps its bound, a peer still gets in
    flood = report["http_flood"]
    assert flood["peer_answer"] == "200"
    assert flood["still_open"] <= 256  # the default max_unauthenticated_connections
    assert flood["evicted"] >= flood["count"] - 256


def _discovery(printed: str, report: Any) -> None:
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

    assert {"static", "etcd"} <= report["cost"].keys()
    events = {e["event"] for e in report["churn"]["events"]}
    assert events == {"join prefill", "join decode", "leave prefill", "leave decode", "kill decode"}
    assert len(report["outages"]["outages"]) == 1
    assert [g["pass"] for g in report["goals"][:3]] == [True, True, True]


_ROUTER_COST_RUN_KEYS = {
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


def _router_cost(printed: str, report: Any) -> None:
    from benchmarks.router_cost import QUICK, floor_loads, plan

    assert report["quick"] is True
    # one run per (server, load) of the plan, each with its figures
    expected = {(server.key, load.key) for server, loads in plan(QUICK) for load in loads}
    runs = report["runs"]
    assert {(r["server"], r["load"]) for r in runs} == expected
    assert len(runs) == len(expected)
    for r in runs:
        assert _ROUTER_COST_RUN_KEYS <= r.keys(), (r["server"], r["load"])
        assert r["window_s"] > 0 and r["router_cpu_s"] >= 0
        assert isinstance(r["tokens"], int) and isinstance(r["failures_total"], dict)
    # paced pdtrio runs read the decode worker directly too
    paced = [r for r in runs if r["app"] == "pdtrio" and r["step_ms"] > 0]
    assert paced and all("decode_own_samples" in r for r in paced)

    # the link exchange alone, for each short load: its process's CPU per request it ended
    floors = report["link_floor"]
    assert [f["load"] for f in floors] == [load.key for load in floor_loads(QUICK)]
    for f in floors:
        assert f["requests"] > 0 and f["failures"] == 0, f
        assert f["cpu_s"] > 0 and f["ms_per_request"] > 0, f

    # the table: six columns, a row for every load of the issue
    rows = report["rows"]
    assert rows and all(len(cells) == 6 for cells in rows)
    # the link floor beside each short load on kept-alive connections
    assert sum(cells[1].startswith("link floor") for cells in rows) == len(floors)
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

    # what hypercorn-trio itself does, beside each goal (the trivial app's floor), and the link's
    assert len(report["floors"]) == 4 and all(report["floors"])
    grouped = next(r for r in runs if r["server"] == "trivial_grouped")
    assert grouped["tokens_per_event"] > 1

    # the printed report: the markdown table and the goals
    assert "| load | measure | pdtrio | trivial app | pdtrio vs trivial | goal |" in printed
    assert "goals:" in printed


def _kv_transfer(printed: str, report: Any) -> None:
    # every pull's bytes are checked by the benchmark itself
    assert "KV pull bandwidth, GB/s" in printed
    assert "256 MiB: READ " in printed  # the goal, judged per size
    bandwidth = report["bandwidth"]
    assert [row["size_mib"] for row in bandwidth] == [1, 16, 64, 256]
    for row in bandwidth:
        for name in ("nixl_read", "nixl_pull", "tcp_pull", "copy_cold", "copy_hot", "kernel_copy"):
            assert row[f"{name}_gbps"] > 0, (name, row)

    # each setup moved its KV the way it says
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
    # the verified handoff's cost, in the same run
    _kv_digest(printed, report["kv_digest"])


def _kv_digest(printed: str, report: Any) -> None:
    # every checked pull passed its check, asserted by the benchmark itself
    assert "with and without the check" in printed and "the default this run argues for" in printed
    rows = report["handoffs"]
    assert {(r["isl"], r["transport"], r["kv_digest"]) for r in rows} == {
        (isl, transport, digest)
        for isl in (256, 1024)
        for transport in ("nixl", "tcp")
        for digest in ("off", "sampled", "full", "lines:16")
    }
    for row in rows:
        assert row["pull_ms"] > 0 and row["handoff_ms"] > 0, row
        if row["kv_digest"] == "off":
            assert row["record_ms"] + row["check_ms"] < 0.1 and row["digest_share"] < 0.01, row
        else:
            assert row["record_ms"] > 0 and row["check_ms"] > 0, row
    assert report["sampling_needed"] == (report["full_share_max"] > 0.05)


def _abandoned_prefill(printed: str, report: Any) -> None:
    # clients that leave during prefill, a stalled prefill link and a stopped prefill
    # worker leave both workers idle, no lease expired
    assert "until both workers idle" in printed
    for case in ("storm", "storm_stalled", "sigstop"):
        row = report[case]
        assert row["idle_after_s"] is not None, (case, row["stats"])
        assert row["leases_expired"] == 0, case
        assert all(stats["kv_leases"] == 0 for stats in row["stats"]), case
    # every stopped prefill's client got an answer (the link timed out: 503)
    assert sum(report["sigstop"]["answers"].values()) == report["plan"]["stopped_clients"]


def _migration(printed: str, report: Any) -> None:
    assert "| fault | migrated streams |" in printed
    streams = report["settings"]["streams"]
    assert set(report["faults"]) == {"kill", "stop"}
    for kind, fault in report["faults"].items():
        # every stream on the faulted decode went on on the other, equal to the undisturbed
        assert fault["streams_not_equal_to_undisturbed"] == 0, (kind, fault)
        assert fault["migrated_streams"] == fault["migrations_counted"] == streams // 2
        assert fault["gap_at_fault_p99_ms"] >= fault["gap_at_fault_p50_ms"] > 0
    assert report["faults"]["kill"]["sockets_closed_p50_ms"] > 0
    assert report["itl_p50_ms"] > 0 and report["continuation_ttft_floor_p50_ms"] > 0


def _engine(printed: str, report: Any) -> None:
    assert "| server | dtype | c | TTFT p50 ms |" in printed
    assert "memory floor of one decode step at c=1, float32" in printed
    assert report["benchmark"] == "engine" and report["vllm"]["status"] == "not run (--quick)"
    rows = {(r["server"], r["dtype"], r["concurrency"]) for r in report["rows"]}
    # both modes, both dtypes, each concurrency of the quick plan
    assert rows == {
        (server, dtype, c)
        for server in ("pdtrio colocated", "pdtrio pd")
        for dtype in ("float32", "bfloat16")
        for c in (1, 4)
    }
    for r in report["rows"]:
        assert r["requests"] >= 4 and r["failed"] == 0 and len(r["ttfts_ms"]) == r["requests"], r
        assert r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0 and r["tpot_p50_ms"] > 0, r
        assert r["output_tokens_per_s"] > 0, r
    floor = report["memory_floor"]
    assert floor["read_gbps"] > 0
    # bfloat16 weights are half the bytes of float32 ones
    assert floor["bfloat16"]["weights_bytes"] * 2 == floor["float32"]["weights_bytes"]


def _multi_turn(printed: str, report: Any) -> None:
    assert "TTFT p50 off" in printed and "on/off p50" in printed
    assert report["benchmark"] == "multi_turn" and report["quick"] is True
    plan = report["plan"]
    cases = {case["engine"]: case for case in report["cases"]}
    assert set(cases) == {"synthetic", "tiny-random"}
    for name, case in cases.items():
        turns = case["turns"]
        assert [row["turn"] for row in turns] == list(range(1, plan["turns"] + 1))
        for row in turns:
            for mode in ("off", "on"):
                assert row[mode]["requests"] == plan["conversations"], (name, row)
                assert row[mode]["ttft_p99_ms"] >= row[mode]["ttft_p50_ms"] > 0, (name, row)
            # the prompts grow, the same in both modes; without the cache nothing is cached
            assert row["on"]["prompt_tokens_mean"] == row["off"]["prompt_tokens_mean"]
            assert row["off"]["cached_fraction"] == 0, (name, row)
        # from the second turn, the last turn's prompt (and the system prompt) is found
        assert all(row["on"]["cached_fraction"] > 0.5 for row in turns[1:]), (name, turns)
        # what usage said was cached is what the prefill worker's /metrics counted
        assert case["usage_cached_tokens"]["off"] == case["metrics_hit_tokens"]["off"] == 0
        assert case["usage_cached_tokens"]["on"] == case["metrics_hit_tokens"]["on"] > 0
        assert case["goal"]["pass"] in (True, False)
    routing = report["routing"]
    assert "cache-aware" in printed and routing["engine"] == "synthetic"
    modes = routing["modes"]
    assert set(modes) == {
        "cache off",
        "one prefill",
        "round robin",
        "cache-aware",
        "+ local prefill",
    }
    for figures in modes.values():
        assert 0 <= figures["cached_share"] <= 1 and figures["ttft_p50_ms"] > 0
        assert figures["ttft_p50_vs_off"] > 0
    assert modes["cache off"]["cached_share"] == 0
    # one prefill holds every conversation's earlier turns
    assert modes["one prefill"]["cached_share"] > 0.5, modes
    # only the mode with local prefill on prefills on decode: every later turn there
    # (decode holds the history it pulled)
    assert [m for m, f in modes.items() if f["local_prefill_share"]] == ["+ local prefill"]
    turns = plan["turns"]
    assert modes["+ local prefill"]["local_prefill_share"] == (turns - 1) / turns, modes
    assert routing["goal"]["pass"] in (True, False)
    assert routing["ttft_goal"]["pass"] in (True, False)


def _structured_output(printed: str, report: Any) -> None:
    assert "schema tok/s" in printed and "plain TPOT ms" in printed
    assert report["benchmark"] == "structured_output"
    rows = {(row["topology"], row["concurrency"]) for row in report["rows"]}
    assert rows == {("colocated", 1), ("pd", 1)}
    for row in report["rows"]:
        for kind in ("plain", "schema"):
            assert row[kind]["failures"] == [], row
            assert row[kind]["tokens_per_s"] > 0 and row[kind]["tpot_p50_ms"] > 0, row
        # the schema's outputs (checked by the benchmark to parse) are about OSL long
        assert row["schema"]["tokens_per_request"] > report["osl"] / 2, row


def _choices(printed: str, report: Any) -> None:
    assert "texts equal both ways" in printed and "decode KV blocks (peak)" in printed
    # the tiny model's choices are the seeded single requests exactly
    assert report["benchmark"] == "choices" and report["text_mismatches"] == 0
    assert report["texts_compared"] == 2 * report["n"] * report["rounds"]
    rows = {(row["topology"], row["way"]): row for row in report["rows"]}
    assert set(rows) == {(t, w) for t in ("colocated", "pd") for w in ("n choices", "n requests")}
    for topology in ("colocated", "pd"):
        together, fanned = rows[topology, "n choices"], rows[topology, "n requests"]
        # one prefill of the prompt, against n
        assert fanned["prefilled_tokens"] == report["n"] * together["prefilled_tokens"] > 0
        for row in (together, fanned):
            assert row["last_token_p50_ms"] >= row["ttft_p50_ms"] > 0, row
            assert row["peak_decode_blocks"] > 0, row


def _router_cost_versus(printed: str, report: Any) -> None:
    routers = ["tracing off", "tracing 1.0", "tracing 0.01"]
    assert report["routers"] == routers
    # each row, for each router, a figure a round
    assert len(report["figures"]) == 2
    for by_router in report["figures"].values():
        assert set(by_router) == set(routers)
        assert all(
            len(values) == 2 and all(v and v > 0 for v in values) for values in by_router.values()
        )
    assert "tracing 1.0 (median)" in printed and "/ tracing off" in printed
    # the SDK's own cost, measured beside them
    assert report["sdk_floor_ms_per_request"] > 0 and "SDK floor" in printed


# --- the list -------------------------------------------------------------------------------


@attrs.frozen
class Quick:
    module: str
    check: Check
    timeout_s: float  # several times what it takes on a shared 2-core machine
    needs_etcd: bool = False
    args: tuple[str, ...] = ()  # more of its command line


QUICK = [
    Quick("benchmarks.big_inputs", _big_inputs, 120),
    Quick("benchmarks.capacity", _capacity, 180),
    Quick("benchmarks.pd_vs_colocated", _pd_vs_colocated, 120),
    Quick("benchmarks.token_path", _token_path, 300),
    Quick("benchmarks.worker_limits", _worker_limits, 120),
    Quick("benchmarks.hostile_bytes", _hostile_bytes, 240),
    Quick("benchmarks.discovery", _discovery, 240, needs_etcd=True),
    Quick("benchmarks.router_cost", _router_cost, 300),
    # (its tracing set: the default set checks out a baseline commit)
    Quick(
        "benchmarks.router_cost_versus",
        _router_cost_versus,
        240,
        args=("--tracing", "--rounds", "2"),
    ),
    Quick("benchmarks.kv_transfer", _kv_transfer, 600),
    Quick("benchmarks.abandoned_prefill", _abandoned_prefill, 300),
    Quick("benchmarks.migration", _migration, 240),
    Quick("benchmarks.engine", _engine, 240),
    Quick("benchmarks.multi_turn", _multi_turn, 240),
    Quick("benchmarks.structured_output", _structured_output, 240),
    Quick("benchmarks.choices", _choices, 240),
]
# run --quick by a test of their own
ELSEWHERE = {
    "benchmarks.soak": "tests/e2e/test_soak.py",
    "benchmarks.front_vllm": "tests/vllm/test_real_vllm.py",  # a real vLLM: nox -s vllm
    "benchmarks.engine_reads": "tests/vllm/test_engine_reads.py",  # a pair of its own
    # in benchmarks.kv_transfer's quick run, whose check is _kv_digest's too (_kv_transfer)
    "benchmarks.kv_digest": "tests/test_benchmarks_quick.py",
}
# modules of benchmarks/ that are not benchmarks
NOT_BENCHMARKS = {
    "benchmarks.kit",
    "benchmarks.plotting",
    "benchmarks.soak_goals",
    "benchmarks.soak_hosts",  # benchmarks.soak --hosts (tests/e2e/test_multihost.py)
    "benchmarks.trivial_sse_app",
}


@pytest.mark.slow
@pytest.mark.parametrize("case", QUICK, ids=[case.module.split(".")[-1] for case in QUICK])
def test_quick_run(case: Quick, tmp_path: Path) -> None:
    if case.needs_etcd:
        require_etcd()
    completed, out = run_quick(case.module, tmp_path, timeout=case.timeout_s, args=case.args)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-8000:]
    assert out.exists(), f"{case.module} --quick wrote no --json report"
    case.check(completed.stdout, json.loads(out.read_text()))


def _benchmarks() -> set[str]:
    """Every runnable module of benchmarks/: a top-level file, or a package with __main__."""
    found = {f"benchmarks.{p.stem}" for p in (ROOT / "benchmarks").glob("*.py")}
    found |= {f"benchmarks.{p.parent.name}" for p in (ROOT / "benchmarks").glob("*/__main__.py")}
    return found - {"benchmarks.__init__"} - NOT_BENCHMARKS


def test_every_benchmark_is_run_quick() -> None:
    listed = [case.module for case in QUICK]
    assert len(listed) == len(set(listed))
    assert _benchmarks() == set(listed) | ELSEWHERE.keys()
    for module, test in ELSEWHERE.items():
        assert f'"{module}"' in (ROOT / test).read_text(), (module, test)
    # and each has a --quick mode to run
    for module in _benchmarks():
        path = ROOT / Path(*module.split("."))
        source = path.with_suffix(".py") if path.with_suffix(".py").exists() else path
        text = "".join(
            p.read_text() for p in ([source] if source.is_file() else source.glob("*.py"))
        )
        assert '"--quick"' in text, module
