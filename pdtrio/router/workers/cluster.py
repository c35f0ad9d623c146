"""The embedded cluster: worker child processes the router starts and supervises."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any, final

import trio

from pdtrio.config import EmbeddedClusterConfig, Role, WorkerConfig, worker_config_to_dict
from pdtrio.security import WORKER_SECRET_ENV
from pdtrio.worker.launch import parse_ready_line, worker_command

log = logging.getLogger("pdtrio.router.cluster")


class WorkerStartFailed(Exception):
    """A worker process exited or stayed silent before it was ready."""


@final
class WorkerProcess:
    """Starts one worker, waits for its ready line, restarts it when it dies."""

    def __init__(
        self,
        name: str,
        role: Role,
        worker_config: WorkerConfig,
        *,
        ready_timeout_s: float,
        restart_backoff_s: float,
        on_ready: Callable[[Role, str, str], Awaitable[None]],
        on_lost: Callable[[str], None],
        secret: str = "",
    ) -> None:
        self.name = name
        self._secret = secret  # handed over in the environment, never on a command line
        self.role = role
        self.worker_config = worker_config
        self.ready_timeout_s = ready_timeout_s
        self.restart_backoff_s = restart_backoff_s
        self._on_ready = on_ready
        self._on_lost = on_lost
        self.pid: int | None = None
        self.restarts = 0
        self._supervision = trio.CancelScope()
        self._supervising = False
        self._stopped = trio.Event()
        self._started_at = 0.0  # when its current process started (trio.current_time)

    def command(self) -> list[str]:
        raw: dict[str, Any] = worker_config_to_dict(self.worker_config)
        raw["role"] = self.role
        raw["instance_id"] = self.name
        raw.pop("secret", None)  # (the command line is visible to every local user)
        return worker_command(raw)

    async def supervise(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the worker for the router's lifetime (or until :meth:`stop`); the first
        start must succeed."""
        first = True
        self._supervising = True
        try:
            with self._supervision:
                while True:
                    try:
                        await self._run_once(task_status if first else trio.TASK_STATUS_IGNORED)
                    except WorkerStartFailed:
                        if first:
                            raise
                        log.error("worker %s failed to restart", self.name)
                    first = False
                    self.restarts += 1
                    log.error("worker %s (%s) exited; restarting", self.name, self.role)
                    await trio.sleep(self.restart_backoff_s)
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        """Stop supervising it and stop its process (SIGTERM, then SIGKILL after a grace
        period), for a router that ends its process itself."""
        self._supervision.cancel()
        if self._supervising:
            await self._stopped.wait()

    async def _run_once(self, task_status: trio.TaskStatus[None]) -> None:
        processes: list[trio.Process] = []
        self._started_at = trio.current_time()
        try:
            async with trio.open_nursery() as nursery:
                process: trio.Process = await nursery.start(
                    _run_process, self.command(), self._secret
                )
                processes.append(process)
                self.pid = process.pid
                try:
                    await self._serve(process, nursery, task_status)
                finally:
                    self._on_lost(self.name)
                    nursery.cancel_scope.cancel()
        finally:
            # the pipes close only once nothing reads them any more
            with trio.CancelScope(shield=True):
                for process in processes:
                    for pipe in (process.stdout, process.stdin):
                        if pipe is not None:
                            await pipe.aclose()

    async def _serve(
        self, process: trio.Process, nursery: trio.Nursery, task_status: trio.TaskStatus[None]
    ) -> None:
        assert process.stdout is not None
        with trio.move_on_after(self.ready_timeout_s) as timer:
            ready = await _read_ready_line(process.stdout)
        if timer.cancelled_caught:
            raise WorkerStartFailed(
                f"worker {self.name} was not ready after {self.ready_timeout_s:.0f}s"
            )
        if ready is None:
            await process.wait()
            raise WorkerStartFailed(
                f"worker {self.name} ({self.role}) exited with status "
                f"{process.returncode} before it was ready"
            )
        url = str(ready["url"])
        log.info(
            "worker %s (%s) ready in %.1f s at %s, pid %d",
            self.name,
            self.role,
            trio.current_time() - self._started_at,
            url,
            process.pid,
        )
        await self._on_ready(self.role, url, self.name)
        task_status.started()
        # keep its stdout drained so it never blocks on a full pipe
        nursery.start_soon(_drain, process.stdout)
        await process.wait()
        log.error("worker %s exited with status %s", self.name, process.returncode)


async def _run_process(
    command: list[str],
    secret: str,
    *,
    task_status: trio.TaskStatus[trio.Process] = trio.TASK_STATUS_IGNORED,
) -> None:
    process = await trio.lowlevel.open_process(
        command,
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE,  # closes when the router dies, however it dies
        # PDTRIO_LOG_LEVEL and PDTRIO_LOG_FORMAT pass on: each worker logs to our stderr,
        # labelled with its instance id
        env={**os.environ, "PYTHONUNBUFFERED": "1", WORKER_SECRET_ENV: secret},
        start_new_session=True,  # a Ctrl-C on the router's terminal is the router's to handle
    )
    try:
        task_status.started(process)
        await process.wait()
    finally:
        with trio.CancelScope(shield=True):
            await _stop_process(process)


async def _stop_process(process: trio.Process) -> None:
    """SIGTERM, a grace period, then SIGKILL; always reaps it."""
    if process.returncode is None:
        try:
            process.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        with trio.move_on_after(5):
            await process.wait()
    if process.returncode is None:
        process.kill()
        await process.wait()


async def _read_ready_line(stdout: trio.abc.ReceiveStream) -> dict[str, Any] | None:
    buffer = b""
    while True:
        chunk = await stdout.receive_some(65536)
        if not chunk:
            return None
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            ready = parse_ready_line(line)
            if ready is not None:
                return ready
            if line.strip():
                sys.stdout.buffer.write(line + b"\n")


async def _drain(stdout: trio.abc.ReceiveStream) -> None:
    while await stdout.receive_some(65536):
        pass


def embedded_workers(config: EmbeddedClusterConfig) -> list[tuple[str, Role]]:
    workers: list[tuple[str, Role]] = []
    for role, count in (
        ("prefill", config.prefill),
        ("decode", config.decode),
        ("both", config.both),
    ):
        for index in range(count):
            workers.append((f"{role}-{index}", role))  # type: ignore[arg-type]
    return workers
