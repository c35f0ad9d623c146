"""pdtrio's processes as tests and benchmarks run them: start, wait until ready, measure, stop.

A :class:`Processes` group starts every process (``pdtrio worker``, ``hypercorn
-k trio pdtrio.app:app``, or any other command) and stops each one by its own
PID: a worker's stdin is closed (it was started with ``--exit-with-stdin``),
then the signal goes out (SIGINT: hypercorn's graceful stop, a worker's clean
exit), SIGKILL after a grace period; last, the descendants it was seen to have
(hypercorn's app process, a router's embedded workers) that outlived it are
given a moment and then killed.  A descendant is remembered with its start
time, so a recycled PID is never signalled; nothing is looked up by name.

Synchronous and subprocess-based, Linux only (``/proc``): for the code that
drives pdtrio from outside, never for the servers themselves.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, final

import attrs
import httpx

from pdtrio.worker.launch import READY_PREFIX, worker_command

LOOPBACK: Final = "127.0.0.1"

Output = Literal["discard", "lines", "capture"]
"""What happens to a process's output: dropped; stdout piped for
:meth:`Processes.read_line` (stderr dropped); or stdout and stderr merged and
drained into memory, for :meth:`Processes.output`."""

# fields of /proc/PID/stat counted after the command name: state is field 3
_STATE, _PPID, _UTIME, _STIME, _START_TIME = 0, 1, 11, 12, 19
_LEFTOVER_GRACE_S: Final = 5.0
_POLL_S: Final = 0.05


class ProcessError(RuntimeError):
    """A process exited, or stayed silent, before it was ready."""


# --- processes, as /proc sees them ----------------------------------------------


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _start_time(pid: int) -> int | None:
    fields = _stat(pid)
    return None if fields is None else int(fields[_START_TIME])


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    fields = _stat(pid)
    return fields is not None and fields[_STATE] not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, parents before their children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and fields[_STATE] not in ("Z", "X"):
                children.setdefault(int(fields[_PPID]), []).append(int(entry))
    found: list[int] = []
    frontier = [pid]
    while frontier:
        frontier = [child for parent in frontier for child in sorted(children.get(parent, ()))]
        found.extend(frontier)
    return found


def command_line(pid: int) -> list[str]:
    """The arguments ``pid`` was started with ([] once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0")[:-1]]


def cpu_seconds(pids: Iterable[int]) -> float:
    """User plus system CPU seconds used so far by those of ``pids`` still there."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = _stat(pid)
        if fields is not None:
            total += int(fields[_UTIME]) + int(fields[_STIME])
    return total / ticks


def pin(pids: Iterable[int], cpus: Collection[int]) -> None:
    """Pin each of ``pids`` to ``cpus`` (their children inherit it); gone ones are skipped."""
    for pid in pids:
        try:
            os.sched_setaffinity(pid, cpus)
        except ProcessLookupError:
            pass


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# --- commands and configuration ----------------------------------------------------


def synthetic_worker_config(
    role: str,
    *,
    decode_step_s: float = 0.005,
    tokens_per_step: int = 1,
    num_kv_blocks: int = 4096,
    coalesce: bool = True,
) -> dict[str, Any]:
    """A worker on the torch-free synthetic engine: a synthetic token's text is ``" t<id>"``."""
    return {
        "role": role,
        "engine": {
            "kind": "synthetic",
            "num_kv_blocks": num_kv_blocks,
            "synthetic": {"decode_step_s": decode_step_s, "tokens_per_step": tokens_per_step},
        },
        "flush": {"coalesce": coalesce},
    }


def router_command(
    bind: str, *, worker_class: str | None = "trio", app: str = "pdtrio.app:app"
) -> list[str]:
    """hypercorn serving the router at ``bind`` (``worker_class`` None: hypercorn's default)."""
    command = [sys.executable, "-m", "hypercorn"]
    if worker_class is not None:
        command += ["-k", worker_class]
    return [*command, "-b", bind, app]


def router_config_toml(
    instances: Iterable[tuple[str, str]], *, router: Mapping[str, Any] | None = None
) -> str:
    """A router configuration over static instances, given as (role, base URL)."""
    lines: list[str] = []
    if router:
        lines.append("[router]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in router.items()]
    for role, url in instances:
        lines += ["[[instances]]", f"role = {json.dumps(role)}", f"url = {json.dumps(url)}"]
    return "\n".join(lines) + "\n"


def write_router_config(
    path: Path, instances: Iterable[tuple[str, str]], *, router: Mapping[str, Any] | None = None
) -> Path:
    path.write_text(router_config_toml(instances, router=router))
    return path


# --- the group ----------------------------------------------------------------------


@final
@attrs.frozen(eq=False)
class Service:
    """A started process that serves HTTP at ``url``."""

    process: subprocess.Popen[bytes]
    url: str
    ready: Mapping[str, Any] = attrs.field(factory=dict)
    """A worker's ready line; empty for a router."""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def address(self) -> str:
        """``host:port``."""
        return self.url.removeprefix("http://")

    def tree(self) -> list[int]:
        """Its PID and its descendants' (hypercorn runs the app in a child process)."""
        return [self.pid, *descendants(self.pid)]


@final
class _Drain:
    """Reads a process's output on a thread into memory, so that its pipe never fills."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        self._fd = process.stdout.fileno()
        self._data = bytearray()
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, name=f"output of {process.pid}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while chunk := os.read(self._fd, 65536):
            with self._lock:
                self._data += chunk

    def wait_closed(self, timeout: float) -> None:
        self._thread.join(timeout)

    def data(self) -> bytes:
        with self._lock:
            return bytes(self._data)


@final
class Processes:
    """Every process a test or a benchmark starts; leaving the ``with`` block stops them all.

    ``stop_grace_s``: how long a stopped process gets between the signal and SIGKILL.
    """

    def __init__(self, *, stop_grace_s: float = 15.0) -> None:
        self.stop_grace_s = stop_grace_s
        self._started: list[subprocess.Popen[bytes]] = []
        # started PID -> {descendant PID: its start time}, for every descendant ever seen
        self._seen: dict[int, dict[int, int]] = {}
        self._unread: dict[int, bytes] = {}
        self._drains: dict[int, _Drain] = {}

    def __enter__(self) -> Processes:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # --- starting ---------------------------------------------------------------------

    def start(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str | None] | None = None,
        stdin: bool = False,
        output: Output = "discard",
        cpus: Collection[int] | None = None,
        new_session: bool = False,
    ) -> subprocess.Popen[bytes]:
        """Start ``command``.

        ``env``: changes to this process's environment (None removes a variable).
        ``stdin``: give it a pipe that stays open until it is stopped.
        ``cpus``: pin it there from the start (its children inherit that).
        ``new_session``: in its own session and process group (its PID is the group's),
        as a supervisor such as systemd starts it.
        """
        environ = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for name, value in (env or {}).items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value
        process = subprocess.Popen(
            list(command),
            env=environ,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.DEVNULL if output == "discard" else subprocess.PIPE,
            stderr=subprocess.STDOUT if output == "capture" else subprocess.DEVNULL,
            start_new_session=new_session,
        )
        self._started.append(process)
        self._seen[process.pid] = {}
        if cpus is not None:
            pin([process.pid], cpus)
        if output == "capture":
            self._drains[process.pid] = _Drain(process)
        return process

    def start_worker(
        self, config: Mapping[str, Any], *, cpus: Collection[int] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``pdtrio worker``; :meth:`wait_ready` waits for it (start several, then wait)."""
        return self.start(worker_command(config), stdin=True, output="lines", cpus=cpus)

    def wait_ready(
        self, process: subprocess.Popen[bytes], *, timeout: float = 300.0, host: str = LOOPBACK
    ) -> Service:
        """Wait for a worker's ready line."""
        ready: dict[str, Any] = json.loads(self.read_line(process, READY_PREFIX, timeout))
        # the address it advertises, when it says (it listens on a wildcard, say)
        url = ready.get("url") or f"http://{host}:{ready['http_port']}"
        return Service(process, str(url), ready)

    def worker(
        self,
        config: Mapping[str, Any],
        *,
        timeout: float = 300.0,
        cpus: Collection[int] | None = None,
    ) -> Service:
        """A ``pdtrio worker`` that is ready."""
        process = self.start_worker(config, cpus=cpus)
        return self.wait_ready(process, timeout=timeout, host=config.get("host", LOOPBACK))

    def start_router(
        self,
        config: Path | None,
        *,
        worker_class: str | None = "trio",
        output: Output = "discard",
        cpus: Collection[int] | None = None,
    ) -> Service:
        """Start ``hypercorn -k trio pdtrio.app:app`` on a free loopback port.

        ``config`` becomes ``PDTRIO_CONFIG``; None runs it without one (the
        embedded default).  Not waited for: see :meth:`wait_healthy`.
        """
        port = free_port()
        process = self.start(
            router_command(f"{LOOPBACK}:{port}", worker_class=worker_class),
            env={"PDTRIO_CONFIG": None if config is None else str(config)},
            output=output,
            cpus=cpus,
        )
        return Service(process, f"http://{LOOPBACK}:{port}")

    def router(
        self,
        config: Path | None,
        *,
        timeout: float = 60.0,
        output: Output = "discard",
        cpus: Collection[int] | None = None,
    ) -> Service:
        """A router whose ``/health`` answers 200."""
        service = self.start_router(config, output=output, cpus=cpus)
        self.wait_healthy(service, timeout=timeout)
        if cpus is not None:
            pin(service.tree(), cpus)  # a child started before the first pin took hold
        return service

    def wait_healthy(self, service: Service, *, timeout: float = 60.0) -> None:
        """Wait until ``GET /health`` answers 200; :class:`ProcessError` if it exits first."""
        deadline = time.monotonic() + timeout
        while True:
            if service.process.poll() is not None:
                raise ProcessError(
                    f"{service.url} exited with status {service.process.returncode} before it was "
                    f"healthy{self._output_tail(service.process)}"
                )
            try:
                if httpx.get(f"{service.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ProcessError(
                    f"{service.url} was not healthy within {timeout:g}s"
                    f"{self._output_tail(service.process)}"
                )
            time.sleep(0.1)
        self._remember(service.process)

    # --- output -----------------------------------------------------------------------

    def read_line(self, process: subprocess.Popen[bytes], prefix: bytes, timeout: float) -> bytes:
        """The rest of the next stdout line starting with ``prefix``; lines before it are skipped.

        For a process started with ``output="lines"``; what was read past the
        line is kept for the next call.
        """
        stdout = process.stdout
        if stdout is None or process.pid in self._drains:
            raise ValueError(f"process {process.pid} was not started with output='lines'")
        buffer = self._unread.pop(process.pid, b"")
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            try:
                while True:
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        if line.startswith(prefix):
                            return line[len(prefix) :]
                    left = deadline - time.monotonic()
                    if left <= 0 or not selector.select(left):
                        raise ProcessError(
                            f"process {process.pid} printed no {prefix!r} line within {timeout:g}s"
                        )
                    chunk = os.read(stdout.fileno(), 65536)
                    if not chunk:
                        raise ProcessError(
                            f"process {process.pid} exited with status {_exit_status(process)} "
                            f"before it printed {prefix!r}"
                        )
                    buffer += chunk
            finally:
                if buffer:
                    self._unread[process.pid] = buffer

    def output(self, process: subprocess.Popen[bytes], *, timeout: float = 10.0) -> bytes:
        """What a process started with ``output="capture"`` printed so far (all, once it exited)."""
        drain = self._drains[process.pid]
        if process.poll() is not None:
            drain.wait_closed(timeout)
        return drain.data()

    def _output_tail(self, process: subprocess.Popen[bytes]) -> str:
        if process.pid not in self._drains:
            return ""
        tail = self.output(process, timeout=2.0)[-4000:].decode(errors="replace")
        return f"; its output:\n{tail}"

    # --- stopping ---------------------------------------------------------------------

    def stop(
        self,
        process: subprocess.Popen[bytes],
        *,
        grace_s: float | None = None,
        sig: signal.Signals = signal.SIGINT,
    ) -> int:
        """Stop one process of the group and what it left behind; returns its exit status."""
        self._stop([process], sig, self.stop_grace_s if grace_s is None else grace_s)
        return process.returncode

    def close(self) -> None:
        """Stop every process (the last started first) and what they left behind; close pipes."""
        started = list(reversed(self._started))
        try:
            self._stop(started, signal.SIGINT, self.stop_grace_s)
        finally:
            for process in started:
                self._release(process)
            self._started.clear()

    def _stop(
        self, processes: list[subprocess.Popen[bytes]], sig: signal.Signals, grace_s: float
    ) -> None:
        running = [p for p in processes if p.poll() is None]
        for process in running:
            self._remember(process)
            if process.stdin is not None:
                process.stdin.close()  # a worker's cue to exit
            try:
                process.send_signal(sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        for process in running:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._kill_leftovers(processes, min(grace_s, _LEFTOVER_GRACE_S))

    def _remember(self, process: subprocess.Popen[bytes]) -> None:
        seen = self._seen.setdefault(process.pid, {})
        for pid in descendants(process.pid):
            start = _start_time(pid)
            if start is not None:
                seen.setdefault(pid, start)

    def _kill_leftovers(self, processes: list[subprocess.Popen[bytes]], grace_s: float) -> None:
        """Descendants that outlived their started process: a moment to exit, then SIGKILL."""
        leftovers = [item for p in processes for item in self._seen.pop(p.pid, {}).items()]
        deadline = time.monotonic() + grace_s
        while True:
            living = [pid for pid, start in leftovers if _start_time(pid) == start and alive(pid)]
            if not living or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        for pid in living:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _release(self, process: subprocess.Popen[bytes]) -> None:
        drain = self._drains.pop(process.pid, None)
        if drain is not None:
            drain.wait_closed(5.0)
        self._unread.pop(process.pid, None)
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()


def _exit_status(process: subprocess.Popen[bytes]) -> str:
    try:
        return str(process.wait(timeout=5))
    except subprocess.TimeoutExpired:
        return "(still running)"
