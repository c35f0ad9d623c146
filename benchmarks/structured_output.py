"""What a JSON schema costs: tokens/s and TPOT with structured output against without, one run.

    python -m benchmarks.structured_output [--json PATH] [--quick] [--concurrency 1,8]

SmolLM2 (the README's default model, float32), colocated and PD, one router
each (``benchmarks.engine``'s servers).  Two loads, one after the other, at
each concurrency: streaming ``/v1/completions`` of random token-id prompts
(ISL ids), ``temperature`` 0, either plain (``ignore_eos``, OSL tokens) or
with ``response_format`` a JSON schema whose every valid output is an array
of OSL/2 one-digit integers (about 75 tokens against the plain load's 48:
tokens/s and TPOT are per token; the schema's requests end when the grammar
is complete).  Per row: output
tokens/s (over the measured requests' wall time) and TPOT p50; the ratio
column is schema over plain, measured in the same run.  Every schema
request's text is checked to parse and to have its OSL/2 items.

``--quick`` (CI): c=1 only, fewer requests.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from benchmarks.engine import SMOLLM2, closed_loop, pdtrio_servers
from benchmarks.kit import StreamResult, aligned_table, percentile, write_json

ISL = 64
OSL = 48
ITEMS = OSL // 2  # "d, " is about two tokens an item


def schema() -> dict[str, Any]:
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    return {
        "type": "object",
        "properties": {
            "digits": {"type": "array", "items": digit, "minItems": ITEMS, "maxItems": ITEMS}
        },
        "required": ["digits"],
        "additionalProperties": False,
    }


def _body(prompt: list[int], constrained: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": SMOLLM2,
        "prompt": prompt,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if constrained:
        body["max_tokens"] = 4 * OSL  # the grammar ends it; this only bounds a runaway
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "digits", "schema": schema()},
        }
    else:
        body["max_tokens"] = OSL
        body["ignore_eos"] = True
    return body


def _check(result: StreamResult, constrained: bool) -> str | None:
    if not result.ok:
        return f"{result.status} {(result.error or {}).get('message', '')}"
    if constrained:
        try:
            digits = json.loads(result.text)["digits"]
        except (ValueError, KeyError, TypeError) as exc:
            return f"not the schema's JSON ({exc!r}): {result.text[:60]!r}"
        if len(digits) != ITEMS:
            return f"{len(digits)} items"
    return None


def measure(url: str, concurrency: int, requests: int, constrained: bool) -> dict[str, Any]:
    rng = random.Random(25)
    prompts = [[rng.randint(100, 40000) for _ in range(ISL)] for _ in range(concurrency + requests)]
    bodies = [_body(prompt, constrained) for prompt in prompts]
    done, first, last = trio.run(closed_loop, url, concurrency, bodies)
    tokens, tpots, failures = 0, [], []
    for result in done[concurrency:]:
        failure = _check(result, constrained)
        if failure is not None:
            failures.append(failure)
            continue
        generated = int((result.usage or {}).get("completion_tokens", 0))
        tokens += generated
        if len(result.arrivals) >= 2 and generated >= 2:
            tpots.append((result.arrivals[-1] - result.arrivals[0]) / (generated - 1) * 1e3)
    return {
        "tokens_per_s": tokens / (last - first),
        "tpot_p50_ms": percentile(tpots, 50),
        "tokens_per_request": tokens / max(1, requests - len(failures)),
        "failures": failures,
    }


def run(levels: Sequence[int], rounds: int) -> dict[str, Any]:
    rows = []
    with pdtrio_servers(SMOLLM2, "float32") as urls:
        for topology in ("colocated", "pd"):
            for concurrency in levels:
                requests = max(4, rounds * concurrency)
                plain = measure(urls[topology], concurrency, requests, constrained=False)
                constrained = measure(urls[topology], concurrency, requests, constrained=True)
                row = {
                    "topology": topology,
                    "concurrency": concurrency,
                    "plain": plain,
                    "schema": constrained,
                    "tokens_per_s_ratio": constrained["tokens_per_s"] / plain["tokens_per_s"],
                    "tpot_ratio": constrained["tpot_p50_ms"] / plain["tpot_p50_ms"],
                }
                rows.append(row)
                print(f"  {topology} c={concurrency} done", file=sys.stderr, flush=True)
    return {"benchmark": "structured_output", "isl": ISL, "osl": OSL, "rows": rows}


def print_report(report: dict[str, Any]) -> None:
    header = [
        "topology",
        "c",
        "plain tok/s",
        "schema tok/s",
        "ratio",
        "plain TPOT ms",
        "schema TPOT ms",
        "ratio",
        "schema tok/req",
        "failed",
    ]
    body = [
        [
            row["topology"],
            str(row["concurrency"]),
            f"{row['plain']['tokens_per_s']:.1f}",
            f"{row['schema']['tokens_per_s']:.1f}",
            f"{row['tokens_per_s_ratio']:.2f}",
            f"{row['plain']['tpot_p50_ms']:.1f}",
            f"{row['schema']['tpot_p50_ms']:.1f}",
            f"{row['tpot_ratio']:.2f}",
            f"{row['schema']['tokens_per_request']:.0f}",
            str(len(row["plain"]["failures"]) + len(row["schema"]["failures"])),
        ]
        for row in report["rows"]
    ]
    print(aligned_table(header, body))
    for row in report["rows"]:
        for kind in ("plain", "schema"):
            for failure in row[kind]["failures"][:3]:
                print(f"  {row['topology']} c={row['concurrency']} {kind}: {failure}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="c=1 only, fewer requests")
    parser.add_argument("--concurrency", default=None, help="e.g. 1,8")
    args = parser.parse_args(argv)
    levels: tuple[int, ...] = (1,) if args.quick else (1, 8)
    if args.concurrency:
        levels = tuple(int(x) for x in args.concurrency.split(","))
    report = run(levels, rounds=1 if args.quick else 3)
    print_report(report)
    write_json(args.json, report)
    failed = sum(len(r["plain"]["failures"]) + len(r["schema"]["failures"]) for r in report["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
