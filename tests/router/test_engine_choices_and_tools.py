"""``n`` > 1 and ``tools`` in front of vLLM and SGLang engines (their fakes: fake_vllm.py,
fake_sglang.py).

``n`` > 1: each choice is a PD flow of its own (``vllm_pd.choice_body`` says why the
engines are never sent ``n``), merged into one answer's choices.  Tools: forwarded in
both legs; the calls an engine's tool parser streams (``delta.tool_calls``) reach the
client whole, and ``<tool_call>`` blocks in the text of one without a parser are read
by pdtrio's parser, as on its own workers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import trio

from pdtrio.router.app import RouterApp
from pdtrio.router.engines.pool import EnginePool
from tests.cluster import wait_for_stats
from tests.router.fake_vllm import MODEL, choice_of
from tests.router.test_openai_choices import streamed_choices
from tests.router.test_sglang_front import fronted as sglang_fronted
from tests.router.test_vllm_front import _events, fronted

MESSAGES = [{"role": "user", "content": "what is the weather in Paris"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"the {what}",
            "parameters": {
                "type": "object",
                "properties": {key: {"type": "string"}},
                "required": [key],
            },
        },
    }
    for name, what, key in (("get_weather", "weather", "city"), ("get_time", "time", "tz"))
]
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def _pool(app: RouterApp) -> EnginePool:
    pool = app.router.backend.pool
    assert pool is not None
    return pool


async def _two_choices_streamed(
    url: str, seed: int, *, once_choice_0_out: Callable[[], object]
) -> list[Any]:
    """A streamed chat of two 3-token choices through the openai client (in a thread);
    ``once_choice_0_out`` runs (in trio) as each chunk carrying choice 0's text arrives."""

    def call() -> list[Any]:
        chunks = []
        with _openai(url) as api:
            for chunk in api.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=3,
                n=2,
                seed=seed,
                stream=True,
                stream_options={"include_usage": True},
            ):
                chunks.append(chunk)
                if any(c.index == 0 and c.delta.content for c in chunk.choices):
                    trio.from_thread.run_sync(once_choice_0_out)
        return chunks

    return await trio.to_thread.run_sync(call)


def _seeded(seed: int, tokens: int) -> str:
    """What the fake answers a request with ``seed`` (its sample's tokens)."""
    return "".join(f" s{seed}t{i}" for i in range(tokens))


# --- n > 1 in front of vLLM ------------------------------------------------------------


async def test_n_choices_are_a_pd_flow_each_with_seed_plus_index_through_the_openai_client() -> (
    None
):
    async with fronted() as (url, [prefill], [decode], _):

        def call() -> tuple[Any, list[Any], Any]:
            with _openai(url) as api:
                fields: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "seed": 7, "n": 3}
                whole = api.chat.completions.create(messages=MESSAGES, **fields)
                chunks = list(
                    api.chat.completions.create(
                        messages=MESSAGES,
                        stream=True,
                        stream_options={"include_usage": True},
                        **fields,
                    )
                )
                completion = api.completions.create(prompt="a b", **fields)
                return whole, chunks, completion

        whole, chunks, completion = await trio.to_thread.run_sync(call)
        with trio.fail_after(10):
            await prefill.wait_until(holding=False)  # every choice's KV pulled

    # choice i is the sample a single request with seed 7 + i gets
    want = [_seeded(7 + i, 3) for i in range(3)]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.message.content for c in whole.choices] == want
    assert [c.finish_reason for c in whole.choices] == ["length"] * 3
    assert whole.usage.completion_tokens == 9  # summed over the choices
    streamed = streamed_choices(chunks)
    assert streamed == {i: (want[i], "length") for i in range(3)}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert [c.text for c in completion.choices] == want
    assert completion.usage.completion_tokens == 9

    # three requests, three choices each: a prefill leg and a decode leg per choice, each
    # one sample (no n: vLLM would fork it into children sharing one prefill's KV)
    assert len(prefill.received) == len(decode.received) == 9
    for request in range(3):
        prefills = prefill.received[3 * request : 3 * request + 3]
        decodes = decode.received[3 * request : 3 * request + 3]
        prefill_ids = sorted(headers["x-request-id"] for _, headers in prefills)
        decode_ids = sorted(headers["x-request-id"] for _, headers in decodes)
        assert prefill_ids == decode_ids and len(set(prefill_ids)) == 3
        assert sorted(choice_of(i) for i in prefill_ids) == [0, 1, 2]
        for body, headers in prefills + decodes:
            assert "n" not in body
            assert body["seed"] == 7 + choice_of(headers["x-request-id"])
        # each decode leg pulls its own choice's prefilled blocks
        pulled = sorted(body["kv_transfer_params"]["remote_request_id"] for body, _ in decodes)
        assert pulled == prefill_ids
    assert prefill.unrecognized_pulls == []


