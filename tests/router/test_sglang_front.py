"""The router in front of SGLang instances (kind = "sglang"): the bootstrap protocol's two
concurrent legs, against the emulator in tests/router/fake_sglang.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from pdtrio.config import InstanceConfig, PdtrioConfig, RouterConfig, TracingConfig
from pdtrio.router.app import RouterApp
from tests.cluster import serve_app
from tests.router.fake_sglang import FakeSglang
from tests.router.fake_vllm import MODEL, token_logprob
from tests.tracing_receiver import trace_receiver

BOOTSTRAP_PORT = 8998


@asynccontextmanager
async def fronted(
    prefills: int = 1, decodes: int = 1, tracing: TracingConfig | None = None
) -> AsyncIterator[tuple[str, list[FakeSglang], list[FakeSglang]]]:
    async with trio.open_nursery() as nursery:
        rooms: dict[Any, Any] = {}
        engines = [
            FakeSglang(f"p{i}", {}, rooms=rooms, bootstrap_port=BOOTSTRAP_PORT + i)
            for i in range(prefills)
        ] + [FakeSglang(f"d{i}", {}, rooms=rooms) for i in range(decodes)]
        for engine in engines:
            engine.url = await serve_app(engine, nursery)
        prefill, decode = engines[:prefills], engines[prefills:]
        config = PdtrioConfig(
            router=RouterConfig(instance_backoff_s=60.0),
            instances=tuple(
                InstanceConfig(
                    role="prefill", url=e.url, kind="sglang", bootstrap_port=e.bootstrap_port
                )
                for e in prefill
            )
            + tuple(InstanceConfig(role="decode", url=e.url, kind="sglang") for e in decode),
            tracing=tracing or TracingConfig(),
        )
        url = await serve_app(RouterApp(config), nursery)
        yield url, prefill, decode
        nursery.cancel_scope.cancel()


def _events(text: str) -> list[Any]:
    return [
        line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


async def test_both_legs_carry_one_room_and_the_client_gets_decodes_stream() -> None:
    async with fronted() as (url, [prefill], [decode]):
        async with httpx.AsyncClient(base_url=url) as client:
            response = await client.post(
                "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": "a b c",
                    "max_tokens": 3,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
    assert response.status_code == 200, response.text
    events = _events(response.text)
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == " t0 t1 t2"
    assert events[-2]["usage"]["completion_tokens"] == 3
    assert events[-1] == "[DONE]"
    [prefill_leg] = prefill.legs()
    [decode_leg] = decode.legs()
    for key in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
        assert prefill_leg[key] == decode_leg[key]
    assert decode_leg["bootstrap_port"] == BOOTSTRAP_PORT
    assert decode_leg["bootstrap_host"] == "127.0.0.1"
    assert 0 <= decode_leg["bootstrap_room"] < 1 << 63
    assert prefill_leg["stream"] is False and decode_leg["stream"] is True


async def test_logprobs_come_with_decodes_stream_and_both_legs_ask_for_them() -> None:
    # decode's tokens come with their logprobs, the first's included (SGLang's decode has
    # it from prefill with the KV, computed only if prefill's leg asked too); prefill's
    # answer carries nothing the OpenAI routes merge (SGLang's router merges prefill's
    # meta_info.input_token_logprobs, which only /generate answers)
    async with fronted() as (url, [prefill], [decode]):
        async with httpx.AsyncClient(base_url=url) as client:
            chat = await client.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                    "logprobs": True,
                    "top_logprobs": 1,
                    "stream": True,
                },
            )
            completion = await client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "a b", "max_tokens": 2, "logprobs": 0},
            )
        chat_legs = [leg for leg in prefill.legs() + decode.legs() if "messages" in leg]
        assert [leg["logprobs"] for leg in chat_legs] == [True, True]
        assert [leg["top_logprobs"] for leg in chat_legs] == [1, 1]
        completion_legs = [leg for leg in prefill.legs() + decode.legs() if "prompt" in leg]
        assert [leg["logprobs"] for leg in completion_legs] == [0, 0]
    assert chat.status_code == 200, chat.text
    events = _events(chat.text)
    items = [item for e in events[1:-1] for item in e["choices"][0]["logprobs"]["content"]]
    assert [(item["token"], item["logprob"]) for item in items] == [
        (" t0", token_logprob(0)),
        (" t1", token_logprob(1)),
    ]
    assert [[top["token"] for top in item["top_logprobs"]] for item in items] == [[" t0"], [" t1"]]
    assert completion.status_code == 200, completion.text
    logprobs = completion.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [" t0", " t1"]
    assert logprobs["token_logprobs"] == [token_logprob(0), token_logprob(1)]
    assert logprobs["text_offset"] == [0, 3]


async def test_a_failed_prefill_closes_the_waiting_decode_and_another_prefill_takes_it() -> None:
    async with fronted(prefills=2) as (url, prefills, [decode]):
        prefills[0].fail_status = prefills[1].fail_status = 500
        async with httpx.AsyncClient(base_url=url) as client:
            refused = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}
            )
            assert refused.status_code == 503
            assert decode.decode_aborted.is_set()  # it waited for KV that never came
            prefills[1].fail_status = 0
            served = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}
            )
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["text"] == " t0 t1"
    rooms = {leg["bootstrap_room"] for leg in decode.legs()}
    assert len(rooms) == len(decode.legs())  # each try its own room


async def test_a_client_that_leaves_closes_both_legs() -> None:
    async with fronted() as (url, [prefill], [decode]):
        prefill.prefill_gate = trio.Event()  # prefill never gets to the KV
        async with httpx.AsyncClient(base_url=url) as client:
            async with trio.open_nursery() as nursery:

                async def leave() -> None:
                    await decode.decode_waiting_for_kv.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(leave)
                await client.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": "a", "max_tokens": 2, "stream": True},
                )
        with trio.fail_after(5):
            await decode.decode_aborted.wait()
        assert not prefill.held


async def test_a_decode_failing_before_its_first_token_starts_both_legs_again() -> None:
    async with fronted(decodes=2) as (url, [prefill], decodes):
        decodes[0].fail_status = decodes[1].fail_status = 500
        async with httpx.AsyncClient(base_url=url) as client:
            refused = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}
            )
            assert refused.status_code == 503
            decodes[1].fail_status = 0
            served = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}
            )
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["text"] == " t0 t1"
    # the prefill legs of the failed tries were closed, each try had its own room
    rooms = [leg["bootstrap_room"] for leg in prefill.legs()]
    decode_legs = len(decodes[0].legs()) + len(decodes[1].legs())
    assert len(rooms) == len(set(rooms)) == decode_legs >= 3


async def test_a_prefill_refusing_the_request_is_the_clients_error_and_closes_the_decode() -> None:
    async with fronted(prefills=2) as (url, prefills, [decode]):
        prefills[0].fail_status = prefills[1].fail_status = 400
        async with httpx.AsyncClient(base_url=url) as client:
            refused = await client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "a", "max_tokens": 2, "stream": True},
            )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["message"].endswith("says no")
        with trio.fail_after(5):
            await decode.decode_aborted.wait()  # it waited for KV that never came
        # the client's own error: tried once, on one prefill
        assert len(prefills[0].legs()) + len(prefills[1].legs()) == 1


async def test_each_leg_carries_the_requests_trace_to_its_sglang_engine() -> None:
    """SGLang joins a trace through the ``traceparent`` header (``--enable-trace``): the
    prefill leg's call and the decode leg's each carry the request's trace, as children
    of the router's decode attempt, which both run within (SGLang's prefill answers once
    decode has fetched the KV)."""
    client_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    with trace_receiver() as receiver:
        async with fronted(tracing=TracingConfig(endpoint=receiver.url)) as (
            url,
            [prefill],
            [decode],
        ):
            async with httpx.AsyncClient(base_url=url) as client:
                body = {"model": MODEL, "prompt": "a b c", "max_tokens": 3, "stream": True}
                headers = {"traceparent": f"00-{client_trace}-00f067aa0ba902b7-01"}
                response = await client.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 200, response.text
        spans = [s for s in receiver.received() if s.trace_id == client_trace]
    legs = {s.span_id: s.name for s in spans if s.service == "pdtrio-router"}
    for engine in (prefill, decode):
        [(_, headers)] = engine.received
        version, trace_id, parent_id, flags = headers["traceparent"].split("-")
        assert (version, trace_id, flags) == ("00", client_trace, "01")
        assert legs.get(parent_id) == "decode", (legs, parent_id)
