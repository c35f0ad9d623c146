"""Hung workers: a SIGSTOPped worker process is dropped from rotation, and comes back after SIGCONT.

A stopped process keeps its TCP connections (the kernel even accepts new
ones), so only the link's heartbeats tell it from an idle one.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from pdtrio.testing import Processes, Service, synthetic_worker_config, write_router_config
from tests.cluster import eventually

# generous: these bound liveness (the link timeout is 2 s), they do not measure it
LIVENESS_S = 10.0
LINK_TIMEOUT_S = 2.0
RECONNECT_WAIT_S = 5.0  # the router's decode_reconnect_wait_s (its default)
# generous for a loaded machine, yet below a second reconnect wait: what a request placed
# on a stopped decode used to wait, on top of its streams' own
SLACK_S = 3.0


@pytest.fixture
def procs() -> Iterator[Processes]:
    with Processes(stop_grace_s=30) as group:
        yield group


@pytest.fixture
def cluster(procs: Processes, tmp_path: Path) -> tuple[Service, Service, Service]:
    started = [
        procs.start_worker(synthetic_worker_config(role, decode_step_s=0.02))
        for role in ("prefill", "decode")
    ]
    prefill, decode = (procs.wait_ready(process) for process in started)
    config = write_router_config(
        tmp_path / "router.toml",
        [("prefill", prefill.url), ("decode", decode.url)],
        router={
            "link_timeout_s": LINK_TIMEOUT_S,
            "link_heartbeat_s": 0.5,
            "decode_reconnect_wait_s": RECONNECT_WAIT_S,
        },
    )
    return prefill, decode, procs.router(config, output="capture")


def _eventually(condition: Callable[[], bool], timeout: float = LIVENESS_S) -> bool:
    return eventually(condition, timeout)


def _health(router: Service) -> httpx.Response:
    return httpx.get(f"{router.url}/health", timeout=LIVENESS_S)


def _body(max_tokens: int) -> dict[str, object]:
    return {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": True,
    }


def _completes(router: Service) -> bool:
    with httpx.stream(
        "POST", f"{router.url}/v1/chat/completions", json=_body(4), timeout=LIVENESS_S
    ) as response:
        events = [line for line in response.iter_lines() if line]
    return (
        response.status_code == 200
        and events[-1] == "data: [DONE]"
        and not any("error" in json.loads(e[6:]) for e in events[:-1])
    )


def test_a_stopped_decode_worker_fails_its_streams_and_comes_back(
    cluster: tuple[Service, Service, Service],
) -> None:
    _, decode, router = cluster
    events: list[str] = []
    with httpx.stream(
        "POST",
        f"{router.url}/v1/chat/completions",
        json=_body(4000),  # 80 s of tokens: it is still running when the worker stops
        timeout=LIVENESS_S,  # the read timeout: a frozen stream fails the test
    ) as response:
        assert response.status_code == 200
        lines = (line for line in response.iter_lines() if line)
        events += [next(lines) for _ in range(5)]  # the stream is flowing
        os.kill(decode.pid, signal.SIGSTOP)
        try:
            stopped_at = time.monotonic()
            detected_at = None
            for line in lines:
                events.append(line)
                if detected_at is None and "error" in line:
                    detected_at = time.monotonic()
            assert detected_at is not None, events[-3:]
            print(f"\ndecode SIGSTOP detected after {detected_at - stopped_at:.2f}s")
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2][6:])["error"]
            assert "sent nothing" in error["message"]
            # out of rotation while stopped
            assert _health(router).status_code == 503
            assert _health(router).json()["decode_instances"] == 0
        finally:
            os.kill(decode.pid, signal.SIGCONT)
    assert _eventually(lambda: _health(router).status_code == 200)
    assert _completes(router)


def test_requests_sent_to_a_stopped_decode_end_with_the_streams_it_had(
    cluster: tuple[Service, Service, Service],
) -> None:
    """Requests placed on the decode after it stopped, before its link is found silent,
    do not wait for it to wake: with no other decode to move to, they end when the
    stream it was running does, within the link timeout and one reconnect wait."""
    _, decode, router = cluster
    # name -> (when it ended, its events)
    ended: dict[str, tuple[float, list[str]]] = {}
    flowing = threading.Event()

    def stream(name: str, max_tokens: int) -> None:
        events: list[str] = []
        with httpx.stream(
            "POST",
            f"{router.url}/v1/chat/completions",
            json=_body(max_tokens),
            # past every wait a request could make: the test measures, httpx does not cut
            timeout=LINK_TIMEOUT_S + 2 * RECONNECT_WAIT_S + LIVENESS_S,
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line:
                    events.append(line)
                if len(events) == 5:
                    flowing.set()
        ended[name] = (time.monotonic(), events)

    def start(name: str, max_tokens: int) -> threading.Thread:
        thread = threading.Thread(target=stream, args=(name, max_tokens), daemon=True)
        thread.start()
        return thread

    threads = [start("in flight", 4000)]  # 80 s of tokens: still running at the stop
    assert flowing.wait(LIVENESS_S)
    os.kill(decode.pid, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        # placed on it while its link still looks alive (detection takes the link timeout)
        for delay in (0.05, 0.15, 0.3, LINK_TIMEOUT_S / 2):
            time.sleep(max(0.0, stopped_at + delay - time.monotonic()))
            threads.append(start(f"sent {delay:g}s after the stop", 20))
        for thread in threads:
            thread.join(LINK_TIMEOUT_S + 2 * RECONNECT_WAIT_S + LIVENESS_S)
    finally:
        os.kill(decode.pid, signal.SIGCONT)
    assert len(ended) == len(threads), sorted(ended)
    in_flight_end = ended["in flight"][0]
    print()
    for name, (at, events) in ended.items():
        print(f"{name}: ended {at - stopped_at:.2f}s after the stop")
        # well-formed: an error event, then [DONE]
        assert events[-1] == "data: [DONE]", (name, events[-3:])
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == "decode_failed" and "sent nothing" in error["message"], name
        assert at - stopped_at < LINK_TIMEOUT_S + RECONNECT_WAIT_S + SLACK_S, name
        assert at - in_flight_end < SLACK_S, name  # with the stream in flight, not after
    assert _eventually(lambda: _health(router).status_code == 200)
    assert _completes(router)


def test_a_stopped_prefill_worker_refuses_new_requests_and_comes_back(
    cluster: tuple[Service, Service, Service],
) -> None:
    prefill, _, router = cluster
    assert _completes(router)
    os.kill(prefill.pid, signal.SIGSTOP)
    try:
        # sent before or after the link is declared dead: an error, not a wait
        response = httpx.post(
            f"{router.url}/v1/chat/completions",
            json={**_body(4), "stream": False},
            timeout=LIVENESS_S,
        )
        assert response.status_code == 503, response.text
        assert _eventually(lambda: _health(router).json()["prefill_instances"] == 0)
        assert _health(router).status_code == 503
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
    assert _eventually(lambda: _health(router).status_code == 200)
    assert _completes(router)
