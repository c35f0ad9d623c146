"""hypercorn's trio worker, run in this process with the settings ``pdtrio serve`` chose.

What ``hypercorn -k trio -w 0 pdtrio.app:app`` does, without hypercorn's command
line: the app runs in the calling process (no master to die silently), and the
router's lifespan handles SIGTERM and SIGINT (drain, then hypercorn's own stop).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import ssl
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Final, final

import attrs
import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import load_application

log = logging.getLogger("pdtrio.serve")

APPLICATION_PATH: Final = "pdtrio.app:app"
# what the router's lifespan exits with when it cannot start (pdtrio.router.lifespan)
STARTUP_FAILED_STATUS: Final = 3
# hypercorn's graceful timeout beyond the drain: the router's drain runs first, then the
# two cleanup graces it may take, then a second for the connections to close
GRACEFUL_MARGIN_S: Final = 1.0


@final
@attrs.frozen(kw_only=True)
class ServerSettings:
    """How the router's HTTP server runs: hypercorn's part of ``pdtrio serve``'s flags."""

    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    certfile: str = ""
    keyfile: str = ""
    ca_certs: str = ""  # clients must show a certificate signed by this CA
    graceful_timeout_s: float = 15.0
    keep_alive_timeout_s: float = 5.0
    backlog: int = 1024

    @property
    def bind(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ServerSettings:
        return cls(**json.loads(text))


def graceful_timeout_for(drain_s: float, cleanup_grace_s: float) -> float:
    """Room for the router's whole drain, so that hypercorn never cuts it (nor warns)."""
    return drain_s + 2 * cleanup_grace_s + GRACEFUL_MARGIN_S


def hypercorn_config(settings: ServerSettings) -> Config:
    config = Config()
    config.application_path = APPLICATION_PATH
    config.worker_class = "trio"
    config.workers = 0  # the app runs in the process that runs hypercorn: no master
    config.bind = [settings.bind]
    config.backlog = settings.backlog
    config.graceful_timeout = settings.graceful_timeout_s
    config.keep_alive_timeout = settings.keep_alive_timeout_s
    if settings.certfile:
        config.certfile = settings.certfile
        config.keyfile = settings.keyfile or None
    if settings.ca_certs:
        config.ca_certs = settings.ca_certs
        config.verify_mode = ssl.CERT_REQUIRED
    return config


def open_sockets(settings: ServerSettings) -> Sockets:
    """Bind and listen now: a taken port fails before anything starts, and connections
    wait in the backlog while the router (or a restarted process) comes up."""
    sockets = hypercorn_config(settings).create_sockets()
    for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
        sock.listen(settings.backlog)
    return sockets


def sockets_from_fds(fds: list[int], *, secure: bool) -> Sockets:
    inherited = [socket.socket(fileno=fd) for fd in fds]
    return Sockets(
        secure_sockets=inherited if secure else [],
        insecure_sockets=[] if secure else inherited,
        quic_sockets=[],
    )


def serve_here(settings: ServerSettings, sockets: Sockets, *, stop_when_stdin_closes: bool) -> None:
    """Serve the router on ``sockets`` until it is stopped; raises what makes it fail.

    ``stop_when_stdin_closes``: a process of ``pdtrio serve --workers N``, whose stdin is
    a pipe from its supervisor: when that closes, the supervisor is gone, and so are we.
    """
    config = hypercorn_config(settings)
    app = load_application(config.application_path, config.wsgi_max_body_size)
    trigger: Callable[[], Awaitable[None]] | None = (
        _wait_for_stdin_to_close if stop_when_stdin_closes else None
    )
    # worker_serve runs in trio's main task: the router's lifespan ends a drain with a
    # KeyboardInterrupt, which trio raises there, and hypercorn takes it as its stop
    trio.run(partial(worker_serve, app, config, sockets=sockets, shutdown_trigger=trigger))


async def _wait_for_stdin_to_close() -> None:
    stdin = trio.lowlevel.FdStream(os.dup(0))
    async with stdin:
        while await stdin.receive_some(4096):
            pass
    log.warning("pdtrio serve's supervising process went away: stopping")


def describe_exit(status: int) -> str:
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"
