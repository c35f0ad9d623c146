"""The token path: coalescing never changes what a client reads, finishes are never held."""

from __future__ import annotations

from functools import partial

import trio

from pdtrio.protocol.tokens.flush import FlushConfig
from tests.cluster import client, running_cluster, synthetic_worker, wait_until_idle


async def _texts(cluster, count: int) -> list[str]:
    texts = [""] * count
    async with client(cluster) as http:
        async with trio.open_nursery() as nursery:
            for index in range(count):

                async def one(index: int = index) -> None:
                    body = {
                        "model": "synthetic",
                        "prompt": f"stream number {index}",
                        "max_tokens": 40 + index,
                        "seed": index,
                        "stream": True,
                    }
                    response = await http.post("/v1/completions", json=body)
                    assert response.status_code == 200
                    texts[index] = response.text

                nursery.start_soon(one)
    return texts


def _content(sse: str) -> str:
    import json

    out = []
    for event in sse.split("\n\n"):
        if event.startswith("data: {"):
            out.append(json.loads(event[6:])["choices"][0]["text"])
    return "".join(out)


async def test_text_is_identical_with_coalescing_on_and_off() -> None:
    contents = {}
    for coalesce in (True, False):
        make = partial(
            synthetic_worker,
            flush=FlushConfig(coalesce=coalesce, window_s=0.02),
            decode_step_s=0.001,
            tokens_per_step=3,
        )
        async with running_cluster(make_worker=make) as cluster:
            raw = await _texts(cluster, 16)
            await wait_until_idle(cluster)
        contents[coalesce] = [_content(r) for r in raw]
    assert contents[True] == contents[False]
    assert all(len(text.split()) == 40 + i for i, text in enumerate(contents[True]))


async def test_a_finishing_request_is_flushed_at_once() -> None:
    # a window of an hour: only the finish rule can get the last tokens out
    make = partial(synthetic_worker, flush=FlushConfig(window_s=3600.0), decode_step_s=0.0005)
    async with running_cluster(make_worker=make) as cluster:
        with trio.fail_after(60):  # liveness bound, not a timing assertion
            raw = await _texts(cluster, 8)
        await wait_until_idle(cluster)
    assert all(r.endswith("data: [DONE]\n\n") for r in raw)
    assert [len(_content(r).split()) for r in raw] == [40 + i for i in range(8)]
