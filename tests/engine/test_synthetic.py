"""The synthetic engine and the torch-free pieces both engines share: budget, stop rules."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from pdtrio.config import SyntheticEngineConfig
from pdtrio.engine.api import EngineError, EngineOutput, PromptRejected, StepFailed
from pdtrio.engine.budget import token_budget, tokens_left
from pdtrio.engine.scheduler import SchedulerLimits
from pdtrio.engine.stopping import OutputProcessor, StopStringHoldBack
from pdtrio.engine.synthetic import SyntheticEngine, synthetic_text
from pdtrio.protocol.link.wire import TextPrompt, TokenEntry, Usage
from pdtrio.protocol.sampling import SamplingParams

PROMPT = "the synthetic prompt"


def engine(**overrides: float) -> SyntheticEngine:
    config = SyntheticEngineConfig(decode_step_s=0.0, **overrides)  # type: ignore[arg-type]
    return SyntheticEngine(config, num_blocks=64, block_size=4)


async def decode_to_the_end(
    target: SyntheticEngine, request_id: str, start: dict[str, object]
) -> list[TokenEntry]:
    """Run ``target`` until the request finishes; its entries, in order."""
    entries: list[TokenEntry] = []
    send, receive = trio.open_memory_channel[EngineOutput](16)
    async with trio.open_nursery() as nursery:
        await nursery.start(target.run, send)
        await target.start_decode(request_id, **start)  # type: ignore[arg-type]
        with trio.fail_after(10):
            async for step in receive:
                assert not isinstance(step, StepFailed)
                entries += [e for e in step if e.request_id == request_id]
                if entries and entries[-1].finish_reason is not None:
                    break
        nursery.cancel_scope.cancel()
    return entries


async def prefill_and_decode(
    sampling: SamplingParams, max_tokens: int | None, *, colocated: bool, **overrides: float
) -> tuple[str, str | None, Usage | None, list[int]]:
    """Prefill on one engine, decode on another (or the same): text, finish, usage, tokens."""
    prefill = engine(**overrides)
    ids = await prefill.tokenize(TextPrompt(PROMPT))
    result = await prefill.prefill("r", ids, sampling, max_tokens)
    if result.finish_reason is not None:
        return result.first_text, result.finish_reason, result.usage, [result.first_token_id]
    decode = prefill if colocated else engine(**overrides)
    blocks = decode.allocate_blocks("r", len(ids) + result.token_budget)
    if not colocated:
        data = await prefill.read_blocks(result.block_ids)
        await decode.write_blocks(blocks[: len(result.block_ids)], data)
        prefill.free_request("r")
    start: dict[str, object] = {
        "prompt_token_ids": ids,
        "first_token_id": result.first_token_id,
        "sampling": sampling,
        "token_budget": result.token_budget,
        "tokens_generated": 1,
        "cached_tokens": result.cached_tokens,
    }
    entries = await decode_to_the_end(decode, "r", start)
    assert all(e.usage is None for e in entries[:-1])
    assert decode.statistics().kv_blocks_in_use == 0  # finished: blocks are free
    tokens = [result.first_token_id, *(t for e in entries for t in e.token_ids)]
    text = result.first_text + "".join(e.text for e in entries)
    return text, entries[-1].finish_reason, entries[-1].usage, tokens


# --- budget ----------------------------------------------------------------------


def test_the_budget_is_whole_and_tokens_left_counts_down_from_it() -> None:
    assert token_budget(10, 5, max_model_len=100, kv_capacity_tokens=1000) == 5
    assert token_budget(10, None, max_model_len=100, kv_capacity_tokens=1000) == 90
    assert tokens_left(5, 1) == 4 and tokens_left(5, 5) == 0
    for prompt, max_tokens, param in [
        (10, 0, "max_tokens"),
        (0, 5, "prompt"),
        (95, 10, "max_tokens"),
    ]:
        with pytest.raises(PromptRejected) as caught:
            token_budget(prompt, max_tokens, max_model_len=100, kv_capacity_tokens=1000)
        assert caught.value.param == param
    with pytest.raises(PromptRejected, match="more than this instance can ever hold"):
        token_budget(10, 50, max_model_len=100, kv_capacity_tokens=40)


# --- the hold-back, alone ------------------------------------------------------------


def test_hold_back_keeps_a_possible_stop_start_and_cuts_at_the_first_stop() -> None:
    hold = StopStringHoldBack(["END", "xy"])
    assert hold.push("abcE") == ("abc", False)
    assert hold.push("N") == ("", False)
    assert hold.push("ough") == ("ENough", False)
    assert hold.push("..x") == ("..", False)
    assert hold.push("yz") == ("", True)
    assert StopStringHoldBack([]).push("anything") == ("anything", False)
    # finishing sends what was held unless it completes a stop string
    tail = StopStringHoldBack(["END"])
    assert tail.push("aE") == ("a", False)
    assert tail.finish("N") == ("EN", False)
    unmatched = StopStringHoldBack(["END"])
    assert unmatched.push("E", match=False) == ("", False)
    assert unmatched.finish("ND", match=False) == ("END", False)


def reference_cut(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    """Brute force: at the first piece that completes a stop string, cut at its earliest start."""
    text = ""
    for piece in pieces:
        old = len(text)
        text += piece
        starts = [
            i for s in stops for i in range(len(text)) if text.startswith(s, i) and i + len(s) > old
        ]
        if starts:
            return text[: min(starts)], True
    return text, False


@given(
    pieces=st.lists(st.text(alphabet="abc", max_size=3), max_size=12),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_hold_back_emits_the_text_cut_at_the_first_stop(
    pieces: list[str], stops: list[str]
) -> None:
    expected, expected_stop = reference_cut(pieces, stops)
    hold = StopStringHoldBack(stops)
    emitted = ""
    so_far = ""
    for piece in pieces:
        text, stopped = hold.push(piece)
        emitted += text
        so_far += piece
        if stopped:
            assert (emitted, True) == (expected, expected_stop)
            return
        # what is held back may still begin a stop string, and nothing more is
        assert so_far.startswith(emitted)
        held = so_far[len(emitted) :]
        assert not held or any(s.startswith(held) and len(held) < len(s) for s in stops)
    text, stopped = hold.finish("")
    assert (emitted + text, stopped) == (expected, expected_stop)


def test_output_processor_counts_the_budget_and_replays_without_counting() -> None:
    class Words:
        def push(self, token_id: int) -> str:
            return synthetic_text(token_id)

        def flush(self) -> str:
            return ""

    prefill = OutputProcessor(Words(), SamplingParams(), token_budget=3)
    assert prefill.push(7) == (" t7", None) and prefill.num_generated == 1
    decode = OutputProcessor(Words(), SamplingParams(), token_budget=3, tokens_generated=1)
    decode.replay(7)
    assert decode.num_generated == 1
    assert decode.push(8) == (" t8", None)
    assert decode.push(9) == (" t9", "length") and decode.num_generated == 3
    with pytest.raises(RuntimeError):
        decode.push(10)


# --- the engine --------------------------------------------------------------------


@pytest.mark.parametrize("colocated", [False, True])
async def test_decode_continues_exactly_where_prefill_left_off(colocated: bool) -> None:
    sampling = SamplingParams(seed=3)
    text, finish, usage, tokens = await prefill_and_decode(sampling, 12, colocated=colocated)
    assert finish == "length" and len(tokens) == 12
    assert text == "".join(synthetic_text(t) for t in tokens)
    assert usage is not None and usage.completion_tokens == 12
    assert usage.prompt_tokens == len(await engine().tokenize(TextPrompt(PROMPT)))


@pytest.mark.parametrize("tokens_per_step", [1, 3])
async def test_a_stop_string_cuts_the_text_and_usage_counts_up_to_it(tokens_per_step: int) -> None:
    whole, _, _, tokens = await prefill_and_decode(SamplingParams(), 10, colocated=False)
    words = [synthetic_text(t) for t in tokens]
    # a stop string from the middle of the 2nd token's word to the middle of the 4th's
    start = len(words[0]) + 2
    stop = whole[start : len(words[0]) + len(words[1]) + len(words[2]) + 2]
    text, finish, usage, cut_tokens = await prefill_and_decode(
        SamplingParams(stop=(stop,)), 10, colocated=False, tokens_per_step=tokens_per_step
    )
    assert (text, finish) == (whole[:start], "stop")
    assert cut_tokens == tokens[:4]  # no token past the one that completed the stop
    assert usage is not None and usage.completion_tokens == 4


async def test_a_stop_string_in_the_first_token_finishes_at_prefill() -> None:
    whole, _, _, tokens = await prefill_and_decode(SamplingParams(), 5, colocated=False)
    text, finish, usage, cut = await prefill_and_decode(
        SamplingParams(stop=(whole[2:4],)), 5, colocated=False
    )
    assert (text, finish, cut) == (whole[:2], "stop", tokens[:1])
    assert usage is not None and usage.completion_tokens == 1


async def test_a_start_with_no_budget_left_or_a_foreign_token_is_an_engine_error() -> None:
    target = engine()
    ids = await target.tokenize(TextPrompt(PROMPT))
    result = await target.prefill("r", ids, SamplingParams(), 4)
    target.allocate_blocks("r", len(ids) + 4)
    for budget, generated, first in [
        (4, 4, result.first_token_id),
        (4, 0, result.first_token_id),
        (4, 1, -1),
    ]:
        with pytest.raises(EngineError):
            await target.start_decode("r", ids, first, SamplingParams(), budget, generated, 0)
    target.free_request("r")
    assert target.statistics().kv_blocks_in_use == 0


# --- continuation (a migrated request) -----------------------------------------------


async def continued_from(
    sampling: SamplingParams, max_tokens: int | None, delivered: list[int]
) -> tuple[str, str | None, Usage | None, list[int]]:
    """Prefill the prompt and ``delivered`` (earlier output) on a fresh engine, decode on
    another: the continuation's text, finish, usage and tokens, as a router would get them."""
    prefill = engine()
    ids = await prefill.tokenize(TextPrompt(PROMPT))
    whole = [*ids, *delivered]
    result = await prefill.prefill("c", whole, sampling, max_tokens, len(delivered))
    if result.finish_reason is not None:
        return result.first_text, result.finish_reason, result.usage, [result.first_token_id]
    decode = engine()
    blocks = decode.allocate_blocks("c", len(ids) + result.token_budget)
    await decode.write_blocks(
        blocks[: len(result.block_ids)], await prefill.read_blocks(result.block_ids)
    )
    prefill.free_request("c")
    start: dict[str, object] = {
        "prompt_token_ids": whole,
        "first_token_id": result.first_token_id,
        "sampling": sampling,
        "token_budget": result.token_budget,
        "tokens_generated": len(delivered) + 1,
        "cached_tokens": 0,
        "generated_tokens": len(delivered),
    }
    entries = await decode_to_the_end(decode, "c", start)
    assert decode.statistics().kv_blocks_in_use == 0
    tokens = [result.first_token_id, *(t for e in entries for t in e.token_ids)]
    text = result.first_text + "".join(e.text for e in entries)
    return text, entries[-1].finish_reason, entries[-1].usage, tokens


