"""A response that ends early never says it finished: no ``"length"`` or ``"stop"``.

An answer cut by the request's deadline, or given up by its engine (vLLM's
``finish_reason: "abort"``), ends as docs/api.md's table says: streamed, an error
event (the Responses API: ``response.failed``) and no finish; not streamed, an error
status and body.  Only a whole answer carries a finish reason.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import httpx
import openai
import pytest
import trio

from pdtrio.config import RouterConfig
from tests.cluster import client, running_cluster, synthetic_worker, wait_until_idle
from tests.router.fake_vllm import MODEL
from tests.router.test_vllm_front import fronted

# slow steps and a short deadline: a long answer is always cut mid-stream
SLOW = partial(synthetic_worker, decode_step_s=0.05)
DEADLINE = RouterConfig(request_timeout_s=1.0, egress_max_delay_s=0.0)

BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "long", "max_tokens": 5000},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "long"}],
        "max_tokens": 5000,
    },
    "/v1/responses": {"input": "long", "max_output_tokens": 5000},
}


def _data_events(text: str) -> list[Any]:
    return [
        line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


def _finish_reasons(events: list[Any]) -> list[str]:
    return [
        choice["finish_reason"]
        for event in events
        if isinstance(event, dict)
        for choice in event.get("choices", [])
        if choice.get("finish_reason") is not None
    ]


async def _read_all(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[int, str]:
    text = ""
    async with http.stream("POST", path, json=body) as response:
        try:
            async for chunk in response.aiter_text():
                text += chunk
        except httpx.RemoteProtocolError:
            pass  # the deadline cut a write: the stream ends torn, with nothing after it
    return response.status_code, text


@pytest.mark.parametrize("path", list(BODIES))
async def test_a_stream_the_deadline_cuts_ends_with_an_error_and_no_finish(path: str) -> None:
    async with running_cluster(make_worker=SLOW, router=DEADLINE) as cluster:
        async with client(cluster) as http:
            body = {"model": "synthetic", **BODIES[path], "stream": True}
            status, text = await _read_all(http, path, body)
        await wait_until_idle(cluster)
    assert status == 200
    if path == "/v1/responses":
        kinds = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
        assert "response.completed" not in kinds and "response.incomplete" not in kinds
        assert kinds[-1] == "response.failed" or not text.endswith("\n\n"), kinds[-3:]
        return
    assert '"length"' not in text and '"stop"' not in text, text[-400:]
    events = _data_events(text)
    assert _finish_reasons(events) == []
    if events and events[-1] == "[DONE]":  # (not torn)
        assert events[-2]["error"]["code"] == "timeout"


@pytest.mark.parametrize("path", list(BODIES))
async def test_an_answer_the_deadline_cuts_is_an_error_body_not_a_short_answer(path: str) -> None:
    async with running_cluster(make_worker=SLOW, router=DEADLINE) as cluster:
        async with client(cluster) as http:
            response = await http.post(path, json={"model": "synthetic", **BODIES[path]})
        await wait_until_idle(cluster)
    assert response.status_code == 504, response.text
    assert set(response.json()) == {"error"}
    assert response.json()["error"]["code"] == "timeout"


async def test_the_openai_client_sees_a_cut_stream_fail_without_a_finish() -> None:
    async with running_cluster(make_worker=SLOW, router=DEADLINE) as cluster:

        def stream() -> tuple[list[Any], BaseException | None]:
            finishes: list[Any] = []
            api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="-", max_retries=0)
            try:
                for chunk in api.chat.completions.create(
                    model="synthetic",
                    messages=[{"role": "user", "content": "long"}],
                    max_tokens=5000,
                    stream=True,
                ):
                    finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
            except (openai.APIError, httpx.HTTPError) as exc:
                return finishes, exc
            finally:
                api.close()
            return finishes, None

        finishes, error = await trio.to_thread.run_sync(stream)
        await wait_until_idle(cluster)
    assert finishes == []
    assert error is not None


async def test_an_engines_abort_after_tokens_went_out_is_an_error_event_not_a_finish() -> None:
    async with fronted() as (url, _, [decode], _):
        decode.abort_after_tokens = 2
        async with httpx.AsyncClient(base_url=url) as http:
            response = await http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "a b", "max_tokens": 5, "stream": True},
            )
            whole = await http.post(
                "/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 5}
            )
    events = _data_events(response.text)
    assert response.status_code == 200
    assert [e["choices"][0]["text"] for e in events[:2]] == [" t0", " t1"]
    assert _finish_reasons(events) == []
    assert "finish_reason 'abort'" in events[2]["error"]["message"]
    assert events[3] == "[DONE]"
    # not streamed, nothing went out: the whole request fails (one decode: none to retry on)
    assert whole.status_code >= 500 and set(whole.json()) == {"error"}, whole.text
