"""``pdtrio serve --workers N``: N router processes on one listening socket, kept running.

The supervisor binds the socket, starts N processes (``pdtrio.serving.process``)
that inherit it, and restarts one that dies, so one crash costs only that
process's connections. It gives up, stopping every process and exiting non-zero,
when restarting cannot help: a process that fails to start (its configuration is
everyone's), or one that dies again and again within seconds of starting.

SIGTERM or SIGINT stops the service: every process drains (SIGTERM, resent each
second until it exits: one that has not started listening for it yet gets the
next), then the supervisor exits 0; a process still there after its drain and
hypercorn's graceful timeout is killed. A process's stdin is a pipe from the
supervisor: if the supervisor dies, even by SIGKILL, its processes stop.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Final, final

import attrs
import trio
from hypercorn.config import Sockets
from prometheus_client import multiprocess

from pdtrio.metrics import MULTIPROC_DIR_ENV
from pdtrio.serving.server import (
    STARTUP_FAILED_STATUS,
    ServerSettings,
    describe_exit,
)

log = logging.getLogger("pdtrio.serve")

# a process that dies this soon after it started counts towards giving up
QUICK_DEATH_S: Final = 10.0
# this many quick deaths in a row of one process: restarting does not help
MAX_QUICK_DEATHS: Final = 5
RESTART_DELAY_S: Final = 1.0
SIGTERM_RESEND_S: Final = 1.0
# beyond the drain and hypercorn's graceful timeout, for the router's own stop
STOP_MARGIN_S: Final = 5.0


@final
@attrs.define(eq=False)
class Supervisor:
    settings: ServerSettings
    environ: Mapping[str, str]
    # how long a stopping process may take before it is killed
    stop_timeout_s: float
    fds: list[int] = attrs.field(factory=list)
    secure: bool = False
    metrics_dir: str | None = None
    exit_status: int = 0
    stopping: trio.Event = attrs.field(factory=trio.Event)
    processes: dict[int, trio.Process] = attrs.field(factory=dict)

    async def run(self) -> int:
        async with trio.open_nursery() as signals:
            # signals are watched until the last process is gone (a second one kills)
            signals.start_soon(self._on_signals)
            async with trio.open_nursery() as processes:
                for index in range(self.settings.workers):
                    processes.start_soon(self._keep_running, index)
            signals.cancel_scope.cancel()
        return self.exit_status

    def stop(self, status: int) -> None:
        if not self.stopping.is_set():
            self.exit_status = status
            self.stopping.set()

    async def _on_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if self.stopping.is_set():
                    log.warning("%s received again: killing the router processes", name)
                    for process in self.processes.values():
                        process.kill()
                    continue
                log.info("%s received: stopping (every router process drains)", name)
                self.stop(0)

    async def _keep_running(self, index: int) -> None:
        quick_deaths = 0
        while not self.stopping.is_set():
            started_at = trio.current_time()
            status = await self._run_once(index)
            if self.stopping.is_set():
                if status == STARTUP_FAILED_STATUS:
                    log.info("router process %d failed to start too", index)
                elif status != 0:
                    log.error("router process %d %s while stopping", index, describe_exit(status))
                    self.exit_status = self.exit_status or 1
                return
            if status == STARTUP_FAILED_STATUS:
                log.error("router process %d failed to start: stopping the service", index)
                self.stop(status)
                return
            lived_s = trio.current_time() - started_at
            quick_deaths = quick_deaths + 1 if lived_s < QUICK_DEATH_S else 0
            if quick_deaths >= MAX_QUICK_DEATHS:
                log.error(
                    "router process %d %s, %d times in a row within %gs of starting: "
                    "stopping the service",
                    index,
                    describe_exit(status),
                    quick_deaths,
                    QUICK_DEATH_S,
                )
                self.stop(1)
                return
            log.error(
                "router process %d %s after %.1f s: restarting it",
                index,
                describe_exit(status),
                lived_s,
            )
            with trio.move_on_after(RESTART_DELAY_S):
                await self.stopping.wait()

    async def _run_once(self, index: int) -> int:
        process = await trio.lowlevel.open_process(
            router_process_command(self.settings, self.fds, secure=self.secure),
            stdin=subprocess.PIPE,
            pass_fds=self.fds,
            env=dict(self.environ),
            # a Ctrl-C in the terminal reaches the supervisor alone, which stops everyone
            start_new_session=True,
        )
        self.processes[index] = process
        log.info("router process %d started: pid %d", index, process.pid)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._stop_when_asked, process)
                status = await process.wait()
                nursery.cancel_scope.cancel()
        finally:
            del self.processes[index]
            if process.stdin is not None:
                await process.stdin.aclose()
            if self.metrics_dir is not None:
                # its live gauges leave the sums (prometheus_client's multiprocess mode)
                multiprocess.mark_process_dead(process.pid, self.metrics_dir)  # type: ignore[no-untyped-call]
        return status

    async def _stop_when_asked(self, process: trio.Process) -> None:
        await self.stopping.wait()
        with trio.move_on_after(self.stop_timeout_s):
            while True:
                process.send_signal(signal.SIGTERM)
                await trio.sleep(SIGTERM_RESEND_S)
        log.error(
            "router process pid %d did not stop within %gs: killing it",
            process.pid,
            self.stop_timeout_s,
        )
        process.kill()


def router_process_command(settings: ServerSettings, fds: list[int], *, secure: bool) -> list[str]:
    spec = json.dumps({"settings": settings.to_json(), "fds": fds, "secure": secure})
    return [sys.executable, "-m", "pdtrio.serving.process", spec]


def supervise(
    settings: ServerSettings, sockets: Sockets, environ: Mapping[str, str], stop_timeout_s: float
) -> int:
    """Run ``settings.workers`` router processes on ``sockets`` until stopped; the exit status."""
    listening = [*sockets.secure_sockets, *sockets.insecure_sockets]
    environ = dict(environ)
    metrics_dir, made_metrics_dir = _metrics_dir(environ)
    environ[MULTIPROC_DIR_ENV] = metrics_dir
    address = listening[0].getsockname()
    scheme = "https" if sockets.secure_sockets else "http"
    log.info(
        "serving on %s://%s with %d router processes (metrics summed in %s)",
        scheme,
        _address(address),
        settings.workers,
        metrics_dir,
    )
    supervisor = Supervisor(
        settings=settings,
        environ=environ,
        stop_timeout_s=stop_timeout_s,
        fds=[sock.fileno() for sock in listening],
        secure=bool(sockets.secure_sockets),
        metrics_dir=metrics_dir,
    )
    try:
        status = trio.run(supervisor.run)
    finally:
        for sock in listening:
            sock.close()
        if made_metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    log.info("stopped (status %d)", status)
    return status


def _metrics_dir(environ: dict[str, str]) -> tuple[str, bool]:
    """Where the processes' metrics meet: PROMETHEUS_MULTIPROC_DIR emptied of what an earlier
    run left there, or a directory of our own (removed at the end). Whether we made it."""
    given = environ.get(MULTIPROC_DIR_ENV)
    if not given:
        return tempfile.mkdtemp(prefix="pdtrio-metrics-"), True
    path = Path(given)
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        # a dead process's gauges would keep counting (docs/metrics.md)
        stale.unlink(missing_ok=True)
    return str(path), False


def _address(address: tuple[object, ...] | str) -> str:
    if isinstance(address, str):
        return address
    host, port = str(address[0]), address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
