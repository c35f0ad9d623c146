"""n > 1 in both engines: one prefill samples every choice's first token, decode forks the
prompt's blocks (full ones shared, the partial last one copied) and runs each choice as
a request of its own; choice i answers as a single request with seed + i."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import attrs
import msgspec
import pytest
import trio
import trio.testing

from pdtrio.config import SyntheticEngineConfig
from pdtrio.engine.api import (
    BlocksFreed,
    Engine,
    EngineError,
    EngineOutput,
    NoRoom,
    PrefillResult,
    PromptRejected,
    StepFailed,
    StepLogprobs,
)
from pdtrio.engine.synthetic import SyntheticEngine
from pdtrio.protocol.kv_layout import choice_blocks_needed
from pdtrio.protocol.link.wire import TextPrompt, TokenEntry, Usage, choice_request_id
from pdtrio.protocol.sampling import SamplingParams, StructuredOutput, choice_sampling

replace_fields = msgspec.structs.replace

PROMPT = TextPrompt("the prompt of a request with several choices")  # a partial last block
# tiny-random's logits are tens apart: a hot draw is what makes seeded choices differ
HOT = SamplingParams(seed=5, temperature=50.0, ignore_eos=True)


def synthetic(num_blocks: int = 256) -> SyntheticEngine:
    config = SyntheticEngineConfig(decode_step_s=0.0)
    return SyntheticEngine(config, num_blocks=num_blocks, block_size=4)


def torch_engine(num_blocks: int = 128) -> Engine:
    pytest.importorskip("torch")
    from pdtrio.config import EngineConfig
    from pdtrio.engine.torch.engine import TorchEngine

    # (the cache off: its comparisons want every prompt computed the same way)
    config = EngineConfig(
        kind="torch",
        model="tiny-random",
        dtype="float64",
        num_kv_blocks=num_blocks,
        block_size=4,
        prefix_cache=False,
    )
    return TorchEngine.from_config(config)


@pytest.fixture(scope="module")
def torch_pair() -> tuple[Engine, Engine]:
    return torch_engine(), torch_engine()


@pytest.fixture(params=["synthetic", "torch"])
def pair(request: pytest.FixtureRequest) -> tuple[Engine, Engine]:
    if request.param == "synthetic":
        return synthetic(), synthetic()
    engines: tuple[Engine, Engine] = request.getfixturevalue("torch_pair")
    return engines


@asynccontextmanager
async def running(engine: Engine) -> AsyncIterator[trio.MemoryReceiveChannel[EngineOutput]]:
    send, receive = trio.open_memory_channel[EngineOutput](64)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run, send)
        yield receive
        nursery.cancel_scope.cancel()


@attrs.frozen
class Answer:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Usage | None


async def drain(
    outputs: trio.MemoryReceiveChannel[EngineOutput], request_ids: set[str]
) -> dict[str, list[TokenEntry]]:
    """Every entry of these requests until each has finished."""
    entries: dict[str, list[TokenEntry]] = {request_id: [] for request_id in request_ids}
    pending = set(request_ids)
    with trio.fail_after(60):
        while pending:
            step = await outputs.receive()
            if isinstance(step, StepLogprobs | BlocksFreed):
                continue
            assert not isinstance(step, StepFailed), step
            for entry in step:
                assert entry.request_id in entries, entry
                entries[entry.request_id].append(entry)
                if entry.finish_reason is not None:
                    pending.discard(entry.request_id)
    return entries


def first_tokens(result: PrefillResult) -> list[tuple[int, str, str | None, Usage | None]]:
    """(token, text, finish, usage) of every choice's first token, choice 0 first."""
    head = (result.first_token_id, result.first_text, result.finish_reason, result.usage)
    rest = [(c.token_id, c.text, c.finish_reason, c.usage) for c in result.choices]
    assert [c.choice for c in result.choices] == list(range(1, len(result.choices) + 1))
    return [head, *rest]


async def hand_over(
    prefill: Engine, decode: Engine, request_id: str, ids: list[int], result: PrefillResult,
    choices: tuple[int, ...],
) -> None:  # fmt: skip
    """The decode side of a start: the request's blocks, every other choice's forked from
    them, the prompt's KV written into the request's (so into the shared ones too)."""
    total = len(ids) + result.token_budget
    blocks = decode.allocate_blocks(request_id, total)
    for choice in choices:
        if choice:
            decode.fork_blocks(request_id, choice_request_id(request_id, choice), len(ids), total)
    if decode is not prefill:
        data = await prefill.read_blocks(result.block_ids)
        await decode.write_blocks(blocks[: len(result.block_ids)], data)
        prefill.free_request(request_id)


