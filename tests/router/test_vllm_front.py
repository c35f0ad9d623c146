"""The router in front of vLLM instances (kind = "vllm"): the KV connector protocol's legs,
the shape of what the client gets, retries, 4xx, a client leaving between the legs.

Against in-process fakes of vLLM's HTTP contract (tests/router/fake_vllm.py); the
same against a real vLLM pair is tests/vllm/test_real_vllm.py (nox -s vllm).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import h11
import httpx
import openai
import pytest
import trio

from pdtrio.config import InstanceConfig, PdtrioConfig, RouterConfig
from pdtrio.router.app import RouterApp
from tests.cluster import serve_app, wait_for_stats
from tests.metrics import value
from tests.router.fake_vllm import CACHED_TOKENS, MODEL, FakeVllm, fake_engines, token_logprob
from tests.router.test_adaptive_egress import _pin_spacing
from tests.router.test_slow_client import open_stalled_stream


@asynccontextmanager
async def fronted(
    prefills: int = 1, decodes: int = 1, api_key: str = "", router: RouterConfig | None = None
) -> AsyncIterator[tuple[str, list[FakeVllm], list[FakeVllm], RouterApp]]:
    names = [f"p{i}" for i in range(prefills)] + [f"d{i}" for i in range(decodes)]
    async with trio.open_nursery() as nursery:
        async with fake_engines(nursery, *names) as engines:
            p = [engines[n] for n in names[:prefills]]
            d = [engines[n] for n in names[prefills:]]
            config = PdtrioConfig(
                # (no egress spacing: the tests read one event per engine event, which
                # adaptive egress merges when this busy machine loads the loop)
                router=router or RouterConfig(instance_backoff_s=60.0, egress_max_delay_s=0.0),
                instances=tuple(
                    [
                        InstanceConfig(role="prefill", url=e.url, kind="vllm", api_key=api_key)
                        for e in p
                    ]
                    + [
                        InstanceConfig(role="decode", url=e.url, kind="vllm", api_key=api_key)
                        for e in d
                    ]
                ),
            )
            app = RouterApp(config)
            url = await serve_app(app, nursery)
            yield url, p, d, app
        nursery.cancel_scope.cancel()


def _events(text: str) -> list[Any]:
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_a_completion_takes_both_legs_and_gets_prefills_cached_tokens() -> None:
    async with fronted() as (url, [prefill], [decode], _):
        async with httpx.AsyncClient(base_url=url) as client:
            response = await client.post(
                "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": "one two three",
                    "max_tokens": 4,
                    "min_tokens": 2,
                },
            )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["text"] == " t0 t1 t2 t3"
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 4
        assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": CACHED_TOKENS}

        [(prefill_leg, prefill_headers)] = prefill.received
        assert prefill_leg["stream"] is False and prefill_leg["max_tokens"] == 1
        assert "stream_options" not in prefill_leg and "min_tokens" not in prefill_leg
        assert prefill_leg["kv_transfer_params"]["do_remote_decode"] is True
        assert prefill_leg["kv_transfer_params"]["do_remote_prefill"] is False
        [(decode_leg, decode_headers)] = decode.received
        # prefill's kv_transfer_params, whole (a newer version's fields included)
        assert decode_leg["kv_transfer_params"]["a_field_of_a_newer_version"] == {"kept": True}
        assert decode_leg["kv_transfer_params"]["remote_engine_id"] == "p0"
        assert decode_leg["max_tokens"] == 4 and decode_leg["min_tokens"] == 2
        assert prefill_headers["x-request-id"] == decode_headers["x-request-id"] == body["id"]
        assert prefill.held == {}  # decode pulled the blocks


async def test_max_completion_tokens_is_one_on_the_prefill_leg() -> None:
    async with fronted() as (url, [prefill], [decode], _):
        async with httpx.AsyncClient(base_url=url) as client:
            response = await client.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_completion_tokens": 3,
                },
            )
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == " t0 t1 t2"
        [leg] = prefill.legs()
        assert leg["max_completion_tokens"] == 1 and leg["max_tokens"] == 1
        assert decode.legs()[0]["max_completion_tokens"] == 3


async def test_a_stream_has_the_role_chunk_usage_only_when_asked_and_done() -> None:
    async with fronted() as (url, [prefill], _, _):
        async with httpx.AsyncClient(base_url=url) as client:
            asked = await client.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            plain = await client.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3,
                    "stream": True,
                },
            )
    assert all("stream_options" not in leg and leg["stream"] is False for leg in prefill.legs())
    events = _events(asked.text)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [e for e in events[1:-1] if e["choices"]]
    assert "".join(e["choices"][0]["delta"]["content"] for e in content) == " t0 t1 t2"
    assert [e["choices"][0]["finish_reason"] for e in content] == [None, None, "length"]
    usage = events[-2]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 3
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": CACHED_TOKENS}
    plain_events = _events(plain.text)
    assert plain_events[-1] == "[DONE]"
    assert all("usage" not in e for e in plain_events[:-1])


async def test_a_null_kv_transfer_params_sends_decode_the_plain_request() -> None:
    async with fronted() as (url, [prefill], [decode], _):
        prefill.null_kv_params = True
        async with httpx.AsyncClient(base_url=url) as client:
            response = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 2}
            )
        assert response.status_code == 200, response.text
        assert "kv_transfer_params" not in decode.legs()[0]


async def test_a_4xx_is_the_clients_and_suspends_nothing() -> None:
    async with fronted() as (url, [prefill], [decode], app):
        prefill.fail_status = 400
        async with httpx.AsyncClient(base_url=url) as client:
            refused = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 2}
            )
            assert refused.status_code == 400
            assert refused.json()["error"]["message"] == "p0 says no"
            prefill.fail_status = 0
            assert (
                await client.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 2}
                )
            ).status_code == 200
        pool = app.router.backend.pool  # type: ignore[union-attr]
        assert all(i.failures_in_a_row == 0 for i in pool.instances.values())


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"model": MODEL, "prompt": "a b", "max_tokens": 3}


def _chat_logprob(i: int, top: int) -> dict[str, Any]:
    """What the client gets for the fake's ``i``-th token, with ``top`` alternatives."""
    token = f" t{i}"
    tops = [(token, token_logprob(i))] + [(f" alt{k}", token_logprob(i) - k) for k in range(1, top)]
    return {
        "token": token,
        "logprob": token_logprob(i),
        "bytes": list(token.encode()),
        "top_logprobs": [
            {"token": name, "logprob": value, "bytes": list(name.encode())} for name, value in tops
        ],
    }


