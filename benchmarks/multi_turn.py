"""Multi-turn conversations with a shared system prompt: the engine's prefix cache off vs on.

    python -m benchmarks.multi_turn [--json PATH] [--conversations 4] [--turns 4] [--quick]

N conversations run at once, turn after turn (as vLLM's multi-turn benchmark does): every
prompt is the shared system prompt, the conversation's history and a new user message;
the history grows by that message and the assistant's reply each turn.  Two PD clusters
(one prefill, one decode worker each, one router each) differ only in
``engine.prefix_cache``; each turn runs on both, one after the other (the order
alternates by turn, so machine noise hits both alike).  Reported per turn: TTFT p50/p99,
and the share of the prompt tokens that usage says were cached
(``prompt_tokens_details.cached_tokens``); per mode, output tokens per second over the
whole run, and the prefill worker's ``/metrics`` hit tokens (which must equal the sum of
the usage figures).

Prompts are token ids (``/v1/completions``), so the history is exact; the assistant's
reply in the history is OSL made-up ids, not what the model said (the cache keeps the
blocks of prompts, not of decode's output, so this changes no hit).  Engines: the
synthetic one (``prefill_s_per_token`` makes a prefill cost its uncached tokens) and
SmolLM2 (``--quick``: tiny-random), float32.  The issue's goal: from the second turn,
TTFT p50 with the cache at most 0.3x without.

Routing: the same conversations (synthetic engine) on five clusters, one after the
other each turn: **cache off** (two prefills in turn, no prefix cache anywhere), and with
the cache on everywhere: **one prefill** (what one instance gets alone), **two prefills in
turn** (``round_robin``, ``prefill_cache_weight = 0``: the cache ignored), **two prefills,
cache-aware** (the router's prefix index from the workers' KV events,
``prefill_cache_weight`` at its default) and **cache-aware + local prefill** (conditional
disaggregation: ``local_prefill_max_tokens`` set to a turn's new tokens and a block, so a
turn whose history decode holds is prefilled on decode, no prefill hop, no KV transfer).
Reported from the second turn on: the share of prompt tokens cached, TTFT p50/p99 and
their ratio to cache off, and the share of prefills run on decode, per mode; the goals:
cache-aware routing's hit share at least 0.9x one prefill's, and TTFT p50 with every
layer on at most 0.3x cache off.  The full run routes SmolLM2 the same five ways too, one
mode's cluster after another (fourteen real workers at once would not fit on the machine),
so machine noise between modes is not evened out there.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from benchmarks.kit import aligned_table, percentile, stream_completion, write_json
from pdtrio.testing import Processes, write_router_config

GOAL_RATIO = 0.3
ROUTING_GOAL = 0.9  # cache-aware routing's hit share against one prefill alone


@attrs.frozen
class Plan:
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: int
    osl: int


FULL = Plan(conversations=4, turns=4, system_tokens=256, user_tokens=32, osl=16)
QUICK = Plan(conversations=2, turns=3, system_tokens=64, user_tokens=16, osl=4)


@attrs.frozen
class Engine:
    name: str  # the served model name
    config: dict[str, Any]  # [engine], bar prefix_cache
    vocab: tuple[int, int]  # the token ids prompts are drawn from


SYNTHETIC = Engine(
    "synthetic",
    {
        "kind": "synthetic",
        "num_kv_blocks": 1024,
        "synthetic": {"prefill_s_per_token": 0.001, "decode_step_s": 0.002},
    },
    (10, 999),
)
SMOLLM2 = Engine(
    "smollm2-135m-instruct",
    {"kind": "torch", "model": "smollm2-135m-instruct", "num_kv_blocks": 512},
    (100, 40000),
)
# tiny-random's ids 3..258 are raw bytes: printable ASCII keeps every token visible text
TINY = Engine(
    "tiny-random",
    {"kind": "torch", "model": "tiny-random", "num_kv_blocks": 512},
    (0x20 + 3, 0x7E + 3),
)


def _worker_config(role: str, engine: Engine, prefix_cache: bool) -> dict[str, Any]:
    return {"role": role, "engine": {**engine.config, "prefix_cache": prefix_cache}}


@attrs.define
class Conversation:
    history: list[int]  # every token of the next prompt but the new user message
    rng: random.Random

    def words(self, count: int, vocab: tuple[int, int]) -> list[int]:
        return [self.rng.randint(*vocab) for _ in range(count)]


def _conversations(
    engine: Engine, plan: Plan, modes: Iterable[str], *, salt: int
) -> dict[str, list[Conversation]]:
    """The same conversations for every mode: one system prompt, each its own seed."""
    base = random.Random(plan.system_tokens * salt + plan.turns)
    system = [base.randint(*engine.vocab) for _ in range(plan.system_tokens)]
    seeds = [base.randrange(1 << 30) for _ in range(plan.conversations)]
    return {
        mode: [Conversation(list(system), random.Random(seed)) for seed in seeds] for mode in modes
    }


async def _turn(
    http: httpx.AsyncClient,
    engine: Engine,
    conversation: Conversation,
    user: list[int],
    plan: Plan,
    results: list[dict[str, float]],
) -> None:
    prompt = [*conversation.history, *user]
    body = {
        "model": engine.name,
        "prompt": prompt,
        "max_tokens": plan.osl,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer = await stream_completion(http, body)
    assert answer.ok, (answer.status, answer.body, answer.error)
    usage = answer.usage or {}
    assert usage.get("completion_tokens") == plan.osl, usage
    assert answer.ttft is not None
    results.append(
        {
            "ttft_ms": answer.ttft * 1e3,
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        }
    )


async def _run_turn(
    url: str, engine: Engine, conversations: list[Conversation], users: list[list[int]], plan: Plan
) -> list[dict[str, float]]:
    results: list[dict[str, float]] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async with trio.open_nursery() as nursery:
            for conversation, user in zip(conversations, users, strict=True):
                nursery.start_soon(_turn, http, engine, conversation, user, plan, results)
    return results


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def run_case(engine: Engine, plan: Plan) -> dict[str, Any]:
    modes = {"off": False, "on": True}
    with tempfile.TemporaryDirectory() as tmp, Processes() as procs:
        starting = {
            (mode, role): procs.start_worker(_worker_config(role, engine, cache))
            for mode, cache in modes.items()
            for role in ("prefill", "decode")
        }
        workers = {key: procs.wait_ready(process) for key, process in starting.items()}
        routers = {
            mode: procs.router(
                write_router_config(
                    Path(tmp) / f"{mode}.toml",
                    [(role, workers[(mode, role)].url) for role in ("prefill", "decode")],
                )
            )
            for mode in modes
        }
        # the same conversations in both modes: the same system prompt, users and replies
        state = _conversations(engine, plan, modes, salt=31)
        samples: dict[str, list[list[dict[str, float]]]] = {mode: [] for mode in modes}
        walls = dict.fromkeys(modes, 0.0)
        for turn in range(plan.turns):
            order = list(modes) if turn % 2 == 0 else list(reversed(modes))
            for mode in order:
                conversations = state[mode]
                users = [c.words(plan.user_tokens, engine.vocab) for c in conversations]
                started = time.perf_counter()
                results = trio.run(_run_turn, routers[mode].url, engine, conversations, users, plan)
                walls[mode] += time.perf_counter() - started
                samples[mode].append(results)
                for conversation, user in zip(conversations, users, strict=True):
                    reply = conversation.words(plan.osl, engine.vocab)
                    conversation.history += [*user, *reply]
        hits: dict[str, float] = {}
        with httpx.Client(timeout=30) as http:
            for mode in modes:
                text = http.get(f"{workers[(mode, 'prefill')].url}/metrics").text
                hits[mode] = _metric(text, "pdtrio_engine_prefix_cache_hit_tokens_total")
    turns = []
    for turn in range(plan.turns):
        row: dict[str, Any] = {"turn": turn + 1}
        for mode in modes:
            results = samples[mode][turn]
            ttfts = [r["ttft_ms"] for r in results]
            row[mode] = {
                "requests": len(results),
                "prompt_tokens_mean": sum(r["prompt_tokens"] for r in results) / len(results),
                "ttft_p50_ms": percentile(ttfts, 50),
                "ttft_p99_ms": percentile(ttfts, 99),
                "cached_fraction": sum(r["cached_tokens"] for r in results)
                / sum(r["prompt_tokens"] for r in results),
            }
        row["ttft_p50_ratio"] = row["on"]["ttft_p50_ms"] / row["off"]["ttft_p50_ms"]
        turns.append(row)
    output_tokens = plan.conversations * plan.turns * plan.osl
    later = [row["ttft_p50_ratio"] for row in turns[1:]]
    return {
        "engine": engine.name,
        "turns": turns,
        "output_tokens_per_s": {mode: output_tokens / walls[mode] for mode in modes},
        "usage_cached_tokens": {
            mode: sum(r["cached_tokens"] for turn in samples[mode] for r in turn) for mode in modes
        },
        "metrics_hit_tokens": hits,
        "goal": {
            "goal": f"from turn 2, TTFT p50 with the cache <= {GOAL_RATIO}x without",
            "worst_ratio": max(later) if later else None,
            "pass": (max(later) <= GOAL_RATIO) if later else None,
        },
    }


@attrs.frozen
class RoutingMode:
    prefills: int
    router: dict[str, Any]  # [router] settings
    prefix_cache: bool = True
    local_prefill: bool = False  # local_prefill_max_tokens: a turn's new tokens and a block


BLIND = {"prefill_policy": "round_robin", "prefill_cache_weight": 0, "decode_cache_weight": 0}
ROUTING_MODES = {
    "cache off": RoutingMode(2, BLIND, prefix_cache=False),
    "one prefill": RoutingMode(1, {}),
    "round robin": RoutingMode(2, BLIND),
    "cache-aware": RoutingMode(2, {"prefill_policy": "round_robin"}),
    "+ local prefill": RoutingMode(2, {"prefill_policy": "round_robin"}, local_prefill=True),
}
BLOCK_SIZE = 16  # the engines' (EngineConfig's default)


def _local_prefill_threshold(plan: Plan) -> int:
    """A turn's new tokens (the last reply, the new message) and the partial block before."""
    return plan.user_tokens + plan.osl + BLOCK_SIZE


