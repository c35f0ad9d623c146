"""Router cost, this tree against a baseline commit, in alternated rounds.

    python -m benchmarks.router_cost_versus [--baseline REV] [--rounds N] [--quick] [--json PATH]

``benchmarks.router_cost``'s own rows, run on two routers: this tree's ``pdtrio``
and the baseline commit's (checked out in a temporary git worktree; by default the
commit the router-wing rebuild was filed at). The machine is shared and noisy, so
the trees take turns: each round runs every row on both, the first tree of a round
alternating (A B, B A, ...), and the table gives each tree's median over the rounds
and the ratio this tree / baseline. The same synthetic workers (this tree's) serve
both; the router is pinned to one core, everything else to the other, as in
``router_cost``. The rows (router CPU from /proc over the window):

- **short**: 32 concurrent 2-token requests in rounds, kept alive: ms per request;
- **paced 128 / 512**: 128 and 512 streams of 128 tokens, decode paced at 10 ms a
  token, egress at its default: µs per token.
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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from benchmarks import router_cost as rc
from benchmarks.kit import aligned_table, cpu_model, write_json
from benchmarks.token_path.measure import router_and_load_cpus
from pdtrio.testing import Processes

# the commit issue 50 (one backend seam, the request machine's phases) was filed at
DEFAULT_BASELINE: Final = "393b77b"


@dataclasses.dataclass(frozen=True)
class Row:
    title: str
    server: rc.Server
    load: rc.Load
    key: str  # the figure in router_cost's row
    unit: str


def rows(sizes: rc.Sizes) -> list[Row]:
    small, large = sizes.paced_streams
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
            for streams in (small, large)
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


def run(
    sizes: rc.Sizes, baseline: str, trees: dict[str, Path], rounds: int
) -> dict[str, dict[str, list[float | None]]]:
    """Each row's figure per tree, one per round."""
    router_cpu, load_cpu = router_and_load_cpus()
    figures: dict[str, dict[str, list[float | None]]] = {}
    names = list(trees)
    with Processes() as procs, tempfile.TemporaryDirectory() as tmp:
        workers = rc.start_workers(procs, load_cpu)
        for round_index in range(rounds):
            order = names if round_index % 2 == 0 else names[::-1]
            for name in order:
                for row in rows(sizes):
                    service = rc.start_server(
                        procs,
                        row.server,
                        workers[row.server.step_s],
                        {router_cpu},
                        Path(tmp),
                        tree=trees[name],
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
                    figures.setdefault(row.title, {}).setdefault(name, []).append(value)
                    print(
                        f"round {round_index + 1}/{rounds} {name}: {row.title}: "
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


def render(
    sizes: rc.Sizes, figures: dict[str, dict[str, list[float | None]]], names: list[str]
) -> str:
    this, base = names
    header = [
        "row",
        "unit",
        f"{this} (median)",
        f"{base} (median)",
        "ratio",
        f"{this} rounds",
        f"{base} rounds",
    ]
    table = []
    for row in rows(sizes):
        by_tree = figures[row.title]
        a, b = _median(by_tree[this]), _median(by_tree[base])
        table.append(
            [
                row.title,
                row.unit,
                rc._fmt(a, ".3f"),
                rc._fmt(b, ".3f"),
                rc._fmt(None if a is None or not b else a / b, ".3f"),
                " ".join(rc._fmt(v, ".3f") for v in by_tree[this]),
                " ".join(rc._fmt(v, ".3f") for v in by_tree[base]),
            ]
        )
    return aligned_table(header, table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.router_cost_versus",
        description="router_cost's router CPU rows, this tree against a baseline commit, "
        "in alternated rounds.",
    )
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="the commit to compare")
    parser.add_argument("--rounds", type=int, default=4, help="rounds (each tree once a round)")
    parser.add_argument("--quick", action="store_true", help="tiny rows (CI): figures mean nothing")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    sizes = rc.QUICK if args.quick else rc.FULL
    cpus = router_and_load_cpus()
    print(
        f"CPU: {cpu_model()}, {os.cpu_count()} cpus; router on cpu "
        f"{cpus[0]}, workers and load on cpu {cpus[1]}"
    )
    with worktree(args.baseline) as baseline_tree:
        trees = {"this tree": rc.ROOT, f"baseline {args.baseline}": baseline_tree}
        figures = run(sizes, args.baseline, trees, args.rounds)
    print(render(sizes, figures, list(trees)))
    write_json(args.json, {"baseline": args.baseline, "rounds": args.rounds, "figures": figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())