def _text_of(tokens: list[int]) -> str:
    return "".join(synthetic_text(t) for t in tokens)


@pytest.mark.parametrize("cut", [1, 2, 5, 11])
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(seed=7),
        SamplingParams(min_tokens=10, temperature=0.0),
    ],
    ids=["greedy", "seeded", "min_tokens"],
)
async def test_a_continuation_goes_on_exactly_where_the_request_stopped(
    sampling: SamplingParams, cut: int
) -> None:
    text, finish, usage, tokens = await prefill_and_decode(sampling, 12, colocated=False)
    assert len(tokens) == 12
    rest_text, rest_finish, rest_usage, rest = await continued_from(sampling, 12, tokens[:cut])
    assert tokens[:cut] + rest == tokens  # no token lost, none twice, the budget exact
    assert _text_of(tokens[:cut]) + rest_text == text
    assert (rest_finish, rest_usage) == (finish, usage)  # the prompt proper, every token once


async def test_a_stop_string_across_the_cut_still_stops_the_continuation() -> None:
    _, _, _, tokens = await prefill_and_decode(SamplingParams(temperature=0.0), 12, colocated=False)
    whole = _text_of(tokens)
    boundary = len(_text_of(tokens[:6]))
    stop = whole[boundary - 2 : boundary + 3]  # begins in token 6, ends in token 7
    sampling = SamplingParams(temperature=0.0, stop=(stop,))
    text, finish, usage, _ = await prefill_and_decode(sampling, 12, colocated=False)
    assert (finish, text) == ("stop", whole[: whole.index(stop)])
    # cut after token 6: the router delivered the text its decode let out (the stop
    # string's start was held back); the continuation sends the rest, cut at the stop
    delivered = whole[: boundary - 2]
    rest_text, rest_finish, rest_usage, _ = await continued_from(sampling, 12, tokens[:6])
    assert (delivered + rest_text, rest_finish, rest_usage) == (text, finish, usage)