def _router_settings(spec: RoutingMode, plan: Plan) -> dict[str, Any]:
    if not spec.local_prefill:
        return spec.router
    return {**spec.router, "local_prefill_max_tokens": _local_prefill_threshold(plan)}


def _labelled(text: str, name: str, label: str, value: str) -> float:
    """A counter's value for one label value (0 when absent)."""
    prefix = f'{name}{{{label}="{value}"}} '
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return 0.0


def _route_turns(
    engine: Engine,
    plan: Plan,
    modes: dict[str, RoutingMode],
    state: dict[str, list[Conversation]],
    samples: dict[str, list[list[dict[str, float]]]],
    local_share: dict[str, float],
) -> None:
    """Every turn of ``state``'s conversations on a cluster per mode of ``modes`` (all
    started at once, the modes' order rotating by turn), into ``samples``; the share of
    each mode's prefills run on decode into ``local_share``."""
    with tempfile.TemporaryDirectory() as tmp, Processes() as procs:
        starting = {
            (mode, role, index): procs.start_worker(_worker_config(role, engine, spec.prefix_cache))
            for mode, spec in modes.items()
            for role, count in (("prefill", spec.prefills), ("decode", 1))
            for index in range(count)
        }
        workers = {key: procs.wait_ready(process) for key, process in starting.items()}
        routers = {
            mode: procs.router(
                write_router_config(
                    Path(tmp) / f"routing-{index}.toml",
                    [(role, w.url) for (m, role, _), w in workers.items() if m == mode],
                    router=_router_settings(spec, plan),
                )
            )
            for index, (mode, spec) in enumerate(modes.items())
        }
        for turn in range(plan.turns):
            order = list(modes)
            order = order[turn % len(order) :] + order[: turn % len(order)]
            for mode in order:
                conversations = state[mode]
                users = [c.words(plan.user_tokens, engine.vocab) for c in conversations]
                samples[mode].append(
                    trio.run(_run_turn, routers[mode].url, engine, conversations, users, plan)
                )
                for conversation, user in zip(conversations, users, strict=True):
                    conversation.history += [*user, *conversation.words(plan.osl, engine.vocab)]
        with httpx.Client(timeout=30) as http:
            for mode in modes:
                text = http.get(f"{routers[mode].url}/metrics").text
                name = "pdtrio_prefill_placements_total"
                local = _labelled(text, name, "where", "local")
                local_share[mode] = local / max(
                    1.0, local + _labelled(text, name, "where", "remote")
                )


