"""Router cost of one router against another, in alternated rounds: this tree against a
baseline commit, or this tree with tracing off, on at every trace and on at 1 %.

    python -m benchmarks.router_cost_versus [--baseline REV | --tracing] [--rounds N]
        [--quick] [--json PATH]

``benchmarks.router_cost``'s own rows, run on each router of a set:

- by default, this tree's ``pdtrio`` and the baseline commit's (checked out in a
  temporary git worktree; by default the commit the router-wing rebuild was filed at);
- ``--tracing``: this tree's, with tracing off, on at sampling 1.0 and on at 0.01
  (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` pointing at a sink in this process that
  answers every export 200 and keeps nothing: the router's spans are made, batched,
  encoded and sent, on its own CPU, as to a Collector; the workers are not traced).

The machine is shared and noisy, so the routers take turns: each round runs every row
on each, the order rotating from round to round, and the table gives each router's
median over the rounds and its ratio to the first. The same synthetic workers (this
tree's) serve all; the router is pinned to one core, everything else to the other, as
in ``router_cost``. The rows (router CPU from /proc over the window):

- **short**: 32 concurrent 2-token requests in rounds, kept alive: ms per request;
- **paced 128 / 512**: 128 and 512 streams of 128 tokens, decode paced at 10 ms a
  token, egress at its default: µs per token (``--tracing``: 128 only).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Final

from benchmarks import router_cost as rc
from benchmarks.kit import aligned_table, cpu_model, write_json
from benchmarks.token_path.measure import router_and_load_cpus
from pdtrio.testing import LOOPBACK, Processes

# the commit issue 50 (one backend seam, the request machine's phases) was filed at
DEFAULT_BASELINE: Final = "393b77b"


@dataclasses.dataclass(frozen=True)
class Row:
    title: str
    server: rc.Server
    load: rc.Load
    key: str  # the figure in router_cost's row
    unit: str


@dataclasses.dataclass(frozen=True)
class Router:
    """One router of the set: the checkout it imports, and more of its environment."""

    name: str
    tree: Path
    environment: Mapping[str, str] = dataclasses.field(default_factory=dict)


def rows(sizes: rc.Sizes, *, large: bool = True) -> list[Row]:
    small, big = sizes.paced_streams
    short = rc.Load("short", sizes.short_clients, sizes.short_tokens, 0.0, rounds=True)
    paced = rc.Server("pdtrio_on", "pdtrio", rc.PACED_STEP_S)
    return [
        Row(
            f"{sizes.short_clients} × {sizes.short_tokens}-token requests, kept alive",
            rc.Server("pdtrio_fast", "pdtrio", 0.0),
            short,
            "router_ms_per_request",
            "ms/request",
        ),
        *(
            Row(
                f"{streams} paced streams of {sizes.paced_tokens} tokens",
                paced,
                rc.Load(f"paced_{streams}", streams, sizes.paced_tokens, rc.PACED_STEP_S),
                "router_us_per_token",
                "µs/token",
            )
            for streams in ((small, big) if large else (small,))
        ),
    ]


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """``rev`` checked out in a temporary git worktree (removed afterwards)."""
    with tempfile.TemporaryDirectory(prefix="router-cost-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(rc.ROOT), "worktree", "add", "--detach", str(tree), rev],
            check=True,
            capture_output=True,
        )
        try:
            yield tree
        finally:
            subprocess.run(
                ["git", "-C", str(rc.ROOT), "worktree", "remove", "--force", str(tree)],
                check=False,
                capture_output=True,
            )


class _Sink(BaseHTTPRequestHandler):
    """Takes an OTLP/HTTP export and answers 200, as a Collector would; keeps nothing."""

    def do_POST(self) -> None:  # noqa: N802 (the http.server name)
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@contextlib.contextmanager
def span_sink() -> Iterator[str]:
    """An OTLP/HTTP traces endpoint on loopback, served from a thread of this process."""
    server = ThreadingHTTPServer((LOOPBACK, 0), _Sink)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{LOOPBACK}:{server.server_address[1]}/v1/traces"
    finally:
        server.shutdown()
        server.server_close()


def tracing_routers(endpoint: str) -> list[Router]:
    def traced(ratio: float) -> dict[str, str]:
        return {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
            "OTEL_TRACES_SAMPLER": "traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": repr(ratio),
        }

    return [
        Router("tracing off", rc.ROOT),
        Router("tracing 1.0", rc.ROOT, traced(1.0)),
        Router("tracing 0.01", rc.ROOT, traced(0.01)),
    ]


Figures = dict[str, dict[str, list[float | None]]]


def run(sizes: rc.Sizes, routers: list[Router], table: list[Row], rounds: int) -> Figures:
    """Each row's figure per router, one per round."""
    router_cpu, load_cpu = router_and_load_cpus()
    figures: Figures = {}
    with Processes() as procs, tempfile.TemporaryDirectory() as tmp:
        workers = rc.start_workers(procs, load_cpu)
        for round_index in range(rounds):
            shift = round_index % len(routers)
            for router in routers[shift:] + routers[:shift]:
                for row in table:
                    service = rc.start_server(
                        procs,
                        row.server,
                        workers[row.server.step_s],
                        {router_cpu},
                        Path(tmp),
                        tree=router.tree,
                        environment=router.environment,
                    )
                    started = time.perf_counter()
                    measured, _ = rc.measure(
                        procs,
                        row.server,
                        service,
                        row.load,
                        workers[row.server.step_s],
                        sizes,
                        (router_cpu, load_cpu),
                    )
                    procs.stop(service.process)
                    value = measured[row.key]
                    figures.setdefault(row.title, {}).setdefault(router.name, []).append(value)
                    print(
                        f"round {round_index + 1}/{rounds} {router.name}: {row.title}: "
                        f"{value if value is None else round(value, 3)} {row.unit}, "
                        f"{rc._failures(measured)} failures "
                        f"({time.perf_counter() - started:.1f}s)",
                        file=sys.stderr,
                        flush=True,
                    )
    return figures


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def render(table: list[Row], figures: Figures, names: list[str]) -> str:
    first = names[0]
    header = ["row", "unit"]
    for name in names:
        header += [f"{name} (median)"] + ([] if name == first else [f"/ {first}"])
    header += [f"{name} rounds" for name in names]
    lines = []
    for row in table:
        by_router = figures[row.title]
        base = _median(by_router[first])
        cells = [row.title, row.unit]
        for name in names:
            median = _median(by_router[name])
            cells.append(rc._fmt(median, ".3f"))
            if name != first:
                cells.append(rc._fmt(None if median is None or not base else median / base, ".3f"))
        cells += [" ".join(rc._fmt(v, ".3f") for v in by_router[name]) for name in names]
        lines.append(cells)
    return aligned_table(header, lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.router_cost_versus",
        description="router_cost's router CPU rows, one router against others (a baseline "
        "commit, or tracing settings) in alternated rounds.",
    )
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--baseline", default=DEFAULT_BASELINE, help="the commit to compare")
    choice.add_argument(
        "--tracing", action="store_true", help="this tree: tracing off, on at 1.0, on at 0.01"
    )
    parser.add_argument("--rounds", type=int, default=4, help="rounds (each router once a round)")
    parser.add_argument("--quick", action="store_true", help="tiny rows (CI): figures mean nothing")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    sizes = rc.QUICK if args.quick else rc.FULL
    cpus = router_and_load_cpus()
    print(
        f"CPU: {cpu_model()}, {os.cpu_count()} cpus; router on cpu {cpus[0]}, "
        f"workers and load on cpu {cpus[1]}"
    )
    with contextlib.ExitStack() as stack:
        if args.tracing:
            routers = tracing_routers(stack.enter_context(span_sink()))
            table = rows(sizes, large=False)
        else:
            baseline_tree = stack.enter_context(worktree(args.baseline))
            routers = [
                Router("this tree", rc.ROOT),
                Router(f"baseline {args.baseline}", baseline_tree),
            ]
            table = rows(sizes)
        figures = run(sizes, routers, table, args.rounds)
    names = [router.name for router in routers]
    print(render(table, figures, names))
    write_json(
        args.json,
        {"routers": names, "baseline": None if args.tracing else args.baseline, "figures": figures},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
