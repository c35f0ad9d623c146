"""The fault proxy as a process (``python -m pdtrio.faults``) in front of a service.

For the end-to-end tests and the benchmarks that put faults between the router and a
worker: the proxy listens on a port it picks, and so does its line-based control
(``stall on``, ``reset``: see ``pdtrio.faults.plan``), so no port is guessed free.
"""

from __future__ import annotations

import sys
from typing import Final, final

import attrs

from pdtrio.testing.processes import LOOPBACK, Processes

_STARTUP_S: Final = 30.0


@final
@attrs.frozen
class FaultProxyProcess:
    """A started fault proxy: where to reach its target through it, and its control."""

    pid: int
    url: str  # http://127.0.0.1:PORT, forwarded to the target
    control_port: int  # its control, on loopback


def start_fault_proxy(
    procs: Processes, target: str, *, timeout: float = _STARTUP_S
) -> FaultProxyProcess:
    """``python -m pdtrio.faults`` in front of ``target`` (``HOST:PORT``), once it listens.

    ``procs`` stops it with the rest; a proxy that fails to start raises the
    :class:`~pdtrio.testing.ProcessError` with its output's tail.
    """
    command = [
        sys.executable,
        "-m",
        "pdtrio.faults",
        "--listen",
        f"{LOOPBACK}:0",
        "--target",
        target,
        "--control-port",
        "0",
    ]
    process = procs.start(command, output="lines")
    # "listening on 127.0.0.1:PORT -> TARGET (FAULT)", then "control on 127.0.0.1:PORT"
    listening = procs.read_line(process, b"listening on ", timeout).decode()
    listen = listening.split(" ", 1)[0]
    control = procs.read_line(process, b"control on ", timeout).decode().strip()
    return FaultProxyProcess(
        pid=process.pid, url=f"http://{listen}", control_port=int(control.rsplit(":", 1)[1])
    )