async def test_chat_logprobs_come_from_decodes_stream_streamed_or_not() -> None:
    async with fronted() as (url, [prefill], [decode], _):
        asked = {**CHAT, "logprobs": True, "top_logprobs": 2}
        async with httpx.AsyncClient(base_url=url) as client:
            whole = await client.post("/v1/chat/completions", json=asked)
            streamed = await client.post("/v1/chat/completions", json={**asked, "stream": True})
        # both legs keep the client's fields (prefill's one token comes with its own: read
        # for nothing, broken by nothing)
        for leg in prefill.legs() + decode.legs():
            assert leg["logprobs"] is True and leg["top_logprobs"] == 2
    assert whole.status_code == 200, whole.text
    [choice] = whole.json()["choices"]
    assert choice["message"]["content"] == " t0 t1 t2"
    assert choice["logprobs"] == {"content": [_chat_logprob(i, 2) for i in range(3)]}
    events = _events(streamed.text)
    assert events[-1] == "[DONE]"
    content = [e["choices"][0] for e in events[1:-1]]
    # each chunk carries its own tokens' logprobs
    assert [c["delta"]["content"] for c in content] == [" t0", " t1", " t2"]
    assert [c["logprobs"] for c in content] == [
        {"content": [_chat_logprob(i, 2)]} for i in range(3)
    ]


async def test_completion_logprobs_come_from_decodes_stream_streamed_or_not() -> None:
    async with fronted() as (url, [prefill], [decode], _):
        asked = {**COMPLETION, "logprobs": 1}
        async with httpx.AsyncClient(base_url=url) as client:
            whole = await client.post("/v1/completions", json=asked)
            streamed = await client.post("/v1/completions", json={**asked, "stream": True})
        assert all(leg["logprobs"] == 1 for leg in prefill.legs() + decode.legs())
    assert whole.status_code == 200, whole.text
    [choice] = whole.json()["choices"]
    assert choice["text"] == " t0 t1 t2"
    assert choice["logprobs"] == {
        "tokens": [" t0", " t1", " t2"],
        "token_logprobs": [token_logprob(i) for i in range(3)],
        "top_logprobs": [{f" t{i}": token_logprob(i)} for i in range(3)],
        "text_offset": [0, 3, 6],
    }
    events = _events(streamed.text)
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    assert [c["logprobs"]["tokens"] for c in chunks] == [[" t0"], [" t1"], [" t2"]]
    assert [c["logprobs"]["text_offset"] for c in chunks] == [[0], [3], [6]]
    assert [c["logprobs"]["token_logprobs"] for c in chunks] == [
        [token_logprob(i)] for i in range(3)
    ]


