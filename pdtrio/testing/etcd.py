"""A real, single-member etcd for tests: started on free loopback ports, stopped by its own PID.

The server keeps its data dir and ports across `stop()` / `start()`, so a test can restart "the
same cluster" and see its data survive. etcd's stderr goes to a file in the data dir's parent, so
a server that will not start is reported with what it said.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO, final

import httpx
import trio

from pdtrio.testing.processes import LOOPBACK, free_port

__all__ = ["EtcdServer", "etcd_binary", "require_etcd", "running_etcd"]

_DEBIAN_ETCD = "/usr/bin/etcd"
_START_TIMEOUT_S = 15.0
_STOP_GRACE_S = 5.0


def etcd_binary() -> str | None:
    """The etcd server binary: Debian's etcd-server, else `etcd` on PATH; None if neither."""
    if os.access(_DEBIAN_ETCD, os.X_OK):
        return _DEBIAN_ETCD
    return shutil.which("etcd")


def require_etcd() -> str:
    """etcd's path, or skip the test (fail it where PDTRIO_REQUIRE_ETCD=1, as in CI)."""
    import pytest  # only tests call this; the package does not depend on pytest

    binary = etcd_binary()
    if binary is not None:
        return binary
    if os.environ.get("PDTRIO_REQUIRE_ETCD") == "1":
        pytest.fail(
            "etcd not installed, and PDTRIO_REQUIRE_ETCD=1: "
            "install it with `apt-get install -y etcd-server` (or put `etcd` on PATH)"
        )
    pytest.skip("etcd not installed (apt-get install -y etcd-server)")


@final
class EtcdServer:
    """One etcd process; its ports and data dir are fixed at construction."""

    def __init__(self, workdir: Path, *, binary: str | None = None) -> None:
        self._binary = binary or etcd_binary() or "etcd"
        self._workdir = workdir
        self.data_dir = workdir / "data"
        self.stderr_path = workdir / "etcd.stderr"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"http://{LOOPBACK}:{self.client_port}"
        self._process: trio.Process | None = None
        self._stderr: IO[bytes] | None = None

    def _command(self) -> list[str]:
        peer = f"http://{LOOPBACK}:{self.peer_port}"
        return [
            self._binary,
            "--name=pdtrio-test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.endpoint}",
            f"--advertise-client-urls={self.endpoint}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=pdtrio-test={peer}",
            "--logger=zap",  # etcd 3.4 honours --log-level only with zap
            "--log-level=error",
        ]

    def stderr_tail(self, limit: int = 4000) -> str:
        try:
            return self.stderr_path.read_bytes()[-limit:].decode(errors="replace")
        except OSError:
            return ""

    async def start(self) -> None:
        """Start etcd and wait until it serves a range (at most 15 s)."""
        if self._process is not None:
            raise RuntimeError("etcd is already running")
        self._stderr = self.stderr_path.open("ab")
        self._process = await trio.lowlevel.open_process(
            self._command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
        )
        try:
            await self._wait_ready()
        except BaseException:
            with trio.CancelScope(shield=True):
                await self.kill()
            raise

    async def _wait_ready(self) -> None:
        assert self._process is not None
        last = "no answer yet"
        async with httpx.AsyncClient(timeout=1.0, trust_env=False) as http:
            with trio.move_on_after(_START_TIMEOUT_S):
                while True:
                    if self._process.returncode is not None:
                        raise RuntimeError(
                            f"etcd exited with {self._process.returncode} while starting:\n"
                            + self.stderr_tail()
                        )
                    try:
                        # a range needs a leader and an applied store, unlike /health in 3.4
                        response = await http.post(
                            f"{self.endpoint}/v3/kv/range", json={"key": "AA=="}
                        )
                        if response.status_code == 200:
                            return
                        last = f"HTTP {response.status_code}: {response.text[:200]}"
                    except httpx.TransportError as exc:
                        last = f"{type(exc).__name__}: {exc}"
                    await trio.sleep(0.05)  # nothing to wait on: etcd says nothing when ready
        raise RuntimeError(
            f"etcd at {self.endpoint} not ready after {_START_TIMEOUT_S:.0f} s ({last}):\n"
            + self.stderr_tail()
        )

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; the data dir and ports stay for a later start()."""
        if self._process is None:
            return
        if self._process.returncode is None:
            self._process.send_signal(signal.SIGTERM)
            with trio.move_on_after(_STOP_GRACE_S):
                await self._process.wait()
        await self.kill()

    def freeze(self) -> None:
        """SIGSTOP: etcd keeps its connections open and answers nothing (a hung server)."""
        if self._process is not None:
            self._process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after :meth:`freeze`."""
        if self._process is not None:
            self._process.send_signal(signal.SIGCONT)

    async def kill(self) -> None:
        """SIGKILL (if still running) and reap."""
        process, self._process = self._process, None
        if process is not None:
            if process.returncode is None:
                process.kill()
            await process.wait()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


@asynccontextmanager
async def running_etcd() -> AsyncIterator[EtcdServer]:
    """A started etcd in a temporary dir; stopped, and the dir removed, on exit."""
    workdir = Path(tempfile.mkdtemp(prefix="pdtrio-etcd-"))
    server = EtcdServer(workdir)
    try:
        await server.start()
        yield server
    finally:
        with trio.CancelScope(shield=True):
            await server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
