"""/metrics counts each completion request once, by how it really ended."""

from __future__ import annotations

from functools import partial

import httpx
import trio
import trio.testing

from pdtrio.config import RouterConfig
from tests.cluster import (
    client,
    raw_post_then_hang_up,
    running_cluster,
    synthetic_worker,
    wait_until_idle,
)
from tests.metrics import by_labels


def _outcomes(metrics: str) -> dict[tuple[str, str], float]:
    return by_labels(metrics, "pdtrio_requests_total", "outcome", "status")


async def test_each_outcome_is_counted_exactly() -> None:
    # slow steps: the deadline almost always finds the request waiting for a token, not
    # mid-write (a write cut by the deadline ends in a hang-up, not an error event)
    make = partial(synthetic_worker, decode_step_s=0.05)
    # a deadline long enough for short requests, too short for the long one; egress
    # spacing off, so that no sampler ticks while the test waits for every task to rest
    router = RouterConfig(request_timeout_s=1.0, egress_max_delay_s=0.0)
    async with running_cluster(make_worker=make, router=router) as cluster:
        async with client(cluster) as http:
            # ok: streamed and not
            for stream in (True, False):
                response = await http.post(
                    "/v1/completions",
                    json={"model": "synthetic", "prompt": "hi", "max_tokens": 3, "stream": stream},
                )
                assert response.status_code == 200
            # rejected before start: validation (400), media type (415), unknown model (404)
            assert (
                await http.post("/v1/completions", json={"model": "synthetic"})
            ).status_code == 400
            assert (
                await http.post(
                    "/v1/completions", content=b"{}", headers={"content-type": "text/plain"}
                )
            ).status_code == 415
            assert (
                await http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
            ).status_code == 404
            # failed after the stream started: the deadline passes mid-stream
            text = ""
            body = {"model": "synthetic", "prompt": "long", "max_tokens": 5000, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                try:
                    async for chunk in response.aiter_text():
                        text += chunk
                except httpx.RemoteProtocolError:
                    text += "<hung up>"  # the deadline cut a write: nothing more may be sent
            assert text.endswith('"code": "timeout"}}\n\ndata: [DONE]\n\n') or text.endswith(
                "<hung up>"
            )
        # disconnected: the client hangs up mid-stream
        body = b'{"model": "synthetic", "prompt": "bye", "max_tokens": 5000, "stream": true}'
        await raw_post_then_hang_up(cluster.url, "/v1/completions", body, events=3)
        await wait_until_idle(cluster)
        # the whole cluster runs in this process: once every task rests, the hung-up
        # request's task has ended and been counted
        await trio.testing.wait_all_tasks_blocked(cushion=0.2)
        async with client(cluster) as http:
            metrics = (await http.get("/metrics")).text
    assert _outcomes(metrics) == {
        ("ok", ""): 2,
        ("rejected", "4xx"): 3,
        ("failed", "5xx"): 1,
        ("disconnected", ""): 1,
    }
    # by endpoint and model: the unknown model's refusal names none (clients choose it)
    assert by_labels(metrics, "pdtrio_requests_total", "endpoint", "model", "outcome") == {
        ("/v1/completions", "synthetic", "ok"): 2,
        ("/v1/completions", "", "rejected"): 3,
        ("/v1/completions", "synthetic", "failed"): 1,
        ("/v1/completions", "synthetic", "disconnected"): 1,
    }