async def test_a_continuation_with_nothing_left_to_generate_is_refused() -> None:
    prefill = engine()
    ids = await prefill.tokenize(TextPrompt(PROMPT))
    with pytest.raises(PromptRejected, match="no token left"):
        await prefill.prefill("c", [*ids, 400, 401], SamplingParams(), 2, 2)
    with pytest.raises(PromptRejected, match="generated tokens"):
        await prefill.prefill("c", [400, 401], SamplingParams(), 5, 2)
    assert prefill.statistics().kv_blocks_in_use == 0


# --- scheduled steps (pdtrio.engine.scheduler), as the torch engine takes them ---------------


def _scheduled(
    max_batch_size: int, max_num_batched_tokens: int, chunk: int, **config: float
) -> SyntheticEngine:
    limits = SchedulerLimits(
        max_batch_size=max_batch_size,
        max_num_batched_tokens=max_num_batched_tokens,
        prefill_chunk_tokens=chunk,
    )
    config.setdefault("decode_step_s", 0.0)
    settings = SyntheticEngineConfig(**config)
    return SyntheticEngine(settings, num_blocks=256, block_size=4, scheduler_limits=limits)


async def test_scheduled_steps_decode_at_most_the_batch_limit() -> None:
    target = _scheduled(max_batch_size=2, max_num_batched_tokens=64, chunk=64)
    sampling = SamplingParams(temperature=0, ignore_eos=True)
    decoded: list[int] = []  # sequences decoded, step by step
    send, receive = trio.open_memory_channel[EngineOutput](64)
    finished: set[str] = set()
    async with trio.open_nursery() as nursery:
        await nursery.start(target.run, send)
        for name in ("a", "b", "c"):
            ids = [5, 6, 7]
            result = await target.prefill(name, ids, sampling, 4)
            target.allocate_blocks(name, len(ids) + result.token_budget)
            await target.start_decode(name, ids, result.first_token_id, sampling, 4, 1, 0)
        with trio.fail_after(10):
            async for step in receive:
                decoded.append(len(step))
                finished |= {e.request_id for e in step if e.finish_reason is not None}
                if finished == {"a", "b", "c"}:
                    break
        nursery.cancel_scope.cancel()
    # never more than max_batch_size a step; 3 tokens after the first for each of 3
    # sequences, 2 a step: 9 in at least 5 steps
    assert max(decoded) == 2 and sum(decoded) == 9 and len(decoded) >= 5
    assert target.statistics().waiting_requests == 0