async def test_a_streamed_completion_with_n_has_each_chunks_choice_index() -> None:
    async with fronted() as (url, _, _, _):
        async with httpx.AsyncClient(base_url=url) as client:
            response = await client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "a b", "max_tokens": 2, "n": 2, "stream": True},
            )
    assert response.status_code == 200, response.text
    events = _events(response.text)
    assert events[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    for event in events[:-1]:
        [choice] = event["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]].append(choice["finish_reason"])
    assert texts == {0: " t0 t1", 1: " t0 t1"}
    assert finishes == {0: ["length"], 1: ["length"]}


async def test_a_client_leaving_mid_stream_with_n_closes_every_choices_legs_and_frees_the_kv() -> (
    None
):
    async with fronted() as (url, [prefill], [decode], app):
        # choices 0 and 1 stream two tokens, then stall; choice 2 waits at decode's door,
        # its KV still held on prefill
        decode.stall_after_tokens = 2
        decode.decode_gate = trio.Event()
        decode.gated_choices = frozenset({2})
        async with httpx.AsyncClient(base_url=url) as client:
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:

                    async def leave_mid_stream() -> None:
                        await decode.wait_for_stalls(stalled=2)
                        await decode.decode_waiting.wait()
                        assert len(prefill.held) == 1  # choice 2's, not pulled
                        nursery.cancel_scope.cancel()  # the client goes

                    nursery.start_soon(leave_mid_stream)
                    async with client.stream(
                        "POST",
                        "/v1/chat/completions",
                        json={
                            "model": MODEL,
                            "messages": MESSAGES,
                            "max_tokens": 8,
                            "n": 3,
                            "stream": True,
                        },
                    ) as response:
                        async for _ in response.aiter_bytes():
                            pass
        with trio.fail_after(10):
            await decode.wait_for_stalls(stalled=2, hung_up=2)  # both streams closed
            await decode.decode_aborted.wait()  # and the leg at the door
            # choice 2's KV freed by a one-token leg that pulls it (the gate holds only
            # the streamed legs)
            await prefill.wait_until(holding=False)
        pool = _pool(app)
        await wait_for_stats(lambda: all(i.in_flight == 0 for i in pool.instances.values()))
        release = decode.legs()[-1]
        assert release["max_tokens"] == 1 and release["stream"] is False
        assert choice_of(release["kv_transfer_params"]["remote_request_id"]) == 2


async def test_a_client_leaving_between_the_legs_with_n_frees_every_choices_kv() -> None:
    async with fronted() as (url, [prefill], [decode], _):
        decode.decode_gate = trio.Event()  # decode takes every leg, but waits
        async with httpx.AsyncClient(base_url=url) as client:
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:

                    async def leave_once_prefilled() -> None:
                        await decode.decode_waiting.wait()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(leave_once_prefilled)
                    await client.post(
                        "/v1/completions",
                        json={"model": MODEL, "prompt": "a b c", "max_tokens": 8, "n": 2},
                    )
            with trio.fail_after(10):
                await decode.decode_aborted.wait()
            assert len(prefill.held) == 2  # each choice's, until a decode pulls them
            decode.decode_gate.set()
            with trio.fail_after(10):
                await prefill.wait_until(holding=False)
        releases = [leg for leg in decode.legs() if leg["stream"] is False]
        pulled = sorted(
            choice_of(leg["kv_transfer_params"]["remote_request_id"]) for leg in releases
        )
        assert pulled == [0, 1]


async def test_a_choice_failing_before_any_token_sends_the_request_again_from_new_prefills() -> (
    None
):
    async with fronted(decodes=2) as (url, [prefill], [failing, working], app):
        pool = _pool(app)
        # the first placement goes to the failing decode (the other is out of rotation:
        # taken only once it is the one left)
        pool.failed(pool.instances[working.url], "kept out of the first placement")
        failing.failed_choices = frozenset({1})  # choice 1's leg answers 500
        failing.decode_gate = trio.Event()  # choice 0's waits: no token goes out before
        failing.gated_choices = frozenset({0})
        async with httpx.AsyncClient(base_url=url) as client:
            with trio.fail_after(10):
                response = await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": MODEL,
                        "messages": MESSAGES,
                        "max_tokens": 2,
                        "n": 2,
                        "seed": 3,
                        "stream": True,
                    },
                )
        assert response.status_code == 200, response.text
        events = _events(response.text)
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
        texts = {0: "", 1: ""}
        for event in events[:-1]:
            for choice in event["choices"]:
                texts[choice["index"]] += choice["delta"].get("content") or ""
        assert texts == {0: _seeded(3, 2), 1: _seeded(4, 2)}
        # the whole request again: new prefills for both choices, on the other decode
        assert len(prefill.legs()) == 4
        assert sorted(choice_of(h["x-request-id"]) for _, h in working.received[-2:]) == [0, 1]
        with trio.fail_after(10):
            await failing.decode_aborted.wait()  # choice 0's first leg was closed
            await prefill.wait_until(holding=False)  # and the first prefills' KV freed


