"""Bytes from a peer that never authenticated cannot stop a router or a worker.

The reproductions are the exact bytes that once ended the whole server: a websocket
upgrade with a frame in the same write, and requests whose bodies never come.
"""

from __future__ import annotations

import logging

import httpx
import pytest
import trio

from pdtrio.config import RouterConfig, SecurityConfig
from pdtrio.logs import LogBudget
from tests.cluster import Cluster, running_cluster

# The upgrade and a masked text frame ("hi") in one write: the frame comes before any
# answer to the upgrade.
UPGRADE_WITH_A_FRAME = (
    b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    b"\x81\x82\x00\x00\x00\x00hi"
)
SECURITY = SecurityConfig(api_keys=("a-key",), worker_secret="the-worker-secret")


def _at_path(request: bytes, path: bytes) -> bytes:
    return request.replace(b"GET / ", b"GET " + path + b" ", 1)


async def _answer_of(port: int, request: bytes, *, timeout_s: float = 10.0) -> bytes:
    """What the server writes back to ``request`` until it closes (or ``timeout_s``)."""
    answer = b""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        with trio.move_on_after(timeout_s):
            while chunk := await stream.receive_some(65536):
                answer += chunk
    return answer


def _status(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:80]
    return int(answer[9:12])


async def _still_serves(cluster: Cluster) -> None:
    async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as client:
        health = await client.get("/health")
        assert health.status_code == 200, health.text
        answer = await client.post(
            "/v1/completions",
            json={"model": "synthetic", "prompt": "hello", "max_tokens": 3},
            headers={"authorization": "Bearer a-key"},
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 3


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.mark.parametrize("path", [b"/", b"/v1/chat/completions", b"/pd/link", b"/health"])
async def test_an_upgrade_with_a_frame_in_the_same_write_leaves_the_router_serving(
    path: bytes,
) -> None:
    async with running_cluster(security=SECURITY) as cluster:
        for _ in range(20):  # the app's refusal and the frame race: both orders come up
            answer = await _answer_of(_port(cluster.url), _at_path(UPGRADE_WITH_A_FRAME, path))
            assert _status(answer) in (400, 403, 404)
            assert answer.count(b"HTTP/1.1 ") == 1  # one answer, never a second
        await _still_serves(cluster)


@pytest.mark.parametrize("path", [b"/", b"/pd/link", b"/pd/decode", b"/pd/prefill"])
async def test_an_upgrade_with_a_frame_in_the_same_write_leaves_each_worker_serving(
    path: bytes,
) -> None:
    async with running_cluster(security=SECURITY) as cluster:
        for worker in cluster.workers:
            for _ in range(10):
                answer = await _answer_of(worker.http_port, _at_path(UPGRADE_WITH_A_FRAME, path))
                assert _status(answer) in (400, 403)
                assert answer.count(b"HTTP/1.1 ") == 1
        await _still_serves(cluster)


async def test_a_declared_body_over_the_cap_is_refused_before_any_of_it_is_read() -> None:
    # a long body timeout: an answer within the test's wait cannot be the timeout's
    router = RouterConfig(max_request_bytes=16 * 1024 * 1024, body_read_timeout_s=120)
    async with running_cluster(router=router) as cluster:
        answer = await _answer_of(
            _port(cluster.url),
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"Content-Length: 20000000\r\n\r\n",
            timeout_s=30,
        )
        assert _status(answer) == 413
        assert b"request_too_large" in answer or b"too large" in answer
        for worker in cluster.workers:
            answer = await _answer_of(
                worker.http_port,
                b"POST /pd/prefill HTTP/1.1\r\nHost: x\r\nContent-Length: 200000000\r\n\r\n",
                timeout_s=30,
            )
            assert _status(answer) == 413


UNSENT_BODY = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
    b"Content-Length: 10000000\r\n\r\n"
)


async def _send_and_leave(port: int, request: bytes, *, read: bool) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        if read:
            with trio.move_on_after(5):
                await stream.receive_some(100)


async def test_requests_whose_bodies_never_come_leave_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    requests = [
        UNSENT_BODY,
        # refused for its media type, and a GET with a body (405)
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
        b"Content-Length: 5\r\n\r\nhello",
        b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
    ]
    caplog.set_level(logging.INFO)
    async with running_cluster(security=SECURITY) as cluster:
        port = _port(cluster.url)
        async with trio.open_nursery() as nursery:
            for index in range(300):
                nursery.start_soon(
                    lambda i=index: _send_and_leave(
                        port, requests[i % len(requests)], read=i % 2 == 0
                    )
                )
        await _still_serves(cluster)
    tracebacks = [record for record in caplog.records if record.exc_info]
    assert not tracebacks, [record.getMessage() for record in tracebacks[:3]]


def test_a_log_budget_logs_a_kind_once_an_interval_and_counts_the_rest() -> None:
    budget = LogBudget(10.0)
    assert budget.admit("refused", now=100.0) == 0
    assert budget.admit("refused", now=101.0) is None
    assert budget.admit("refused", now=109.9) is None
    assert budget.admit("other", now=109.9) == 0  # kinds are budgeted apart
    assert budget.admit("refused", now=110.0) == 2  # the two left out, said once
    assert budget.admit("refused", now=121.0) == 0


def test_a_log_budget_says_how_many_it_left_out(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("pdtrio.test_budget")
    budget = LogBudget(3600.0)
    with caplog.at_level(logging.WARNING, logger="pdtrio.test_budget"):
        assert budget.log(logger, logging.WARNING, "k", "refused %s", "a")
        assert not budget.log(logger, logging.WARNING, "k", "refused %s", "b")
    assert [record.getMessage() for record in caplog.records] == ["refused a"]


async def test_an_exception_that_escapes_a_connection_ends_that_connection_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from hypercorn.protocol.h11 import H11Protocol

    create_stream = H11Protocol._create_stream

    async def fail_on_boom(self: H11Protocol, request: object) -> None:
        if getattr(request, "target", b"") == b"/boom":
            raise RuntimeError("a failure nobody foresaw")
        await create_stream(self, request)  # type: ignore[arg-type]

    monkeypatch.setattr(H11Protocol, "_create_stream", fail_on_boom)
    async with running_cluster(security=SECURITY) as cluster:
        for _ in range(3):
            answer = await _answer_of(
                _port(cluster.url), b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n", timeout_s=10
            )
            assert answer == b""  # closed, unanswered
        await _still_serves(cluster)
    # within the log's budget: one line for the three at most (none if a test before this
    # one, in this process, spent it), and no traceback
    failures = [r for r in caplog.records if r.name == "pdtrio.http"]
    assert len(failures) <= 1
    assert all("a failure nobody foresaw" in r.getMessage() and not r.exc_info for r in failures)
