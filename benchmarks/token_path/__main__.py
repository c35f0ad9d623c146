"""``python -m benchmarks.token_path``: the three sections, their table and JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks import plotting
from benchmarks.kit import aligned_table, write_json
from benchmarks.token_path import ingest, producer, sse_clients
from benchmarks.token_path.end_to_end import run_e2e
from benchmarks.token_path.light_load import run_latency
from benchmarks.token_path.measure import router_and_load_cpus

# what a process started by measure.start_role runs
ROLES: dict[str, Callable[[dict[str, Any]], None]] = {
    "producer": producer.run,
    "ingest-router": ingest.run_router,
    "sse-clients": sse_clients.run,
}


def _table(title: str, header: list[str], rows: list[list[str]]) -> str:
    table = aligned_table(header, rows, align="r" * len(header), separator="  ", rule=None)
    return f"{title}\n{table}"


def _fmt(value: Any, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value != value:
        return "nan"
    return format(value, spec)


def _ingest_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        _table(
            "\n1. ingest: one router core absorbing token frames (K entries x T tokens per frame)",
            [
                "KxT",
                "tok/frame",
                "tokens/s/core",
                "frames/s/core",
                "us/token",
                "router util",
                "tok/SSE chunk",
                "profiled",
            ],
            [
                [
                    f"{r['entries_per_frame']}x{r['tokens_per_entry']}",
                    str(r["tokens_per_frame"]),
                    _fmt(r["tokens_per_cpu_s"], ",.0f"),
                    _fmt(r["frames_per_cpu_s"], ",.0f"),
                    _fmt(r["us_per_token"], ".2f"),
                    _fmt(r["router_util"] * 100, ".0f") + "%",
                    _fmt(r["tokens_per_sse_chunk"], ".1f"),
                    "yes" if r["profiled"] else "",
                ]
                for r in rows
            ],
        )
    ]
    for r in rows:
        if r.get("profile_top"):
            out.append(
                f"\n  py-spy {r['entries_per_frame']}x{r['tokens_per_entry']} "
                f"({r['profile']}), self %:"
            )
            out += [f"    {pct:5.1f}  {frame}" for frame, pct in r["profile_top"]["self"][:15]]
            out.append("  inclusive %:")
            out += [f"    {pct:5.1f}  {frame}" for frame, pct in r["profile_top"]["inclusive"][:20]]
    return out


def _e2e_table(rows: list[dict[str, Any]]) -> str:
    return _table(
        "\n2. end to end: hypercorn router on one core, synthetic workers, raw SSE clients",
        [
            "clients",
            "offered tok/s",
            "tokens/s",
            "tok/event",
            "router us/tok",
            "router util",
            "decode us/tok",
            "router/decode",
            "load core",
            "ITL p50 ms",
            "ITL p99 ms",
            "worst p99",
            "TTFT p50 ms",
            "failures",
        ],
        [
            [
                str(r["clients"]),
                _fmt(r["offered_tokens_per_s"], ",.0f"),
                _fmt(r["tokens_per_s"], ",.0f"),
                _fmt(r["tokens_per_event"], ".2f"),
                _fmt(r["router_us_per_token"]),
                _fmt(r["router_util"] * 100, ".0f") + "%",
                _fmt(r["decode_us_per_token"]),
                _fmt(r["router_over_decode"], ".2f"),
                _fmt(r["load_core_util"] * 100, ".0f") + "%",
                _fmt(r["itl_p50_ms"], ".2f"),
                _fmt(r["itl_p99_ms"], ".2f"),
                _fmt(r["itl_p99_worst_ms"], ".2f"),
                _fmt(r["ttft_p50_ms"], ".1f"),
                str(sum(r["failures"].values())),
            ]
            for r in rows
        ],
    )


def _latency_table(rows: list[dict[str, Any]]) -> str:
    return _table(
        "\n3. light load: one stream; added = router client arrival"
        " - direct websocket arrival, same engine step",
        [
            "coalesce",
            "tok/s",
            "steps",
            "ITL router p50/p99 ms",
            "ITL direct p50/p99 ms",
            "added p50 us",
            "added p99 us",
            "added mean us",
            "mismatched",
        ],
        [
            [
                "on" if r["coalesce"] else "off",
                _fmt(r["tokens_per_s"], ".0f"),
                str(r["samples"]),
                f"{_fmt(r['itl_router_p50_ms'], '.2f')} / {_fmt(r['itl_router_p99_ms'], '.2f')}",
                f"{_fmt(r['itl_direct_p50_ms'], '.2f')} / {_fmt(r['itl_direct_p99_ms'], '.2f')}",
                _fmt(r["added_p50_us"], ".0f"),
                _fmt(r["added_p99_us"], ".0f"),
                _fmt(r["added_mean_us"], ".0f"),
                str(r["mismatched_steps"]),
            ]
            for r in rows
        ],
    )


def render(report: dict[str, Any]) -> str:
    out = [f"token path benchmark ({'quick' if report['quick'] else 'full'}), {report['machine']}"]
    if report.get("ingest"):
        out += _ingest_table(report["ingest"])
    if report.get("e2e"):
        out.append(_e2e_table(report["e2e"]))
    if report.get("latency"):
        out.append(_latency_table(report["latency"]))
    return "\n".join(out)


def plot(
    path: Path,
    report: dict[str, Any],
    e2e: dict[int, dict[str, list[float]]],
    latency: dict[str, dict[str, list[float]]],
) -> None:
    """The e2e section's TTFT and ITL CDFs per client count and its tokens/s against
    clients; the light-load section's ITL and added-latency CDFs per coalescing mode."""
    panels: list[plotting.Panel] = []
    cdfs = plotting.latency_cdfs
    if e2e:
        step = report["e2e"][0]["decode_step_ms"]
        for key, xlabel in (("ttft", "TTFT (ms)"), ("itl", "gap between SSE reads (ms)")):
            panels.append(
                partial(
                    cdfs,
                    series={f"{clients} clients": s[key] for clients, s in e2e.items()},
                    xlabel=xlabel,
                    title=f"2. e2e, decode step {step:g} ms: {key.upper()}",
                )
            )
        panels.append(
            partial(
                plotting.throughput_vs_concurrency,
                series={"delivered": [(r["clients"], r["tokens_per_s"]) for r in report["e2e"]]},
                reference={
                    "offered (a token per step per stream)": [
                        (r["clients"], r["offered_tokens_per_s"]) for r in report["e2e"]
                    ]
                },
                title="2. e2e: tokens/s against concurrency",
            )
        )
    if latency:
        rate = report["latency"][0]["tokens_per_s"]
        itl: dict[str, list[float]] = {}
        for reader, key in (("router", "itl_routed"), ("direct", "itl_direct")):
            for mode, s in latency.items():
                itl[f"{reader}, coalesce {mode}"] = [v * 1e3 for v in s[key]]
        panels.append(
            partial(
                cdfs,
                series=itl,
                xlabel="gap between tokens (ms)",
                title=f"3. light load, {rate:g} tok/s: ITL",
            )
        )
        panels.append(
            partial(
                cdfs,
                series={f"coalesce {m}": [v * 1e6 for v in s["added"]] for m, s in latency.items()},
                xlabel="added: router arrival - direct arrival, same step (µs)",
                title=f"3. light load, {rate:g} tok/s: latency the router adds",
            )
        )
    if not panels:
        print(
            "--plot: nothing to draw (the e2e and latency phases have the samples)", file=sys.stderr
        )
        return
    plotting.save_figure(
        path,
        *panels,
        title=f"token_path ({'quick' if report['quick'] else 'full'}): "
        f"decode worker -> router -> SSE; {report['machine']}",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.token_path",
        description="The token path: decode worker -> router -> SSE, measured three ways.",
    )
    parser.add_argument("--quick", action="store_true", help="short runs (under a minute in all)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--only", default="ingest,e2e,latency", help="comma-separated phases")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="also py-spy the ingest router (1x1 and 16x1) into this folder",
    )
    parser.add_argument(
        "--e2e-step-ms", type=float, default=10.0, help="decode step of the e2e load"
    )
    parser.add_argument(
        "--latency-rate", type=float, default=200.0, help="tokens/s of the light-load stream"
    )
    parser.add_argument(
        "--plot", type=Path, default=None, help="draw the latency CDFs into this PNG (matplotlib)"
    )
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        ROLES[args.role](json.loads(args.spec))
        return 0
    if args.plot is not None:
        plotting.require_matplotlib()
    phases = {p.strip() for p in args.only.split(",") if p.strip()}
    router_cpu, load_cpu = router_and_load_cpus()
    if router_cpu == load_cpu:
        print("warning: one CPU only; router and load share it", file=sys.stderr)
    os.sched_setaffinity(0, {load_cpu})
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "quick": args.quick,
        "machine": f"{os.cpu_count()} cpus, router on cpu {router_cpu}, load on cpu {load_cpu}",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    started = time.perf_counter()
    e2e_samples: dict[int, dict[str, list[float]]] = {}
    latency_samples: dict[str, dict[str, list[float]]] = {}
    if "ingest" in phases:
        report["ingest"] = ingest.run_ingest(args.quick, args.profile)
    if "e2e" in phases:
        report["e2e"], e2e_samples = run_e2e(args.quick, args.e2e_step_ms / 1e3)
    if "latency" in phases:
        report["latency"], latency_samples = run_latency(args.quick, args.latency_rate)
    report["elapsed_s"] = time.perf_counter() - started
    print(render(report))
    print(f"\n({report['elapsed_s']:.0f}s)")
    write_json(args.json, report)
    if args.plot is not None:
        plot(args.plot, report, e2e_samples, latency_samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
