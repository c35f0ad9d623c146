"""The NIXL KV transport: decode READs prefill's blocks one-sided, zero-copy; TCP stays the fallback.

At start each worker makes one NIXL agent (UCX backend) and registers its
whole KV cache once (``Engine.kv_region``: DRAM, or VRAM when the cache lives
on a GPU).  A prefill instance describes its agent on its KV transfer port
(a NIXL session, see ``pdtrio.kv.tcp``): the agent's metadata, where its
blocks are, how big one is.  A decode instance opens that session the first
time it meets a prefill instance, loads the metadata, and keeps the session
open: when it ends, the prefill instance went away, and its metadata is dropped.

One pull: decode asks on the session for the handle's blocks (prefill
refuses blocks the request's lease does not hold), READs them straight into
its own blocks (one descriptor per run of contiguous blocks), and the READ
carries a NIXL notification (a msgpack ``TransferDone``) that tells prefill
the read is done (the blocks stay leased until the router releases them, once
decode has produced a token).  Prefill looks for notifications only while a read it granted
is outstanding, so an idle worker does no work at all.

The choice is per pair.  A decode instance falls back to TCP for a prefill
instance without NIXL, with another block size, a memory kind its UCX cannot
reach, or metadata its agent cannot load; ``/pd/info`` and the log say which
and why.

UCX here: the shared-memory transports (cma, sysv, posix) need
``ucx_error_handling_mode = none``; NIXL's progress thread busy-spins a core
even while idle, so it is off, and nothing makes progress unless a call does.
Agent calls run one at a time (UCX is serialized).  On shared memory a READ's
post is itself the copy: a big one runs on a worker thread, so trio's thread
never waits on it; calls that return at once (a small READ, a look at a
transfer's state or at notifications) run on trio's thread.  A READ still in
flight after its post is polled from trio with growing sleeps, never spun on.

NIXL's own listener thread is off (metadata goes on the authenticated KV port),
but UCX's TCP transport listens on every network device UCX uses, outside the
worker's secret: ``UCX_NET_DEVICES`` keeps those to the worker's own interface
(loopback for a loopback host), see :func:`ucx_net_devices`.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import ipaddress
import logging
import os
import secrets
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final, TypeVar, final

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
from pdtrio.kv.tcp import (
    DEFAULT_TRANSFER_TIMEOUT_S,
    SESSION_NIXL,
    answer_decoder,
    check_destination,
    connect,
    done_decoder,
    pull_over_tcp,
    receive_message,
    request_decoder,
    send_message,
    serve_kv_port,
)
from pdtrio.protocol import wire
from pdtrio.protocol.wire import (
    KvHandle,
    NixlAgentInfo,
    TransferAnswer,
    TransferDone,
    TransferRequest,
    WireError,
    lease_deadline,
)
from pdtrio.security import PeerCredentials

log = logging.getLogger("pdtrio.kv")

UCX_BACKEND_PARAMS: Final = {"ucx_error_handling_mode": "none"}
# READs up to this size are posted on trio's thread (on shared memory, ~0.1 ms of copying)
INLINE_READ_BYTES: Final = 1 << 20
# a read must end this long before prefill's lease does (the lease's TTL left prefill a
# network hop and a send queue ago: decode's count starts a little late)
LEASE_MARGIN_S: Final = 1.0
# how long decode waits for a prefill instance to describe its agent
HANDSHAKE_TIMEOUT_S: Final = 10.0
# polling a read's completion, and prefill's notifications while a read is outstanding
_FIRST_POLL_S: Final = 0.0005
_LAST_POLL_S: Final = 0.004
_FIRST_NOTIF_POLL_S: Final = 0.001
_LAST_NOTIF_POLL_S: Final = 0.016
_MEMORY_KINDS: Final = {"cpu": "DRAM", "cuda": "VRAM"}

_T = TypeVar("_T")
_info_decoder: wire.Decoder[NixlAgentInfo] = wire.Decoder(NixlAgentInfo)


def run_starts(
    source_ids: Sequence[int], dest_ids: Sequence[int]
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(first source block, first destination block, count) arrays: one entry for each run
    of blocks contiguous on both sides, in order."""
    source = np.asarray(source_ids, dtype=np.int64)
    dest = np.asarray(dest_ids, dtype=np.int64)
    if source.shape != dest.shape:
        raise ValueError(f"{source.size} source blocks but {dest.size} destinations")
    if source.size == 0:
        return source, dest, source
    breaks = np.flatnonzero((np.diff(source) != 1) | (np.diff(dest) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.append(starts, source.size))
    return source[starts], dest[starts], counts


def coalesced_runs(
    source_ids: Sequence[int], dest_ids: Sequence[int]
) -> list[tuple[int, int, int]]:
    """``run_starts`` as (first source block, first destination block, count) tuples."""
    return [
        (int(s), int(d), int(c)) for s, d, c in zip(*run_starts(source_ids, dest_ids), strict=True)
    ]


def memory_kind(region: KvRegion) -> str:
    """NIXL's name for where the region lives; KvTransportUnavailable for any other device."""
    kind = _MEMORY_KINDS.get(region.device)
    if kind is None:
        raise KvTransportUnavailable(f"NIXL cannot register KV memory on device {region.device!r}")
    return kind


def _quiet_nixl_logging() -> None:
    # NIXL's Python logger prints INFO lines to stdout, where a worker's ready line goes
    nixl_logger = logging.getLogger("nixl")
    nixl_logger.handlers.clear()
    nixl_logger.propagate = True
    nixl_logger.setLevel(logging.WARNING)


@final
class NixlAgent:
    """One NIXL agent with the KV region registered; its calls run one at a time."""

    def __init__(
        self, made: _MadeAgent, name: str, region: KvRegion, limiter: trio.CapacityLimiter
    ) -> None:
        self._agent: Any = made.agent
        self.name = name
        self.region = region
        self.memory = memory_kind(region)
        self._registration = made.registration
        self._limiter = limiter
        self.memory_kinds = made.memory_kinds
        self.metadata = made.metadata

    @classmethod
    async def open(
        cls, region: KvRegion, name: str | None = None, host: str | None = None
    ) -> NixlAgent:
        """Import NIXL, make the agent, register the region, and check a loopback READ.

        ``host``: the address the worker's own ports are bound to; UCX's listeners stay
        on its interface (None: UCX's default, every device).
        Raises KvTransportUnavailable with the reason when any step fails.
        """
        memory = memory_kind(region)
        if region.nbytes <= 0:
            raise KvTransportUnavailable("the KV cache is empty: nothing to register")
        name = name or f"pdtrio-{os.getpid()}-{secrets.token_hex(4)}"
        limiter = trio.CapacityLimiter(1)
        try:
            devices = None if host is None else ucx_net_devices(host)
            made = await trio.to_thread.run_sync(
                _make_agent, name, region, memory, devices, limiter=limiter
            )
        except ImportError as exc:
            raise KvTransportUnavailable(f"NIXL does not import: {exc}") from exc
        except Exception as exc:  # NIXL raises its own classes, all plain Exceptions
            # (kept as the cause: a bug of ours in _make_agent would read the same)
            raise KvTransportUnavailable(f"NIXL does not start: {_describe(exc)}") from exc
        opened = cls(made, name, region, limiter)
        try:
            await opened.call(_loopback_read, made.agent, name, region, memory)
        except Exception as exc:
            await opened.close()
            raise KvTransportUnavailable(f"a NIXL loopback READ fails: {_describe(exc)}") from exc
        return opened

    async def call(self, function: Callable[..., _T], *args: Any) -> _T:
        """``function(*args)`` on a worker thread, after every earlier call has returned.

        Not abandoned when cancelled: it returns once the thread has, and the
        cancellation lands at the caller's next checkpoint.
        """
        return await trio.to_thread.run_sync(function, *args, limiter=self._limiter)

    async def call_here(self, function: Callable[..., _T], *args: Any) -> _T:
        """``function(*args)`` on trio's thread, after every earlier call has returned: for
        calls that return at once (a look at progress, a small copy), not worth a thread."""
        try:
            self._limiter.acquire_nowait()  # free (the usual case): no trip through the scheduler
        except trio.WouldBlock:
            await self._limiter.acquire()
        try:
            return function(*args)
        finally:
            self._limiter.release()

    @property
    def agent(self) -> Any:
        return self._agent

    async def close(self) -> None:
        """Deregister the region and let the agent go (it disconnects from every peer)."""
        with trio.CancelScope(shield=True):
            try:
                await self.call(self._agent.deregister_memory, self._registration)
            except Exception as exc:
                log.warning("NIXL could not deregister the KV cache: %s", _describe(exc))
            await self.call(self._let_go)

    def _let_go(self) -> None:
        # the agent's C++ side is destroyed with its last reference: here, on a serialized call
        self._agent = None

    def describe(self) -> dict[str, Any]:
        return {
            "agent": self.name,
            "memory": self.memory,
            "registered_bytes": self.region.nbytes,
            "backend": "UCX",
        }


@attrs.frozen
class _MadeAgent:
    agent: Any
    registration: Any
    memory_kinds: frozenset[str]  # what UCX here can reach: "DRAM", "VRAM"
    metadata: bytes  # what a peer loads to reach the agent and its registered region


def _make_agent(name: str, region: KvRegion, memory: str, devices: str | None) -> _MadeAgent:
    from nixl._api import nixl_agent, nixl_agent_config

    _quiet_nixl_logging()
    # no progress thread (it spins a core while idle), no listener (metadata goes on the KV port)
    config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
    agent = nixl_agent(name, config)
    # UCX reads its configuration from the environment when the backend makes its context
    # (NIXL 1.5.1's ucx_devices parameter leaves the TCP listeners on every device)
    with _environment("UCX_NET_DEVICES", devices):
        agent.create_backend("UCX", dict(UCX_BACKEND_PARAMS))
    kinds = frozenset(str(kind).removesuffix("_SEG") for kind in agent.get_backend_mem_types("UCX"))
    if memory not in kinds:
        raise KvTransportUnavailable(f"UCX here cannot register {memory} (only {sorted(kinds)})")
    registration = agent.register_memory(
        [(region.address, region.nbytes, region.device_id, "")], memory
    )
    return _MadeAgent(agent, registration, kinds, bytes(agent.get_agent_metadata()))


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """``name=value`` in the environment for the block (None: left as it is)."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


_WILDCARDS: Final = frozenset({"", "0.0.0.0", "::"})
_SIOCGIFFLAGS: Final = 0x8913
_SIOCGIFADDR: Final = 0x8915
_IFF_LOOPBACK: Final = 0x8


def ucx_net_devices(host: str) -> str | None:
    """``UCX_NET_DEVICES`` for a worker whose ports are bound to ``host``; None: UCX's default.

    UCX's TCP transport listens on each network device it uses, and without this it
    uses all of them. Loopback host: the loopback device alone (every peer is on this
    machine). A specific address: the interfaces holding it, and the RDMA ports (no
    TCP listener, and where NIXL's fast path runs). A wildcard host: the worker's own
    ports are on every interface already. An operator's ``UCX_NET_DEVICES`` stands.
    """
    if os.environ.get("UCX_NET_DEVICES") or host in _WILDCARDS:
        return None
    try:
        addresses = {
            ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
            for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        }
    except (OSError, ValueError):
        return None
    interfaces = [name for _, name in socket.if_nameindex()]
    if all(address.is_loopback for address in addresses):
        chosen = [name for name in interfaces if _flags(name) & _IFF_LOOPBACK]
    else:
        held = _interface_addresses(interfaces)
        chosen = [name for name in interfaces if held.get(name, set()) & addresses]
        if chosen:
            chosen += _rdma_ports()
    if not chosen:
        log.warning("no network interface holds %s: UCX listens on every device", host)
        return None
    return ",".join(chosen)


def _ioctl(name: str, request: int) -> bytes | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            return fcntl.ioctl(probe.fileno(), request, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address, or gone meanwhile
            return None


def _flags(name: str) -> int:
    answer = _ioctl(name, _SIOCGIFFLAGS)
    return 0 if answer is None else int(struct.unpack_from("H", answer, 16)[0])


def _interface_addresses(
    interfaces: Iterable[str],
) -> dict[str, set[ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    held: dict[str, set[ipaddress.IPv4Address | ipaddress.IPv6Address]] = {}
    for name in interfaces:
        answer = _ioctl(name, _SIOCGIFADDR)
        if answer is not None:  # its (primary) IPv4 address: a sockaddr_in at offset 16
            held.setdefault(name, set()).add(ipaddress.IPv4Address(answer[20:24]))
    try:
        with open("/proc/net/if_inet6") as lines:
            for line in lines:
                fields = line.split()
                if len(fields) >= 6:
                    address = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
                    held.setdefault(fields[5], set()).add(address)
    except OSError:  # no IPv6
        pass
    return held


def _rdma_ports() -> list[str]:
    """UCX's names for the RDMA ports here (``mlx5_0:1``)."""
    root = "/sys/class/infiniband"
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        return []
    ports = []
    for device in devices:
        try:
            ports += [f"{device}:{port}" for port in sorted(os.listdir(f"{root}/{device}/ports"))]
        except OSError:
            continue
    return ports


def _loopback_read(agent: Any, name: str, region: KvRegion, memory: str) -> None:
    """READ the first block onto itself through the agent: UCX moves bytes here, or raises."""
    descs = np.array([[region.address, region.block_nbytes, region.device_id]], dtype=np.uint64)
    local = agent.get_xfer_descs(descs, memory)
    remote = agent.get_xfer_descs(descs, memory)
    handle = agent.initialize_xfer("READ", local, remote, name)
    try:
        state = agent.transfer(handle)
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)  # start-up only, on a worker thread
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise KvTransferError(f"the loopback READ ended in state {state}")
    finally:
        handle.release()


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _post_read(
    agent: Any,
    local: np.ndarray[Any, Any],
    remote: np.ndarray[Any, Any],
    memory: tuple[str, str],
    remote_agent: str,
    notification: bytes,
) -> tuple[str, Any, float]:
    """Make and post the READ: its state, its handle while it runs (else None), the seconds
    it took.  On shared memory the post is the whole copy.
    """
    started = time.perf_counter()
    local_descs = agent.get_xfer_descs(local, memory[0])
    remote_descs = agent.get_xfer_descs(remote, memory[1])
    handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote_agent, notification)
    try:
        state: str = agent.transfer(handle)
    except BaseException:
        _release_quietly(handle)
        raise
    if state != "PROC":
        _release_quietly(handle)  # done (or failed) already: no second call to release it
        return state, None, time.perf_counter() - started
    return state, handle, time.perf_counter() - started


