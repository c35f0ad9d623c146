"""The router counts a KV lease from the reply on its own clock, and decode from the start
on its own: three hosts whose clocks disagree by hours still agree on the lease."""

from __future__ import annotations

import time
from typing import final

import pytest
import trio
import trio.testing

from pdtrio.config import SyntheticEngineConfig
from pdtrio.engine.synthetic import SyntheticEngine
from pdtrio.kv.api import KvBlockSink, KvBlockSource
from pdtrio.protocol.link import wire
from pdtrio.protocol.link.wire import DecodeStart, KvHandle, TextPrompt
from pdtrio.protocol.sampling import SamplingParams
from pdtrio.router.workers.kv_leases import LeaseClock
from pdtrio.worker.admission import Accepted, DecodeAdmission
from pdtrio.worker.leases import KvLeases

_HOURS = 3600.0


@final
class RecordingTransport:
    """Copies the blocks, and notes what the handle says of its lease as the pull starts."""

    def __init__(self, source: SyntheticEngine) -> None:
        self.source = source
        self.ttls: list[float] = []

    async def serve(
        self,
        source: KvBlockSource,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        raise AssertionError("not served here")

    async def pull(self, handle: KvHandle, sink: KvBlockSink, dest: tuple[int, ...]) -> None:
        self.ttls.append(handle.lease_ttl_s)
        await sink.write_blocks(dest, await self.source.read_blocks(handle.block_ids))


def _engine() -> SyntheticEngine:
    return SyntheticEngine(SyntheticEngineConfig(vocab_size=1000), num_blocks=64, block_size=4)


def _handle(ttl_s: float, token: str = "grant") -> KvHandle:
    layout = _engine().layout
    return KvHandle("r", "prefill-0", "10.0.0.5", 9000, (0,), 4, layout, ttl_s, token)


def _start(handle: KvHandle) -> DecodeStart:
    return DecodeStart("r", (1, 2, 3, 4), 5, SamplingParams(), 8, 1, 0, handle)


def test_the_router_counts_the_lease_from_the_reply_on_its_own_clock() -> None:
    leases = LeaseClock()
    # prefill sent 30 s; the router's clock reads 5 hours past anything prefill's does
    arrived = 5 * _HOURS + 123.0
    leases.received(_handle(30.0), arrived)
    assert leases.left_s(_handle(30.0), arrived) == pytest.approx(30.0)
    assert leases.left_s(_handle(30.0), arrived + 10.0) == pytest.approx(20.0)
    assert leases.left_s(_handle(30.0), arrived + 45.0) == 0.0
    # decode gets what is left as the start is sent, and counts from its receipt
    sent = leases.to_send(_start(_handle(30.0)), arrived + 10.0)
    assert sent.kv_handle.lease_ttl_s == pytest.approx(20.0)
    assert sent.kv_handle.access_token == "grant" and sent.prompt_token_ids == (1, 2, 3, 4)


def test_a_handle_it_never_saw_counts_from_now_and_released_ones_are_forgotten() -> None:
    leases = LeaseClock()
    stranger = _handle(30.0, token="")
    assert leases.left_s(stranger, 1e6) == 30.0
    assert leases.to_send(_start(stranger), 1e6).kv_handle is stranger
    leases.received(_handle(30.0, "a"), 0.0)
    leases.received(_handle(30.0, "b"), 1.0)
    assert len(leases) == 2
    leases.forget("a")
    assert len(leases) == 1
    # the leases that ended go as new ones come: the clock holds no more than the live ones
    leases.received(_handle(30.0, "c"), 40.0)
    assert len(leases) == 1


async def test_three_hosts_whose_clocks_disagree_by_hours_agree_on_the_lease(
    mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # decode's wall clock is hours off prefill's: no lease arithmetic may read it
    wall = time.time
    monkeypatch.setattr(time, "time", lambda: wall() + 7 * _HOURS)
    prefill, decode = _engine(), _engine()
    ids = await prefill.tokenize(TextPrompt("a prompt of a few blocks"))
    result = await prefill.prefill("r", ids, SamplingParams(), 8)
    # prefill (its clock near 0) sends a 30 s lease; the router's reads 5 hours later
    handle = KvHandle(
        "r", "prefill-0", "10.0.0.5", 9000, result.block_ids, len(ids), prefill.layout, 30.0, "g"
    )
    router = LeaseClock()
    reply_at = 5 * _HOURS
    router.received(wire.Decoder(KvHandle).decode(wire.encode(handle)), reply_at)
    # decode room comes free after 10 s on the router's clock: the start goes out
    start = DecodeStart(
        "r", tuple(ids), result.first_token_id, SamplingParams(), result.token_budget, 1, 0, handle
    )
    on_the_wire = wire.encode(router.to_send(start, reply_at + 10.0))
    # decode (the mock clock, its own origin) gets it, and pulls 3 s later (a handshake)
    received = wire.Decoder(DecodeStart).decode(on_the_wire)
    received_at = trio.current_time()
    mock_clock.jump(3.0)
    transport = RecordingTransport(prefill)
    admission = DecodeAdmission(decode, KvLeases(decode.free_request), transport, "decode-0")
    assert isinstance(await admission.admit(received, received_at), Accepted)
    # 30 s in all: 10 waited on the router, 3 on decode, 17 left for the pull itself
    assert transport.ttls == [pytest.approx(17.0)]


def test_release_tokens_are_the_routers_own() -> None:
    # two routers in one process never make each other's release tokens
    one, other = LeaseClock(), LeaseClock()
    assert one.release_token("req-1") == one.release_token("req-1")
    assert one.release_token("req-1") != one.release_token("req-2")
    assert one.release_token("req-1") != other.release_token("req-1")
    assert len(bytes.fromhex(one.release_token("req-1"))) == 16