async def answer_choices(
    prefill: Engine, decode: Engine, sampling: SamplingParams, max_tokens: int,
    request_id: str = "r",
) -> tuple[dict[int, Answer], int]:  # fmt: skip
    """Every choice's whole answer, prefill to decode's last token, and how many blocks
    decode held while they ran."""
    async with AsyncExitStack() as stack:
        outputs = await stack.enter_async_context(running(decode))
        if prefill is not decode:
            await stack.enter_async_context(running(prefill))
        ids = await prefill.tokenize(PROMPT)
        result = await prefill.prefill(request_id, ids, sampling, max_tokens)
        firsts = first_tokens(result)
        assert len(firsts) == sampling.n
        answers = {
            c: Answer([token], text, finish, usage)
            for c, (token, text, finish, usage) in enumerate(firsts)
        }
        to_run = tuple((c, token) for c, (token, _, finish, _) in enumerate(firsts) if not finish)
        if not to_run:
            assert result.block_ids == ()
            assert prefill.statistics().kv_blocks_in_use == 0
            return answers, 0
        await hand_over(prefill, decode, request_id, ids, result, tuple(c for c, _ in to_run))
        # (n = 1 is the plain start, with no choices)
        await decode.start_decode(
            request_id, ids, to_run[0][1], sampling, result.token_budget, 1,
            result.cached_tokens, choices=to_run if sampling.n > 1 else (),
        )  # fmt: skip
        held = decode.statistics().kv_blocks_in_use
        ran = {choice_request_id(request_id, c): c for c, _ in to_run}
        entries = await drain(outputs, set(ran))
    for choice_id, choice in ran.items():
        got = entries[choice_id]
        before = answers[choice]
        answers[choice] = Answer(
            before.token_ids + [t for e in got for t in e.token_ids],
            before.text + "".join(e.text for e in got),
            got[-1].finish_reason,
            got[-1].usage,
        )
        assert all(e.usage is None for e in got[:-1])
    assert decode.statistics().kv_blocks_in_use == 0
    assert prefill.statistics().kv_blocks_in_use == 0
    return answers, held


async def answer_single(
    prefill: Engine, decode: Engine, sampling: SamplingParams, max_tokens: int
) -> tuple[Answer, int]:
    """A single request (n = 1) answered, and the blocks decode held while it ran."""
    answers, held = await answer_choices(prefill, decode, sampling, max_tokens, "single")
    return answers[0], held


async def test_seeded_choice_i_answers_as_a_single_request_with_seed_plus_i_pd_and_colocated(
    pair: tuple[Engine, Engine],
) -> None:
    one, other = pair
    n = 3
    handed_over, held = await answer_choices(one, other, replace_fields(HOT, n=n), 9)
    colocated, _ = await answer_choices(one, one, replace_fields(HOT, n=n), 9)
    assert colocated == handed_over
    singles = [await answer_single(one, other, choice_sampling(HOT, c), 9) for c in range(n)]
    assert [handed_over[c] for c in range(n)] == [answer for answer, _ in singles]
    # the draws differ (else this would not tell the choices' seeds apart)
    assert len({tuple(handed_over[c].token_ids) for c in range(n)}) > 1
    for answer in handed_over.values():
        assert answer.finish_reason == "length" and len(answer.token_ids) == 9
        assert answer.usage is not None and answer.usage.completion_tokens == 9
    # the prompt's full blocks held once, not once per choice
    single_held = singles[0][1]
    ids = await one.tokenize(PROMPT)
    block_size = one.layout.block_size
    assert len(ids) > block_size and len(ids) % block_size  # shared blocks and a partial one
    assert held == choice_blocks_needed(len(ids), len(ids) + 9, n, block_size)
    assert held < n * single_held


async def test_greedy_choices_are_all_the_same(pair: tuple[Engine, Engine]) -> None:
    one, other = pair
    greedy = SamplingParams(temperature=0, ignore_eos=True, n=3)
    answers, _ = await answer_choices(one, other, greedy, 6)
    single, _ = await answer_single(one, other, replace_fields(greedy, n=1), 6)
    assert answers[0] == answers[1] == answers[2] == single


async def test_unseeded_synthetic_choices_differ_and_choice_0_is_the_single_request() -> None:
    one, other = synthetic(), synthetic()
    unseeded = SamplingParams(n=4, ignore_eos=True)
    answers, _ = await answer_choices(one, other, unseeded, 5)
    assert len({tuple(a.token_ids) for a in answers.values()}) == 4
    single, _ = await answer_single(one, other, replace_fields(unseeded, n=1), 5)
    assert answers[0] == single