def run_routing_case(engine: Engine, plan: Plan, *, together: bool = True) -> dict[str, Any]:
    """The same conversations, routed five ways (the first with the cache off): every
    mode's cluster at once, turns alternating between them (``together``), or one mode's
    cluster after another (a real model's fourteen workers would not fit at once)."""
    modes = ROUTING_MODES
    state = _conversations(engine, plan, modes, salt=17)
    samples: dict[str, list[list[dict[str, float]]]] = {mode: [] for mode in modes}
    local_share: dict[str, float] = {}
    groups = [modes] if together else [{mode: spec} for mode, spec in modes.items()]
    for group in groups:
        _route_turns(engine, plan, group, state, samples, local_share)
    result: dict[str, Any] = {"engine": engine.name, "modes": {}}
    for mode in modes:
        later = [r for turn in samples[mode][1:] for r in turn]
        result["modes"][mode] = {
            "cached_share": sum(r["cached_tokens"] for r in later)
            / max(1, sum(r["prompt_tokens"] for r in later)),
            "ttft_p50_ms": percentile([r["ttft_ms"] for r in later], 50),
            "ttft_p99_ms": percentile([r["ttft_ms"] for r in later], 99),
            "local_prefill_share": local_share[mode],
        }
    off = result["modes"]["cache off"]["ttft_p50_ms"]
    for figures in result["modes"].values():
        figures["ttft_p50_vs_off"] = figures["ttft_p50_ms"] / off
    alone = result["modes"]["one prefill"]["cached_share"]
    aware = result["modes"]["cache-aware"]["cached_share"]
    ratio = aware / alone if alone else None
    every_layer = result["modes"]["+ local prefill"]["ttft_p50_vs_off"]
    result["goal"] = {
        "goal": f"from turn 2, cache-aware hit share >= {ROUTING_GOAL}x one prefill's",
        "ratio": ratio,
        "pass": None if ratio is None else ratio >= ROUTING_GOAL,
    }
    result["ttft_goal"] = {
        "goal": f"from turn 2, TTFT p50 with every layer on <= {GOAL_RATIO}x cache off",
        "ratio": every_layer,
        "pass": every_layer <= GOAL_RATIO,
    }
    result["local_prefill_max_tokens"] = _local_prefill_threshold(plan)
    result["modes_together"] = together
    return result


