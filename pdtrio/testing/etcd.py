"""A real, single-member etcd for tests: started on free loopback ports, stopped by its own PID.

The server keeps its data dir and ports across `stop()` / `start()`, so a test can restart "the
same cluster" and see its data survive. etcd's stderr goes to a file in the data dir's parent, so
a server that will not start is reported with what it said.

A server can serve client TLS (``tls=make_etcd_tls(dir)``: https, and a client certificate
required) and have etcd's authentication turned on (:meth:`EtcdServer.enable_auth`).
"""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO, final

import attrs
import httpx
import trio

from pdtrio.security import system_tls_context
from pdtrio.testing.processes import LOOPBACK, free_port

__all__ = [
    "EtcdServer",
    "EtcdTls",
    "etcd_binary",
    "make_etcd_tls",
    "require_etcd",
    "running_etcd",
]

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
@attrs.frozen
class EtcdTls:
    """A CA, etcd's server certificate (for the loopback address), and a client
    certificate the CA signed (for etcd's ``--client-cert-auth``): PEM files."""

    ca_file: str
    server_cert_file: str
    server_key_file: str
    client_cert_file: str
    client_key_file: str

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_file)
        context.load_cert_chain(self.client_cert_file, self.client_key_file)
        return context


def make_etcd_tls(directory: Path) -> EtcdTls:
    """Certificates from a fresh throwaway CA (``trustme``, a test dependency)."""
    import trustme

    ca = trustme.CA()
    server = ca.issue_cert(LOOPBACK, "localhost")
    client = ca.issue_cert("pdtrio-client")
    paths = {name: directory / f"{name}.pem" for name in ("ca", "server", "skey", "client", "ckey")}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    server.cert_chain_pems[0].write_to_path(str(paths["server"]))
    server.private_key_pem.write_to_path(str(paths["skey"]))
    client.cert_chain_pems[0].write_to_path(str(paths["client"]))
    client.private_key_pem.write_to_path(str(paths["ckey"]))
    return EtcdTls(
        ca_file=str(paths["ca"]),
        server_cert_file=str(paths["server"]),
        server_key_file=str(paths["skey"]),
        client_cert_file=str(paths["client"]),
        client_key_file=str(paths["ckey"]),
    )


@final
class EtcdServer:
    """One etcd process; its ports and data dir are fixed at construction."""

    def __init__(
        self, workdir: Path, *, binary: str | None = None, tls: EtcdTls | None = None
    ) -> None:
        self._binary = binary or etcd_binary() or "etcd"
        self._workdir = workdir
        self.data_dir = workdir / "data"
        self.stderr_path = workdir / "etcd.stderr"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.tls = tls
        scheme = "https" if tls is not None else "http"
        self.endpoint = f"{scheme}://{LOOPBACK}:{self.client_port}"
        # etcd's root user, once enable_auth turned authentication on
        self.auth: tuple[str, str] | None = None
        self._process: trio.Process | None = None
        self._stderr: IO[bytes] | None = None

    def _client(self, timeout: float) -> httpx.AsyncClient:
        verify = self.tls.client_context() if self.tls else system_tls_context()
        return httpx.AsyncClient(timeout=timeout, trust_env=False, verify=verify)

    async def enable_auth(self, password: str) -> None:
        """Create the root user with ``password`` and turn authentication on: from now on
        every call needs a token (and :meth:`start` waits with one)."""
        async with self._client(5.0) as http:
            for path, body in (
                ("/v3/auth/user/add", {"name": "root", "password": password}),
                ("/v3/auth/role/add", {"name": "root"}),
                ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                ("/v3/auth/enable", {}),
            ):
                response = await http.post(self.endpoint + path, json=body)
                if response.status_code != 200:
                    raise RuntimeError(f"etcd {path}: HTTP {response.status_code} {response.text}")
        self.auth = ("root", password)

    async def _token_headers(self, http: httpx.AsyncClient) -> dict[str, str]:
        if self.auth is None:
            return {}
        name, password = self.auth
        response = await http.post(
            f"{self.endpoint}/v3/auth/authenticate", json={"name": name, "password": password}
        )
        if response.status_code != 200:
            return {}  # (not ready yet: the range says so)
        return {"authorization": response.json()["token"]}

    def _command(self) -> list[str]:
        peer = f"http://{LOOPBACK}:{self.peer_port}"
        tls = (
            [
                f"--cert-file={self.tls.server_cert_file}",
                f"--key-file={self.tls.server_key_file}",
                f"--trusted-ca-file={self.tls.ca_file}",
                "--client-cert-auth",
            ]
            if self.tls is not None
            else []
        )
        return [
            self._binary,
            *tls,
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
        async with self._client(1.0) as http:
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
                            f"{self.endpoint}/v3/kv/range",
                            json={"key": "AA=="},
                            headers=await self._token_headers(http),
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
async def running_etcd(*, tls: bool = False) -> AsyncIterator[EtcdServer]:
    """A started etcd in a temporary dir (serving client TLS, with ``tls``); stopped, and
    the dir removed, on exit."""
    workdir = Path(tempfile.mkdtemp(prefix="pdtrio-etcd-"))
    server = EtcdServer(workdir, tls=make_etcd_tls(workdir) if tls else None)
    try:
        await server.start()
        yield server
    finally:
        with trio.CancelScope(shield=True):
            await server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
