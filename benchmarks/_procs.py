"""Start and stop the processes a benchmark measures: workers and hypercorn routers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def worker_process(config: dict[str, Any], *, cpus: set[int] | None = None) -> Iterator[tuple[str, int]]:
    """A ``pdtrio worker``; yields (base url, pid) once it printed its ready line."""
    command = [sys.executable, "-m", "pdtrio", "worker", "--config-json", json.dumps(config), "--exit-with-stdin"]
    process = subprocess.Popen(
        command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        if cpus is not None:
            os.sched_setaffinity(process.pid, cpus)
        assert process.stdout is not None
        deadline = time.monotonic() + 300
        while True:
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"worker exited with {process.wait()} before it was ready")
            if line.startswith(b"PDTRIO_READY "):
                ready = json.loads(line[len(b"PDTRIO_READY ") :])
                break
            if time.monotonic() > deadline:
                raise RuntimeError("worker not ready in time")
        yield f"http://127.0.0.1:{ready['http_port']}", process.pid
    finally:
        _stop(process)
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()


@contextmanager
def router_process(
    instances: list[tuple[str, str]], tmp: Path, *, router: dict[str, Any] | None = None, cpus: set[int] | None = None
) -> Iterator[tuple[str, int]]:
    """``hypercorn -k trio pdtrio.app:app`` over static instances; yields (url, pid of the app process)."""
    lines = []
    if router:
        lines.append("[router]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in router.items()]
    for role, url in instances:
        lines += ["[[instances]]", f'role = "{role}"', f'url = "{url}"']
    config = tmp / f"router-{free_port()}.toml"
    config.write_text("\n".join(lines) + "\n")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "hypercorn", "-k", "trio", "-b", f"127.0.0.1:{port}", "pdtrio.app:app"],
        cwd=ROOT, env={**os.environ, "PDTRIO_CONFIG": str(config)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError("router exited during start-up")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("router not healthy in time")
            time.sleep(0.1)
        app_pids = _descendants(process.pid) or [process.pid]
        if cpus is not None:
            for pid in [process.pid, *app_pids]:
                os.sched_setaffinity(pid, cpus)
        yield url, app_pids[-1]
    finally:
        _stop(process)


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    # hypercorn runs the app in a spawned child (multiprocessing spawn)
    return [int(p) for p in out.stdout.split()]


def process_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks
