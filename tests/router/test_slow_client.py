"""A client that stops reading is cut off; the other streams on its decode link never wait for it."""

from __future__ import annotations

import json
import socket
from functools import partial

import pytest
import trio

from pdtrio.config import RouterConfig
from tests.cluster import client, running_cluster, synthetic_worker, wait_for_stats, wait_until_idle
from tests.metrics import value


async def open_stalled_stream(
    url: str, max_tokens: int, model: str = "synthetic"
) -> trio.SocketStream:
    """POST a streaming request, then never read: a client frozen mid-stream."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    # a small window; the kernel still buffers a few MB, so the stream must outgrow that
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((host, int(port)))
    stream = trio.SocketStream(sock)
    body = json.dumps(
        {"model": model, "prompt": "firehose", "max_tokens": max_tokens, "stream": True}
    ).encode()
    await stream.send_all(
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return stream


async def test_a_stalled_client_is_cut_off_without_stalling_its_link() -> None:
    make = partial(
        synthetic_worker,
        decode_step_s=0.001,
        tokens_per_step=512,
        max_model_len=3_100_000,
        num_kv_blocks=200_000,
    )
    router = RouterConfig(stream_buffer_tokens=5000, max_tokens_limit=5_000_000)
    async with running_cluster(make_worker=make, router=router) as cluster:
        stalled = await open_stalled_stream(cluster.url, max_tokens=3_000_000)
        async with stalled:
            # while the stalled stream backs up, another stream on the same link completes
            async with client(cluster) as http:
                with trio.fail_after(60):  # liveness bound, not a timing assertion
                    response = await http.post(
                        "/v1/completions",
                        json={
                            "model": "synthetic",
                            "prompt": "meanwhile",
                            "max_tokens": 3000,
                            "stream": True,
                        },
                    )
            assert response.status_code == 200
            assert response.text.endswith("data: [DONE]\n\n")
            assert '"finish_reason":"length"' in response.text
            # the stalled request is aborted upstream while its client still has not read a byte
            await wait_until_idle(cluster, deadline_s=60)
            assert cluster.workers[1].stats()["decode_requests"] == 0
            async with client(cluster) as http:
                metrics = (await http.get("/metrics")).text
            assert value(metrics, "pdtrio_slow_clients_cut_off_total") == 1
            # its task may still wait on the frozen socket, but it holds nothing upstream
            # what the frozen client finds once it reads: no normal end; an error if any end at all
            received = b""
            with trio.move_on_after(10):
                while chunk := await stalled.receive_some(1 << 20):
                    received += chunk
        text = received.decode(errors="replace")
        assert text.startswith("HTTP/1.1 200")
        assert '"finish_reason":"length"' not in text
        if "data: [DONE]" in text:
            assert '"error"' in text and "too far behind" in text


@pytest.mark.parametrize(
    "router",
    [
        # the request's deadline (or a drain's cut) gives the stuck write cleanup_grace_s
        pytest.param(RouterConfig(request_timeout_s=1.0, cleanup_grace_s=0.5), id="deadline"),
        # long before the deadline: a write that waited client_write_timeout_s ends it
        pytest.param(
            RouterConfig(client_write_timeout_s=1.0, request_timeout_s=600.0), id="write_timeout"
        ),
    ],
)
async def test_a_client_that_stops_reading_is_hung_up_on(router: RouterConfig) -> None:
    # hypercorn's write waits on the frozen socket and ignores cancellation: the router
    # shuts the connection down, and the request ends
    async with running_cluster(router=router, decode_step_s=0.001) as cluster:
        stalled = await open_stalled_stream(cluster.url, max_tokens=8000)
        async with stalled:
            # liveness bounds: before, it waited for the client
            router = cluster.router_app.router
            assert router is not None
            await wait_for_stats(lambda: len(router.requests) > 0, 20)
            await wait_for_stats(lambda: not len(router.requests), 20)
            await wait_until_idle(cluster, deadline_s=20)  # nothing held on the workers
            async with client(cluster) as http:
                metrics = (await http.get("/metrics")).text
            ended = value(metrics, "pdtrio_requests_total", outcome="failed", status="5xx")
            assert ended == 1, metrics
            # the client, reading at last: part of the stream, then the connection's end
            received = b""
            with trio.fail_after(10):
                while chunk := await stalled.receive_some(1 << 20):
                    received += chunk
        assert received.startswith(b"HTTP/1.1 200")
        assert b'"finish_reason":"length"' not in received


async def test_a_client_that_reads_slowly_but_steadily_is_not_hung_up_on() -> None:
    # each write waits on the client for less than the timeout: the stream completes
    router = RouterConfig(client_write_timeout_s=1.0)
    async with running_cluster(router=router, decode_step_s=0.001) as cluster:
        stalled = await open_stalled_stream(cluster.url, max_tokens=3000)
        received = b""
        async with stalled:
            with trio.fail_after(60):
                while chunk := await stalled.receive_some(2048):
                    received += chunk
                    if received.endswith(b"data: [DONE]\n\n"):
                        break
                    await trio.sleep(0.02)  # about 100 KB/s: behind decode, never 1 s stuck
        assert b'"finish_reason":"length"' in received
        async with client(cluster) as http:
            metrics = (await http.get("/metrics")).text
        assert value(metrics, "pdtrio_requests_total", outcome="ok") == 1, metrics
