"""A completed response ends the way HTTP says: closed for HTTP/1.0, counted as ok."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import trio

from pdtrio.protocol.link.wire import Usage
from pdtrio.protocol.openai.answers import AnswerDelta
from pdtrio.protocol.openai.sse import StreamShaper
from pdtrio.router.request.client_response import ClientResponse
from tests.cluster import client, running_cluster, wait_until_idle
from tests.metrics import by_labels


async def _http10_stream(url: str) -> bytes:
    """What `curl --http1.0 -N` does: POST, then read until the server closes."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(
        {"model": "synthetic", "prompt": "hello", "max_tokens": 5, "stream": True}
    ).encode()
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(
            f"POST /v1/completions HTTP/1.0\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while chunk := await stream.receive_some(65536):
            received += chunk
    return received


async def test_an_http10_stream_ends_with_the_connection_closed() -> None:
    async with running_cluster(decode_step_s=0.001) as cluster:
        with trio.fail_after(20):  # liveness bound: the server must close the connection
            received = await _http10_stream(cluster.url)
        assert received.startswith(b"HTTP/1.1 200") or received.startswith(b"HTTP/1.0 200")
        assert received.endswith(b"data: [DONE]\n\n")
        await wait_until_idle(cluster)


async def test_completed_requests_count_as_ok_not_disconnected() -> None:
    async with running_cluster(decode_step_s=0.001) as cluster:
        async with client(cluster) as http:
            for stream in (True, False):
                response = await http.post(
                    "/v1/completions",
                    json={"model": "synthetic", "prompt": "hi", "max_tokens": 3, "stream": stream},
                )
                assert response.status_code == 200
            with trio.fail_after(20):
                await _http10_stream(cluster.url)
            metrics = (await http.get("/metrics")).text
        outcomes = by_labels(metrics, "pdtrio_requests_total", "outcome")
        assert outcomes == {("ok",): 3}


async def test_a_client_closing_after_the_last_event_still_ends_its_request_ok(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # hypercorn closes a `Connection: close` connection inside the last body send and
    # cancels the request's task: before the final write was shielded, about one such
    # request in 40 here ended as "nothing to wait on" and counted as an error
    requests = 40
    async with running_cluster(decode_step_s=0.001) as cluster:
        async with client(cluster) as http:
            for _ in range(requests):
                body = {"model": "synthetic", "prompt": "hi", "max_tokens": 4, "stream": True}
                headers = {"connection": "close"}
                async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                    assert (await r.aread()).endswith(b"data: [DONE]\n\n")
            metrics = (await http.get("/metrics")).text
        await wait_until_idle(cluster)
    assert by_labels(metrics, "pdtrio_requests_total", "outcome") == {("ok",): requests}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_the_last_event_goes_out_whole_though_the_server_cancels_inside_its_send() -> None:
    sent: list[dict[str, Any]] = []
    with trio.CancelScope() as scope:

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and not message["more_body"]:
                scope.cancel()  # as hypercorn, closing the connection inside this send
                await trio.lowlevel.checkpoint()

        shaper = StreamShaper(
            kind="completion", request_id="r", model="m", created=0,
            include_usage=False, continuous_usage_stats=False,
        )  # fmt: skip
        response = ClientResponse(
            request_id="r", kind="completion", model="m", created=0, shaper=shaper,
            send=send, hang_up=lambda: True, draining=lambda: False,
        )  # fmt: skip
        await response.deliver(AnswerDelta(" t1", 1, "stop", Usage(1, 1), final=True))
        returned = True  # the send was not cut: the shell goes on to tell the machine
    assert returned and not scope.cancelled_caught
    assert sent[-1]["body"].endswith(b"data: [DONE]\n\n")
