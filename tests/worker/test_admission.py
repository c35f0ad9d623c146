"""Decode admission on its own: a decision value, and nothing left allocated unless accepted."""

from __future__ import annotations

from typing import final

import msgspec
import pytest
import trio

from pdtrio.config import SyntheticEngineConfig
from pdtrio.engine.synthetic import SyntheticEngine
from pdtrio.kv.api import KvBlockSink, KvBlockSource, KvTransferError
from pdtrio.protocol.sampling import SamplingParams
from pdtrio.protocol.wire import DecodeStart, KvHandle, RejectReason, TextPrompt
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
        if self.hang:
            await trio.sleep_forever()
        if self.fail:
            raise KvTransferError("the peer went away")
        await sink.write_blocks(dest, await self.source.read_blocks(handle.block_ids))


def synthetic(*, vocab_size: int = 1000, num_blocks: int = 64) -> SyntheticEngine:
    config = SyntheticEngineConfig(vocab_size=vocab_size)
    return SyntheticEngine(config, num_blocks=num_blocks, block_size=4)


async def prefilled(
    engine: SyntheticEngine, instance_id: str, *, max_tokens: int = 8
) -> DecodeStart:
    ids = await engine.tokenize(TextPrompt("a prompt of a few blocks"))
    result = await engine.prefill("r", ids, SamplingParams(), max_tokens)
    handle = KvHandle(
        "r", instance_id, "127.0.0.1", 1, result.block_ids, len(ids), engine.layout, 30.0
    )
    return DecodeStart(
        "r", tuple(ids), result.first_token_id, SamplingParams(), result.token_budget, 1, 0, handle
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