async def test_a_choice_failing_before_its_first_token_once_others_streamed_runs_again_alone() -> (
    None
):
    async with fronted(decodes=2) as (url, [prefill], [failing, working], app):
        pool = _pool(app)
        # the first placement goes to the failing decode (the other is out of rotation:
        # taken only once it is the one left)
        pool.failed(pool.instances[working.url], "kept out of the first placement")
        failing.early_failed_choices = frozenset({1})  # 200, then an error before a token
        gate = failing.early_failure_gate = trio.Event()

        # choice 0's tokens reached the client: choice 1 fails now
        chunks = await _two_choices_streamed(url, 3, once_choice_0_out=gate.set)
        with trio.fail_after(10):
            # choice 1's first KV pulled by a one-token leg, its second by its new leg
            await prefill.wait_until(holding=False)
        await wait_for_stats(lambda: all(i.in_flight == 0 for i in pool.instances.values()))

    # both choices whole, each with one role chunk and one finish, no error
    assert streamed_choices(chunks) == {0: (_seeded(3, 3), "length"), 1: (_seeded(4, 3), "length")}
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens > 0
    # choice 1 alone again: a third prefill with an id of its own, its leg on the other
    # decode; choice 0's legs once each
    ids = [headers["x-request-id"] for _, headers in prefill.received]
    assert len(ids) == 3 and len(set(ids)) == 3
    assert sorted(choice_of(i) for i in ids) == [0, 1, 1]
    [(rerun, rerun_headers)] = [(b, h) for b, h in working.received if b["stream"]]
    assert choice_of(rerun_headers["x-request-id"]) == 1 and rerun["seed"] == 4
    assert rerun_headers["x-request-id"] == ids[-1]
    assert rerun["kv_transfer_params"]["remote_request_id"] == ids[-1]
    streamed_on_failing = [h["x-request-id"] for b, h in failing.received if b["stream"]]
    assert sorted(choice_of(i) for i in streamed_on_failing) == [0, 1]
    assert prefill.unrecognized_pulls == []


async def test_a_decode_that_failed_one_choice_stays_out_of_rotation_though_it_finished_others() -> (
    None
):
    async with fronted(decodes=2) as (url, [prefill], [failing, working], app):
        pool = _pool(app)
        pool.failed(pool.instances[working.url], "kept out of the first placement")
        failing.early_failed_choices = frozenset({1})  # 200, then an error before a token
        gate = failing.early_failure_gate = trio.Event()

        chunks = await _two_choices_streamed(url, 3, once_choice_0_out=gate.set)
        with trio.fail_after(10):
            await prefill.wait_until(holding=False)
        await wait_for_stats(lambda: all(i.in_flight == 0 for i in pool.instances.values()))

        assert streamed_choices(chunks) == {
            0: (_seeded(3, 3), "length"),
            1: (_seeded(4, 3), "length"),
        }
        # the decode that served choice 1 again is back in rotation (once the request's
        # task, past its last write, has said so); the one that finished choice 0 but
        # failed choice 1 stays suspended, as a failed n = 1 request leaves it
        await wait_for_stats(lambda: pool.instances[working.url].failures_in_a_row == 0)
        assert pool.instances[failing.url].failures_in_a_row == 1
        assert pool.instances[failing.url].suspended_until > trio.current_time()