async def test_every_choice_ending_at_its_first_token_frees_the_blocks_at_prefill(
    pair: tuple[Engine, Engine],
) -> None:
    one, _ = pair
    answers, _ = await answer_choices(one, one, replace_fields(HOT, n=3), 1)
    assert len(answers) == 3
    for answer in answers.values():
        assert answer.finish_reason == "length" and len(answer.token_ids) == 1
        assert answer.usage is not None and answer.usage.completion_tokens == 1


async def test_choice_0_ending_at_prefill_leaves_the_others_running_on_shared_blocks(
    pair: tuple[Engine, Engine],
) -> None:
    one, other = pair
    sampling = replace_fields(HOT, n=3)
    async with running(one):
        ids = await one.tokenize(PROMPT)
        probe = await one.prefill("probe", ids, sampling, 9)
        one.free_request("probe")
    firsts = [token for token, _, _, _ in first_tokens(probe)]
    assert firsts[0] not in firsts[1:]
    # choice 0's first token stops it; the others go on
    stopping = replace_fields(sampling, stop_token_ids=(firsts[0],))
    answers, _ = await answer_choices(one, other, stopping, 9)
    assert answers[0].finish_reason == "stop" and answers[0].token_ids == [firsts[0]]
    assert answers[0].usage == Usage(len(ids), 1, 0)
    singles = [await answer_single(one, other, choice_sampling(stopping, c), 9) for c in (1, 2)]
    assert [answers[1], answers[2]] == [answer for answer, _ in singles]


async def test_aborting_each_choice_frees_every_block(pair: tuple[Engine, Engine]) -> None:
    one, _ = pair
    sampling = replace_fields(HOT, n=3)
    async with running(one):
        ids = await one.tokenize(PROMPT)
        result = await one.prefill("r", ids, sampling, 50)
        assert result.block_ids
        choices = tuple((c, token) for c, (token, *_) in enumerate(first_tokens(result)))
        await hand_over(one, one, "r", ids, result, (0, 1, 2))
        await one.start_decode(
            "r", ids, choices[0][1], sampling, result.token_budget, 1, 0, choices=choices
        )
        assert one.statistics().kv_blocks_in_use > 0
        for c in (2, 0, 1):
            one.abort(choice_request_id("r", c))
        # the torch engine reads its inbox in order: once a later prefill is answered, the
        # aborts before it were taken
        with trio.fail_after(30):
            await one.prefill("later", [5, 6, 7], SamplingParams(), 4)
        one.free_request("later")
        assert one.statistics().kv_blocks_in_use == 0
        assert one.statistics().running_requests == 0


