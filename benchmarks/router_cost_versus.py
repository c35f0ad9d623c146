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
  Beside it, the **SDK floor**: a process on the router's core that only makes the
  spans a traced 2-token request makes (the request's, a prefill's, a decode's, their
  attributes and events, through ``pdtrio.tracing``'s tracer) and exports them the
  same way: the OpenTelemetry SDK's own CPU per request, which no router can trace
  below.

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


def sdk_floor(endpoint: str, requests: int) -> float:
    """CPU seconds per request the OpenTelemetry SDK spends making and exporting the
    spans of one traced 2-token request (this process, pinned by the caller)."""
    from pdtrio.config import TracingConfig
    from pdtrio.tracing._otel import Tracing, traceparent_of

    tracing = Tracing.start(
        TracingConfig(endpoint=endpoint, sampler_ratio=1.0), endpoint, "router", {}
    )
    started = time.process_time()
    for number in range(requests):
        request = tracing.request_span(
            "POST /v1/completions",
            "",
            {
                "pdtrio.request_id": f"floor-{number}",
                "gen_ai.request.model": "m",
                "http.route": "/v1/completions",
            },
        )
        traceparent_of(request)
        prefill = tracing.child_span(
            "prefill", request, {"pdtrio.attempt": 1, "pdtrio.continuation": False}
        )
        traceparent_of(prefill)
        prefill.set_attribute("pdtrio.instance", "prefill-0")
        prefill.end()
        decode = tracing.child_span("decode", request, {"pdtrio.attempt": 1, "pdtrio.retry": False})
        traceparent_of(decode)
        decode.set_attribute("pdtrio.instance", "decode-0")
        decode.add_event("placed")
        decode.add_event("accepted")
        request.add_event("first_token")
        decode.end()
        for key, value in (
            ("pdtrio.outcome", "ok"),
            ("http.response.status_code", 200),
            ("gen_ai.usage.input_tokens", 16),
            ("gen_ai.usage.output_tokens", 2),
            ("pdtrio.prefill.instance", "prefill-0"),
            ("pdtrio.decode.instance", "decode-0"),
        ):
            request.set_attribute(key, value)
        request.end()
    tracing._provider.shutdown()  # noqa: SLF001 (the last batches exported, counted)
    return (time.process_time() - started) / requests


def measure_sdk_floor(endpoint: str, cpu: int, requests: int) -> float:
    """:func:`sdk_floor` in a process of its own on ``cpu``: ms per request."""
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.router_cost_versus",
            "--role",
            "sdk-floor",
            "--spec",
            f"{endpoint} {requests}",
        ],
        cwd=rc.ROOT,
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
    )
    return float(completed.stdout.strip().splitlines()[-1]) * 1000


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
    parser.add_argument("--role", choices=["sdk-floor"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "sdk-floor":
        endpoint, requests = args.spec.split()
        print(sdk_floor(endpoint, int(requests)))
        return 0
    sizes = rc.QUICK if args.quick else rc.FULL
    cpus = router_and_load_cpus()
    print(
        f"CPU: {cpu_model()}, {os.cpu_count()} cpus; router on cpu {cpus[0]}, "
        f"workers and load on cpu {cpus[1]}"
    )
    floor_ms = None
    with contextlib.ExitStack() as stack:
        if args.tracing:
            sink = stack.enter_context(span_sink())
            routers = tracing_routers(sink)
            table = rows(sizes, large=False)
            floor_ms = measure_sdk_floor(sink, cpus[0], 200 if args.quick else 5000)
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
    if floor_ms is not None:
        print(
            f"SDK floor: the OpenTelemetry SDK alone makes and exports one traced 2-token "
            f"request's spans in {floor_ms:.3f} ms of CPU (on the router's core)"
        )
    write_json(
        args.json,
        {
            "routers": names,
            "baseline": None if args.tracing else args.baseline,
            "figures": figures,
            "sdk_floor_ms_per_request": floor_ms,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
