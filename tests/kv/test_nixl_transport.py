"""The NIXL transport in one process: exact bytes, leases, refusals, deadlines, per-pair fallback."""

from __future__ import annotations

import msgspec
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from pdtrio.kv.api import KvTransferError
from pdtrio.kv.nixl import NixlKvTransport
from pdtrio.kv.nixl_agent import coalesced_runs
from pdtrio.kv.tcp import TcpKvTransport
from pdtrio.protocol.link.wire import DecodeStart, KvHandle, RejectReason
from pdtrio.protocol.sampling import SamplingParams
from pdtrio.worker.admission import Accepted, DecodeAdmission, Rejected
from pdtrio.worker.leases import KvLeases
from tests.cluster import wait_for_stats
from tests.kv.blocks import (
    LOOPBACK,
    LeasedBlocks,
    fragment,
    leased_request,
    running_pair,
    synthetic,
)

pytest.importorskip("nixl")


def nixl(engine: object, **kwargs: object) -> NixlKvTransport:
    return NixlKvTransport(engine, required=True, **kwargs)  # type: ignore[arg-type]


def start_for(handle: KvHandle) -> DecodeStart:
    """A decode start for the handle's request (the synthetic engine is not asked to check it)."""
    prompt = tuple(range(10, 10 + handle.num_tokens))
    return DecodeStart(handle.request_id, prompt, 11, SamplingParams(), 8, 1, 0, handle)


def test_runs_join_blocks_contiguous_on_both_sides() -> None:
    assert coalesced_runs([4, 5, 6, 9], [0, 1, 7, 8]) == [(4, 0, 2), (6, 7, 1), (9, 8, 1)]
    assert coalesced_runs([], []) == []


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=30))
def test_runs_cover_exactly_the_pairs_in_order(pairs: list[tuple[int, int]]) -> None:
    runs = coalesced_runs([s for s, _ in pairs], [d for _, d in pairs])
    expanded = [(s + i, d + i) for s, d, count in runs for i in range(count)]
    assert expanded == pairs


async def test_nixl_reads_exactly_the_named_blocks_and_prefill_keeps_them_until_released() -> None:
    prefill, decode = synthetic(), synthetic()
    fragment(prefill, holes=3)
    fragment(decode, holes=2)
    transport = nixl(decode)
    serving = nixl(prefill)
    async with running_pair(serving, transport, prefill, decode) as pair:
        handle, data = await leased_request(pair.prefill, "r", 30, pair.endpoint)
        dest = decode.allocate_blocks("r", 40)[: len(handle.block_ids)]
        assert len(coalesced_runs(handle.block_ids, dest)) > 1  # not one contiguous range
        await transport.pull(handle, decode, dest)
        assert await decode.read_blocks(dest) == data
        # decode's notification says the read is done; the blocks stay leased until the
        # router releases them (after decode's first token), with the request's grant
        await wait_for_stats(lambda: serving.releases_notified == 1)
        assert pair.prefill.released == [] and pair.prefill.holds("r", handle.block_ids)
        assert not pair.prefill.release_granted("r", "a guess")
        assert pair.prefill.release_granted("r", handle.access_token)
        assert pair.prefill.released == [("r", True)]
        assert pair.prefill.blocks_in_use() == 3  # the fillers only
        info = transport.info()
        assert info["pulls"] == {"nixl": 1, "tcp": 0}
        assert [peer["transport"] for peer in info["peers"].values()] == ["nixl"]


async def test_a_read_of_blocks_the_handle_does_not_name_is_refused() -> None:
    prefill, decode = synthetic(), synthetic()
    transport = nixl(decode)
    async with running_pair(nixl(prefill), transport, prefill, decode) as pair:
        handle, _ = await leased_request(pair.prefill, "r", 8, pair.endpoint)
        other, _ = await leased_request(pair.prefill, "other", 8, pair.endpoint)
        greedy = msgspec.structs.replace(handle, block_ids=(*handle.block_ids, other.block_ids[0]))
        dest = decode.allocate_blocks("r", 12)
        with pytest.raises(KvTransferError, match="refused"):
            await transport.pull(greedy, decode, dest)
        assert pair.prefill.released == []  # both leases stand
        await transport.pull(handle, decode, dest[: len(handle.block_ids)])
        assert len(pair.prefill.leases) == 2  # (released by the router, later)


@pytest.mark.parametrize("kind", ["nixl", "tcp"])
async def test_a_pull_of_some_of_the_granted_blocks_is_allowed_and_of_others_refused(
    kind: str,
) -> None:
    # decode holding a prompt's first blocks already pulls only the rest of the handle's
    prefill, decode = synthetic(), synthetic()
    transport = nixl(decode) if kind == "nixl" else TcpKvTransport()
    serving = nixl(prefill)
    async with running_pair(serving, transport, prefill, decode) as pair:
        handle, data = await leased_request(pair.prefill, "r", 20, pair.endpoint)
        other, _ = await leased_request(pair.prefill, "other", 8, pair.endpoint)
        nbytes = handle.layout.block_nbytes
        tail = msgspec.structs.replace(handle, block_ids=handle.block_ids[3:])
        dest = decode.allocate_blocks("r", 20)[3:]
        await transport.pull(tail, decode, dest)
        assert await decode.read_blocks(dest) == data[3 * nbytes :]
        assert transport.info()["pull_bytes"][kind] == 2 * nbytes
        stray = msgspec.structs.replace(handle, block_ids=(handle.block_ids[4], other.block_ids[0]))
        with pytest.raises(KvTransferError, match="refused"):
            await transport.pull(stray, decode, dest[:2])
        assert len(pair.prefill.leases) == 2  # both leases stand (the router releases them)