async def test_the_openai_client_reads_logprobs_in_front_of_vllm() -> None:
    async with fronted() as (url, _, _, _):

        def call() -> tuple[Any, list[Any], Any]:
            api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            whole = api.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
                logprobs=True,
                top_logprobs=3,
            )
            chunks = list(
                api.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=3,
                    logprobs=True,
                    top_logprobs=3,
                    stream=True,
                )
            )
            completion = api.completions.create(model=MODEL, prompt="a b", max_tokens=2, logprobs=2)
            return whole, chunks, completion

        whole, chunks, completion = await trio.to_thread.run_sync(call)
    content = whole.choices[0].logprobs.content
    assert [item.token for item in content] == [" t0", " t1", " t2"]
    assert [item.logprob for item in content] == [token_logprob(i) for i in range(3)]
    assert [top.token for top in content[1].top_logprobs] == [" t1", " alt1", " alt2"]
    streamed = [
        item
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs
        for item in chunk.choices[0].logprobs.content
    ]
    assert [item.model_dump() for item in streamed] == [item.model_dump() for item in content]
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == [" t0", " t1"]
    assert logprobs.top_logprobs == [
        {" t0": token_logprob(0), " alt1": token_logprob(0) - 1},
        {" t1": token_logprob(1), " alt1": token_logprob(1) - 1},
    ]


async def test_tokens_merged_by_adaptive_egress_keep_their_own_logprobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # an hour's spacing: the first event goes at once, the rest wait for the finish and
    # go out as one event, with every merged token's logprobs in order
    _pin_spacing(monkeypatch, 3600.0)
    async with fronted() as (url, _, _, _):
        async with httpx.AsyncClient(base_url=url) as client:
            with trio.fail_after(30):
                response = await client.post(
                    "/v1/chat/completions",
                    json={**CHAT, "max_tokens": 6, "logprobs": True, "stream": True},
                )
    events = _events(response.text)
    content = [e["choices"][0] for e in events[:-1] if e["choices"][0]["delta"].get("content")]
    assert len(content) < 6  # merged
    for chunk in content:
        items = chunk["logprobs"]["content"]
        assert "".join(item["token"] for item in items) == chunk["delta"]["content"]
    items = [item for chunk in content for item in chunk["logprobs"]["content"]]
    assert [item["logprob"] for item in items] == [token_logprob(i) for i in range(6)]


async def test_no_logprobs_asked_none_sent_nor_asked_of_the_engines() -> None:
    async with fronted() as (url, [prefill], [decode], _):
        async with httpx.AsyncClient(base_url=url) as client:
            chat = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
            completion = await client.post("/v1/completions", json=COMPLETION)
        assert all("logprobs" not in leg for leg in prefill.legs() + decode.legs())
    events = _events(chat.text)
    assert all(e["choices"][0]["logprobs"] is None for e in events[:-1])
    assert completion.json()["choices"][0]["logprobs"] is None


async def test_malformed_logprobs_from_decode_end_the_answer_with_a_clear_error() -> None:
    async with fronted() as (url, _, [decode], app):
        decode.bad_logprobs_at = 1
        async with httpx.AsyncClient(base_url=url) as client:
            streamed = await client.post(
                "/v1/chat/completions", json={**CHAT, "logprobs": True, "stream": True}
            )
            whole = await client.post("/v1/completions", json={**COMPLETION, "logprobs": 0})
    events = _events(streamed.text)
    assert streamed.status_code == 200
    assert events[1]["choices"][0]["delta"]["content"] == " t0"  # what came before it
    error = events[-2]["error"]
    assert "decode's stream" in error["message"] and "logprobs" in error["message"]
    assert events[-1] == "[DONE]"
    assert whole.status_code == 502, whole.text
    message = whole.json()["error"]["message"]
    assert "logprobs" in message and "Traceback" not in whole.text
    pool = app.router.backend.pool  # type: ignore[union-attr]
    assert pool.instances[decode.url].failures_in_a_row >= 1  # a broken answer: suspended


