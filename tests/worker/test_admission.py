"""Decode admission on its own: a decision value, and nothing left allocated unless accepted."""

from __future__ import annotations

from typing import final

import msgspec
import pytest
import trio

from pdtrio.config import SyntheticEngineConfig
from pdtrio.engine.synthetic import SyntheticEngine
from pdtrio.kv.api import KvBlockSink, KvBlockSource, KvTransferError
from pdtrio.protocol.link.wire import (
    DecodeStart,
    DecodeStartChoices,
    KvHandle,
    RejectReason,
    TextPrompt,
    choice_request_id,
)
from pdtrio.protocol.sampling import SamplingParams
from pdtrio.worker.admission import Accepted, DecodeAdmission, Rejected
from pdtrio.worker.leases import KvLeases


@final
class InMemoryTransport:
    """Copies blocks straight from the prefill engine; or fails, or hangs, when told to."""

    def __init__(self, source: SyntheticEngine, *, fail: bool = False, hang: bool = False) -> None:
        self.source = source
        self.fail = fail
        self.hang = hang
        self.pulls = 0
        self.pulled_blocks: list[tuple[int, ...]] = []  # each pull's source blocks

    async def serve(
        self,
        source: KvBlockSource,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        raise AssertionError("not served in these tests")

    async def pull(self, handle: KvHandle, sink: KvBlockSink, dest: tuple[int, ...]) -> None:
        self.pulls += 1
        self.pulled_blocks.append(handle.block_ids)
        if self.hang:
            await trio.sleep_forever()
        if self.fail:
            raise KvTransferError("the peer went away")
        await sink.write_blocks(dest, await self.source.read_blocks(handle.block_ids))


def synthetic(
    *, vocab_size: int = 1000, num_blocks: int = 64, prefix_cache: bool = False
) -> SyntheticEngine:
    config = SyntheticEngineConfig(vocab_size=vocab_size)
    return SyntheticEngine(config, num_blocks=num_blocks, block_size=4, prefix_cache=prefix_cache)


async def prefilled(
    engine: SyntheticEngine,
    instance_id: str,
    *,
    max_tokens: int = 8,
    text: str = "a prompt of a few blocks",
    request_id: str = "r",
) -> DecodeStart:
    ids = await engine.tokenize(TextPrompt(text))
    result = await engine.prefill(request_id, ids, SamplingParams(), max_tokens)
    handle = KvHandle(
        request_id, instance_id, "127.0.0.1", 1, result.block_ids, len(ids), engine.layout, 30.0
    )
    return DecodeStart(
        request_id,
        tuple(ids),
        result.first_token_id,
        SamplingParams(),
        result.token_budget,
        1,
        0,
        handle,
    )


async def test_a_remote_start_is_pulled_and_accepted() -> None:
    prefill, decode = synthetic(), synthetic()
    start = await prefilled(prefill, "prefill-0")
    transport = InMemoryTransport(prefill)
    admission = DecodeAdmission(decode, KvLeases(decode.free_request), transport, "decode-0")
    assert await admission.admit(start) == Accepted()
    assert transport.pulls == 1
    # blocks for the whole request: the prompt and the budget
    needed = -(-(len(start.prompt_token_ids) + start.token_budget) // 4)
    assert decode.statistics().kv_blocks_in_use == needed
    await decode.start_decode(
        "r", list(start.prompt_token_ids), start.first_token_id, start.sampling,
        start.token_budget, 1, 0,
    )  # fmt: skip
    decode.abort("r")
    assert decode.statistics().kv_blocks_in_use == 0


async def test_a_layout_mismatch_names_both_sides_and_allocates_nothing() -> None:
    prefill, decode = synthetic(vocab_size=1000), synthetic(vocab_size=2000)
    start = await prefilled(prefill, "prefill-0")
    transport = InMemoryTransport(prefill)
    admission = DecodeAdmission(decode, KvLeases(decode.free_request), transport, "decode-0")
    decision = await admission.admit(start)
    assert isinstance(decision, Rejected) and decision.reason == RejectReason.LAYOUT_MISMATCH
    assert "prefill has" in decision.message and "decode has" in decision.message
    assert "vocab1000" in decision.message and "vocab2000" in decision.message
    assert transport.pulls == 0 and decode.statistics().kv_blocks_in_use == 0


@pytest.mark.parametrize(
    ("decode_blocks", "fail", "reason"),
    [(2, False, RejectReason.NO_ROOM), (64, True, RejectReason.TRANSFER_FAILED)],
)
async def test_no_room_and_failed_transfers_free_everything(
    decode_blocks: int, fail: bool, reason: RejectReason
) -> None:
    prefill, decode = synthetic(), synthetic(num_blocks=decode_blocks)
    start = await prefilled(prefill, "prefill-0")
    admission = DecodeAdmission(
        decode, KvLeases(decode.free_request), InMemoryTransport(prefill, fail=fail), "decode-0"
    )
    decision = await admission.admit(start)
    assert isinstance(decision, Rejected) and decision.reason == reason
    assert decode.statistics().kv_blocks_in_use == 0


async def test_cancelling_an_admission_frees_what_it_took() -> None:
    prefill, decode = synthetic(), synthetic()
    start = await prefilled(prefill, "prefill-0")
    admission = DecodeAdmission(
        decode, KvLeases(decode.free_request), InMemoryTransport(prefill, hang=True), "decode-0"
    )
    with trio.move_on_after(0.05) as timer:
        await admission.admit(start)
    assert timer.cancelled_caught
    assert decode.statistics().kv_blocks_in_use == 0


async def test_a_colocated_start_takes_over_the_lease_without_a_copy() -> None:
    both = synthetic()
    leases = KvLeases(both.free_request)
    start = await prefilled(both, "both-0")
    leases.hold("r", start.kv_handle.block_ids, trio.current_time() + 30)
    transport = InMemoryTransport(both)
    admission = DecodeAdmission(both, leases, transport, "both-0")
    assert await admission.admit(start) == Accepted()
    assert transport.pulls == 0 and len(leases) == 0
    assert both.statistics().kv_blocks_in_use > len(start.kv_handle.block_ids)
    # the lease is gone: a second start of the same prefill finds nothing to take over
    both.free_request("r")
    decision = await admission.admit(start)
    assert isinstance(decision, Rejected) and decision.reason == RejectReason.TRANSFER_FAILED
    assert both.statistics().kv_blocks_in_use == 0


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"tokens_generated": 0}, "no token left"),
        ({"token_budget": 1}, "no token left"),
        ({"cached_tokens": -1}, "cached_tokens"),
        ({"request_id": "other"}, "KV handle is for"),
        ({"prompt_token_ids": (1, 2)}, "holds"),
    ],
)
async def test_an_impossible_start_is_a_bad_request(change: dict[str, object], says: str) -> None:
    prefill, decode = synthetic(), synthetic()
    start = msgspec.structs.replace(await prefilled(prefill, "prefill-0"), **change)
    transport = InMemoryTransport(prefill)
    admission = DecodeAdmission(decode, KvLeases(decode.free_request), transport, "decode-0")
    decision = await admission.admit(start)
    assert isinstance(decision, Rejected) and decision.reason == RejectReason.BAD_REQUEST
    assert says in decision.message
    assert transport.pulls == 0 and decode.statistics().kv_blocks_in_use == 0


