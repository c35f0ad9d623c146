"""What ``n`` > 1 saves: one request with ``n`` choices against ``n`` requests, one run.

    python -m benchmarks.choices [--json PATH] [--quick] [--n 4]

SmolLM2 (the README's default model, float32), colocated and PD (the README's
default), one router each (``benchmarks.engine``'s servers).  Two ways to get
the same ``n`` answers to one prompt (ISL random token ids, OSL tokens each,
``ignore_eos``, temperature 1, seeded), one after the other, ``rounds`` times:

- **n choices**: one streamed request with ``n`` and ``seed``;
- **n requests**: ``n`` concurrent streamed requests, seeds ``seed + i`` (a
  router that fans ``n`` out; pdtrio's prefix cache is off by default, as here).

Choice ``i`` samples with ``seed + i``, so both give the same texts: every
round checks they do.  Per row: TTFT p50 (send to the first token of any
choice), time to the last token p50, output tokens/s (n x OSL over that time),
the prompt tokens prefill computed per answer (its ``served_prefills`` count x
ISL) and the KV blocks decode held at most (sampled from its ``/pd/stats``
while the answer streams).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks.engine import SMOLLM2, TINY
from benchmarks.kit import aligned_table, percentile, write_json
from pdtrio.testing import Processes, write_router_config

ISL = 256
OSL = 32
QUICK_ISL = 64  # the tiny model's context is short
SEED = 1234


@contextmanager
def servers(model: str) -> Iterator[dict[str, tuple[str, str, str]]]:
    """topology -> (router URL, prefill worker URL, decode worker URL)."""
    with tempfile.TemporaryDirectory() as tmp, Processes() as procs:

        def config(role: str) -> dict[str, Any]:
            return {"role": role, "engine": {"kind": "torch", "model": model, "dtype": "float32"}}

        starting = {
            role: procs.start_worker(config(role)) for role in ("prefill", "decode", "both")
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
        yield {
            "colocated": (colocated.url, both.url, both.url),
            "pd": (pd.url, prefill.url, decode.url),
        }


async def _stream(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], sent: float
) -> tuple[dict[int, str], float, float]:
    """Each choice's text, and when the first and the last token came (from ``sent``)."""
    texts: dict[int, str] = {}
    first = last = 0.0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                if choice.get("text"):
                    now = time.perf_counter() - sent
                    first = first or now
                    last = now
                    index = choice["index"]
                    texts[index] = texts.get(index, "") + choice["text"]
    return texts, first, last


async def _peak_blocks(http: httpx.AsyncClient, decode_url: str, peak: list[int]) -> None:
    while True:
        stats = (await http.get(f"{decode_url}/pd/stats")).json()
        peak[0] = max(peak[0], stats["kv_blocks_in_use"])
        await trio.sleep(0.005)


async def _served_prefills(http: httpx.AsyncClient, prefill_url: str) -> int:
    return int((await http.get(f"{prefill_url}/pd/stats")).json()["served_prefills"])


async def _one_answer(
    urls: tuple[str, str, str], model: str, prompt: list[int], n: int, fan_out: bool, osl: int
) -> dict[str, Any]:
    router, prefill, decode = urls
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": osl,
        "ignore_eos": True,
        "temperature": 1.0,
        "stream": True,
    }
    async with httpx.AsyncClient(timeout=600) as http:
        prefills_before = await _served_prefills(http, prefill)
        peak = [0]
        texts: dict[int, str] = {}
        firsts: list[float] = []
        lasts: list[float] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_peak_blocks, http, decode, peak)
            sent = time.perf_counter()
            async with trio.open_nursery() as requests:
                if fan_out:

                    async def single(index: int) -> None:
                        got, first, last = await _stream(
                            http, router, {**body, "seed": SEED + index}, sent
                        )
                        texts[index] = got[0]
                        firsts.append(first)
                        lasts.append(last)

                    for index in range(n):
                        requests.start_soon(single, index)
                else:

                    async def together() -> None:
                        got, first, last = await _stream(
                            http, router, {**body, "seed": SEED, "n": n}, sent
                        )
                        texts.update(got)
                        firsts.append(first)
                        lasts.append(last)

                    requests.start_soon(together)
            nursery.cancel_scope.cancel()
        prefills = await _served_prefills(http, prefill) - prefills_before
    return {
        "ttft_ms": min(firsts) * 1e3,
        "last_ms": max(lasts) * 1e3,
        "prefilled_tokens": prefills * len(prompt),
        "peak_decode_blocks": peak[0],
        "texts": [texts[index] for index in range(n)],
    }


def run(model: str, n: int, rounds: int, isl: int, osl: int) -> dict[str, Any]:
    rng = random.Random(26)
    low, high = (0x20 + 3, 0x7E + 3) if model == TINY else (100, 40000)
    rows = []
    mismatches = 0
    with servers(model) as topologies:
        for topology, urls in topologies.items():
            results: dict[str, list[dict[str, Any]]] = {"n choices": [], "n requests": []}
            for round_ in range(rounds + 1):  # the first round warms up
                prompt = [rng.randint(low, high) for _ in range(isl)]
                together = trio.run(_one_answer, urls, model, prompt, n, False, osl)
                fanned = trio.run(_one_answer, urls, model, prompt, n, True, osl)
                if together["texts"] != fanned["texts"]:
                    mismatches += 1
                if round_:
                    results["n choices"].append(together)
                    results["n requests"].append(fanned)
            for way, measured in results.items():
                last = percentile([m["last_ms"] for m in measured], 50)
                rows.append(
                    {
                        "topology": topology,
                        "way": way,
                        "ttft_p50_ms": percentile([m["ttft_ms"] for m in measured], 50),
                        "last_token_p50_ms": last,
                        "output_tokens_per_s": n * osl / (last / 1e3),
                        "prefilled_tokens": max(m["prefilled_tokens"] for m in measured),
                        "peak_decode_blocks": max(m["peak_decode_blocks"] for m in measured),
                    }
                )
            print(f"  {topology} done", file=sys.stderr, flush=True)
    return {
        "benchmark": "choices",
        "model": model,
        "n": n,
        "isl": isl,
        "osl": osl,
        "rounds": rounds,
        "rows": rows,
        "text_mismatches": mismatches,
    }


def print_report(report: dict[str, Any]) -> None:
    header = [
        "topology",
        "way",
        "TTFT p50 ms",
        "last token p50 ms",
        "tok/s",
        "prefilled tokens",
        "decode KV blocks (peak)",
    ]
    body = [
        [
            row["topology"],
            row["way"],
            f"{row['ttft_p50_ms']:.0f}",
            f"{row['last_token_p50_ms']:.0f}",
            f"{row['output_tokens_per_s']:.1f}",
            str(row["prefilled_tokens"]),
            str(row["peak_decode_blocks"]),
        ]
        for row in report["rows"]
    ]
    print(f"n = {report['n']}, ISL {report['isl']}, OSL {report['osl']}, {report['model']}")
    print(aligned_table(header, body, align="llrrrrr"))
    print(
        f"same texts both ways: {'yes' if not report['text_mismatches'] else 'NO'}"
        f" ({report['text_mismatches']} rounds differed)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="the tiny model, one round")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.quick:
        report = run(TINY, args.n, 1, QUICK_ISL, OSL // 2)
    else:
        report = run(SMOLLM2, args.n, args.rounds, ISL, OSL)
    print_report(report)
    write_json(args.json, report)
    return 1 if report["text_mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