async def test_a_choice_out_of_retries_ends_the_answer_with_an_error_event() -> None:
    async with fronted() as (url, [prefill], [decode], _):
        # one decode: choice 1, failing there once choice 0 streamed, has none left to go to
        decode.early_failed_choices = frozenset({1})
        gate = decode.early_failure_gate = trio.Event()
        async with httpx.AsyncClient(base_url=url) as client:
            async with client.stream(
                "POST",
                "/v1/completions",
                json={"model": MODEL, "prompt": "a b", "max_tokens": 3, "n": 2, "stream": True},
            ) as response:
                text = ""
                async for line in response.aiter_lines():
                    text += line + "\n"
                    if '"text": " t0"' in line or '"text":" t0"' in line:
                        gate.set()
        with trio.fail_after(10):
            await prefill.wait_until(holding=False)
    events = _events(text)
    assert events[-1] == "[DONE]"
    message = events[-2]["error"]["message"]
    assert "choice 1: no decode instance is available" in message and "broke choice 1" in message
    assert len(prefill.legs()) == 2  # (no prefill again: no decode to pull it)


async def test_a_choices_prefill_failing_frees_the_others_kv_and_another_prefill_takes_it() -> None:
    async with fronted(prefills=2) as (url, [failing, working], [decode], app):
        pool = _pool(app)
        pool.failed(pool.instances[working.url], "kept out of the first pick")
        failing.failed_choices = frozenset({1})  # choice 0's prefill is held, choice 1's fails
        async with httpx.AsyncClient(base_url=url) as client:
            response = await client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "a b", "max_tokens": 2, "n": 2, "seed": 5},
            )
        assert response.status_code == 200, response.text
        assert [c["text"] for c in response.json()["choices"]] == [_seeded(5, 2), _seeded(6, 2)]
        assert len(failing.legs()) == len(working.legs()) == 2
        with trio.fail_after(10):
            # choice 0's blocks on the failed prefill: pulled by a one-token leg
            await failing.wait_until(holding=False)
            await working.wait_until(holding=False)
        [release] = [leg for leg in decode.legs() if leg["stream"] is False]
        assert release["kv_transfer_params"]["remote_engine_id"] == "p0"


async def test_a_choice_failing_mid_stream_ends_the_answer_with_an_error_event_and_done() -> None:
    async with fronted() as (url, [prefill], [decode], _):
        decode.fail_after_tokens = 2
        async with httpx.AsyncClient(base_url=url) as client:
            streamed = await client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "a b", "max_tokens": 5, "n": 2, "stream": True},
            )
            whole = await client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "a b", "max_tokens": 5, "n": 2},
            )
        with trio.fail_after(10):
            await prefill.wait_until(holding=False)
    assert streamed.status_code == 200
    events = _events(streamed.text)
    assert events[-1] == "[DONE]"
    assert "the engine broke" in events[-2]["error"]["message"]
    tokens = [e["choices"][0]["text"] for e in events[:-2] if e.get("choices")]
    assert tokens and all(token in (" t0", " t1") for token in tokens)  # what came first
    assert whole.status_code == 502, whole.text
    assert "the engine broke" in whole.json()["error"]["message"]


# --- tools in front of vLLM -------------------------------------------------------------


