"""Shutdown and supervision as users see them: SIGTERM drains, start-up fails in one line,
the router does not outlive hypercorn's master."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdtrio.testing import (
    LOOPBACK,
    Processes,
    Service,
    alive,
    command_line,
    descendants,
    free_port,
)
from tests.cluster import eventually

STREAMS = 20


@pytest.fixture
def procs() -> Iterator[Processes]:
    with Processes(stop_grace_s=30) as group:
        yield group


def _config(
    path: Path, *, drain_s: float, decode_step_s: float = 0.05, kv_transport: str = "auto"
) -> Path:
    path.write_text(
        f"[router]\ndrain_s = {drain_s}\n"
        "[embedded]\nprefill = 1\ndecode = 1\n"
        f'[worker]\nkv_transport = "{kv_transport}"\n'
        '[worker.engine]\nkind = "synthetic"\nnum_kv_blocks = 4096\n'
        f"[worker.engine.synthetic]\ndecode_step_s = {decode_step_s}\n"
    )
    return path


def _start(
    procs: Processes, config: Path, *hypercorn_args: str, new_session: bool = False
) -> Service:
    port = free_port()
    command = [
        sys.executable, "-m", "hypercorn", "-k", "trio", *hypercorn_args,
        "-b", f"{LOOPBACK}:{port}", "pdtrio.app:app",
    ]  # fmt: skip
    process = procs.start(
        command, env={"PDTRIO_CONFIG": str(config)}, output="capture", new_session=new_session
    )
    service = Service(process, f"http://{LOOPBACK}:{port}")
    procs.wait_healthy(service)
    return service


def _stream(url: str, max_tokens: int, out: list[str], errors: list[BaseException]) -> None:
    body = {"model": "synthetic", "prompt": "hello", "max_tokens": max_tokens, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            out.extend(line for line in response.iter_lines() if line)
    except httpx.HTTPError as exc:
        errors.append(exc)


def _outcome(events: list[str]) -> str:
    """'complete', 'shutting_down', or what went wrong (never a bare EOF)."""
    if not events or events[-1] != "data: [DONE]":
        return f"no [DONE] after {len(events)} events"
    last = json.loads(events[-2][6:])
    if "error" in last:
        return str(last["error"]["code"])
    return "complete" if last["choices"][0]["finish_reason"] == "length" else "unfinished"


@pytest.mark.parametrize(
    ("workers", "max_tokens", "expected", "stop"),
    [
        ("1", 200, "shutting_down", signal.SIGTERM),  # 10s streams, 2s drain: an error event
        ("0", 200, "shutting_down", signal.SIGTERM),  # -w 0: the SIGTERM reaches the router
        # -w 0 and Ctrl-C: drained like SIGTERM (hypercorn's own KeyboardInterrupt, raised in
        # a connection's task, escaped it: exit 1 and a traceback)
        ("0", 200, "shutting_down", signal.SIGINT),
        ("1", 20, "complete", signal.SIGTERM),  # 1s streams finish within the drain
    ],
)
def test_sigterm_drains_streams(
    procs: Processes,
    tmp_path: Path,
    workers: str,
    max_tokens: int,
    expected: str,
    stop: signal.Signals,
) -> None:
    if stop == signal.SIGINT and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        pytest.skip("SIGINT is ignored here (started in the background), and so in the router")
    router = _start(
        procs, _config(tmp_path / "c.toml", drain_s=2), "-w", workers, "--graceful-timeout", "10"
    )
    tree = router.tree()
    results = [[] for _ in range(STREAMS)]  # type: list[list[str]]
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_stream, args=(router.url, max_tokens, out, errors))
        for out in results
    ]
    for thread in threads:
        thread.start()
    assert eventually(lambda: all(len(r) >= 2 for r in results), 20), "not every stream started"
    sent = time.monotonic()
    router.process.send_signal(stop)
    # a moment for the signal to start the drain: outside, the drain shows only as the 503
    # checked here
    time.sleep(0.5)
    # a new request during the drain: 503 while hypercorn still accepts (-w 0), else refused
    try:
        late = httpx.post(
            f"{router.url}/v1/completions",
            json={"model": "synthetic", "prompt": "late", "max_tokens": 3},
            timeout=20,
        )
        assert late.status_code == 503, late.text
        assert late.json()["error"]["code"] == "shutting_down"
        late_seen = "503"
    except httpx.TransportError as exc:
        late_seen = type(exc).__name__
    for thread in threads:
        thread.join(30)
    assert router.process.wait(timeout=30) == 0
    took = time.monotonic() - sent
    assert not errors, errors
    outcomes = [_outcome(r) for r in results]
    assert outcomes == [expected] * STREAMS, outcomes
    assert eventually(lambda: not any(alive(pid) for pid in tree), 10), [
        pid for pid in tree if alive(pid)
    ]
    print(f"-w {workers}: {expected} x{STREAMS}, late request: {late_seen}, exit {took:.2f}s")
    if workers == "0":
        assert late_seen == "503"


def test_a_second_sigterm_during_the_drain_does_not_end_it(
    procs: Processes, tmp_path: Path
) -> None:
    # -w 0 (and pdtrio serve's single process): once draining, another SIGTERM (a process
    # group's, a supervisor's retry) used to meet the default action and end the process
    # mid-drain, streams cut without an error event, exit -15
    router = _start(procs, _config(tmp_path / "c.toml", drain_s=3), "-w", "0")
    results: list[list[str]] = [[] for _ in range(4)]
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_stream, args=(router.url, 40, out, errors)) for out in results
    ]
    for thread in threads:
        thread.start()
    assert eventually(lambda: all(len(r) >= 2 for r in results), 20), "not every stream started"
    router.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    router.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    router.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(30)
    assert router.process.wait(timeout=30) == 0
    assert not errors, errors
    # 2 s streams within a 3 s drain: each one finished
    assert [_outcome(r) for r in results] == ["complete"] * 4
    assert b"received again: already draining" in procs.output(router.process)


def test_a_router_started_in_the_background_stops_its_workers_before_it_exits(
    procs: Processes, tmp_path: Path
) -> None:
    # a shell's `cmd &` starts it with SIGINT ignored, so hypercorn -w 0 cannot be asked to
    # stop: the router exits by itself once drained. Its workers used to learn of it from
    # their pipes closing and took it for a crash ("supervisor went away", a WARNING)
    port = free_port()
    hypercorn = [
        sys.executable, "-m", "hypercorn", "-k", "trio", "-w", "0",
        "-b", f"{LOOPBACK}:{port}", "pdtrio.app:app",
    ]  # fmt: skip
    config = _config(tmp_path / "c.toml", drain_s=2)
    process = procs.start(
        ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *hypercorn],
        env={"PDTRIO_CONFIG": str(config)},
        output="capture",
    )
    router = Service(process, f"http://{LOOPBACK}:{port}")
    procs.wait_healthy(router)
    tree = router.tree()
    router.process.send_signal(signal.SIGTERM)
    assert router.process.wait(timeout=30) == 0
    output = procs.output(router.process).decode()
    assert "drained after SIGTERM" in output
    assert [line for line in output.splitlines() if "WARNING" in line or "ERROR" in line] == []
    assert eventually(lambda: not any(alive(pid) for pid in tree), 10), [
        pid for pid in tree if alive(pid)
    ]


GROUP_SIGTERM_RUNS = 20
GROUP_STREAMS = 4


@pytest.mark.parametrize("workers", ["1", "0"])
def test_sigterm_to_the_process_group_drains_every_time(
    procs: Processes, tmp_path: Path, workers: str
) -> None:
    # systemd's default KillMode=control-group signals every process of the service at
    # once. hypercorn's master and its app process both got it, and the app forwarded its
    # copy to the master: a second SIGTERM inside the master's (non-reentrant) handler hung
    # it in 1 run of 3, streams open, until SIGKILL. The embedded workers run in sessions
    # of their own, so only the router's drain stops them.
    config = _config(tmp_path / "c.toml", drain_s=1, decode_step_s=0.02, kv_transport="tcp")
    runs = GROUP_SIGTERM_RUNS if workers == "1" else 3
    for run in range(1, runs + 1):
        _sigterm_the_group(procs, config, workers, f"run {run} of {runs}")
    print(f"-w {workers}: {runs} group SIGTERMs, every one drained and exited")


def _sigterm_the_group(procs: Processes, config: Path, workers: str, run: str) -> None:
    router = _start(procs, config, "-w", workers, "--graceful-timeout", "5", new_session=True)
    tree = router.tree()
    results: list[list[str]] = [[] for _ in range(GROUP_STREAMS)]
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_stream, args=(router.url, 1000, out, errors)) for out in results
    ]
    for thread in threads:
        thread.start()
    assert eventually(lambda: all(len(r) >= 2 for r in results), timeout=20), results
    os.killpg(router.pid, signal.SIGTERM)
    try:
        status = router.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{run}: hypercorn did not exit after the group's SIGTERM")
    for thread in threads:
        thread.join(30)
    assert status == 0, f"{run}: exit status {status}"
    assert not errors, f"{run}: {errors}"
    outcomes = [_outcome(r) for r in results]
    assert outcomes == ["shutting_down"] * GROUP_STREAMS, f"{run}: {outcomes}"
    assert eventually(lambda: not any(alive(pid) for pid in tree), timeout=10), (
        f"{run}: left running: {[pid for pid in tree if alive(pid)]}"
    )


def _frozen_client(url: str, max_tokens: int) -> socket.socket:
    """A streamed request whose client then never reads (a small window: it fills fast)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = json.dumps(
        {
            "model": "synthetic",
            "prompt": "frozen",
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def test_sigterm_stops_the_router_while_a_client_does_not_read(
    procs: Processes, tmp_path: Path
) -> None:
    # hypercorn's writes ignore cancellation: before, the process waited on the frozen
    # client for as long as its TCP stayed up (here: until the test closed it)
    router = _start(procs, _config(tmp_path / "c.toml", drain_s=1, decode_step_s=0.001), "-w", "1")
    tree = router.tree()
    with _frozen_client(router.url, 8_000) as frozen:
        _wait_until_writes_stall(router.url)
        sent = time.monotonic()
        router.process.send_signal(signal.SIGTERM)
        # drain (1 s), then the cut, then the stuck write's grace (cleanup_grace_s, 2 s)
        assert router.process.wait(timeout=30) == 0
        took = time.monotonic() - sent
        # what the client finds when it reads at last: part of the stream, then the hang-up
        frozen.settimeout(10)
        received = b""
        while chunk := frozen.recv(1 << 20):
            received += chunk
    assert received.startswith(b"HTTP/1.1 200")
    assert b'"finish_reason":"length"' not in received
    assert eventually(lambda: not any(alive(pid) for pid in tree), 10), [
        pid for pid in tree if alive(pid)
    ]
    output = procs.output(router.process).decode(errors="replace")
    assert "stopped reading; hung up on it" in output, output[-2000:]
    print(f"exit {took:.2f}s after SIGTERM with a frozen client")


def test_a_worker_stops_on_sigterm_while_its_router_is_frozen(
    procs: Processes, tmp_path: Path
) -> None:
    # the worker's writes to the frozen router's link wait on full buffers, and hypercorn
    # shields them from cancellation: before, the worker outlived its drain until the
    # router woke up
    config = tmp_path / "c.toml"
    config.write_text(
        "[embedded]\nprefill = 1\ndecode = 1\n[worker]\ndrain_s = 1\n"
        '[worker.engine]\nkind = "synthetic"\nnum_kv_blocks = 4096\n'
        "[worker.engine.synthetic]\ndecode_step_s = 0.001\n"
    )
    router = _start(procs, config, "-w", "0")
    decode = next(
        pid
        for pid in router.tree()
        if b'"role": "decode"' in Path(f"/proc/{pid}/cmdline").read_bytes()
    )
    results = [[] for _ in range(4)]  # type: list[list[str]]
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_stream, args=(router.url, 8000, out, errors)) for out in results
    ]
    for thread in threads:
        thread.start()
    # every stream under way (a late one would meet the stopped router, then a dead decode)
    assert eventually(lambda: all(len(r) >= 2 for r in results), 20), "not every stream started"
    router.process.send_signal(signal.SIGSTOP)
    try:
        time.sleep(3)  # decode's link writes fill the frozen router's buffers
        os.kill(decode, signal.SIGTERM)
        stopped = eventually(lambda: not alive(decode), 20)
    finally:
        router.process.send_signal(signal.SIGCONT)
    assert stopped, "the decode worker did not stop while its router was frozen"
    for thread in threads:
        thread.join(60)


