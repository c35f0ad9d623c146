"""pdtrio's processes as tests and benchmarks run them: start, wait until ready, measure, stop.

A :class:`Processes` group starts every process (``pdtrio worker``, ``hypercorn
-k trio pdtrio.app:app``, or any other command) and stops each one by its own
PID: a worker's stdin is closed (it was started with ``--exit-with-stdin``),
then the signal goes out (SIGINT: hypercorn's graceful stop, a worker's clean
exit), SIGKILL after a grace period; last, the descendants it was seen to have
(hypercorn's app process, a router's embedded workers) that outlived it are
given a moment and then killed.  A descendant is remembered with its start
time, so a recycled PID is never signalled; nothing is looked up by name.

No failure is hidden: whatever ``output`` is chosen, the last lines of each
process's stdout and stderr are kept (a thread drains each pipe, so a child
never blocks on a full one) and every :class:`ProcessError` carries them, so a
worker that dies at start says why.  A process that exits with a non-zero
status on its own, unless the caller reaped it (``wait``/``poll``: it saw the
status) or said it would (:meth:`Processes.expect_exit`), is reported when the
group closes, as is one that stops with anything but 0 or the harness's own
signal.

Synchronous and subprocess-based, Linux only (``/proc``): for the code that
drives pdtrio from outside, never for the servers themselves.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final, Literal, final

import attrs
import httpx

from pdtrio.worker.launch import READY_PREFIX, worker_command

LOOPBACK: Final = "127.0.0.1"

Output = Literal["discard", "lines", "capture"]
"""What happens to a process's output besides its tail (always kept, for errors):
nothing; stdout read line by line with :meth:`Processes.read_line`; or stdout and
stderr merged and kept whole in memory, for :meth:`Processes.output`."""

# fields of /proc/PID/stat counted after the command name: state is field 3
_STATE, _PPID, _UTIME, _STIME, _START_TIME = 0, 1, 11, 12, 19
_LEFTOVER_GRACE_S: Final = 5.0
_POLL_S: Final = 0.05
# what is kept of each pipe for errors, and how much of it an error shows
_TAIL_BYTES: Final = 64 * 1024
_TAIL_LINES: Final = 200
# stdout not yet asked for by read_line: beyond this the oldest lines are dropped, so a
# chatty child is never blocked and memory stays bounded
_UNREAD_BYTES: Final = 16 * 1024 * 1024
# how long an error waits for a dead process's last output (a descendant may hold the pipe)
_LAST_WORDS_S: Final = 2.0


class ProcessError(RuntimeError):
    """A process exited, or stayed silent, before it was ready; or a process of the
    group failed (reported at close).  The message ends with the process's output tail."""


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
class _Pipe:
    """One of a process's output pipes, read on a thread until it closes: the pipe never
    fills, whoever reads or does not.  Keeps its last bytes (for errors), and, as asked,
    everything (``keep_all``) or the lines :meth:`read_line` has yet to take (``lines``)."""

    def __init__(
        self, pipe: IO[bytes], name: str, *, keep_all: bool = False, lines: bool = False
    ) -> None:
        self._pipe = pipe
        self._changed = threading.Condition()
        self._tail = bytearray()
        self._all: bytearray | None = bytearray() if keep_all else None
        self._unread: bytearray | None = bytearray() if lines else None
        self.dropped = 0  # unread bytes let go of, past _UNREAD_BYTES
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # this thread alone owns the pipe, and closes it at EOF: closing it from another
        # thread while a read waits could hand the fd number to someone else's file
        fd = self._pipe.fileno()
        try:
            while chunk := os.read(fd, 65536):
                with self._changed:
                    self._tail += chunk
                    del self._tail[:-_TAIL_BYTES]
                    if self._all is not None:
                        self._all += chunk
                    if self._unread is not None:
                        self._unread += chunk
                        self._bound_unread()
                    self._changed.notify_all()
        except OSError:
            pass
        finally:
            with self._changed:
                self._closed = True
                self._changed.notify_all()
            self._pipe.close()

    def _bound_unread(self) -> None:
        assert self._unread is not None
        excess = len(self._unread) - _UNREAD_BYTES
        if excess > 0:
            cut = self._unread.find(b"\n", excess) + 1 or len(self._unread)
            del self._unread[:cut]
            self.dropped += cut

    def read_line(self, prefix: bytes, deadline: float) -> bytes | None:
        """The rest of the next line starting with ``prefix`` (others are skipped); None if
        the pipe closed first.  TimeoutError at ``deadline`` (``time.monotonic()``)."""
        assert self._unread is not None
        with self._changed:
            while True:
                while (newline := self._unread.find(b"\n")) >= 0:
                    line = bytes(self._unread[:newline])
                    del self._unread[: newline + 1]
                    if line.startswith(prefix):
                        return line[len(prefix) :]
                if self._closed:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self._changed.wait(left)

    def wait_closed(self, timeout: float) -> None:
        self._thread.join(timeout)

    def data(self) -> bytes:
        with self._changed:
            return bytes(self._all if self._all is not None else self._tail)

    def tail(self) -> str:
        """The last lines read, as text ("" when none)."""
        with self._changed:
            text = bytes(self._tail).decode(errors="replace")
        return "\n".join(_shorten(line, 1000) for line in text.splitlines()[-_TAIL_LINES:])