async def test_an_expired_lease_is_freed_once_and_a_late_pull_is_refused() -> None:
    prefill, decode = synthetic(), synthetic()
    transport = nixl(decode)
    async with running_pair(nixl(prefill), transport, prefill, decode) as pair:
        handle, _ = await leased_request(pair.prefill, "r", 8, pair.endpoint, lease_s=0.2)
        await wait_for_stats(lambda: not pair.prefill.leases)
        assert pair.prefill.leases.expired_count == 1
        assert pair.prefill.blocks_in_use() == 0
        admission = DecodeAdmission(decode, KvLeases(decode.free_request), transport, "decode-0")
        decision = await admission.admit(start_for(handle))
        assert isinstance(decision, Rejected)
        assert decision.reason == RejectReason.TRANSFER_FAILED
        assert decode.statistics().kv_blocks_in_use == 0
        assert pair.prefill.released == []  # the expiry freed them, nobody else
        assert not pair.prefill.release("r")  # and the router's release, late, is harmless
        assert pair.prefill.leases.expired_count == 1


async def test_a_second_release_and_an_unknown_one_are_harmless() -> None:
    prefill, decode = synthetic(), synthetic()
    transport = nixl(decode)
    async with running_pair(nixl(prefill), transport, prefill, decode) as pair:
        handle, _ = await leased_request(pair.prefill, "r", 8, pair.endpoint)
        dest = decode.allocate_blocks("r", 8)
        await transport.pull(handle, decode, dest)
        # the router's release after decode's first token, a second one, and one for nobody
        assert pair.prefill.release_granted("r", handle.access_token)
        assert not pair.prefill.release_granted("r", handle.access_token)
        assert not pair.prefill.release("nobody")
        assert pair.prefill.released == [("r", True), ("nobody", False)]
        assert pair.prefill.blocks_in_use() == 0


async def test_an_abort_before_the_pull_frees_both_sides() -> None:
    prefill, decode = synthetic(), synthetic()
    transport = nixl(decode)
    async with running_pair(nixl(prefill), transport, prefill, decode) as pair:
        handle, _ = await leased_request(pair.prefill, "r", 8, pair.endpoint)
        assert pair.prefill.release("r")  # the router cleans up before decode pulls
        admission = DecodeAdmission(decode, KvLeases(decode.free_request), transport, "decode-0")
        decision = await admission.admit(start_for(handle))
        assert isinstance(decision, Rejected)
        assert decision.reason == RejectReason.TRANSFER_FAILED and "no lease" in decision.message
        assert pair.prefill.blocks_in_use() == 0
        assert decode.statistics().kv_blocks_in_use == 0


async def test_a_pull_cancelled_midway_leaves_decode_nothing_and_prefill_its_lease() -> None:
    prefill, decode = synthetic(), synthetic()
    transport = nixl(decode)
    async with running_pair(nixl(prefill), transport, prefill, decode) as pair:
        handle, _ = await leased_request(pair.prefill, "r", 8, pair.endpoint)
        admission = DecodeAdmission(decode, KvLeases(decode.free_request), transport, "decode-0")
        with trio.CancelScope() as scope:
            scope.cancel()  # the router aborted: cancelled at its first checkpoint
            await admission.admit(start_for(handle))
        assert decode.statistics().kv_blocks_in_use == 0
        assert pair.prefill.leases.holds("r", handle.block_ids)
        decision = await admission.admit(start_for(handle))  # and it still works afterwards
        assert isinstance(decision, Accepted)


async def test_a_stalled_transfer_fails_at_its_deadline_and_decode_frees_its_blocks() -> None:
    decode = synthetic()
    transport = nixl(decode, timeout_s=0.3)

    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()  # accepts, then never says a word

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, silent, 0)
        port = listeners[0].socket.getsockname()[1]
        await nursery.start(transport.run, None, LOOPBACK, 0)
        prefill = synthetic()
        block_ids = prefill.allocate_blocks("r", 8)
        handle = KvHandle("r", "prefill-0", LOOPBACK, port, block_ids, 8, prefill.layout, 2e9)
        admission = DecodeAdmission(decode, KvLeases(decode.free_request), transport, "decode-0")
        decision = await admission.admit(start_for(handle))
        assert isinstance(decision, Rejected)
        assert decision.reason == RejectReason.TRANSFER_FAILED
        assert "deadline" in decision.message
        assert decode.statistics().kv_blocks_in_use == 0
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("prefill_side", "decode_side"), [("tcp", "nixl"), ("nixl", "tcp")])
async def test_a_pair_that_cannot_agree_on_nixl_moves_kv_over_tcp(
    prefill_side: str, decode_side: str
) -> None:
    prefill, decode = synthetic(), synthetic()

    def transport(side: str, engine: object) -> NixlKvTransport | TcpKvTransport:
        return nixl(engine) if side == "nixl" else TcpKvTransport()

    decode_transport = transport(decode_side, decode)
    async with running_pair(
        transport(prefill_side, prefill), decode_transport, prefill, decode
    ) as pair:
        handle, data = await leased_request(pair.prefill, "r", 8, pair.endpoint)
        dest = decode.allocate_blocks("r", 8)
        await decode_transport.pull(handle, decode, dest)
        assert await decode.read_blocks(dest) == data
        assert pair.prefill.released == []  # kept until the router releases it
        info = decode_transport.info()
        assert info["pulls"].get("nixl", 0) == 0 and info["pulls"]["tcp"] == 1
        if decode_side == "nixl":
            (peer,) = info["peers"].values()
            assert peer["transport"] == "tcp"
            assert "prefill has no NIXL" in peer["reason"] and "tcp" in peer["reason"]


async def test_different_block_sizes_fall_back_to_tcp_which_refuses_to_mix_them() -> None:
    prefill, decode = synthetic(block_size=8), synthetic(block_size=4)
    transport = nixl(decode)
    async with running_pair(nixl(prefill), transport, prefill, decode) as pair:
        handle, _ = await leased_request(pair.prefill, "r", 16, pair.endpoint)
        dest = decode.allocate_blocks("r", 8)
        with pytest.raises(KvTransferError, match="does not fit"):
            await transport.pull(handle, decode, dest)
        (peer,) = transport.info()["peers"].values()
        assert peer["transport"] == "tcp" and "block sizes differ" in peer["reason"]
        decode.free_request("r")
        assert pair.prefill.release("r")  # the router's cleanup
        assert pair.prefill.blocks_in_use() == 0
        assert decode.statistics().kv_blocks_in_use == 0


async def test_a_prefill_that_goes_away_is_forgotten_and_met_anew_when_it_is_back() -> None:
    decode = synthetic()
    transport = nixl(decode)
    async with trio.open_nursery() as nursery:
        await nursery.start(transport.run, None, LOOPBACK, 0)
        agents = []
        port = 0
        for round_ in range(2):  # the same address, a new instance behind it each time
            prefill = synthetic()
            source = LeasedBlocks(prefill)
            prefill_transport = nixl(prefill)
            async with trio.open_nursery() as prefill_nursery:
                endpoint = await prefill_nursery.start(
                    prefill_transport.run, source, LOOPBACK, port
                )
                port = endpoint[1]
                handle, data = await leased_request(source, f"r{round_}", 8, endpoint)
                dest = decode.allocate_blocks(handle.request_id, 8)
                await transport.pull(handle, decode, dest)
                assert await decode.read_blocks(dest) == data
                decode.free_request(handle.request_id)
                (peer,) = transport.info()["peers"].values()
                assert peer["transport"] == "nixl"
                agents.append(prefill_transport.info()["nixl"]["agent"])
                prefill_nursery.cancel_scope.cancel()
            # its session ended with it: decode dropped the peer and its metadata
            await wait_for_stats(lambda: not transport.info()["peers"])
        assert agents[0] != agents[1]
        assert transport.info()["pulls"] == {"nixl": 2, "tcp": 0}
        nursery.cancel_scope.cancel()


async def test_a_transport_stopped_while_it_meets_prefill_keeps_no_socket_of_that_meeting() -> None:
    decode = synthetic()
    transport = nixl(decode)
    real_meet = transport._meet
    met, stopped = trio.Event(), trio.Event()
    peers = []

    async def meet_then_wait(handle: KvHandle) -> object:
        peer = await real_meet(handle)
        peers.append(peer)
        met.set()
        await stopped.wait()  # the transport stops here, mid-meeting
        return peer

    transport._meet = meet_then_wait  # type: ignore[method-assign]
    prefill = synthetic()
    source = LeasedBlocks(prefill)
    async with trio.open_nursery() as nursery:
        endpoint = await nursery.start(nixl(prefill).run, source, LOOPBACK, 0)
        handle, _ = await leased_request(source, "r", 8, endpoint)
        failures: list[BaseException] = []

        async def pull() -> None:
            dest = decode.allocate_blocks("r", 8)
            try:
                await transport.pull(handle, decode, dest)
            except KvTransferError as exc:
                failures.append(exc)
            finally:
                decode.free_request("r")

        async with trio.open_nursery() as decode_nursery:
            await decode_nursery.start(transport.run, None, LOOPBACK, 0)
            nursery.start_soon(pull)
            await met.wait()
            decode_nursery.cancel_scope.cancel()
        stopped.set()
        await wait_for_stats(lambda: bool(failures))
        assert "stopped while meeting prefill" in str(failures[0])
        (peer,) = peers
        assert peer.session.ended.is_set()
        assert peer.session.stream.socket.fileno() == -1  # closed, not leaked
        assert not transport.info()["peers"]
        nursery.cancel_scope.cancel()