async def test_tokens_without_the_logprobs_asked_for_are_logged_once_per_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with fronted() as (url, _, [decode], _):
        decode.drop_logprobs = True
        async with httpx.AsyncClient(base_url=url) as client:
            response = await client.post(
                "/v1/chat/completions",
                json={**CHAT, "max_tokens": 4, "logprobs": True, "stream": True},
            )
    assert response.status_code == 200, response.text
    events = _events(response.text)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == (
        " t0 t1 t2 t3"
    )
    said = [r for r in caplog.records if "decode sent logprobs for" in r.getMessage()]
    assert len(said) == 1


async def test_a_prefill_failing_with_a_5xx_is_suspended_and_another_takes_it() -> None:
    async with fronted(prefills=2) as (url, prefills, [decode], app):
        prefills[0].fail_status = 500
        prefills[1].fail_status = 500
        async with httpx.AsyncClient(base_url=url) as client:
            both_down = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 2}
            )
            assert both_down.status_code == 503
            assert "no prefill instance is available" in both_down.json()["error"]["message"]
            prefills[1].fail_status = 0
            served = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 2}
            )
        assert served.status_code == 200, served.text
        pool = app.router.backend.pool  # type: ignore[union-attr]
        assert pool.instances[prefills[0].url].failures_in_a_row >= 1


async def test_a_decode_failing_before_its_first_token_gets_a_new_prefill_and_another_decode() -> (
    None
):
    async with fronted(decodes=2) as (url, [prefill], decodes, _):
        decodes[0].fail_status = 500
        decodes[1].fail_status = 500
        async with httpx.AsyncClient(base_url=url) as client:
            for _ in range(2):  # whichever decode it picks first
                decodes[0].fail_status, decodes[1].fail_status = 500, 0
                response = await client.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": "a b", "max_tokens": 2, "stream": True},
                )
                assert response.status_code == 200, response.text
                assert _events(response.text)[-1] == "[DONE]"
        assert decodes[1].legs()  # the one that works served them
        # each request that met the failing decode was prefilled again
        assert len(prefill.legs()) == 2 + len(decodes[0].legs())


async def test_a_decode_failing_mid_stream_ends_with_an_error_event_and_done() -> None:
    async with fronted() as (url, _, [decode], _):
        decode.fail_after_tokens = 2
        async with httpx.AsyncClient(base_url=url) as client:
            response = await client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "a b", "max_tokens": 5, "stream": True},
            )
    events = _events(response.text)
    assert response.status_code == 200
    assert [e["choices"][0]["text"] for e in events[:2]] == [" t0", " t1"]
    assert "the engine broke" in events[2]["error"]["message"]
    assert events[3] == "[DONE]"


async def test_a_client_leaving_between_the_legs_leaves_no_kv_on_prefill() -> None:
    async with fronted() as (url, [prefill], [decode], _):
        decode.decode_gate = trio.Event()  # decode takes the request but waits
        async with httpx.AsyncClient(base_url=url) as client:
            with trio.move_on_after(5) as waited:
                async with trio.open_nursery() as nursery:

                    async def leave_once_prefilled() -> None:
                        await decode.decode_waiting.wait()  # prefill answered, decode waits
                        nursery.cancel_scope.cancel()  # the client goes

                    nursery.start_soon(leave_once_prefilled)
                    await client.post(
                        "/v1/completions",
                        json={"model": MODEL, "prompt": "a b c", "max_tokens": 8, "stream": True},
                    )
            assert not waited.cancelled_caught
            with trio.fail_after(5):
                await decode.decode_aborted.wait()  # the router hung up on the decode leg
            assert prefill.held  # stranded, until a decode pulls them
            decode.decode_gate.set()
            with trio.fail_after(5):
                await prefill.wait_until(holding=False)
        # the leg that freed them: one token, not streamed, prefill's params
        release = decode.legs()[-1]
        assert release["max_tokens"] == 1 and release["stream"] is False
        assert release["kv_transfer_params"]["remote_engine_id"] == "p0"