def _release_quietly(handle: Any) -> str:
    """Release a transfer (cancelling it if still running); what went wrong, or ''."""
    try:
        handle.release()
    except Exception as exc:
        return _describe(exc)
    return ""


def _remove_remote_agent(agent: Any, name: str) -> None:
    agent.remove_remote_agent(name)


class _SessionEnded(KvTransferError):
    """The session ended before prefill answered: nothing was granted."""


@attrs.define(eq=False)
class _Waiter:
    done: trio.Event = attrs.Factory(trio.Event)
    answer: TransferAnswer | None = None


@final
class _Session:
    """Decode's end of a NIXL session: grants asked in order, answered in order."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.ended = trio.Event()
        self.end_reason = ""
        self._waiting: deque[_Waiter] = deque()
        self._send_lock = trio.Lock()

    async def ask(self, request: TransferRequest) -> TransferAnswer:
        """Prefill's answer; _SessionEnded if the session ends first."""
        if self.ended.is_set():
            raise _SessionEnded(self.end_reason)
        waiter = _Waiter()
        async with self._send_lock:
            self._waiting.append(waiter)
            try:
                await send_message(self.stream, request)
            except BaseException as exc:
                # a half-sent message leaves the stream unusable: end the session
                self.end(f"the NIXL session with prefill broke ({exc!r})")
                await trio.aclose_forcefully(self.stream)
                if isinstance(exc, (trio.BrokenResourceError, trio.ClosedResourceError)):
                    raise _SessionEnded(self.end_reason) from exc
                raise
        await waiter.done.wait()
        if waiter.answer is None:
            raise _SessionEnded(self.end_reason)
        return waiter.answer

    def end(self, reason: str) -> None:
        """No more asking on this session (its reader ends it for good)."""
        if not self.end_reason:
            self.end_reason = reason
        self.ended.set()

    async def read_answers(self) -> None:
        """Hand each answer to the oldest asker, until the session ends."""
        try:
            while True:
                answer = await receive_message(self.stream, answer_decoder)
                if not self._waiting:
                    raise WireError("prefill answered a request nobody made")
                waiter = self._waiting.popleft()
                waiter.answer = answer
                waiter.done.set()
        except (
            KvTransferError,
            WireError,
            trio.BrokenResourceError,
            trio.ClosedResourceError,
        ) as exc:
            self.end(f"the NIXL session with prefill ended ({exc})")
        finally:
            self.end("the NIXL session with prefill ended")
            for waiter in self._waiting:
                waiter.done.set()
            self._waiting.clear()
            await trio.aclose_forcefully(self.stream)


