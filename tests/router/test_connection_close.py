"""A completed response ends the way HTTP says: closed for HTTP/1.0, counted as ok."""

from __future__ import annotations

import json

import trio

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