def _wait_until_writes_stall(url: str) -> None:
    """Until the router's count of tokens sent stops growing: its write waits on the client."""
    last = -1.0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.5)  # the count read twice, this far apart: still, so the write waits
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        sent = next(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("pdtrio_tokens_delivered_total ")
        )
        if sent == last and sent > 0:
            return
        last = sent
    raise AssertionError("the router's writes never stalled")


@pytest.mark.parametrize("case", ["bad key", "missing file", "missing model"])
def test_startup_failure_is_one_line(procs: Processes, tmp_path: Path, case: str) -> None:
    config = tmp_path / "c.toml"
    if case == "bad key":
        config.write_text('[worker.engine]\nnum_kv_blocks = "lots"\n')
        expected = "worker.engine.num_kv_blocks"
    elif case == "missing file":
        config = tmp_path / "absent.toml"
        expected = "config file not found"
    else:
        config.write_text('[worker.engine]\nkind = "torch"\nmodel = "/nonexistent/model"\n')
        expected = "/nonexistent/model"
    command = [
        sys.executable, "-m", "hypercorn", "-k", "trio", "-w", "0",
        "-b", f"{LOOPBACK}:{free_port()}", "pdtrio.app:app",
    ]  # fmt: skip
    done = subprocess.run(
        command,
        env={**os.environ, "PDTRIO_CONFIG": str(config)},
        capture_output=True,
        timeout=120,
        check=False,
    )
    output = done.stderr.decode().strip().splitlines() + done.stdout.decode().strip().splitlines()
    lines = _without_progress(output)
    assert done.returncode != 0
    assert 1 <= len(lines) <= 3, output
    assert any(expected in line for line in lines), output


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--config-json", '{"engine": {"bogus": 1}}'], "bogus"),
        (["--engine-kind", "torch", "--model", "/nonexistent/model"], "/nonexistent/model"),
    ],
)
def test_worker_startup_failure_is_one_line(args: list[str], expected: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdtrio", "worker", *args],
        capture_output=True,
        timeout=120,
        check=False,
    )
    output = done.stderr.decode().strip().splitlines()
    lines = _without_progress(output)
    assert done.returncode != 0
    assert len(lines) == 1 and expected in lines[0], output


