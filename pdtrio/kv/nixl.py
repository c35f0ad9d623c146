"""The NIXL KV transport: decode READs prefill's blocks one-sided, zero-copy; TCP stays the fallback.

At start each worker makes one NIXL agent (UCX backend) and registers its
whole KV cache once (``Engine.kv_region``: DRAM, or VRAM when the cache lives
on a GPU).  A prefill instance describes its agent on its KV transfer port
(a NIXL session, see ``pdtrio.kv.tcp``): the agent's metadata, where its
blocks are, how big one is.  A decode instance opens that session the first
time it meets a prefill instance, loads the metadata, and keeps the session
open: when it ends, the prefill instance went away, and its metadata is dropped.

One pull: decode asks on the session for the handle's blocks (prefill
refuses blocks the request's lease does not hold, and says what it wrote in those
it grants, for decode to check), READs them straight into
its own blocks (one descriptor per run of contiguous blocks), and the READ
carries a NIXL notification (a msgpack ``TransferDone``) that tells prefill
the read is done (the blocks stay leased until the router releases them, once
decode has produced a token).  Prefill looks for notifications only while a read it granted
is outstanding, so an idle worker does no work at all.

The choice is per pair.  A decode instance falls back to TCP for a prefill
instance without NIXL, with another block size, a memory kind its UCX cannot
reach, or metadata its agent cannot load; ``/pd/info`` and the log say which
and why.

A READ still in flight after its post is polled from trio with growing sleeps,
never spun on.

The parts: the agent wrapper (``pdtrio.kv.nixl_agent``: one agent, the region
registered, its calls serialized, UCX kept to the worker's interface), the grant
protocol on the session (``pdtrio.kv.nixl_grants``: decode asks, prefill grants and
collects the notifications), and here the transport that meets each prefill
instance, chooses NIXL or TCP per pair, and READs.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Final, final

import attrs
import numpy as np
import trio

from pdtrio.engine.api import KvRegion
from pdtrio.kv.api import (
    KvBlockSink,
    KvBlockSource,
    KvMemory,
    KvTransferError,
    KvTransportUnavailable,
)
from pdtrio.kv.nixl_agent import (
    HANDSHAKE_TIMEOUT_S,
    NixlAgent,
    blocks_within,
    describe_error,
    post_read,
    read_descriptors,
    release_quietly,
    remove_remote_agent,
)
from pdtrio.kv.nixl_grants import LEASE_MARGIN_S, DecodeSession, PrefillGrants, SessionEnded
from pdtrio.kv.tcp import (
    DEFAULT_TRANSFER_TIMEOUT_S,
    SESSION_NIXL,
    check_destination,
    connect,
    pull_over_tcp,
    receive_message,
    serve_kv_port,
)
from pdtrio.protocol.link import wire
from pdtrio.protocol.link.wire import (
    KvDigests,
    KvHandle,
    NixlAgentInfo,
    TransferDone,
    TransferRequest,
    WireError,
    lease_deadline,
)
from pdtrio.security import PeerCredentials

log = logging.getLogger("pdtrio.kv")

# READs up to this size are posted on trio's thread (on shared memory, ~0.1 ms of copying)
INLINE_READ_BYTES: Final = 1 << 20
# polling a read's completion
_FIRST_POLL_S: Final = 0.0005
_LAST_POLL_S: Final = 0.004

_info_decoder: wire.Decoder[NixlAgentInfo] = wire.Decoder(NixlAgentInfo)


@attrs.define(eq=False)
class _Peer:
    """What decode knows of one prefill instance, for as long as its session lasts."""

    label: str
    transport: str  # "nixl" or "tcp"
    reason: str  # why TCP, when it is
    info: NixlAgentInfo
    session: DecodeSession
    loaded_agent: str = ""  # the remote agent loaded into ours, to drop at the end


@final
class NixlKvTransport:
    """NIXL READs where both sides of a pair can, the TCP transport where they cannot.

    ``required``: ``kv_transport = "nixl"`` (fail at start without NIXL); else
    ``auto`` (run the TCP transport alone, and say so).
    """

    def __init__(
        self,
        memory: KvMemory,
        *,
        required: bool,
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        agent_name: str | None = None,
    ) -> None:
        self._memory = memory
        self._required = required
        # what peers' KV ports ask for, and ours asks for (the worker sets it)
        self.secret = PeerCredentials("")
        self.timeout_s = timeout_s
        self._agent_name = agent_name
        self.agent: NixlAgent | None = None
        self.unavailable = ""  # why NIXL is not used at all, once running
        self._nursery: trio.Nursery | None = None
        self._peers: dict[tuple[str, str, int], _Peer] = {}
        self._meeting = trio.Lock()
        # prefill's grants, once it serves its KV port with an agent
        self._grants: PrefillGrants | None = None
        self.pulls = {"nixl": 0, "tcp": 0}
        self.pull_seconds = {"nixl": 0.0, "tcp": 0.0}
        self.pull_bytes = {"nixl": 0, "tcp": 0}
        self.read_seconds = 0.0  # in the READs themselves (made, posted, done)

    @property
    def name(self) -> str:
        return "tcp" if self.unavailable else "nixl"

    @property
    def releases_notified(self) -> int:
        """Reads decode's notifications said were done."""
        return 0 if self._grants is None else self._grants.releases_notified

    # --- lifetime -------------------------------------------------------------------

    async def run(
        self,
        source: KvBlockSource | None,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[tuple[str, int] | None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        try:
            self.agent = await NixlAgent.open(self._memory.kv_region(), self._agent_name, host)
        except KvTransportUnavailable as exc:
            if self._required:
                raise
            self.unavailable = f"kv_transport = 'auto' and {exc}"
            # one line is the usual answer (no NIXL here); where it failed, at DEBUG
            debug = log.isEnabledFor(logging.DEBUG)
            log.info("KV transport: tcp (%s)", self.unavailable, exc_info=exc if debug else None)
        else:
            agent = self.agent
            log.info(
                "KV transport: nixl (UCX, %.1f MiB of %s registered, agent %s)",
                agent.region.nbytes / (1 << 20),
                agent.memory,
                agent.name,
            )
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if source is None:
                    task_status.started(None)
                    await trio.sleep_forever()
                if self.agent is not None:
                    self._grants = PrefillGrants(self.agent, source, self.timeout_s)
                    nursery.start_soon(self._grants.collect_releases)
                endpoint = await nursery.start(
                    functools.partial(
                        serve_kv_port,
                        source,
                        host,
                        port,
                        nixl_sessions=None if self._grants is None else self._grants.serve_session,
                        nixl_unavailable=self.unavailable,
                        secret=self.secret,
                    )
                )
                task_status.started(endpoint)
        finally:
            self._nursery = None
            if self.agent is not None:
                await self.agent.close()

    def info(self) -> dict[str, Any]:
        nixl: dict[str, Any] = (
            {"unavailable": self.unavailable} if self.agent is None else self.agent.describe()
        )
        return {
            "transport": self.name,
            "requested": "nixl" if self._required else "auto",
            "nixl": nixl,
            "peers": {
                peer.label: {"transport": peer.transport, "reason": peer.reason}
                for peer in self._peers.values()
            },
            "pulls": dict(self.pulls),
            "pull_seconds": dict(self.pull_seconds),
            "pull_bytes": dict(self.pull_bytes),
            "read_seconds": self.read_seconds,
            "nixl_sessions": 0 if self._grants is None else self._grants.sessions,
            "reads_granted": 0 if self._grants is None else self._grants.outstanding,
            "releases_notified": self.releases_notified,
        }

    # --- decode: pulls ------------------------------------------------------------

    async def pull(
        self, handle: KvHandle, sink: KvBlockSink, dest_block_ids: tuple[int, ...]
    ) -> KvDigests | None:
        check_destination(handle, dest_block_ids)
        # the handle's TTL counts from now (the caller passes what is left of it)
        lease_ends = lease_deadline(handle, trio.current_time())
        started = time.perf_counter()
        transport = "tcp"
        digests: KvDigests | None = None
        with trio.move_on_after(self.timeout_s) as deadline:
            for attempt in (1, 2):
                peer = await self._peer_for(handle) if self.agent is not None else None
                if peer is None or peer.transport != "nixl" or sink.kv_region() != self._region():
                    digests = await pull_over_tcp(handle, sink, dest_block_ids, self.secret)
                    break
                transport = "nixl"
                try:
                    digests = await self._read(peer, handle, dest_block_ids, lease_ends)
                    break
                except SessionEnded:
                    # prefill restarted at the same address since we met it: meet it anew, once
                    if attempt == 2:
                        raise
        if deadline.cancelled_caught:
            raise KvTransferError(
                f"the KV transfer ({transport}) stalled past its deadline ({self.timeout_s:g} s)"
            )
        self.pulls[transport] += 1
        self.pull_seconds[transport] += time.perf_counter() - started
        self.pull_bytes[transport] += len(handle.block_ids) * handle.layout.block_nbytes
        return digests

    def _region(self) -> KvRegion:
        assert self.agent is not None
        return self.agent.region

    async def _peer_for(self, handle: KvHandle) -> _Peer:
        """The prefill instance behind the handle, met (its session opened) the first time."""
        key = (handle.instance_id, handle.transfer_host, handle.transfer_port)
        peer = self._peers.get(key)
        if peer is not None and not peer.session.ended.is_set():
            return peer
        async with self._meeting:
            peer = self._peers.get(key)
            if peer is not None and not peer.session.ended.is_set():
                return peer
            if self._nursery is None:
                raise KvTransferError("the NIXL transport is not running")
            peer = await self._meet(handle)
            # read again: the transport may have stopped while we met prefill, and its
            # closed nursery takes no task (the peer's socket and metadata would leak)
            nursery = self._nursery
            if nursery is None:
                await self._drop(peer)
                raise KvTransferError("the NIXL transport stopped while meeting prefill")
            self._peers[key] = peer
            nursery.start_soon(self._keep, key, peer)
            return peer

    async def _meet(self, handle: KvHandle) -> _Peer:
        label = f"{handle.instance_id} ({handle.transfer_host}:{handle.transfer_port})"
        stream = await connect(handle, SESSION_NIXL, self.secret)
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                info = await receive_message(stream, _info_decoder)
        except (trio.TooSlowError, KvTransferError, WireError, trio.BrokenResourceError) as exc:
            await trio.aclose_forcefully(stream)
            raise KvTransferError(
                f"prefill {label} did not describe its NIXL agent: {exc}"
            ) from exc
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        peer = _Peer(label, "tcp", "", info, DecodeSession(stream))
        peer.reason = self._disagreement(info, handle)
        if not peer.reason:
            peer.reason = await self._load(peer)
        if not peer.reason:
            peer.transport = "nixl"
            log.info("KV from prefill %s: nixl (agent %s)", label, info.agent_name)
        else:
            log.info("KV from prefill %s: tcp (%s)", label, peer.reason)
        return peer

    def _disagreement(self, info: NixlAgentInfo, handle: KvHandle) -> str:
        """Why this pair cannot use NIXL ('' when it can)."""
        region = self._region()
        if info.unavailable:
            return f"prefill has no NIXL: {info.unavailable}"
        if (
            info.block_nbytes != region.block_nbytes
            or info.block_nbytes != handle.layout.block_nbytes
        ):
            return (
                f"block sizes differ: prefill's are {info.block_nbytes} bytes, "
                f"decode's {region.block_nbytes}"
            )
        if info.memory not in self._agent_or_fail().memory_kinds:
            return f"decode's UCX cannot reach prefill's {info.memory}"
        if info.agent_name == self._agent_or_fail().name:
            return "prefill and decode share one agent name"
        return ""

    def _agent_or_fail(self) -> NixlAgent:
        if self.agent is None:
            raise KvTransferError("NIXL is not running")
        return self.agent

    async def _load(self, peer: _Peer) -> str:
        agent = self._agent_or_fail()
        try:
            loaded = await agent.call(agent.agent.add_remote_agent, peer.info.agent_metadata)
        except Exception as exc:
            return f"decode's NIXL cannot load prefill's agent metadata: {describe_error(exc)}"
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        peer.loaded_agent = name
        if name != peer.info.agent_name:
            return f"prefill's metadata names agent {name!r}, not {peer.info.agent_name!r}"
        return ""

    async def _keep(self, key: tuple[str, str, int], peer: _Peer) -> None:
        """Hold the peer while its session lasts; then forget it and drop its metadata."""
        stopping = False
        try:
            await peer.session.read_answers()
        except trio.Cancelled:
            stopping = True  # the worker stops: nothing went away
            raise
        finally:
            if self._peers.get(key) is peer:
                del self._peers[key]
            await self._drop_metadata(peer)
            if not stopping:
                log.info(
                    "NIXL session with prefill %s over, its metadata dropped: %s",
                    peer.label,
                    peer.session.end_reason,
                )

    async def _drop(self, peer: _Peer) -> None:
        """A peer met but never kept: its session's socket closed, its metadata dropped."""
        peer.session.end("the NIXL transport stopped")
        await trio.aclose_forcefully(peer.session.stream)
        await self._drop_metadata(peer)

    async def _drop_metadata(self, peer: _Peer) -> None:
        agent = self.agent
        if peer.loaded_agent and agent is not None and agent.agent is not None:
            with trio.CancelScope(shield=True):
                try:
                    await agent.call(remove_remote_agent, agent.agent, peer.loaded_agent)
                except Exception as exc:
                    log.warning("NIXL kept %s: %s", peer.loaded_agent, describe_error(exc))

    async def _read(
        self, peer: _Peer, handle: KvHandle, dest_block_ids: tuple[int, ...], lease_ends: float
    ) -> KvDigests | None:
        """READ the blocks, done before ``lease_ends`` (trio clock) less the margin; what
        prefill's grant says it wrote in them."""
        agent = self._agent_or_fail()
        info = peer.info
        region = agent.region
        lease_left = lease_ends - trio.current_time() - LEASE_MARGIN_S
        if lease_left <= 0:
            raise KvTransferError("prefill's lease on the blocks ends before a read could")
        if not blocks_within(handle.block_ids, info.num_blocks):
            raise KvTransferError(
                f"the handle names blocks prefill does not have ({info.num_blocks})"
            )
        if not blocks_within(dest_block_ids, region.num_blocks):
            raise KvTransferError(f"decode has no such blocks (it has {region.num_blocks})")
        with trio.move_on_after(lease_left) as lease_deadline:
            answer = await peer.session.ask(
                TransferRequest(handle.request_id, handle.block_ids, handle.access_token)
            )
            if not answer.granted:
                raise KvTransferError(f"prefill refused the transfer: {answer.reason}")
            local, remote = read_descriptors(handle.block_ids, dest_block_ids, info, region)
            notification = wire.encode(TransferDone(handle.request_id, handle.access_token))
            await self._read_granted(peer, local, remote, notification)
        if lease_deadline.cancelled_caught:
            raise KvTransferError("the NIXL read did not finish before prefill's lease ends")
        return answer.digests

    async def _read_granted(
        self,
        peer: _Peer,
        local: np.ndarray[Any, Any],
        remote: np.ndarray[Any, Any],
        notification: bytes,
    ) -> None:
        """READ the granted blocks; a failure ends the session (the next pull meets prefill anew)."""
        agent = self._agent_or_fail()
        memories = (agent.memory, peer.info.memory)
        try:
            # a small READ is done in the post, in well under a millisecond: no thread for it
            nbytes = int(local[:, 1].sum())
            call = agent.call_here if nbytes <= INLINE_READ_BYTES else agent.call
            state, transfer, seconds = await call(
                post_read, agent.agent, local, remote, memories, peer.info.agent_name, notification
            )
        except Exception as exc:
            peer.session.end(f"a NIXL read failed ({describe_error(exc)})")
            await trio.aclose_forcefully(peer.session.stream)
            log.debug("the NIXL read from %s failed", peer.label, exc_info=True)
            raise KvTransferError(f"the NIXL read failed: {describe_error(exc)}") from exc
        self.read_seconds += seconds
        if transfer is not None:
            polled_from = time.perf_counter()
            try:
                delay = _FIRST_POLL_S
                while state == "PROC":
                    await trio.sleep(delay)
                    delay = min(2 * delay, _LAST_POLL_S)
                    state = await agent.call_here(agent.agent.check_xfer_state, transfer)
            finally:
                with trio.CancelScope(shield=True):
                    problem = await agent.call_here(release_quietly, transfer)
                if problem:
                    log.error("NIXL could not cancel a READ from %s: %s", peer.label, problem)
                self.read_seconds += time.perf_counter() - polled_from
        if state != "DONE":
            peer.session.end(f"a NIXL read ended in state {state}")
            await trio.aclose_forcefully(peer.session.stream)
            raise KvTransferError(f"the NIXL read from {peer.label} failed (state {state})")