async def test_the_openai_client_and_health() -> None:
    async with fronted() as (url, _, _, _):
        async with httpx.AsyncClient(base_url=url) as client:
            health = (await client.get("/health")).json()
            models = (await client.get("/v1/models")).json()
        assert health["status"] == "ok"
        assert [e["kind"] for e in health["engines"]] == ["vllm", "vllm"]
        assert [m["id"] for m in models["data"]] == [MODEL]

        def call() -> tuple[str, Any]:
            api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            chunks = list(
                api.completions.create(
                    model=MODEL,
                    prompt="hello",
                    max_tokens=3,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            return text, chunks[-1].usage

        text, usage = await trio.to_thread.run_sync(call)
        assert text == " t0 t1 t2"
        assert usage.completion_tokens == 3
        assert usage.prompt_tokens_details.cached_tokens == CACHED_TOKENS


async def test_a_draining_router_refuses_new_requests_before_any_leg() -> None:
    async with fronted() as (url, [prefill], [decode], app):
        app.router.requests.draining = True  # type: ignore[union-attr]
        async with httpx.AsyncClient(base_url=url) as client:
            response = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}
            )
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "shutting_down"
        assert not prefill.received and not decode.received


async def test_an_instances_api_key_goes_with_each_leg() -> None:
    async with fronted(api_key="sk-engine") as (url, [prefill], [decode], _):
        async with httpx.AsyncClient(base_url=url) as client:
            response = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}
            )
        assert response.status_code == 200, response.text
        for _, headers in prefill.received + decode.received:
            assert headers["authorization"] == "Bearer sk-engine"


async def test_an_engine_not_up_is_not_routed_to_and_health_says_why() -> None:
    async with trio.open_nursery() as nursery:
        async with fake_engines(nursery, "p0", "d0") as engines:
            engines["p0"].health_status = 503
            config = PdtrioConfig(
                router=RouterConfig(prefill_wait_s=0.0),  # (refused at once: no wait for it)
                instances=(
                    InstanceConfig(role="prefill", url=engines["p0"].url, kind="vllm"),
                    InstanceConfig(role="decode", url=engines["d0"].url, kind="vllm"),
                ),
            )
            url = await serve_app(RouterApp(config), nursery)
            async with httpx.AsyncClient(base_url=url) as client:
                health = await client.get("/health")
                response = await client.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}
                )
        nursery.cancel_scope.cancel()
    assert health.status_code == 503
    [prefill] = [e for e in health.json()["engines"] if e["role"] == "prefill"]
    assert prefill["healthy"] is False and "/health answered 503" in prefill["error"]
    assert response.status_code == 503
    assert "no prefill instance is available" in response.json()["error"]["message"]
    assert not engines["p0"].received


async def test_an_engine_slow_to_answer_its_health_read_stays_until_it_misses_three() -> None:
    # busy is not down: vLLM's API server, starved of CPU by its own engine, answers late
    router = RouterConfig(
        instance_backoff_s=60.0, egress_max_delay_s=0.0, connect_timeout_s=0.5, prefill_wait_s=0.0
    )
    async with fronted(router=router) as (url, [prefill], _, app):
        pool = app.router.backend.pool  # type: ignore[union-attr]
        [engine] = [e for e in pool.instances.values() if e.url == prefill.url]
        body = {"model": MODEL, "prompt": "a", "max_tokens": 2}
        prefill.health_gate = trio.Event()
        async with httpx.AsyncClient(base_url=url) as client:
            await wait_for_stats(lambda: engine.slow_probes_in_a_row >= 1)
            assert engine.healthy
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            await wait_for_stats(lambda: not engine.healthy, deadline_s=15.0)
            assert engine.slow_probes_in_a_row == 3
            assert "TooSlowError" in engine.last_error
            refused = await client.post("/v1/completions", json=body)
            prefill.health_gate.set()  # it answers again: back in rotation
            await wait_for_stats(lambda: engine.healthy, deadline_s=10.0)
            assert engine.slow_probes_in_a_row == 0
            assert (await client.post("/v1/completions", json=body)).status_code == 200
    assert refused.status_code == 503
    assert "no prefill instance is available" in refused.json()["error"]["message"]