@attrs.define(eq=False)
class _Peer:
    """What decode knows of one prefill instance, for as long as its session lasts."""

    label: str
    transport: str  # "nixl" or "tcp"
    reason: str  # why TCP, when it is
    info: NixlAgentInfo
    session: _Session
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
        # prefill: the reads granted and not yet known to be done, with the trio time they end by
        self._source: KvBlockSource | None = None
        self._granted: dict[str, float] = {}
        self._granted_changed = trio.Event()
        self._sessions = 0
        self.pulls = {"nixl": 0, "tcp": 0}
        self.pull_seconds = {"nixl": 0.0, "tcp": 0.0}
        self.pull_bytes = {"nixl": 0, "tcp": 0}
        self.read_seconds = 0.0  # in the READs themselves (made, posted, done)
        self.releases_notified = 0

    @property
    def name(self) -> str:
        return "tcp" if self.unavailable else "nixl"

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
                self._source = source
                if self.agent is not None:
                    nursery.start_soon(self._collect_releases, source)
                endpoint = await nursery.start(
                    functools.partial(
                        serve_kv_port,
                        source,
                        host,
                        port,
                        nixl_sessions=self._serve_session if self.agent is not None else None,
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
            "nixl_sessions": self._sessions,
            "reads_granted": len(self._granted),
            "releases_notified": self.releases_notified,
        }

    # --- decode: pulls ------------------------------------------------------------

    async def pull(
        self, handle: KvHandle, sink: KvBlockSink, dest_block_ids: tuple[int, ...]
    ) -> None:
        check_destination(handle, dest_block_ids)
        # the handle's TTL counts from now (the caller passes what is left of it)
        lease_ends = lease_deadline(handle, trio.current_time())
        started = time.perf_counter()
        transport = "tcp"
        with trio.move_on_after(self.timeout_s) as deadline:
            for attempt in (1, 2):
                peer = await self._peer_for(handle) if self.agent is not None else None
                if peer is None or peer.transport != "nixl" or sink.kv_region() != self._region():
                    await pull_over_tcp(handle, sink, dest_block_ids, self.secret)
                    break
                transport = "nixl"
                try:
                    await self._read(peer, handle, dest_block_ids, lease_ends)
                    break
                except _SessionEnded:
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
            nursery = self._nursery
            if nursery is None:
                raise KvTransferError("the NIXL transport is not running")
            peer = await self._meet(handle)
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
        peer = _Peer(label, "tcp", "", info, _Session(stream))
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
            return f"decode's NIXL cannot load prefill's agent metadata: {_describe(exc)}"
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
            agent = self.agent
            if peer.loaded_agent and agent is not None and agent.agent is not None:
                with trio.CancelScope(shield=True):
                    try:
                        await agent.call(_remove_remote_agent, agent.agent, peer.loaded_agent)
                    except Exception as exc:
                        log.warning("NIXL kept %s: %s", peer.loaded_agent, _describe(exc))
            if not stopping:
                log.info(
                    "NIXL session with prefill %s over, its metadata dropped: %s",
                    peer.label,
                    peer.session.end_reason,
                )

    async def _read(
        self, peer: _Peer, handle: KvHandle, dest_block_ids: tuple[int, ...], lease_ends: float
    ) -> None:
        """READ the blocks, done before ``lease_ends`` (trio clock) less the margin."""
        agent = self._agent_or_fail()
        info = peer.info
        region = agent.region
        lease_left = lease_ends - trio.current_time() - LEASE_MARGIN_S
        if lease_left <= 0:
            raise KvTransferError("prefill's lease on the blocks ends before a read could")
        if not _within(handle.block_ids, info.num_blocks):
            raise KvTransferError(
                f"the handle names blocks prefill does not have ({info.num_blocks})"
            )
        if not _within(dest_block_ids, region.num_blocks):
            raise KvTransferError(f"decode has no such blocks (it has {region.num_blocks})")
        with trio.move_on_after(lease_left) as lease_deadline:
            answer = await peer.session.ask(
                TransferRequest(handle.request_id, handle.block_ids, handle.access_token)
            )
            if not answer.granted:
                raise KvTransferError(f"prefill refused the transfer: {answer.reason}")
            local, remote = _descriptors(handle.block_ids, dest_block_ids, info, region)
            notification = wire.encode(TransferDone(handle.request_id, handle.access_token))
            await self._read_granted(peer, local, remote, notification)
        if lease_deadline.cancelled_caught:
            raise KvTransferError("the NIXL read did not finish before prefill's lease ends")

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
                _post_read, agent.agent, local, remote, memories, peer.info.agent_name, notification
            )
        except Exception as exc:
            peer.session.end(f"a NIXL read failed ({_describe(exc)})")
            await trio.aclose_forcefully(peer.session.stream)
            log.debug("the NIXL read from %s failed", peer.label, exc_info=True)
            raise KvTransferError(f"the NIXL read failed: {_describe(exc)}") from exc
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
                    problem = await agent.call_here(_release_quietly, transfer)
                if problem:
                    log.error("NIXL could not cancel a READ from %s: %s", peer.label, problem)
                self.read_seconds += time.perf_counter() - polled_from
        if state != "DONE":
            peer.session.end(f"a NIXL read ended in state {state}")
            await trio.aclose_forcefully(peer.session.stream)
            raise KvTransferError(f"the NIXL read from {peer.label} failed (state {state})")

    # --- prefill: grants and releases -------------------------------------------------

    async def _serve_session(self, stream: trio.abc.Stream) -> None:
        """One decode instance's NIXL session: describe the agent, then grant reads."""
        agent = self._agent_or_fail()
        region = agent.region
        info = NixlAgentInfo(
            unavailable="",
            agent_name=agent.name,
            agent_metadata=agent.metadata,
            memory=agent.memory,
            device_id=region.device_id,
            base_address=region.address,
            num_blocks=region.num_blocks,
            block_nbytes=region.block_nbytes,
        )
        self._sessions += 1
        try:
            await send_message(stream, info)
            while True:
                try:
                    request = await receive_message(stream, request_decoder)
                except KvTransferError:
                    return  # decode closed the session
                await send_message(stream, self._grant(request))
        finally:
            self._sessions -= 1

    def _grant(self, request: TransferRequest) -> TransferAnswer:
        """May decode read these blocks now? Only blocks the request's lease holds."""
        source = self._source
        region = self._agent_or_fail().region
        request_id, block_ids = request.request_id, request.block_ids
        if source is None:
            return TransferAnswer(False, reason="this instance serves no prefill")
        if not block_ids or not _within(block_ids, region.num_blocks):
            return TransferAnswer(False, reason=f"bad block ids for {request_id}")
        if not source.holds(request_id, block_ids, request.access_token):
            # (no lease, or not this request's grant: the same answer, telling nothing)
            return TransferAnswer(False, reason=f"no lease held for {request_id} on those blocks")
        self._granted[request_id] = trio.current_time() + self.timeout_s + LEASE_MARGIN_S
        self._granted_changed.set()
        return TransferAnswer(True, nbytes=len(block_ids) * region.block_nbytes)

    async def _collect_releases(self, source: KvBlockSource) -> None:
        """Free blocks as decode's notifications say; looks only while a read is outstanding."""
        agent = self._agent_or_fail()
        delay = _FIRST_NOTIF_POLL_S
        while True:
            if not self._granted:
                self._granted_changed = trio.Event()
                await self._granted_changed.wait()
                delay = _FIRST_NOTIF_POLL_S
            notifications = await agent.call_here(agent.agent.get_new_notifs)
            released = self._release_notified(source, _messages(notifications))
            now = trio.current_time()
            for request_id, until in list(self._granted.items()):
                # done elsewhere (the router's release, the lease), or abandoned by decode
                if until <= now or not source.holds(request_id, ()):
                    del self._granted[request_id]
            delay = _FIRST_NOTIF_POLL_S if released else min(2 * delay, _LAST_NOTIF_POLL_S)
            await trio.sleep(delay)

    def _release_notified(self, source: KvBlockSource, messages: Iterable[bytes]) -> bool:
        released = False
        for message in messages:
            try:
                done = done_decoder.decode(message)
            except WireError as exc:
                log.warning("a NIXL notification that is not a TransferDone: %s", exc)
                continue
            if done.request_id not in self._granted:
                # not a read this instance granted (or one given up on): the lease decides
                log.warning("a NIXL release for %s, which no read was granted", done.request_id)
                continue
            if not source.holds(done.request_id, (), done.access_token):
                continue  # gone already (expired, released by the router), or not its grant
            # the read is done; the blocks stay leased until the router releases them, once
            # decode has produced a token (a decode failing before that is replaced)
            del self._granted[done.request_id]
            self.releases_notified += 1
            released = True
        return released


def _within(block_ids: tuple[int, ...], num_blocks: int) -> bool:
    return not block_ids or (min(block_ids) >= 0 and max(block_ids) < num_blocks)


def _messages(notifications: dict[str, list[bytes]]) -> list[bytes]:
    return [message for messages in notifications.values() for message in messages]


def _descriptors(
    source_ids: Sequence[int], dest_ids: Sequence[int], info: NixlAgentInfo, region: KvRegion
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(local, remote) descriptors, rows of (address, length, device): one row per run."""
    sources, dests, counts = run_starts(source_ids, dest_ids)
    size = region.block_nbytes
    local = np.empty((counts.size, 3), dtype=np.uint64)
    remote = np.empty((counts.size, 3), dtype=np.uint64)
    local[:, 0] = region.address + dests * size
    local[:, 1] = remote[:, 1] = counts * size
    local[:, 2] = region.device_id
    remote[:, 0] = info.base_address + sources * size
    remote[:, 2] = info.device_id
    return local, remote