def print_routing_table(case: dict[str, Any]) -> None:
    rows = [
        [
            mode,
            f"{100 * figures['cached_share']:.0f}%",
            f"{figures['ttft_p50_ms']:.1f}",
            f"{figures['ttft_p99_ms']:.1f}",
            f"{figures['ttft_p50_vs_off']:.2f}",
            f"{100 * figures['local_prefill_share']:.0f}%",
        ]
        for mode, figures in case["modes"].items()
    ]
    how = "modes side by side" if case["modes_together"] else "one mode after another"
    print(
        f"routing ({case['engine']}, {how}, from turn 2; local prefill up to "
        f"{case['local_prefill_max_tokens']} missing tokens):"
    )
    header = ["mode", "cached", "TTFT p50 ms", "TTFT p99 ms", "p50 vs off", "prefilled on decode"]
    print(aligned_table(header, rows, align="lrrrrr"))
    for goal in (case["goal"], case["ttft_goal"]):
        verdict = "n/a" if goal["pass"] is None else ("pass" if goal["pass"] else "FAIL")
        ratio = "n/a" if goal["ratio"] is None else f"{goal['ratio']:.2f}"
        print(f"goal ({goal['goal']}): {ratio}, {verdict}")


def print_table(cases: list[dict[str, Any]]) -> None:
    header = [
        "engine",
        "turn",
        "prompt",
        "TTFT p50 off",
        "TTFT p99 off",
        "TTFT p50 on",
        "TTFT p99 on",
        "on/off p50",
        "cached on",
    ]
    rows = []
    for case in cases:
        for row in case["turns"]:
            off, on = row["off"], row["on"]
            rows.append(
                [
                    case["engine"],
                    str(row["turn"]),
                    f"{on['prompt_tokens_mean']:.0f}",
                    f"{off['ttft_p50_ms']:.1f}",
                    f"{off['ttft_p99_ms']:.1f}",
                    f"{on['ttft_p50_ms']:.1f}",
                    f"{on['ttft_p99_ms']:.1f}",
                    f"{row['ttft_p50_ratio']:.2f}",
                    f"{100 * on['cached_fraction']:.0f}%",
                ]
            )
    print("TTFT in ms; prompt: mean prompt tokens; cached on: share of prompt tokens cached")
    print(aligned_table(header, rows, align="ll" + "r" * 7))
    for case in cases:
        tps = case["output_tokens_per_s"]
        goal = case["goal"]
        print(
            f"{case['engine']}: output tokens/s off {tps['off']:.1f}, on {tps['on']:.1f}; "
            f"cached tokens (usage) {case['usage_cached_tokens']['on']}, "
            f"(/metrics) {case['metrics_hit_tokens']['on']:.0f}; "
            f"goal ({goal['goal']}): worst {goal['worst_ratio']:.2f}, "
            f"{'pass' if goal['pass'] else 'FAIL'}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--conversations", type=int, default=FULL.conversations)
    parser.add_argument("--turns", type=int, default=FULL.turns)
    parser.add_argument(
        "--quick", action="store_true", help="2 conversations of 3 short turns, tiny-random"
    )
    args = parser.parse_args(argv)
    if args.quick:
        plan, engines = QUICK, [SYNTHETIC, TINY]
    else:
        plan = attrs.evolve(FULL, conversations=args.conversations, turns=args.turns)
        engines = [SYNTHETIC, SMOLLM2]
    cases = []
    for engine in engines:
        print(f"running {engine.name} ...", file=sys.stderr, flush=True)
        cases.append(run_case(engine, plan))
    print(f"running routing ({SYNTHETIC.name}) ...", file=sys.stderr, flush=True)
    routing = run_routing_case(SYNTHETIC, plan)
    real_routing = None
    if not args.quick:
        # a real model's clusters one mode after another (five at once would not fit)
        print(f"running routing ({SMOLLM2.name}) ...", file=sys.stderr, flush=True)
        real_routing = run_routing_case(SMOLLM2, plan, together=False)
    print_table(cases)
    print_routing_table(routing)
    if real_routing is not None:
        print_routing_table(real_routing)
    write_json(
        args.json,
        {
            "benchmark": "multi_turn",
            "quick": args.quick,
            "plan": attrs.asdict(plan),
            "cases": cases,
            "routing": routing,
            "real_routing": real_routing,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