async def test_scheduled_prefills_take_their_chunks_within_the_step_budget() -> None:
    # 10-token prompts, 4 tokens of one a step, 6 tokens a step in all: 2 prompts share it
    target = _scheduled(max_batch_size=8, max_num_batched_tokens=6, chunk=4)
    sampling = SamplingParams(temperature=0, ignore_eos=True)
    batches: list[int] = []
    target.observe_steps(lambda seconds, batch, tokens: batches.append(batch))
    done: list[str] = []
    send, _receive = trio.open_memory_channel[EngineOutput](64)

    async def prefill(name: str) -> None:
        await target.prefill(name, list(range(5, 15)), sampling, 4)
        done.append(name)

    async with trio.open_nursery() as nursery:
        with trio.fail_after(10):
            async with trio.open_nursery() as prompts:
                # both waiting, a first, before the engine takes a step
                for name in ("a", "b"):
                    prompts.start_soon(prefill, name)
                    await trio.testing.wait_all_tasks_blocked()
                await nursery.start(target.run, send)
        nursery.cancel_scope.cancel()
    # a: 4 + 4 + 2; b: 2 + 2 + 4 + 2 (what a leaves of each step's 6): 4 steps, a first
    assert done == ["a", "b"]
    assert batches == [2, 2, 2, 1]
    assert target.statistics().waiting_requests == 0


async def test_decodes_go_on_every_step_while_a_long_prompt_is_prefilled_in_chunks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 10 tokens a step: the 2 decodes' rows, then 8 of the 20-token prompt (8, 8, 4); each
    # step lasts 1 ms and 10 ms for each prompt token in it
    target = _scheduled(
        max_batch_size=8,
        max_num_batched_tokens=10,
        chunk=16,
        decode_step_s=0.001,
        prefill_s_per_token=0.01,
    )
    sampling = SamplingParams(temperature=0, ignore_eos=True)
    steps: list[tuple[float, list[str]]] = []
    send, receive = trio.open_memory_channel[EngineOutput](64)
    async with trio.open_nursery() as nursery:
        await nursery.start(target.run, send)
        for name in ("a", "b"):
            ids = [5, 6, 7]
            result = await target.prefill(name, ids, sampling, 40)
            target.allocate_blocks(name, len(ids) + result.token_budget)
            await target.start_decode(name, ids, result.first_token_id, sampling, 40, 1, 0)

        async def record() -> None:
            async for step in receive:
                assert isinstance(step, list)
                steps.append((trio.current_time(), [entry.request_id for entry in step]))

        nursery.start_soon(record)
        while not steps or steps[-1][1] != ["a", "b"]:
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(0.001)
        started = trio.current_time()
        await target.prefill("long", list(range(5, 25)), sampling, 4)
        prefilled = trio.current_time() - started
        await trio.testing.wait_all_tasks_blocked()  # the last step's tokens recorded
        nursery.cancel_scope.cancel()
    # three steps of 8 + 8 + 4 prompt tokens (1 ms + 10 ms a prompt token each), each with
    # both decodes
    # (less the part of the first step's 1 ms that had passed when it came)
    assert 0.202 - 1e-9 <= prefilled <= 0.203 + 1e-9
    during = [ids for at, ids in steps if started < at <= started + prefilled]
    assert during == [["a", "b"]] * 3