# --- decode-side prefix reuse ------------------------------------------------------------

TURN = "a conversation's first turn"  # 1 + 27 tokens: 7 blocks of 4, all full


async def decoded(decode: SyntheticEngine, start: DecodeStart) -> None:
    """Start the accepted request (its KV checked against its prompt), then end it."""
    await decode.start_decode(
        start.request_id, list(start.prompt_token_ids), start.first_token_id, start.sampling,
        start.token_budget, 1, 0,
    )  # fmt: skip
    decode.abort(start.request_id)


async def test_decode_with_the_cache_pulls_only_the_blocks_it_lacks() -> None:
    prefill, decode = synthetic(prefix_cache=True), synthetic(prefix_cache=True)
    transport = InMemoryTransport(prefill)
    admission = DecodeAdmission(decode, KvLeases(decode.free_request), transport, "decode-0")
    first = await prefilled(prefill, "prefill-0", text=TURN, request_id="t1")
    assert await admission.admit(first) == Accepted()
    await decoded(decode, first)
    second = await prefilled(prefill, "prefill-0", text=TURN + " and more", request_id="t2")
    assert await admission.admit(second) == Accepted()
    # the first turn's 7 full blocks are decode's already: the 3 after them are pulled
    assert transport.pulled_blocks == [first.kv_handle.block_ids, second.kv_handle.block_ids[7:]]
    await decoded(decode, second)  # checks the reused and the pulled blocks hold the prompt
    statistics = decode.statistics()
    assert statistics.prefix_cache_decode_reused_blocks == 7
    assert statistics.prefix_cache_decode_pulled_blocks == 7 + 3
    assert statistics.kv_blocks_in_use == 0 and statistics.prefix_cache_blocks == 9