async def test_a_decode_answering_4xx_is_the_clients_error_and_suspends_nothing() -> None:
    async with fronted() as (url, _, [decode], app):
        decode.fail_status = 400
        async with httpx.AsyncClient(base_url=url) as client:
            response = await client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "a b", "max_tokens": 2, "stream": True},
            )
        assert response.status_code == 400  # nothing went out before: the status says it
        assert response.json()["error"]["message"] == "d0 says no"
        pool = app.router.backend.pool  # type: ignore[union-attr]
        assert all(i.failures_in_a_row == 0 for i in pool.instances.values())


async def test_the_request_deadline_ends_a_waiting_decode_and_frees_prefills_kv() -> None:
    # the machine's deadline, as for pdtrio's workers; its cleanup frees the KV no decode
    # pulled (the one-token decode leg)
    async with fronted(router=RouterConfig(request_timeout_s=1.0)) as (
        url,
        [prefill],
        [decode],
        _,
    ):
        decode.decode_gate = trio.Event()
        async with httpx.AsyncClient(base_url=url) as client:
            response = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 4}
            )
        assert response.status_code == 504, response.text
        assert response.json()["error"]["code"] == "timeout"
        with trio.fail_after(5):
            await decode.decode_aborted.wait()
        assert prefill.held
        decode.decode_gate.set()
        with trio.fail_after(5):
            await prefill.wait_until(holding=False)


async def test_a_client_that_stops_reading_is_hung_up_on_by_the_shared_stall_sweep() -> None:
    router = RouterConfig(client_write_timeout_s=1.0)
    async with fronted(router=router) as (url, _, [decode], app):
        decode.token_padding = 8192  # a stream far bigger than the sockets' buffers
        stalled = await open_stalled_stream(url, model=MODEL, max_tokens=2000)
        async with stalled:
            requests = app.router.requests  # type: ignore[union-attr]
            await wait_for_stats(lambda: len(requests) > 0, 20)
            await wait_for_stats(lambda: not len(requests), 20)
            async with httpx.AsyncClient(base_url=url) as client:
                metrics = (await client.get("/metrics")).text
            assert value(metrics, "pdtrio_requests_total", outcome="failed", status="5xx") == 1
            pool = app.router.backend.pool  # type: ignore[union-attr]
            assert all(i.in_flight == 0 for i in pool.instances.values())  # its legs ended


async def _engine_closing_each_connection_after_one_answer(
    *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """vLLM's GETs, served so that each connection answers once, keeps alive, then closes
    as the next request comes: what an idle connection meets when the server's keep-alive
    timeout strikes as the client sends on it."""

    async def serve(stream: trio.SocketStream) -> None:
        connection = h11.Connection(h11.SERVER)
        async with stream:
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    connection.receive_data(data)
                    continue
                if not isinstance(event, h11.Request):
                    continue
                if event.target == b"/v1/models":
                    body = json.dumps({"data": [{"id": MODEL, "max_model_len": 2048}]}).encode()
                else:
                    body = b""
                headers = [("content-length", str(len(body)))]
                await stream.send_all(
                    connection.send(h11.Response(status_code=200, headers=headers)) or b""
                )
                await stream.send_all(connection.send(h11.Data(data=body)) or b"")
                await stream.send_all(connection.send(h11.EndOfMessage()) or b"")
                # kept alive (no "connection: close"), then closed unanswered as the next
                # request arrives
                await stream.receive_some(65536)
                return

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, serve, listeners)
        task_status.started(f"http://127.0.0.1:{port}")


async def test_a_health_read_on_a_connection_the_engine_closed_is_asked_again() -> None:
    """A GET that meets a kept-alive connection closed by the engine ("Server disconnected
    without sending a response") is asked again on a new one: the engine stays up."""
    async with trio.open_nursery() as nursery:
        engine = await nursery.start(_engine_closing_each_connection_after_one_answer)
        async with fake_engines(nursery, "d0") as engines:
            config = PdtrioConfig(
                instances=(
                    InstanceConfig(role="prefill", url=engine, kind="vllm"),
                    InstanceConfig(role="decode", url=engines["d0"].url, kind="vllm"),
                )
            )
            app = RouterApp(config)
            await serve_app(app, nursery)
            pool = app.router.backend.pool
            assert pool is not None
            [prefill] = [e for e in pool.instances.values() if e.url == engine]
            for _ in range(3):  # scrapes, a second apart: each meets closed connections
                await trio.sleep(1.0)
                assert prefill.healthy, prefill.last_error
        nursery.cancel_scope.cancel()