def _without_progress(lines: list[str]) -> list[str]:
    """The lines that say what went wrong: start-up's INFO progress lines aside."""
    return [line for line in lines if " INFO " not in line]


def test_router_exits_when_hypercorn_master_is_killed(procs: Processes, tmp_path: Path) -> None:
    router = _start(procs, _config(tmp_path / "c.toml", drain_s=2, decode_step_s=0.005), "-w", "1")
    below = descendants(router.pid)
    assert len(below) >= 3  # the app process, its two workers (and multiprocessing's tracker)
    os.kill(router.pid, signal.SIGKILL)
    router.process.wait(timeout=5)
    killed = time.monotonic()
    while any(alive(pid) for pid in below) and time.monotonic() - killed < 5:
        time.sleep(0.01)  # (finer than eventually's: the time it took is printed)
    took = time.monotonic() - killed
    assert not [pid for pid in below if alive(pid)], "orphans left behind"
    print(f"orphans gone {took:.2f}s after the master was killed")


def test_hypercorn_exits_when_its_app_process_is_killed(procs: Processes, tmp_path: Path) -> None:
    # hypercorn's master sets its shutdown event when its app process dies; the router
    # waited on that event in a thread, and the master's set() then waited for that dead
    # thread to wake, forever
    config = _config(tmp_path / "c.toml", drain_s=1, decode_step_s=0.005, kv_transport="tcp")
    router = _start(procs, config, "-w", "1")
    below = descendants(router.pid)
    app = [pid for pid in below if "spawn_main" in " ".join(command_line(pid))]
    assert len(app) == 1, [command_line(pid) for pid in below]
    os.kill(app[0], signal.SIGKILL)
    router.process.wait(timeout=30)
    assert eventually(lambda: not any(alive(pid) for pid in below), timeout=10), "orphans left"
