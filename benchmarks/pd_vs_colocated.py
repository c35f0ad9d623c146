"""PD (prefill + decode workers) against one colocated `both` worker, same run.

    python -m benchmarks.pd_vs_colocated [--json PATH] [--plot PATH] [--requests 16] [--quick]

Concurrency 1, ignore_eos, token-id prompts of exactly ISL tokens, OSL output
tokens; 2 warm-up requests then N measured, PD and colocated interleaved
request by request so that machine noise hits both alike.  TTFT is the time to
the first SSE event carrying text or a finish; TPOT is (last event - first
event) / (tokens - 1), so in PD it carries the KV handoff in its first gap;
ITL p50 is the median gap between events, which leaves that out; decode
steps/s is 1 / TPOT (one token per step at concurrency 1).  ``--plot`` draws,
per case, the CDFs of TTFT and of every gap between events (the first gap
included) for both modes as a PNG.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from benchmarks import plotting
from benchmarks.kit import aligned_table, percentile, stream_completion_sync, write_json
from pdtrio.testing import Processes, write_router_config

CASES = [
    # (model, ISL, OSL, kv blocks)
    ("tiny-random", 128, 128, 1024),
    ("tiny-random", 1024, 128, 1024),
    ("smollm2-135m-instruct", 256, 64, 256),
]


def _worker_config(role: str, model: str, blocks: int) -> dict[str, Any]:
    return {
        "role": role,
        "engine": {"kind": "torch", "model": model, "num_kv_blocks": blocks, "max_batch_size": 8},
    }


def _one_request(
    http: httpx.Client, url: str, model: str, prompt: list[int], osl: int
) -> tuple[dict[str, float], list[float]]:
    """The request's figures, and every gap between its events in ms (for ``--plot``)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": osl,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer = stream_completion_sync(http, body, f"{url}/v1/completions")
    assert answer.status == 200, answer.body
    tokens = (answer.usage or {}).get("completion_tokens")
    assert answer.arrivals and tokens == osl, (tokens, osl)
    start, first, last = answer.started, answer.arrivals[0], answer.arrivals[-1]
    tpot = (last - first) / (tokens - 1)
    gaps = answer.gaps
    # the median gap leaves out the first one, which in PD includes the KV handoff
    itl = percentile(gaps, 50) if gaps else tpot
    figures = {
        "ttft_ms": (first - start) * 1e3,
        "tpot_ms": tpot * 1e3,
        "itl_p50_ms": itl * 1e3,
        "steps_per_s": 1 / tpot,
    }
    return figures, [gap * 1e3 for gap in gaps]


def run_case(
    model: str, isl: int, osl: int, blocks: int, requests: int, warmup: int
) -> tuple[dict[str, Any], dict[str, dict[str, list[float]]]]:
    """The case's summary, and per mode its raw TTFTs and gaps in ms (for ``--plot``)."""
    rng = random.Random(isl * 7 + osl)
    # tiny-random's ids 3..258 are raw bytes: printable ASCII keeps every token visible text
    vocab_low, vocab_high = (0x20 + 3, 0x7E + 3) if model == "tiny-random" else (100, 40000)
    prompts = [
        [rng.randint(vocab_low, vocab_high) for _ in range(isl)] for _ in range(warmup + requests)
    ]
    with tempfile.TemporaryDirectory() as tmp, Processes() as procs:
        # the three load their models at once
        starting = {
            role: procs.start_worker(_worker_config(role, model, blocks))
            for role in ("prefill", "decode", "both")
        }
        prefill, decode, both = (procs.wait_ready(p) for p in starting.values())
        pd = procs.router(
            write_router_config(
                Path(tmp) / "pd.toml", [("prefill", prefill.url), ("decode", decode.url)]
            )
        )
        colocated = procs.router(
            write_router_config(Path(tmp) / "colocated.toml", [("both", both.url)])
        )
        pd_url, colo_url = pd.url, colocated.url
        samples: dict[str, list[dict[str, float]]] = {"pd": [], "colocated": []}
        latencies: dict[str, dict[str, list[float]]] = {
            mode: {"ttft": [], "itl": []} for mode in samples
        }
        with httpx.Client(timeout=600) as http:
            for index, prompt in enumerate(prompts):
                order = [("pd", pd_url), ("colocated", colo_url)]
                if index % 2:
                    order.reverse()  # neither mode always runs first
                for mode, url in order:
                    result, gaps = _one_request(http, url, model, prompt, osl)
                    if index >= warmup:
                        samples[mode].append(result)
                        latencies[mode]["ttft"].append(result["ttft_ms"])
                        latencies[mode]["itl"] += gaps
    summary: dict[str, Any] = {"model": model, "isl": isl, "osl": osl, "requests": requests}
    for mode, rows in samples.items():
        summary[mode] = {key: percentile((r[key] for r in rows), 50) for key in rows[0]}
    summary["tpot_diff_pct"] = 100 * (
        summary["pd"]["tpot_ms"] / summary["colocated"]["tpot_ms"] - 1
    )
    summary["ttft_diff_pct"] = 100 * (
        summary["pd"]["ttft_ms"] / summary["colocated"]["ttft_ms"] - 1
    )
    summary["itl_diff_pct"] = 100 * (
        summary["pd"]["itl_p50_ms"] / summary["colocated"]["itl_p50_ms"] - 1
    )
    return summary, latencies


