"""``/v1/responses`` in front of vLLM and SGLang engines (their fakes: fake_vllm.py,
fake_sglang.py), through the real openai client.

The engines are sent the chat request a Responses body stands for
(``responses.engine_chat_body``) on both legs, and decode's chat stream comes back as
the Responses events or body, with chat's guarantees in front of engines.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import trio

from tests.cluster import wait_for_stats
from tests.router.fake_vllm import CACHED_TOKENS, MODEL
from tests.router.test_engine_choices_and_tools import CALLS, _openai, _pool, _seeded
from tests.router.test_engine_choices_and_tools import TOOLS as CHAT_TOOLS
from tests.router.test_sglang_front import fronted as sglang_fronted
from tests.router.test_vllm_front import fronted

# the chat tests' tools in the Responses API's flat shape
TOOLS = [{"type": "function", **tool["function"]} for tool in CHAT_TOOLS]
INPUT: list[Any] = [
    {"role": "user", "content": "hi"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yo"}]},
    {"role": "user", "content": [{"type": "input_text", "text": "more"}]},
]
STREAM_HEAD = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
STREAM_TAIL = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.incomplete",
]


def _deltas(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


async def test_a_response_is_the_chat_request_on_both_legs_streamed_or_not() -> None:
    async with fronted() as (url, [prefill], [decode], _):

        def call() -> tuple[Any, list[Any]]:
            fields: dict[str, Any] = {
                "model": MODEL,
                "instructions": "Be brief.",
                "input": INPUT,
                "max_output_tokens": 3,
                "temperature": 0.5,
                "top_p": 0.9,
                "metadata": {"team": "a"},
                "extra_body": {"seed": 11},
            }
            with _openai(url) as api:
                whole = api.responses.create(**fields)
                events = list(api.responses.create(stream=True, **fields))
                return whole, events

        whole, events = await trio.to_thread.run_sync(call)
        with trio.fail_after(10):
            await prefill.wait_until(holding=False)  # decode pulled each request's KV
        prefill_legs, decode_legs = prefill.received, decode.received

    want = _seeded(11, 3)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.output_text == want
    assert whole.status == "incomplete"  # (the fake stops at the token limit)
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.metadata == {"team": "a"} and whole.max_output_tokens == 3
    assert whole.usage.output_tokens == 3
    assert whole.usage.input_tokens > 0
    assert whole.usage.input_tokens_details.cached_tokens == CACHED_TOKENS

    kinds = [event.type for event in events]
    assert kinds[:4] == STREAM_HEAD and kinds[-4:] == STREAM_TAIL
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert _deltas(events) == want
    final = events[-1].response
    assert final.output_text == want and final.usage.output_tokens == 3
    assert final.usage.input_tokens == whole.usage.input_tokens

    # each leg a chat request: the instructions a system message, the items chat's
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "more"},
    ]
    assert len(prefill_legs) == len(decode_legs) == 2
    for (leg, headers), (decode_leg, decode_headers) in zip(prefill_legs, decode_legs, strict=True):
        assert headers["x-request-id"] == decode_headers["x-request-id"]
        assert headers["x-request-id"].startswith("resp_")
        assert leg["messages"] == decode_leg["messages"] == messages
        assert leg["max_tokens"] == 1 and leg["stream"] is False
        assert leg["kv_transfer_params"]["do_remote_decode"] is True
        assert decode_leg["max_tokens"] == 3 and decode_leg["stream"] is True
        assert decode_leg["kv_transfer_params"]["remote_engine_id"] == "p0"
        for body in (leg, decode_leg):
            assert (body["temperature"], body["top_p"], body["seed"]) == (0.5, 0.9, 11)
            for key in ("input", "instructions", "max_output_tokens", "metadata"):
                assert key not in body


async def test_an_engines_tool_calls_are_function_call_items_streamed_or_not() -> None:
    async with fronted() as (url, [prefill], [decode], _):
        decode.tool_calls = list(CALLS)
        history: list[Any] = [
            {"role": "user", "content": "weather?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
            {"role": "user", "content": "and Paris?"},
        ]

        def call() -> tuple[Any, list[Any], Any]:
            with _openai(url) as api:
                fields: dict[str, Any] = {"model": MODEL, "input": history, "tools": TOOLS}
                whole = api.responses.create(**fields)
                events = list(api.responses.create(stream=True, **fields))
                named = api.responses.create(
                    model=MODEL,
                    input="weather?",
                    tools=TOOLS,
                    tool_choice={"type": "function", "name": "get_time"},
                )
                return whole, events, named

        whole, events, named = await trio.to_thread.run_sync(call)
        legs = prefill.legs() + decode.legs()

    want = [(name, arguments) for name, arguments in CALLS]
    assert [item.type for item in whole.output] == ["function_call", "function_call"]
    assert [(i.name, json.loads(i.arguments)) for i in whole.output] == want
    assert all(i.call_id.startswith("chatcmpl-tool-") for i in whole.output)
    assert whole.status == "completed"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.name, json.loads(i.arguments)) for i in done] == want
    assert events[-1].type == "response.completed"
    assert [(i.name, i.call_id) for i in events[-1].response.output] == [
        (i.name, i.call_id) for i in done
    ]
    [forced] = named.output
    assert forced.name == "get_time" and named.tool_choice.name == "get_time"

    # chat's shapes on the legs: nested tools, the history's call and its answer
    for leg in legs:
        assert [t["function"]["name"] for t in leg["tools"]] == ["get_weather", "get_time"]
        assert leg["tools"][0]["function"]["parameters"] == TOOLS[0]["parameters"]
    first = legs[0]["messages"]
    assert first[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    }
    assert first[2] == {"role": "tool", "content": "rain", "tool_call_id": "call_1"}
    assert "tool_choice" not in legs[0]
    assert legs[-1]["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}


async def test_a_client_leaving_a_streamed_response_closes_decodes_leg() -> None:
    async with fronted() as (url, [prefill], [decode], app):
        decode.stall_after_tokens = 2  # two tokens out, then the engine waits for a hang-up

        def read_two_tokens_and_leave() -> str:
            with _openai(url) as api:
                stream = api.responses.create(
                    model=MODEL, input="hi", max_output_tokens=8, stream=True
                )
                with stream:
                    text = ""
                    for event in stream:
                        if event.type == "response.output_text.delta":
                            text += event.delta
                            if text == _seeded_plain(2):
                                return text
            raise AssertionError("the stream ended before two tokens")

        assert await trio.to_thread.run_sync(read_two_tokens_and_leave) == " t0 t1"
        with trio.fail_after(10):
            await decode.wait_for_stalls(stalled=1, hung_up=1)  # the router closed the leg
        pool = _pool(app)
        await wait_for_stats(lambda: all(i.in_flight == 0 for i in pool.instances.values()))
        assert prefill.held == {}


async def test_a_client_leaving_between_the_legs_frees_the_prefilled_kv() -> None:
    async with fronted() as (url, [prefill], [decode], _):
        decode.decode_gate = trio.Event()  # decode takes the leg but waits
        # (httpx: a request cancelled here closes its connection, as a client leaving does)
        async with httpx.AsyncClient(base_url=url) as client:
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:

                    async def leave_once_prefilled() -> None:
                        await decode.decode_waiting.wait()
                        nursery.cancel_scope.cancel()  # the client goes

                    nursery.start_soon(leave_once_prefilled)
                    await client.post(
                        "/v1/responses",
                        json={"model": MODEL, "input": "hi", "max_output_tokens": 8},
                    )
        with trio.fail_after(10):
            await decode.decode_aborted.wait()  # the router closed the decode leg
        assert prefill.held  # stranded, until a decode pulls them
        decode.decode_gate.set()
        with trio.fail_after(10):
            await prefill.wait_until(holding=False)  # a one-token leg pulled them
        release = decode.legs()[-1]
        assert release["max_tokens"] == 1 and release["stream"] is False
        assert release["messages"] == [{"role": "user", "content": "hi"}]


async def test_a_decode_failing_before_its_first_token_is_retried_and_after_it_is_an_error_event() -> (  # noqa: E501
    None
):
    async with fronted(decodes=2) as (url, [prefill], [failing, working], app):
        pool = _pool(app)
        pool.failed(pool.instances[working.url], "kept out of the first placement")
        failing.fail_status = 500

        def retried() -> Any:
            with _openai(url) as api:
                return list(
                    api.responses.create(model=MODEL, input="hi", max_output_tokens=2, stream=True)
                )

        events = await trio.to_thread.run_sync(retried)
        assert _deltas(events) == " t0 t1" and events[-1].type == "response.incomplete"
        assert len(prefill.legs()) == 2  # prefilled again for the other decode
        streamed_legs = [leg for leg in working.legs() if leg["stream"]]
        assert failing.legs() and len(streamed_legs) == 1

        # now either decode breaks after its first token
        failing.fail_status = 0
        failing.fail_after_tokens = working.fail_after_tokens = 1

        def broken() -> tuple[list[Any], openai.APIStatusError]:
            with _openai(url) as api:
                streamed = list(
                    api.responses.create(model=MODEL, input="hi", max_output_tokens=4, stream=True)
                )
                try:
                    api.responses.create(model=MODEL, input="hi", max_output_tokens=4)
                except openai.APIStatusError as exc:
                    return streamed, exc
            raise AssertionError("the broken answer was a 200")

        streamed, whole = await trio.to_thread.run_sync(broken)
    assert _deltas(streamed) == " t0"
    assert [e.type for e in streamed[-2:]] == ["error", "response.failed"]
    assert "the engine broke" in streamed[-2].message
    failed = streamed[-1].response
    assert failed.status == "failed" and failed.output_text == " t0"
    assert whole.status_code == 502 and "the engine broke" in whole.message
    assert "Traceback" not in str(whole.body)


async def test_bad_input_is_a_400_naming_its_param_before_any_leg() -> None:
    async with fronted() as (url, [prefill], [decode], _):

        def call() -> list[tuple[int, Any]]:
            refused = []
            with _openai(url) as api:
                for fields in (
                    {"input": "hi", "previous_response_id": "resp_1"},
                    {"input": [{"type": "reasoning", "summary": []}]},
                    {"input": "hi", "tools": [{"type": "web_search"}]},
                    {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                ):
                    try:
                        api.responses.create(model=MODEL, **fields)
                    except openai.BadRequestError as exc:
                        refused.append((exc.status_code, exc.body))
            return refused

        refused = await trio.to_thread.run_sync(call)
        assert prefill.received == [] and decode.received == []
    assert [status for status, _ in refused] == [400] * 4
    assert [body["param"] for _, body in refused] == [
        "previous_response_id",
        "input.[0].type",
        "tools.[0].type",
        "input.[0].content.[0].type",
    ]


async def test_an_engines_4xx_is_passed_on_as_the_clients_400() -> None:
    async with fronted() as (url, [prefill], _, _):
        prefill.fail_status = 400  # (the fake's error names no param: the message is kept)

        def call() -> openai.BadRequestError:
            with _openai(url) as api:
                try:
                    api.responses.create(model=MODEL, input="hi")
                except openai.BadRequestError as exc:
                    return exc
            raise AssertionError("a 200")

        refused = await trio.to_thread.run_sync(call)
    assert refused.status_code == 400 and "p0 says no" in refused.message


# --- SGLang -------------------------------------------------------------------------


async def test_a_response_in_front_of_sglang_is_one_room_on_both_chat_legs() -> None:
    async with sglang_fronted() as (url, [prefill], [decode]):

        def call() -> tuple[Any, list[Any]]:
            with _openai(url) as api:
                fields: dict[str, Any] = {
                    "model": MODEL,
                    "instructions": "sys",
                    "input": "hi",
                    "max_output_tokens": 3,
                }
                whole = api.responses.create(**fields)
                events = list(api.responses.create(stream=True, **fields))
                return whole, events

        whole, events = await trio.to_thread.run_sync(call)
        prefill_legs, decode_legs = prefill.legs(), decode.legs()
    assert whole.output_text == " t0 t1 t2" and whole.usage.output_tokens == 3
    assert _deltas(events) == " t0 t1 t2" and events[-1].type == "response.incomplete"
    assert len(prefill_legs) == len(decode_legs) == 2
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    for prefill_leg, decode_leg in zip(prefill_legs, decode_legs, strict=True):
        assert prefill_leg["bootstrap_room"] == decode_leg["bootstrap_room"]
        assert prefill_leg["messages"] == decode_leg["messages"] == messages


async def test_a_client_leaving_a_streamed_response_closes_both_sglang_legs() -> None:
    async with sglang_fronted() as (url, [prefill], [decode]):
        decode.stall_after_tokens = 1

        def read_a_token_and_leave() -> str:
            with _openai(url) as api:
                stream = api.responses.create(
                    model=MODEL, input="hi", max_output_tokens=8, stream=True
                )
                with stream:
                    for event in stream:
                        if event.type == "response.output_text.delta":
                            return str(event.delta)
            raise AssertionError("no token came")

        assert await trio.to_thread.run_sync(read_a_token_and_leave) == " t0"
        with trio.fail_after(10):
            await decode.wait_for_stalls(stalled=1, hung_up=1)
        assert len(prefill.legs()) == 1


def _seeded_plain(tokens: int) -> str:
    """What the fake answers a request with no seed: " t0 t1 ..."."""
    return "".join(f" t{i}" for i in range(tokens))
