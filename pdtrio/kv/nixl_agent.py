"""The NIXL agent wrapper: one agent per worker, its KV region registered, its calls serialized.

UCX here: the shared-memory transports (cma, sysv, posix) need
``ucx_error_handling_mode = none``; NIXL's progress thread busy-spins a core
even while idle, so it is off, and nothing makes progress unless a call does.
Agent calls run one at a time (UCX is serialized).  On shared memory a READ's
post is itself the copy: a big one runs on a worker thread, so trio's thread
never waits on it; calls that return at once (a small READ, a look at a
transfer's state or at notifications) run on trio's thread.

NIXL's own listener thread is off (metadata goes on the authenticated KV port),
but UCX's TCP transport listens on every network device UCX uses, outside the
worker's secret: ``UCX_NET_DEVICES`` keeps those to the worker's own interface
(loopback for a loopback host), see :func:`ucx_net_devices`.

Also here: the READ's descriptors (one per run of blocks contiguous on both sides),
and the calls the transport makes on the agent's thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final, TypeVar, final

import attrs
import numpy as np
import trio

from pdtrio.engine.api import KvRegion
from pdtrio.kv.api import KvTransferError, KvTransportUnavailable
from pdtrio.protocol.link.wire import NixlAgentInfo

log = logging.getLogger("pdtrio.kv")

UCX_BACKEND_PARAMS: Final = {"ucx_error_handling_mode": "none"}
# how long decode waits for a prefill instance to describe its agent (and the agent for
# its loopback READ at start)
HANDSHAKE_TIMEOUT_S: Final = 10.0
_MEMORY_KINDS: Final = {"cpu": "DRAM", "cuda": "VRAM"}

_T = TypeVar("_T")


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
            raise KvTransportUnavailable(f"NIXL does not start: {describe_error(exc)}") from exc
        opened = cls(made, name, region, limiter)
        try:
            await opened.call(_loopback_read, made.agent, name, region, memory)
        except Exception as exc:
            await opened.close()
            raise KvTransportUnavailable(
                f"a NIXL loopback READ fails: {describe_error(exc)}"
            ) from exc
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
                log.warning("NIXL could not deregister the KV cache: %s", describe_error(exc))
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


def describe_error(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def post_read(
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
        release_quietly(handle)
        raise
    if state != "PROC":
        release_quietly(handle)  # done (or failed) already: no second call to release it
        return state, None, time.perf_counter() - started
    return state, handle, time.perf_counter() - started


def release_quietly(handle: Any) -> str:
    """Release a transfer (cancelling it if still running); what went wrong, or ''."""
    try:
        handle.release()
    except Exception as exc:
        return describe_error(exc)
    return ""


def remove_remote_agent(agent: Any, name: str) -> None:
    agent.remove_remote_agent(name)


def blocks_within(block_ids: tuple[int, ...], num_blocks: int) -> bool:
    return not block_ids or (min(block_ids) >= 0 and max(block_ids) < num_blocks)


def read_descriptors(
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