async def test_an_engines_tool_calls_reach_the_client_as_openai_calls_streamed_or_not() -> None:
    async with fronted() as (url, [prefill], [decode], _):
        decode.tool_calls = list(CALLS)

        def call() -> tuple[Any, list[Any]]:
            with _openai(url) as api:
                fields: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS}
                whole = api.chat.completions.create(n=2, **fields)
                chunks = list(api.chat.completions.create(stream=True, **fields))
                return whole, chunks

        whole, chunks = await trio.to_thread.run_sync(call)
        # both legs carry the tools: the engine renders them with its chat template
        for leg in prefill.legs() + decode.legs():
            assert [tool["function"]["name"] for tool in leg["tools"]] == [
                "get_weather",
                "get_time",
            ]

    assert [c.index for c in whole.choices] == [0, 1]
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls"
        assert not choice.message.content
        calls = choice.message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == CALLS
        assert all(c.type == "function" and c.id.startswith("chatcmpl-tool-") for c in calls)
    deltas = [
        (chunk.choices[0].delta.tool_calls, chunk.choices[0].finish_reason)
        for chunk in chunks
        if chunk.choices
    ]
    called = [call for calls, _ in deltas if calls for call in calls]
    # each call whole, in one chunk, numbered among the answer's
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in called] == [
        (0, *CALLS[0]),
        (1, *CALLS[1]),
    ]
    assert [finish for _, finish in deltas if finish] == ["tool_calls"]


async def test_tool_calls_an_engine_writes_as_text_are_read_by_pdtrios_parser() -> None:
    async with fronted() as (url, _, [decode], _):
        decode.tool_calls = list(CALLS)
        decode.tool_parser = False  # the calls come as <tool_call> blocks in the text

        def call() -> tuple[Any, list[Any]]:
            with _openai(url) as api:
                fields: dict[str, Any] = {
                    "model": MODEL,
                    "messages": MESSAGES,
                    "tools": TOOLS,
                    "max_tokens": 200,
                }
                whole = api.chat.completions.create(**fields)
                chunks = list(api.chat.completions.create(stream=True, **fields))
                return whole, chunks

        whole, chunks = await trio.to_thread.run_sync(call)
    [choice] = whole.choices
    assert choice.finish_reason == "tool_calls"  # (the engine said stop)
    assert "<tool_call>" not in (choice.message.content or "")
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == CALLS
    streamed = [
        (c.function.name, json.loads(c.function.arguments))
        for chunk in chunks
        if chunk.choices and chunk.choices[0].delta.tool_calls
        for c in chunk.choices[0].delta.tool_calls
    ]
    assert streamed == CALLS
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


async def test_tool_choice_none_leaves_a_call_like_text_as_text() -> None:
    async with fronted() as (url, _, [decode], _):
        decode.tool_calls = list(CALLS)
        decode.tool_parser = False  # the model writes a call-like block all the same
        async with httpx.AsyncClient(base_url=url) as client:
            body = {
                "model": MODEL,
                "messages": MESSAGES,
                "tools": TOOLS,
                "tool_choice": "none",
                "max_tokens": 200,
            }
            whole = await client.post("/v1/chat/completions", json=body)
            streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
        assert all(leg["tool_choice"] == "none" for leg in decode.legs())
    assert whole.status_code == 200, whole.text
    [choice] = whole.json()["choices"]
    assert "<tool_call>" in choice["message"]["content"]
    assert not choice["message"].get("tool_calls") and choice["finish_reason"] == "stop"
    events = _events(streamed.text)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == choice["message"]["content"]
    assert all("tool_calls" not in e["choices"][0]["delta"] for e in events[:-1])


async def test_malformed_tool_calls_from_decode_end_the_answer_with_a_clear_error() -> None:
    async with fronted() as (url, _, [decode], app):
        decode.tool_calls = list(CALLS)
        decode.bad_tool_calls = True  # a call's name is not a string
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS}
        async with httpx.AsyncClient(base_url=url) as client:
            streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
            whole = await client.post("/v1/chat/completions", json=body)
        assert _pool(app).instances[decode.url].failures_in_a_row >= 1  # a broken answer
    assert streamed.status_code == 200
    events = _events(streamed.text)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert "decode's stream" in error["message"] and "tool call" in error["message"]
    assert whole.status_code == 502, whole.text
    message = whole.json()["error"]["message"]
    assert "tool call" in message and "Traceback" not in whole.text


# --- SGLang -------------------------------------------------------------------------


