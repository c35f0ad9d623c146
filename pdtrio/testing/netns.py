"""A test bed of several hosts on one machine: network namespaces on a private bridge.

Every test on loopback sees a dead peer reset at once and UCX move KV through shared
memory; across hosts a partition drops packets silently and NIXL moves KV over TCP.  A
:class:`Bed` makes that here: one network namespace per host (``pdt<PID>-<N>-<host>``: the
test's PID and the bed's number), each with one interface, ``eth0``, the end of a veth
pair whose other end (``p-<host>``) is a port of the bridge ``br0`` in a namespace of its
own (``pdt<PID>-<N>-switch``: the switch).
Host ``i`` holds ``10.213.0.<10+i>/24`` and loopback, nothing else: no default route, and
the root namespace gets no address and no interface, so nothing the bed carries can
leave it, and nothing outside can reach it.  A fresh namespace has every port free, so
services listen on fixed ports.

Processes run in a host with ``ip netns exec`` (it ``exec``\\ s: the PID a
:class:`~pdtrio.testing.Processes` group stops is the process's own); the test itself
talks to them from inside a host (:meth:`Bed.inside` moves the calling thread's network
namespace there, and back), e.g. a ``client`` host of its own.

Faults, inside the namespaces:

- :meth:`Bed.partition` ``how="link"``: the host's switch port is set down; packets to and
  from it vanish, no reset, no ICMP (a cable pulled at the switch).  ``how="drop"``: an
  nftables rule in the host drops every packet in and out of ``eth0``, its link up (a
  firewall that eats everything; a local ``connect`` waits, as a remote one does).
  ``how="blackhole"``: every other host gets a blackhole route to it and it to each of
  them; established connections lose every packet silently (a new ``connect`` on a
  blackholed host fails at once: the kernel's answer to a local sender).  :meth:`Bed.heal`
  undoes any of them.
- :meth:`Bed.cut_port`: an nftables rule in the host drops every packet to and from one
  of its TCP ports, silently; the host's other ports go on (a prefill's KV port cut off
  while its router link lives).  :meth:`Bed.heal_port` undoes it.
- :meth:`Bed.flap`: the link goes down and up on a period while the block runs.
- Loss: :meth:`Bed.set_loss` drops that share of the frames the switch forwards, at
  random, each direction (an nftables ``numgen random`` rule in the switch's bridge
  table): every TCP connection between hosts sees it, UCX's data connections too.
- Latency: this kernel has no ``sch_netem`` (``tc qdisc add ... netem``: "unknown qdisc";
  no tc actions either), so no packet is delayed by the kernel.  :meth:`Bed.start_proxy`
  puts pdtrio's fault proxy (``python -m pdtrio.faults``) in a host, in front of one of
  its listening ports: the service binds an inner port and advertises the proxy's, so
  every TCP connection to that port (router links, health probes, etcd, the KV port's
  NIXL session and TCP transport, the client's HTTP) crosses it; :meth:`BedProxy.control`
  sets ``latency 50`` and the rest of the proxy's faults while it runs.  It cannot reach
  UCX's own TCP data connections: UCX listens on ports of its own choosing and a peer
  dials the address in the agent's metadata, past any proxy.

``nft`` (Debian's nftables) is needed for ``drop`` and loss; :func:`nft_unavailable` says
why they cannot be had.

Root only (``ip netns add``); :func:`bed_unavailable` says why a bed cannot be made.
Leaving the ``with`` block kills whatever still runs in the bed's namespaces and deletes
them (the veths and the bridge go with them), also when the block failed; entering it
first removes namespaces left by a test whose PID is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Final, Literal, final

import attrs
import httpx

from pdtrio.testing.processes import Processes, alive

__all__ = [
    "Bed",
    "BedProxy",
    "Partition",
    "bed_unavailable",
    "nft_unavailable",
    "list_namespaces",
]

SUBNET_PREFIX: Final = "10.213.0."
"""The bed's addresses: they exist only inside its namespaces."""
_FIRST_HOST: Final = 10
_SWITCH: Final = "switch"
_CLONE_NEWNET: Final = 0x40000000
_NETNS_DIR: Final = Path("/run/netns")
_NAME: Final = re.compile(r"^pdt(\d+)-\d+-[a-z0-9]+$")
_beds_made = itertools.count(1)
_HOST_NAME: Final = re.compile(r"^[a-z][a-z0-9]{0,11}$")  # "p-<host>" fits IFNAMSIZ

Partition = Literal["link", "drop", "blackhole"]
_CUT_TABLE: Final = "pdtcut"
_PORT_CUT_TABLE: Final = "pdtportcut"
_LOSS_TABLE: Final = "pdtloss"

_libc = ctypes.CDLL(None, use_errno=True)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    completed = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=30, check=False
    )
    if check and completed.returncode != 0:
        raise RuntimeError(
            f"ip {' '.join(args)}: {completed.stderr.strip() or completed.returncode}"
        )
    return completed


def list_namespaces() -> list[str]:
    """The names ``ip netns list`` shows."""
    completed = _ip("netns", "list", check=False)
    return [line.split()[0] for line in completed.stdout.splitlines() if line.strip()]


def _pids_in(namespace: str) -> list[int]:
    completed = _ip("netns", "pids", namespace, check=False)
    return [int(word) for word in completed.stdout.split() if word.isdigit()]


def _remove_namespace(namespace: str) -> None:
    """Kill what runs in ``namespace`` (processes of a bed: nothing else enters one) and delete it."""
    for _ in range(3):
        pids = _pids_in(namespace)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
    _ip("netns", "del", namespace, check=False)


def sweep_stale() -> list[str]:
    """Delete the namespaces of beds whose test process is gone; returns their names."""
    stale = []
    for name in list_namespaces():
        match = _NAME.match(name)
        if match and not alive(int(match.group(1))):
            _remove_namespace(name)
            stale.append(name)
    return stale


def bed_unavailable() -> str | None:
    """Why no bed can be made here (not root, no ``ip``, ``ip netns add`` refused); None: it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    probe = f"pdt{os.getpid()}-probe"
    try:
        completed = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "no `ip` command (install iproute2)"
    if completed.returncode != 0:
        return f"`ip netns add` failed: {completed.stderr.strip()}"
    try:
        link = _ip(
            "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1", check=False
        )
        if link.returncode != 0:
            return f"cannot make a veth pair in a namespace: {link.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def nft_unavailable() -> str | None:
    """Why nftables rules cannot be used here (no ``nft``); None: they can."""
    if shutil.which("nft") is None:
        return "no `nft` command (apt-get install nftables)"
    return None


def _nft(namespace: str, script: str) -> None:
    completed = subprocess.run(
        ["ip", "netns", "exec", namespace, "nft", "-f", "-"],
        input=script,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"nft in {namespace}: {completed.stderr.strip()}\n{script}")


@contextlib.contextmanager
def _in_namespace(path: Path) -> Iterator[None]:
    """The calling thread in the network namespace at ``path`` for the block, then back."""
    with open("/proc/thread-self/ns/net", "rb") as before, open(path, "rb") as target:
        if _libc.setns(target.fileno(), _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {path}: {os.strerror(errno)}")
        try:
            yield
        finally:
            if _libc.setns(before.fileno(), _CLONE_NEWNET) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"setns back: {os.strerror(errno)}")


@final
@attrs.frozen
class BedProxy:
    """A fault proxy in ``host``: ``listen`` (the advertised port) forwarded to ``target``."""

    bed: Bed
    host: str
    pid: int
    listen: str  # address:port
    target: str  # address:port
    control_port: int  # on the host's loopback

    def control(self, line: str) -> str:
        """Send one control line (``latency 50``, ``stall on``, ``clear``); the proxy's answer."""
        with (
            self.bed.inside(self.host),
            socket.create_connection(("127.0.0.1", self.control_port), timeout=5) as sock,
        ):
            reader = sock.makefile("rb")
            reader.readline()  # its greeting: the fault in force
            sock.sendall(line.encode() + b"\n")
            answer = reader.readline().decode().strip()
        if not answer.startswith("ok"):
            raise RuntimeError(f"fault proxy in {self.host}: {line!r}: {answer}")
        return answer


