"""A NIXL worker on loopback listens on loopback only: UCX's TCP transport listened on
every network device, outside the worker's secret, whatever ``host`` said."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterator

import pytest

from pdtrio.testing import LOOPBACK, Processes, synthetic_worker_config

pytest.importorskip("nixl")

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


@pytest.fixture
def procs() -> Iterator[Processes]:
    with Processes(stop_grace_s=10) as group:
        yield group


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target.removeprefix("socket:[").removesuffix("]"))
    return inodes


def _address(field: str) -> tuple[str, int]:
    hex_address, hex_port = field.split(":")
    raw = bytes.fromhex(hex_address)
    # the kernel prints each 32-bit word in host (little-endian) order
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw)), int(hex_port, 16)


def listening_sockets(pid: int) -> list[tuple[str, str, int]]:
    """(protocol, address, port) of each TCP socket ``pid`` listens on and each UDP one it has."""
    inodes = _socket_inodes(pid)
    found = []
    for protocol in ("tcp", "tcp6", "udp", "udp6"):
        with open(f"/proc/{pid}/net/{protocol}") as table:
            for line in table.read().splitlines()[1:]:
                fields = line.split()
                listening = protocol.startswith("udp") or fields[3] == _LISTEN
                if fields[9] in inodes and listening:
                    found.append((protocol, *_address(fields[1])))
    return found


def test_a_nixl_worker_on_loopback_listens_on_loopback_only(procs: Processes) -> None:
    config = {**synthetic_worker_config("prefill"), "kv_transport": "nixl", "host": LOOPBACK}
    worker = procs.wait_ready(procs.start_worker(config), timeout=120)
    assert worker.ready["kv_transport"] == "nixl"
    sockets = listening_sockets(worker.pid)
    ports = {worker.ready["http_port"], worker.ready["transfer_port"]}
    assert ports <= {port for _, _, port in sockets}, sockets
    assert len(sockets) > len(ports), f"UCX's own listener was not found: {sockets}"
    assert [s for s in sockets if s[1] != LOOPBACK] == [], sockets