async def test_n_choices_in_front_of_sglang_are_a_room_each_streamed_or_not() -> None:
    async with sglang_fronted() as (url, [prefill], [decode]):

        def call() -> tuple[Any, list[Any]]:
            with _openai(url) as api:
                fields: dict[str, Any] = {
                    "model": MODEL,
                    "messages": MESSAGES,
                    "max_tokens": 3,
                    "seed": 20,
                    "n": 2,
                }
                whole = api.chat.completions.create(**fields)
                chunks = list(
                    api.chat.completions.create(
                        stream=True, stream_options={"include_usage": True}, **fields
                    )
                )
                return whole, chunks

        whole, chunks = await trio.to_thread.run_sync(call)
        prefill_legs, decode_legs = prefill.legs(), decode.legs()

    want = [_seeded(20, 3), _seeded(21, 3)]
    assert [c.index for c in whole.choices] == [0, 1]
    assert [c.message.content for c in whole.choices] == want
    assert [c.finish_reason for c in whole.choices] == ["length", "length"]
    assert whole.usage.completion_tokens == 6
    assert streamed_choices(chunks) == {0: (want[0], "length"), 1: (want[1], "length")}
    assert chunks[-1].usage.completion_tokens == 6
    # a room per choice, each on both its legs; no n on any leg
    assert len(prefill_legs) == len(decode_legs) == 4
    rooms = {leg["bootstrap_room"]: leg["seed"] for leg in prefill_legs}
    assert len(rooms) == 4
    assert {leg["bootstrap_room"]: leg["seed"] for leg in decode_legs} == rooms
    assert sorted(rooms.values()) == [20, 20, 21, 21]
    assert all("n" not in leg for leg in prefill_legs + decode_legs)


async def test_a_client_leaving_mid_stream_with_n_closes_every_sglang_leg() -> None:
    async with sglang_fronted() as (url, [prefill], [decode]):
        decode.stall_after_tokens = 1
        async with httpx.AsyncClient(base_url=url) as client:
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:

                    async def leave_mid_stream() -> None:
                        await decode.wait_for_stalls(stalled=2)
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(leave_mid_stream)
                    await client.post(
                        "/v1/completions",
                        json={
                            "model": MODEL,
                            "prompt": "a b",
                            "max_tokens": 8,
                            "n": 2,
                            "stream": True,
                        },
                    )
        with trio.fail_after(10):
            await decode.wait_for_stalls(stalled=2, hung_up=2)
        assert len(prefill.legs()) == 2  # (each answered once its room was fetched)


async def test_an_sglang_choice_failing_before_its_first_token_runs_again_alone_in_a_new_room() -> (
    None
):
    async with sglang_fronted(decodes=2) as (url, [prefill], decodes):
        gate = trio.Event()
        for decode in decodes:
            decode.early_failed_choices = frozenset({1})
            decode.early_failure_gate = gate

        def let_choice_1_fail() -> None:
            # choice 0's tokens reached the client: choice 1 fails on the decode placed,
            # and the other (the one its retry goes to) serves it
            for decode in decodes:
                if not decode.received:
                    decode.early_failed_choices = frozenset()
            gate.set()

        chunks = await _two_choices_streamed(url, 8, once_choice_0_out=let_choice_1_fail)
        prefill_legs = prefill.legs()
        decode_legs = [leg for decode in decodes for leg in decode.legs()]
    assert streamed_choices(chunks) == {0: (_seeded(8, 3), "length"), 1: (_seeded(9, 3), "length")}
    assert chunks[-1].usage.completion_tokens == 6
    # choice 1's second run: a room of its own on both its legs
    assert len(prefill_legs) == len(decode_legs) == 3
    rooms = [leg["bootstrap_room"] for leg in prefill_legs]
    assert len(set(rooms)) == 3
    assert sorted(leg["bootstrap_room"] for leg in decode_legs) == sorted(rooms)


async def test_an_sglang_engines_tool_calls_reach_the_client_streamed_or_not() -> None:
    async with sglang_fronted() as (url, _, [decode]):
        decode.tool_calls = list(CALLS)
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS}
        async with httpx.AsyncClient(base_url=url) as client:
            whole = await client.post("/v1/chat/completions", json=body)
            streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert whole.status_code == 200, whole.text
    [choice] = whole.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == (
        CALLS
    )
    events = _events(streamed.text)
    streamed_calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for e in events[:-1]
        for c in e["choices"][0]["delta"].get("tool_calls") or []
    ]
    assert streamed_calls == CALLS
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "tool_calls"