@final
class Bed:
    """Hosts in namespaces on one bridge; ``with Bed(("router", "prefill", ...)) as bed:``.

    ``hosts``: short names (a lowercase letter, then letters and digits, 12 at most),
    given addresses in order (:meth:`address`).
    """

    def __init__(self, hosts: Sequence[str]) -> None:
        for host in hosts:
            if not _HOST_NAME.match(host) or host == _SWITCH:
                raise ValueError(
                    f"host name {host!r}: a letter, then letters and digits, 12 at most"
                )
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"host names repeat: {list(hosts)}")
        self.hosts = tuple(hosts)
        self.prefix = f"pdt{os.getpid()}-{next(_beds_made)}"
        self._made: list[str] = []
        self._partitioned: dict[str, Partition] = {}
        self._ports_cut: set[str] = set()
        self._flaps: list[tuple[threading.Thread, threading.Event]] = []
        self._loss = False
        self._lock = threading.Lock()  # faults may come from several threads at once

    # --- names and addresses ----------------------------------------------------------

    def namespace(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        return f"{SUBNET_PREFIX}{_FIRST_HOST + self.hosts.index(host)}"

    def namespaces(self) -> list[str]:
        """Every namespace this bed made (the switch's last)."""
        return list(self._made)

    # --- making and removing ------------------------------------------------------------

    def __enter__(self) -> Bed:
        sweep_stale()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _make(self) -> None:
        switch = self.namespace(_SWITCH)
        self._add_namespace(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for host in self.hosts:
            namespace = self.namespace(host)
            self._add_namespace(namespace)
            port = f"p-{host}"
            # both ends made in the switch, then one moved into the host: nothing in the root
            _ip(
                "-n",
                switch,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                namespace,
            )
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            _ip("-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")

    def close(self) -> None:
        """Stop the flaps, kill whatever still runs in the bed, delete its namespaces."""
        for thread, stop in self._flaps:
            stop.set()
            thread.join(10)
        self._flaps.clear()
        # hosts first: their veths go with them, then the switch and its bridge
        for name in reversed(self._made):
            _remove_namespace(name)
        self._made.clear()
        self._partitioned.clear()
        self._loss = False

    # --- running things in a host -------------------------------------------------------

    def command(self, host: str, command: Sequence[str]) -> list[str]:
        """``command`` run in ``host``'s network namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *command]

    @contextlib.contextmanager
    def inside(self, host: str) -> Iterator[None]:
        """The calling thread in ``host`` for the block: the sockets it makes meanwhile are
        that host's (and stay so after the block)."""
        with _in_namespace(_NETNS_DIR / self.namespace(host)):
            yield

    def start_proxy(
        self,
        procs: Processes,
        host: str,
        listen_port: int,
        target_port: int,
        *,
        control_port: int,
        timeout: float = 30.0,
    ) -> BedProxy:
        """pdtrio's fault proxy in ``host``, on its address: ``listen_port`` forwarded to
        ``target_port`` (where the service listens, on the same address); ``procs`` stops it."""
        address = self.address(host)
        process = procs.start(
            self.command(
                host,
                [
                    sys.executable,
                    "-m",
                    "pdtrio.faults",
                    "--listen",
                    f"{address}:{listen_port}",
                    "--target",
                    f"{address}:{target_port}",
                    "--control-port",
                    str(control_port),
                ],
            ),
            output="lines",
        )
        procs.read_line(process, b"control on ", timeout)
        return BedProxy(
            self,
            host,
            process.pid,
            f"{address}:{listen_port}",
            f"{address}:{target_port}",
            control_port,
        )

    def start_etcd(
        self,
        procs: Processes,
        host: str,
        data_dir: Path,
        *,
        port: int = 2379,
        binary: str = "/usr/bin/etcd",
        timeout: float = 20.0,
        ask_from: str = "client",
    ) -> subprocess.Popen[bytes]:
        """A single-member etcd in ``host``, serving ``http://ADDRESS:port``; returned once
        it serves a range, asked from ``ask_from``; ``procs`` stops it."""
        client = f"http://{self.address(host)}:{port}"
        peer = f"http://127.0.0.1:{port + 1}"
        process = procs.start(
            self.command(
                host,
                [
                    binary,
                    "--name=bed",
                    f"--data-dir={data_dir}",
                    f"--listen-client-urls={client}",
                    f"--advertise-client-urls={client}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=bed={peer}",
                    "--logger=zap",  # etcd 3.4 honours --log-level only with zap
                    "--log-level=error",
                ],
            ),
            output="capture",
        )
        deadline = time.monotonic() + timeout
        with self.inside(ask_from):
            while True:  # polled: etcd says nothing when it is ready
                try:
                    response = httpx.post(
                        f"{client}/v3/kv/range", json={"key": "AA=="}, timeout=1, trust_env=False
                    )
                    if response.status_code == 200:
                        return process
                except httpx.HTTPError:
                    pass
                if process.poll() is not None or time.monotonic() > deadline:
                    said = procs.output(process, timeout=2).decode(errors="replace")[-2000:]
                    raise RuntimeError(
                        f"etcd in {host} not ready within {timeout:g}s "
                        f"(status {process.poll()}): {said}"
                    )
                time.sleep(0.1)

    # --- faults -------------------------------------------------------------------------

    def partition(self, host: str, how: Partition = "link") -> None:
        """Cut ``host`` off from every other host, silently (see the module's docstring)."""
        with self._lock:
            self._partition(host, how)

    def heal(self, host: str) -> None:
        """Undo :meth:`partition`."""
        with self._lock:
            self._heal(host)

    def _partition(self, host: str, how: Partition) -> None:
        if host in self._partitioned:
            raise RuntimeError(f"{host} is partitioned already")
        if how == "link":
            self._set_port(host, up=False)
        elif how == "drop":
            _nft(
                self.namespace(host),
                f"table inet {_CUT_TABLE} {{\n"
                "  chain input { type filter hook input priority 0; policy accept;\n"
                '    iifname "eth0" drop\n  }\n'
                "  chain output { type filter hook output priority 0; policy accept;\n"
                '    oifname "eth0" drop\n  }\n'
                "}\n",
            )
        else:
            before = self._routes()
            self._partitioned[host] = how
            self._blackholes(before)
        self._partitioned[host] = how

    def _heal(self, host: str) -> None:
        how = self._partitioned[host]
        if how == "link":
            self._set_port(host, up=True)
        elif how == "drop":
            _nft(self.namespace(host), f"delete table inet {_CUT_TABLE}\n")
        else:
            before = self._routes()
            del self._partitioned[host]
            self._blackholes(before)
        self._partitioned.pop(host, None)

    def cut_port(self, host: str, port: int) -> None:
        """Drop every packet to and from ``host``'s TCP ``port``, silently (nft)."""
        with self._lock:
            if host in self._ports_cut:
                raise RuntimeError(f"a port of {host} is cut already")
            _nft(
                self.namespace(host),
                f"table inet {_PORT_CUT_TABLE} {{\n"
                "  chain input { type filter hook input priority 0; policy accept;\n"
                f'    iifname "eth0" tcp dport {port} drop\n  }}\n'
                "  chain output { type filter hook output priority 0; policy accept;\n"
                f'    oifname "eth0" tcp sport {port} drop\n  }}\n'
                "}\n",
            )
            self._ports_cut.add(host)

    def heal_port(self, host: str) -> None:
        """Undo :meth:`cut_port`."""
        with self._lock:
            if host in self._ports_cut:
                _nft(self.namespace(host), f"delete table inet {_PORT_CUT_TABLE}\n")
                self._ports_cut.discard(host)

    def heal_all(self) -> None:
        """Undo every partition, port cut and the loss (a flap in progress goes on)."""
        with self._lock:
            for host in list(self._partitioned):
                self._heal(host)
        for host in list(self._ports_cut):
            self.heal_port(host)
        self.set_loss(0)

    def set_loss(self, percent: float) -> None:
        """Drop ``percent`` % of the frames the switch forwards, at random (0: none)."""
        if not 0 <= percent <= 100:
            raise ValueError(f"loss must be within 0..100 %, not {percent!r}")
        switch = self.namespace(_SWITCH)
        with self._lock:
            self._set_loss(switch, percent)

    def _set_loss(self, switch: str, percent: float) -> None:
        if self._loss:
            _nft(switch, f"delete table bridge {_LOSS_TABLE}\n")
            self._loss = False
        if percent:
            per_million = round(percent * 10_000)
            _nft(
                switch,
                f"table bridge {_LOSS_TABLE} {{\n"
                "  chain forward { type filter hook forward priority 0; policy accept;\n"
                f"    numgen random mod 1000000 < {per_million} counter drop\n  }}\n"
                "}\n",
            )
            self._loss = True

    def frames_lost(self) -> int:
        """How many frames :meth:`set_loss`'s rule has dropped (0 with no rule)."""
        if not self._loss:
            return 0
        completed = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                self.namespace(_SWITCH),
                "nft",
                "list",
                "table",
                "bridge",
                _LOSS_TABLE,
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        found = re.search(r"counter packets (\d+)", completed.stdout)
        return int(found.group(1)) if found else 0

    def _set_port(self, host: str, *, up: bool) -> None:
        _ip("-n", self.namespace(_SWITCH), "link", "set", f"p-{host}", "up" if up else "down")

    def _routes(self) -> set[tuple[str, str]]:
        """The blackhole routes the blackholed hosts need, as (host it is on, address)."""
        cut = [host for host, how in self._partitioned.items() if how == "blackhole"]
        return {
            pair
            for host in cut
            for other in self.hosts
            if other != host
            for pair in ((other, self.address(host)), (host, self.address(other)))
        }

    def _blackholes(self, before: set[tuple[str, str]]) -> None:
        """Add and delete routes so that exactly :meth:`_routes` are there (two blackholed
        hosts share the routes between them)."""
        after = self._routes()
        for verb, pairs in (("del", before - after), ("add", after - before)):
            for host, address in sorted(pairs):
                _ip("-n", self.namespace(host), "route", verb, "blackhole", f"{address}/32")

    @contextlib.contextmanager
    def flap(self, host: str, *, down_s: float, up_s: float) -> Iterator[None]:
        """``host``'s link down ``down_s``, up ``up_s``, again and again while the block runs;
        up when it ends."""
        stop = threading.Event()

        def run() -> None:
            while True:
                self._set_port(host, up=False)
                stopped = stop.wait(down_s)
                self._set_port(host, up=True)
                if stopped or stop.wait(up_s):
                    return

        thread = threading.Thread(target=run, name=f"flap {host}", daemon=True)
        entry = (thread, stop)
        self._flaps.append(entry)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(10)
            self._flaps.remove(entry)