async def test_a_prompt_decode_holds_whole_is_not_pulled_and_forks_share_it() -> None:
    prefill, decode = synthetic(prefix_cache=True), synthetic(prefix_cache=True)
    transport = InMemoryTransport(prefill)
    leases = KvLeases(decode.free_request)
    admission = DecodeAdmission(decode, leases, transport, "decode-0")
    first = await prefilled(prefill, "prefill-0", text=TURN, request_id="t1")
    assert await admission.admit(first) == Accepted()
    await decoded(decode, first)
    again = await prefilled(prefill, "prefill-0", text=TURN, request_id="t2")
    sampling = SamplingParams(n=2)
    choices = DecodeStartChoices(
        **{f: getattr(again, f) for f in again.__struct_fields__ if f != "sampling"},
        sampling=sampling,
        choices=((0, again.first_token_id), (1, again.first_token_id)),
    )
    assert await admission.admit(choices) == Accepted()
    assert transport.pulls == 1  # the first turn's only: prefill's lease ends by the router
    table = decode._blocks.owned("t2")
    fork = decode._blocks.owned(choice_request_id("t2", 1))
    assert fork[:7] == table[:7]  # the cached prompt blocks, shared
    assert [decode._blocks.prefix_cache.refs(b) for b in table[:7]] == [2] * 7
    decode.free_request(choice_request_id("t2", 1))
    decode.free_request("t2")
    statistics = decode.statistics()
    assert statistics.kv_blocks_in_use == 0 and statistics.prefix_cache_decode_reused_blocks == 7


async def test_cancelling_a_partial_pull_frees_it_and_keeps_the_cached_prefix() -> None:
    prefill, decode = synthetic(prefix_cache=True), synthetic(prefix_cache=True)
    transport = InMemoryTransport(prefill)
    admission = DecodeAdmission(decode, KvLeases(decode.free_request), transport, "decode-0")
    first = await prefilled(prefill, "prefill-0", text=TURN, request_id="t1")
    assert await admission.admit(first) == Accepted()
    await decoded(decode, first)
    transport.hang = True
    second = await prefilled(prefill, "prefill-0", text=TURN + " and more", request_id="t2")
    with trio.move_on_after(0.05) as timer:
        await admission.admit(second)
    assert timer.cancelled_caught and transport.pulled_blocks[-1] == second.kv_handle.block_ids[7:]
    statistics = decode.statistics()
    # nothing held; the first turn's blocks cached (reclaimable), nothing of the second
    assert statistics.kv_blocks_in_use == 0 and statistics.prefix_cache_blocks == 7
    assert statistics.prefix_cache_decode_pulled_blocks == 7  # the first turn's only
    transport.hang = False
    assert await admission.admit(second) == Accepted()
    await decoded(decode, second)


async def test_with_the_cache_off_decode_pulls_every_block_as_before() -> None:
    prefill, decode = synthetic(prefix_cache=True), synthetic()
    transport = InMemoryTransport(prefill)
    admission = DecodeAdmission(decode, KvLeases(decode.free_request), transport, "decode-0")
    for request_id in ("t1", "t2"):
        start = await prefilled(prefill, "prefill-0", text=TURN, request_id=request_id)
        assert await admission.admit(start) == Accepted()
        await decoded(decode, start)
        assert transport.pulled_blocks[-1] == start.kv_handle.block_ids
    statistics = decode.statistics()
    assert statistics.prefix_cache_blocks == 0 and statistics.prefix_cache_decode_reused_blocks == 0


async def test_a_continuation_reuses_the_prompt_decode_holds_and_pulls_the_rest() -> None:
    # a decode lost the request after some tokens; prefill ran prompt + output again, and
    # this decode, holding the prompt from an earlier turn, pulls only the blocks after it
    prefill, decode = synthetic(prefix_cache=True), synthetic(prefix_cache=True)
    transport = InMemoryTransport(prefill)
    admission = DecodeAdmission(decode, KvLeases(decode.free_request), transport, "decode-0")
    first = await prefilled(prefill, "prefill-0", text=TURN, request_id="t1")
    assert await admission.admit(first) == Accepted()
    await decoded(decode, first)
    ids = [*first.prompt_token_ids, 40, 41, 42, 43, 44, 45]  # 6 tokens delivered already
    result = await prefill.prefill("t2", ids, SamplingParams(), 12, generated_tokens=6)
    handle = KvHandle(
        "t2", "prefill-0", "127.0.0.1", 1, result.block_ids, len(ids), prefill.layout, 30.0
    )
    start = DecodeStart(
        "t2", tuple(ids), result.first_token_id, SamplingParams(), result.token_budget, 7,
        result.cached_tokens, handle, generated_tokens=6,
    )  # fmt: skip
    assert await admission.admit(start) == Accepted()
    assert transport.pulled_blocks[-1] == handle.block_ids[7:]
    await decode.start_decode(
        "t2", ids, start.first_token_id, start.sampling, start.token_budget, 7,
        start.cached_tokens, generated_tokens=6,
    )  # fmt: skip
    decode.abort("t2")
    assert decode.statistics().kv_blocks_in_use == 0