def plot(
    path: Path,
    results: list[dict[str, Any]],
    latencies: list[dict[str, dict[str, list[float]]]],
    quick: bool,
) -> None:
    panels = []
    for r, modes in zip(results, latencies, strict=True):
        case = f"{r['model']} ISL {r['isl']} OSL {r['osl']}"
        for key, xlabel, what in (
            ("ttft", "TTFT (ms)", "TTFT"),
            ("itl", "gap between events (ms)", "ITL, first gap (PD: KV handoff) included"),
        ):
            series = {mode: modes[mode][key] for mode in ("colocated", "pd")}
            panels.append(
                partial(
                    plotting.latency_cdfs,
                    series=series,
                    xlabel=xlabel,
                    title=f"{case}: {what}",
                )
            )
    requests = results[0]["requests"]
    plotting.save_figure(
        path,
        *panels,
        title=f"pd_vs_colocated ({'quick' if quick else 'full'}): PD vs colocated, "
        f"concurrency 1, {requests} requests per mode, ignore_eos",
        columns=2,
    )


def print_table(results: list[dict[str, Any]]) -> None:
    header = [
        "model",
        "ISL",
        "OSL",
        "mode",
        "TTFT p50 ms",
        "TPOT p50 ms",
        "ITL p50 ms",
        "steps/s",
        "dTTFT %",
        "dTPOT %",
        "dITL %",
    ]
    rows = []
    for r in results:
        for mode in ("colocated", "pd"):
            m = r[mode]
            diffs = (
                [
                    f"{r['ttft_diff_pct']:+.1f}",
                    f"{r['tpot_diff_pct']:+.1f}",
                    f"{r['itl_diff_pct']:+.1f}",
                ]
                if mode == "pd"
                else ["", "", ""]
            )
            rows.append(
                [
                    r["model"],
                    str(r["isl"]),
                    str(r["osl"]),
                    mode,
                    f"{m['ttft_ms']:.2f}",
                    f"{m['tpot_ms']:.3f}",
                    f"{m['itl_p50_ms']:.3f}",
                    f"{m['steps_per_s']:.1f}",
                    *diffs,
                ]
            )
    print(aligned_table(header, rows, align="lrrl" + "r" * 7))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny-random ISL 128 only, 4 requests")
    parser.add_argument(
        "--plot", type=Path, default=None, help="draw the latency CDFs into this PNG (matplotlib)"
    )
    args = parser.parse_args(argv)
    if args.plot is not None:
        plotting.require_matplotlib()
    cases = CASES[:1] if args.quick else CASES
    requests = 4 if args.quick else args.requests
    results = []
    latencies = []
    for model, isl, osl, blocks in cases:
        print(f"running {model} ISL {isl} OSL {osl} ...", file=sys.stderr, flush=True)
        summary, samples = run_case(model, isl, osl, blocks, requests, args.warmup)
        results.append(summary)
        latencies.append(samples)
    print_table(results)
    write_json(args.json, {"benchmark": "pd_vs_colocated", "results": results})
    if args.plot is not None:
        plot(args.plot, results, latencies, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