async def test_no_room_for_a_fork_takes_nothing(pair: tuple[Engine, Engine]) -> None:
    ids = await pair[0].tokenize(PROMPT)
    block_size, max_tokens = 4, 40
    total = len(ids) + max_tokens
    own = -(-total // block_size)
    per_fork = own - len(ids) // block_size
    # room for the request and one fork, one block short of a second
    num_blocks = own + 2 * per_fork - 1
    engine = (
        synthetic(num_blocks) if isinstance(pair[0], SyntheticEngine) else torch_engine(num_blocks)
    )
    sampling = replace_fields(HOT, n=3)
    async with running(engine):
        result = await engine.prefill("r", ids, sampling, max_tokens)
        assert result.token_budget == max_tokens
        engine.allocate_blocks("r", total)
        assert engine.statistics().kv_blocks_in_use == own
        table = engine.fork_blocks("r", "r/1", len(ids), total)
        assert len(table) == own
        assert engine.statistics().kv_blocks_in_use == own + per_fork
        with pytest.raises(NoRoom):
            engine.fork_blocks("r", "r/2", len(ids), total)
        assert engine.statistics().kv_blocks_in_use == own + per_fork
        engine.free_request("r/1")
        assert engine.statistics().kv_blocks_in_use == own
        engine.free_request("r")
        assert engine.statistics().kv_blocks_in_use == 0


async def test_a_continuation_with_choices_and_impossible_choices_are_refused(
    pair: tuple[Engine, Engine],
) -> None:
    one, _ = pair
    async with running(one):
        ids = await one.tokenize(PROMPT)
        with pytest.raises(PromptRejected) as refused:
            await one.prefill("c", ids, replace_fields(HOT, n=2), 9, generated_tokens=2)
        assert refused.value.param == "n"
        with pytest.raises(PromptRejected) as refused:
            await one.prefill("c", ids, replace_fields(HOT, n=17), 9)
        assert refused.value.param == "n"
        assert one.statistics().kv_blocks_in_use == 0
        with pytest.raises(EngineError, match="choices"):
            await one.start_decode(
                "c", ids, 7, replace_fields(HOT, n=2), 9, 1, 0, choices=((2, 7),)
            )
        with pytest.raises(EngineError, match="choices"):
            await one.start_decode("c", ids, 7, HOT, 9, 1, 0, choices=((0, 7),))


async def test_each_structured_choice_obeys_its_grammar(
    torch_pair: tuple[Engine, Engine],
) -> None:
    pytest.importorskip("llguidance")
    one, other = torch_pair
    pattern = "(yes|no|maybe) [0-9]{2}"
    sampling = replace_fields(
        HOT, n=3, ignore_eos=False, structured=StructuredOutput("regex", pattern)
    )
    answers, _ = await answer_choices(one, other, sampling, 30)
    for answer in answers.values():
        assert re.fullmatch(pattern, answer.text), answer
        assert answer.finish_reason == "stop"
    singles = [await answer_single(one, other, choice_sampling(sampling, c), 30) for c in range(3)]
    assert [answers[c] for c in range(3)] == [answer for answer, _ in singles]
    assert len({a.text for a in answers.values()}) > 1


async def test_a_step_mixing_choices_and_single_prefills_samples_each_row_as_alone(
    torch_pair: tuple[Engine, Engine],
) -> None:
    one, _ = torch_pair
    fresh = torch_engine()
    batches: list[int] = []
    fresh.observe_steps(lambda seconds, batch, tokens: batches.append(batch))
    ids = await one.tokenize(PROMPT)
    other_ids = await one.tokenize(TextPrompt("another prompt, alone"))
    results: dict[str, PrefillResult] = {}

    async def prefill(request_id: str, token_ids: list[int], sampling: SamplingParams) -> None:
        results[request_id] = await fresh.prefill(request_id, token_ids, sampling, 9)

    send, _receive = trio.open_memory_channel[EngineOutput](64)
    async with trio.open_nursery() as engine_nursery:
        with trio.fail_after(60):
            async with trio.open_nursery() as prefills:
                prefills.start_soon(prefill, "single", other_ids, choice_sampling(HOT, 7))
                prefills.start_soon(prefill, "choices", ids, replace_fields(HOT, n=3))
                prefills.start_soon(prefill, "greedy", ids, SamplingParams(temperature=0, n=2))
                # queued before the engine thread starts: one step prefills them together
                await trio.testing.wait_all_tasks_blocked()
                await engine_nursery.start(fresh.run, send)
        engine_nursery.cancel_scope.cancel()
    assert batches[0] == 3
    alone: dict[str, list[int]] = {}
    async with running(one):
        for c in range(3):
            result = await one.prefill("alone", ids, choice_sampling(HOT, c), 9)
            one.free_request("alone")
            alone.setdefault("choices", []).append(result.first_token_id)
        result = await one.prefill("alone", other_ids, choice_sampling(HOT, 7), 9)
        one.free_request("alone")
        alone["single"] = [result.first_token_id]
        result = await one.prefill("alone", ids, SamplingParams(temperature=0), 9)
        one.free_request("alone")
        alone["greedy"] = [result.first_token_id] * 2
    for request_id, expected in alone.items():
        got = results[request_id]
        assert [token for token, *_ in first_tokens(got)] == expected, request_id
        fresh.free_request(request_id)
    assert fresh.statistics().kv_blocks_in_use == 0


async def test_forks_of_cached_prompt_blocks_hold_and_free_them_by_reference(
    pair: tuple[Engine, Engine],
) -> None:
    if isinstance(pair[0], SyntheticEngine):
        config = SyntheticEngineConfig(decode_step_s=0.0)
        engine: Engine = SyntheticEngine(config, num_blocks=256, block_size=4, prefix_cache=True)
    else:
        from pdtrio.config import EngineConfig
        from pdtrio.engine.torch.engine import TorchEngine

        engine = TorchEngine.from_config(
            EngineConfig(
                kind="torch",
                model="tiny-random",
                dtype="float64",
                num_kv_blocks=128,
                block_size=4,
                prefix_cache=True,
            )  # fmt: skip
        )
    sampling = replace_fields(HOT, n=3)
    first, _ = await answer_choices(engine, engine, sampling, 9)
    again, _ = await answer_choices(engine, engine, sampling, 9, request_id="again")
    # the second prompt found the first's full blocks cached; every reference went back
    assert again[0].usage is not None and again[0].usage.cached_tokens > 0
    assert [a.token_ids for a in again.values()] == [a.token_ids for a in first.values()]
    assert engine.statistics().prefix_cache_blocks > 0
