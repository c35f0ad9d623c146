"""The torch engine behind the engine API: a handed-over request goes on exactly as colocated."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import attrs
import msgspec
import pytest
import trio

pytest.importorskip("torch")

import trio.lowlevel

from pdtrio.config import EngineConfig  # noqa: E402
from pdtrio.engine.api import (  # noqa: E402
    BlocksFreed,
    EngineError,
    EngineOutput,
    PromptRejected,
    StepFailed,
)
from pdtrio.engine.torch.engine import TorchEngine  # noqa: E402
from pdtrio.protocol.link.wire import TextPrompt, TokenEntry, Usage  # noqa: E402
from pdtrio.protocol.sampling import SamplingParams  # noqa: E402

replace_fields = msgspec.structs.replace

TINY = EngineConfig(kind="torch", model="tiny-random", dtype="float64", num_kv_blocks=64)


PENALIZED = SamplingParams(
    seed=5,
    repetition_penalty=1.3,
    presence_penalty=0.5,
    frequency_penalty=0.4,
    logit_bias=((7, 3.0), (11, -2.0)),
    min_p=0.02,
    ignore_eos=True,
)


@pytest.fixture(scope="module")
def engines() -> tuple[TorchEngine, TorchEngine]:
    return TorchEngine.from_config(TINY), TorchEngine.from_config(TINY)


@asynccontextmanager
async def running(
    engine: TorchEngine,
) -> AsyncIterator[trio.MemoryReceiveChannel[EngineOutput]]:
    send, receive = trio.open_memory_channel[EngineOutput](16)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run, send)
        yield receive
        nursery.cancel_scope.cancel()


async def complete(
    prefill: TorchEngine, decode: TorchEngine, sampling: SamplingParams, max_tokens: int
) -> tuple[str, str | None, Usage | None, list[int]]:
    """Prefill on one engine, hand the KV over (unless it is the same one), decode to the end."""
    async with AsyncExitStack() as stack:
        outputs = await stack.enter_async_context(running(decode))
        if prefill is not decode:
            await stack.enter_async_context(running(prefill))
        ids = await prefill.tokenize(TextPrompt("the torch engine says"))
        result = await prefill.prefill("r", ids, sampling, max_tokens)
        if result.finish_reason is not None:
            assert prefill.statistics().kv_blocks_in_use == 0
            return result.first_text, result.finish_reason, result.usage, [result.first_token_id]
        blocks = decode.allocate_blocks("r", len(ids) + result.token_budget)
        if decode is not prefill:
            data = await prefill.read_blocks(result.block_ids)
            await decode.write_blocks(blocks[: len(result.block_ids)], data)
            prefill.free_request("r")
        await decode.start_decode(
            "r", ids, result.first_token_id, sampling, result.token_budget, 1, 0
        )
        entries: list[TokenEntry] = []
        with trio.fail_after(60):
            async for step in outputs:
                assert not isinstance(step, StepFailed)
                entries += step
                if entries[-1].finish_reason is not None:
                    break
    assert decode.statistics().kv_blocks_in_use == 0
    assert all(e.usage is None for e in entries[:-1])
    tokens = [result.first_token_id, *(t for e in entries for t in e.token_ids)]
    return (
        result.first_text + "".join(e.text for e in entries),
        entries[-1].finish_reason,
        (entries[-1].usage),
        tokens,
    )


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0, ignore_eos=True),
        SamplingParams(seed=5, top_k=40, ignore_eos=True),
        PENALIZED,
    ],
)
async def test_handed_over_equals_colocated_and_decode_counts_the_whole_budget(
    engines: tuple[TorchEngine, TorchEngine], sampling: SamplingParams
) -> None:
    one, other = engines
    colocated = await complete(one, one, sampling, 9)
    handed_over = await complete(one, other, sampling, 9)
    assert handed_over == colocated
    _, finish, usage, tokens = colocated
    assert finish == "length" and len(tokens) == 9
    assert usage is not None and usage.completion_tokens == 9


async def test_penalties_and_bias_change_the_tokens_as_asked(
    engines: tuple[TorchEngine, TorchEngine],
) -> None:
    one, other = engines
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    _, _, _, plain = await complete(one, one, greedy, 12)
    forced = replace_fields(greedy, logit_bias=((42, 100.0),))
    assert (await complete(one, other, forced, 5))[3] == [42] * 5
    # the strongest penalty on repeats: greedy then never takes a token twice in a row
    # (tiny-random, greedy, repeats itself plainly)
    assert any(a == b for a, b in zip(plain, plain[1:], strict=False))
    repeated = replace_fields(greedy, frequency_penalty=2.0, presence_penalty=2.0)
    _, _, _, penalized = await complete(one, other, repeated, 12)
    assert penalized != plain
    assert len(set(penalized)) > len(set(plain))


async def test_stop_token_ids_stop_and_logit_bias_out_of_the_vocabulary_is_refused(
    engines: tuple[TorchEngine, TorchEngine],
) -> None:
    one, other = engines
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    _, _, _, plain = await complete(one, one, greedy, 8)
    stop_at = plain[3]
    cut = replace_fields(greedy, stop_token_ids=(stop_at,))
    text, finish, usage, tokens = await complete(one, other, cut, 8)
    assert finish == "stop" and tokens == plain[: plain.index(stop_at) + 1]
    assert usage is not None and usage.completion_tokens == len(tokens)
    ids = await one.tokenize(TextPrompt("x"))
    with pytest.raises(PromptRejected) as info:
        await one.prefill("bad", ids, replace_fields(greedy, logit_bias=((10**6, 1.0),)), 4)
    assert info.value.param == "logit_bias"
    assert one.statistics().kv_blocks_in_use == 0


async def test_a_stop_string_across_the_first_token_agrees_between_modes(
    engines: tuple[TorchEngine, TorchEngine],
) -> None:
    one, other = engines
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    text, _, _, _ = await complete(one, one, greedy, 12)
    if len(text) < 6:
        pytest.skip("the tiny model said too little to place a stop string")
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = SamplingParams(temperature=0, ignore_eos=True, stop=(stop,))
    colocated = await complete(one, one, cut, 12)
    assert await complete(one, other, cut, 12) == colocated
    assert colocated[0] == text[: text.find(stop)] and colocated[1] == "stop"


async def test_a_budget_of_one_finishes_at_prefill_with_its_usage(
    engines: tuple[TorchEngine, TorchEngine],
) -> None:
    one, _ = engines
    _, finish, usage, tokens = await complete(one, one, SamplingParams(temperature=0), 1)
    assert finish in ("length", "stop") and len(tokens) == 1
    assert usage is not None and usage.completion_tokens == 1


async def test_a_start_with_nothing_left_to_generate_is_refused(
    engines: tuple[TorchEngine, TorchEngine],
) -> None:
    one, _ = engines
    with pytest.raises(EngineError, match="no token budget left"):
        await one.start_decode("x", [5, 6], 7, SamplingParams(), 3, 3, 0)
    with pytest.raises(EngineError, match="out of the vocabulary"):
        await one.start_decode("x", [5, 6], -1, SamplingParams(), 3, 1, 0)


async def test_each_step_is_reported_to_the_step_observer() -> None:
    engine = TorchEngine.from_config(TINY)
    steps: list[tuple[float, int, int]] = []
    engine.observe_steps(lambda seconds, batch, tokens: steps.append((seconds, batch, tokens)))
    sampling = SamplingParams(temperature=0, ignore_eos=True)
    await complete(engine, engine, sampling, max_tokens=5)
    # the prefill step, then one decode step per token after the first
    assert len(steps) == 5
    assert all(seconds > 0 and batch == 1 and tokens == 1 for seconds, batch, tokens in steps)
    assert engine.statistics().waiting_requests == 0


def _chunked(chunk: int) -> TorchEngine:
    return TorchEngine.from_config(
        attrs.evolve(TINY, prefill_chunk_tokens=chunk, num_kv_blocks=128)
    )


async def test_a_long_prompt_prefilled_in_chunks_answers_as_prefilled_whole() -> None:
    prompt = [(7 * i + 3) % 200 + 5 for i in range(300)]
    sampling = SamplingParams(temperature=0, ignore_eos=True)
    answers = []
    for chunk in (64, 2048):
        engine = _chunked(chunk)
        steps: list[int] = []
        engine.observe_steps(lambda seconds, batch, tokens, steps=steps: steps.append(batch))
        async with running(engine) as outputs:
            result = await engine.prefill("r", prompt, sampling, 4)
            await engine.start_decode("r", prompt, result.first_token_id, sampling, 4, 1, 0)
            tokens = [result.first_token_id]
            with trio.fail_after(60):
                async for step in outputs:
                    assert not isinstance(step, StepFailed)
                    tokens += [t for entry in step for t in entry.token_ids]
                    if step[-1].finish_reason is not None:
                        break
        answers.append(tokens)
        # 300 tokens a chunk of 64 a step: 5 prefill steps, then 3 decode steps
        assert len(steps) == (5 if chunk == 64 else 1) + 3
        assert engine.statistics().kv_blocks_in_use == 0
    assert answers[0] == answers[1]


async def test_a_long_prefill_that_is_cancelled_stops_within_a_chunk() -> None:
    engine = _chunked(16)
    prompt = [(5 * i + 1) % 200 + 5 for i in range(1000)]  # 63 chunks of 16
    steps: list[int] = []
    first_step = trio.Event()

    def observed(seconds: float, batch: int, tokens: int) -> None:
        steps.append(batch)
        trio.from_thread.run_sync(first_step.set, trio_token=token)

    engine.observe_steps(observed)
    token = trio.lowlevel.current_trio_token()
    async with running(engine) as outputs:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.prefill, "gone", prompt, SamplingParams(), 4)
            await first_step.wait()
            nursery.cancel_scope.cancel()  # the client left
        # the engine reads its inbox in order: once a later prefill is answered, the
        # abort before it was taken
        with trio.fail_after(30):
            await engine.prefill("later", [5, 6, 7], SamplingParams(), 4)
        engine.free_request("later")
        assert engine.statistics().kv_blocks_in_use == 0
        # (sent as the abort was taken, before the later prefill's step)
        assert outputs.receive_nowait() == BlocksFreed(("gone",))
    assert len(steps) < 63 // 2, steps


async def test_a_prefill_step_whose_requests_all_left_is_abandoned_between_layers() -> None:
    # one chunk is the whole prompt: the abort must cut the step itself short
    engine = _chunked(4096)
    prompt = [(3 * i + 2) % 200 + 5 for i in range(1500)]
    steps: list[int] = []
    engine.observe_steps(lambda seconds, batch, tokens: steps.append(batch))
    async with running(engine):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.prefill, "gone", prompt, SamplingParams(), 4)
            while engine.statistics().kv_blocks_in_use == 0:  # noqa: ASYNC110 (its blocks, taken)
                await trio.lowlevel.checkpoint()
            nursery.cancel_scope.cancel()
        with trio.fail_after(30):
            await engine.prefill("later", [5, 6, 7], SamplingParams(), 4)
        engine.free_request("later")
        assert engine.statistics().kv_blocks_in_use == 0
    assert steps == [1], steps  # the later prefill's step alone: the long one never completed


async def test_an_aborted_decode_is_freed_between_steps_and_the_engine_says_so() -> None:
    engine = TorchEngine.from_config(TINY)
    sampling = SamplingParams(temperature=0, ignore_eos=True)
    async with running(engine) as outputs:
        ids = await engine.tokenize(TextPrompt("the torch engine says"))
        # more tokens than the outputs channel holds: it cannot finish before the abort
        result = await engine.prefill("r", ids, sampling, 200)
        engine.allocate_blocks("r", len(ids) + result.token_budget)
        await engine.start_decode(
            "r", ids, result.first_token_id, sampling, result.token_budget, 1, 0
        )
        with trio.fail_after(60):
            first = await outputs.receive()
            assert isinstance(first, list) and first[0].request_id == "r"  # it runs
            engine.abort("r")  # the engine thread takes it between steps
            async for step in outputs:
                if isinstance(step, BlocksFreed):
                    break
                assert isinstance(step, list), step
                assert all(e.finish_reason is None for e in step), step  # steps before it
            # the output comes once the blocks are free, not before
            assert step == BlocksFreed(("r",))
            statistics = engine.statistics()
            assert statistics.kv_blocks_in_use == 0 and statistics.running_requests == 0


async def continue_from(
    prefill: TorchEngine,
    decode: TorchEngine,
    sampling: SamplingParams,
    max_tokens: int,
    delivered: list[int],
) -> tuple[str, str | None, Usage | None, list[int]]:
    """A migrated request: the prompt and ``delivered`` prefilled again, decoded elsewhere."""
    async with AsyncExitStack() as stack:
        outputs = await stack.enter_async_context(running(decode))
        await stack.enter_async_context(running(prefill))
        ids = [*await prefill.tokenize(TextPrompt("the torch engine says")), *delivered]
        result = await prefill.prefill("c", ids, sampling, max_tokens, len(delivered))
        if result.finish_reason is not None:
            return result.first_text, result.finish_reason, result.usage, [result.first_token_id]
        own = len(ids) - len(delivered)
        blocks = decode.allocate_blocks("c", own + result.token_budget)
        await decode.write_blocks(
            blocks[: len(result.block_ids)], await prefill.read_blocks(result.block_ids)
        )
        prefill.free_request("c")
        await decode.start_decode(
            "c",
            ids,
            result.first_token_id,
            sampling,
            result.token_budget,
            len(delivered) + 1,
            0,
            len(delivered),
        )
        entries: list[TokenEntry] = []
        with trio.fail_after(60):
            async for step in outputs:
                assert not isinstance(step, StepFailed)
                entries += step
                if entries[-1].finish_reason is not None:
                    break
    assert decode.statistics().kv_blocks_in_use == 0
    tokens = [result.first_token_id, *(t for e in entries for t in e.token_ids)]
    text = result.first_text + "".join(e.text for e in entries)
    return text, entries[-1].finish_reason, entries[-1].usage, tokens


@pytest.mark.parametrize("cut", [1, 4])
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0, ignore_eos=True),
        SamplingParams(seed=5, top_k=40, ignore_eos=True),
        PENALIZED,
    ],
    ids=["greedy", "seeded", "penalized"],
)
async def test_a_continuation_goes_on_as_the_undisturbed_request(
    engines: tuple[TorchEngine, TorchEngine], sampling: SamplingParams, cut: int
) -> None:
    one, other = engines
    text, finish, usage, tokens = await complete(one, other, sampling, 9)
    rest_text, rest_finish, rest_usage, rest = await continue_from(
        one, other, sampling, 9, tokens[:cut]
    )
    # the same tokens from the cut on, the budget exact, usage as if nothing happened
    assert tokens[:cut] + rest == tokens
    assert (rest_finish, rest_usage) == (finish, usage)
    assert text.endswith(rest_text)