@final
@attrs.frozen
class _Outputs:
    """Where a started process's output goes: its stdout pipe, and stderr's when apart."""

    stdout: _Pipe
    stderr: _Pipe | None  # None: merged into stdout
    mode: Output

    def wait_closed(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for pipe in (self.stdout, self.stderr):
            if pipe is not None:
                pipe.wait_closed(max(0.0, deadline - time.monotonic()))

    def describe(self) -> str:
        """The output tail, for an error message."""
        parts = []
        if self.stderr is None:
            parts.append(("output (stdout and stderr)", self.stdout.tail()))
        else:
            parts += [("stderr", self.stderr.tail()), ("stdout", self.stdout.tail())]
        said = [f"\n--- its {name}, last lines ---\n{text}" for name, text in parts if text]
        return "".join(said) if said else "\n(it printed nothing)"


@final
class Processes:
    """Every process a test or a benchmark starts; leaving the ``with`` block stops them all.

    ``stop_grace_s``: how long a stopped process gets between the signal and SIGKILL.

    Closing raises :class:`ProcessError` for every process that failed unseen (see the
    module's docstring); leaving the ``with`` block on an exception adds that report to
    the exception's notes instead of hiding the exception behind it.
    """

    def __init__(self, *, stop_grace_s: float = 15.0) -> None:
        self.stop_grace_s = stop_grace_s
        self._started: list[subprocess.Popen[bytes]] = []
        # started PID -> {descendant PID: its start time}, for every descendant ever seen
        self._seen: dict[int, dict[int, int]] = {}
        self._outputs: dict[int, _Outputs] = {}
        self._expected: set[int] = set()  # PIDs whose own exit the caller expects

    def __enter__(self) -> Processes:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except ProcessError as failed:
            if exc is None:
                raise
            exc.add_note(str(failed))  # the exception in flight stays the one raised

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
            stdout=subprocess.PIPE,
            # read_line reads stdout alone; otherwise one pipe keeps the two in order
            stderr=subprocess.PIPE if output == "lines" else subprocess.STDOUT,
            start_new_session=new_session,
        )
        self._started.append(process)
        self._seen[process.pid] = {}
        if cpus is not None:
            pin([process.pid], cpus)
        assert process.stdout is not None
        stdout = _Pipe(
            process.stdout,
            f"stdout of {process.pid}",
            keep_all=output == "capture",
            lines=output == "lines",
        )
        stderr = (
            None if process.stderr is None else _Pipe(process.stderr, f"stderr of {process.pid}")
        )
        self._outputs[process.pid] = _Outputs(stdout, stderr, output)
        return process

    def expect_exit(self, process: subprocess.Popen[bytes]) -> None:
        """``process`` is meant to end on its own, whatever its status (a fault hook's
        ``os._exit``, a kill by the test): closing does not report it."""
        self._expected.add(process.pid)

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
                    f"healthy{self._output_tail(service.process, exited=True)}"
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

        For a process started with ``output="lines"``; what was printed past the
        line is kept for the next call.
        """
        outputs = self._outputs.get(process.pid)
        if outputs is None or outputs.mode != "lines":
            raise ValueError(f"process {process.pid} was not started with output='lines'")
        try:
            line = outputs.stdout.read_line(prefix, time.monotonic() + timeout)
        except TimeoutError:
            dropped = outputs.stdout.dropped
            raise ProcessError(
                f"process {process.pid} printed no {prefix!r} line within {timeout:g}s"
                + (f" ({dropped} unread bytes of its stdout let go)" if dropped else "")
                + self._output_tail(process)
            ) from None
        if line is None:
            raise ProcessError(
                f"process {process.pid} exited with status {_exit_status(process)} "
                f"before it printed {prefix!r}{self._output_tail(process, exited=True)}"
            )
        return line

    def output(self, process: subprocess.Popen[bytes], *, timeout: float = 10.0) -> bytes:
        """What a process started with ``output="capture"`` printed so far (all, once it exited)."""
        outputs = self._outputs.get(process.pid)
        if outputs is None or outputs.mode != "capture":
            raise ValueError(f"process {process.pid} was not started with output='capture'")
        if process.poll() is not None:
            outputs.wait_closed(timeout)
        return outputs.stdout.data()

    def _output_tail(self, process: subprocess.Popen[bytes], *, exited: bool = False) -> str:
        """``; command: ...`` and its output tail, for an error message; once it ``exited``,
        after a moment for its last words to arrive."""
        outputs = self._outputs.get(process.pid)
        if outputs is None:
            return ""
        if exited:
            outputs.wait_closed(_LAST_WORDS_S)
        return f"; command: {_command(process)}{outputs.describe()}"

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
        """Stop every process (the last started first) and what they left behind; close pipes.

        Then :class:`ProcessError` naming each process that failed unseen: one that exited
        with a non-zero status on its own, not reaped by the caller (``wait``, ``poll``) nor
        expected (:meth:`expect_exit`); or one that stopped, when told to here, with a
        status other than 0 or the signal it was sent.
        """
        started = list(reversed(self._started))
        failures: list[str] = []
        try:
            # the caller reaped these: it has seen their status (harness checks reap only
            # when they raise about it, and stop() returns it)
            unseen = [p for p in started if p.returncode is None and p.pid not in self._expected]
            ended = {p.pid for p in unseen if _has_exited(p)}
            self._stop(started, signal.SIGINT, self.stop_grace_s)
            for process in unseen:
                status = process.returncode
                if process.pid in ended:
                    if status != 0:
                        failures.append(f"{_shown(process)} exited with status {status} on its own")
                elif status not in (0, -signal.SIGINT, -signal.SIGKILL):
                    failures.append(
                        f"{_shown(process)} exited with status {status} as it was stopped (SIGINT)"
                    )
                else:
                    continue
                outputs = self._outputs.get(process.pid)
                if outputs is not None:
                    outputs.wait_closed(_LAST_WORDS_S)
                    failures[-1] += outputs.describe()
        finally:
            for process in started:
                self._release(process)
            self._started.clear()
            self._expected.clear()
        if failures:
            raise ProcessError(f"{len(failures)} process(es) failed:\n" + "\n\n".join(failures))

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
        outputs = self._outputs.pop(process.pid, None)
        if outputs is not None:
            # a moment for the reader threads to finish; they close their pipes themselves
            outputs.wait_closed(_LAST_WORDS_S)
        if process.stdin is not None:
            process.stdin.close()


def _has_exited(process: subprocess.Popen[bytes]) -> bool:
    """Whether ``process`` has exited, without reaping it (its status stays for ``wait``)."""
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True  # reaped already


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[: limit - 200]} ... {text[-150:]}"


def _command(process: subprocess.Popen[bytes]) -> str:
    """The command, as a shell would run it, shortened (a worker's carries its config)."""
    args = process.args
    return _shorten(shlex.join(args) if isinstance(args, list) else str(args), 600)


def _shown(process: subprocess.Popen[bytes]) -> str:
    return f"process {process.pid} ({_command(process)})"


def _exit_status(process: subprocess.Popen[bytes]) -> str:
    try:
        return str(process.wait(timeout=5))
    except subprocess.TimeoutExpired:
        return "(still running)"
