"""``POST /v1/responses`` through the real openai client, disaggregated and colocated.

The synthetic engine's output is a function of the prompt's tokens, so a
response equals the chat completion of the messages its input maps to.  It
finishes only at the token limit: every answer here is ``incomplete``.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
import trio

from tests.cluster import running_cluster, wait_until_idle

TOPOLOGIES = [("prefill", "decode"), ("both",)]

STREAM_EVENTS_HEAD = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
STREAM_EVENTS_TAIL = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.incomplete",
]


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.mark.parametrize("roles", TOPOLOGIES, ids=["pd", "colocated"])
async def test_streamed_and_whole_responses_agree(roles: tuple[str, ...]) -> None:
    async with running_cluster(roles=roles) as cluster:

        def call() -> tuple[Any, list[Any]]:
            with _openai(cluster.url) as api:
                whole = api.responses.create(model="synthetic", input="hi", max_output_tokens=6)
                events = list(
                    api.responses.create(
                        model="synthetic", input="hi", max_output_tokens=6, stream=True
                    )
                )
                return whole, events

        whole, events = await trio.to_thread.run_sync(call)
        await wait_until_idle(cluster)
    assert whole.object == "response"
    assert whole.id.startswith("resp_")
    assert len(whole.output_text.split()) == 6
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[0].type == "message" and whole.output[0].id.startswith("msg_")
    assert whole.usage.output_tokens == 6
    assert whole.usage.input_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + 6
    assert whole.max_output_tokens == 6 and whole.tools == []

    kinds = [event.type for event in events]
    assert kinds[:4] == STREAM_EVENTS_HEAD
    assert kinds[-4:] == STREAM_EVENTS_TAIL
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text
    assert events[-4].text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.status == "incomplete"
    assert final.usage.output_tokens == 6
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.id == events[0].response.id != whole.id


@pytest.mark.parametrize("roles", TOPOLOGIES, ids=["pd", "colocated"])
async def test_instructions_and_items_are_the_chat_messages(roles: tuple[str, ...]) -> None:
    async with running_cluster(roles=roles) as cluster:

        def call() -> tuple[Any, Any, Any]:
            with _openai(cluster.url) as api:
                response = api.responses.create(
                    model="synthetic",
                    instructions="Be brief.",
                    input=[
                        {"role": "user", "content": "hi"},
                        {
                            "type": "message",
                            "role": "assistant",
                            "content": [{"type": "output_text", "text": "hello"}],
                        },
                        {
                            "type": "message",
                            "role": "user",
                            "content": [{"type": "input_text", "text": "more"}],
                        },
                    ],
                    max_output_tokens=5,
                    temperature=0.5,
                    metadata={"team": "a"},
                    store=False,
                )
                chat = api.chat.completions.create(
                    model="synthetic",
                    messages=[
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "hello"},
                        {"role": "user", "content": "more"},
                    ],
                    max_tokens=5,
                    temperature=0.5,
                )
                plain = api.responses.create(model="synthetic", input="more", max_output_tokens=5)
                return response, chat, plain

        response, chat, plain = await trio.to_thread.run_sync(call)
        await wait_until_idle(cluster)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert plain.output_text != response.output_text  # (the other messages counted)
    assert response.instructions == "Be brief."
    assert response.metadata == {"team": "a"}
    assert response.store is False
    assert response.temperature == 0.5


BAD_REQUESTS: list[tuple[dict[str, Any], str]] = [
    # the synthetic engine serves no output constraint: the 400 names the client's field
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}},
        "text.format",
    ),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    # a forced call needs a grammar, which the synthetic engine does not serve
    (
        {"tools": [{"type": "function", "name": "f", "parameters": {}}], "tool_choice": "required"},
        "tools",
    ),
    ({"tools": [{"type": "web_search"}]}, "tools.[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input.[0].content.[0].type",
    ),
    (
        {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
        "input.[0].call_id",
    ),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.[0].role"),
]


async def test_bad_and_unserved_requests_are_a_400_naming_the_param() -> None:
    async with running_cluster() as cluster:

        def call() -> list[tuple[int, Any]]:
            errors = []
            with _openai(cluster.url) as api:
                for fields, _ in BAD_REQUESTS:
                    request: dict[str, Any] = {"input": "hi", "max_output_tokens": 4, **fields}
                    with pytest.raises(openai.BadRequestError) as info:
                        api.responses.create(model="synthetic", **request)
                    errors.append((info.value.status_code, info.value.body))
                # streamed too: refused before the stream begins, a plain 400
                with pytest.raises(openai.BadRequestError) as info:
                    api.responses.create(
                        model="synthetic",
                        input="hi",
                        stream=True,
                        text={"format": {"type": "json_object"}},
                    )
                errors.append((info.value.status_code, info.value.body))
            return errors

        errors = await trio.to_thread.run_sync(call)
        await wait_until_idle(cluster)
    wanted = [param for _, param in BAD_REQUESTS] + ["text.format"]
    assert [status for status, _ in errors] == [400] * len(wanted)
    assert [body.get("param") for _, body in errors] == wanted


async def test_a_stream_is_typed_events_without_done() -> None:
    async with running_cluster() as cluster:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as http:
            response = await http.post(
                "/v1/responses",
                json={"model": "synthetic", "input": "hi", "max_output_tokens": 2, "stream": True},
            )
            await wait_until_idle(cluster)
            metrics = (await http.get("/metrics")).text
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-1] == ""
    assert "[DONE]" not in response.text
    for event in events[:-1]:
        kind, data = event.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: {")
        assert f'"type":"{kind[7:]}"' in data
    assert events[-2].startswith("event: response.incomplete\n")
    # counted under its own endpoint
    assert (
        'pdtrio_requests_total{endpoint="/v1/responses",model="synthetic",outcome="ok"' in metrics
    )


WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.mark.parametrize("roles", TOPOLOGIES, ids=["pd", "colocated"])
async def test_tools_and_a_call_history_run_as_the_chat_request(roles: tuple[str, ...]) -> None:
    """The synthetic engine never calls (its text is no <tool_call>), but what it says
    is a function of the prompt: the tools and the earlier call and its output reach it
    as the chat request's do."""
    async with running_cluster(roles=roles) as cluster:

        def call() -> tuple[Any, Any, list[Any], Any]:
            with _openai(cluster.url) as api:
                base: dict[str, Any] = {"model": "synthetic", "max_output_tokens": 5}
                history: list[Any] = [
                    {"role": "user", "content": "Weather in Oslo?"},
                    {
                        "type": "function_call",
                        "call_id": "call_1",
                        "name": "get_weather",
                        "arguments": '{"city": "Oslo"}',
                    },
                    {"type": "function_call_output", "call_id": "call_1", "output": "snow"},
                ]
                response = api.responses.create(
                    input=history, tools=[WEATHER_TOOL], parallel_tool_calls=False, **base
                )
                events = list(
                    api.responses.create(input=history, tools=[WEATHER_TOOL], stream=True, **base)
                )
                chat = api.chat.completions.create(
                    model="synthetic",
                    max_tokens=5,
                    tools=[
                        {
                            "type": "function",
                            "function": {
                                "name": "get_weather",
                                "description": "The weather in a city",
                                "parameters": WEATHER_TOOL["parameters"],
                            },
                        }
                    ],
                    messages=[
                        {"role": "user", "content": "Weather in Oslo?"},
                        {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [
                                {
                                    "id": "call_1",
                                    "type": "function",
                                    "function": {
                                        "name": "get_weather",
                                        "arguments": '{"city": "Oslo"}',
                                    },
                                }
                            ],
                        },
                        {
                            "role": "tool",
                            "tool_call_id": "call_1",
                            "name": "get_weather",
                            "content": "snow",
                        },
                    ],
                )
                plain = api.responses.create(input=history[:1], **base)
                return response, chat, events, plain

        response, chat, events, plain = await trio.to_thread.run_sync(call)
        await wait_until_idle(cluster)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.input_tokens > plain.usage.input_tokens  # (tools and history shown)
    assert [tool.name for tool in response.tools] == ["get_weather"]
    assert response.tools[0].parameters == WEATHER_TOOL["parameters"]
    assert response.tool_choice == "auto" and response.parallel_tool_calls is False
    final = events[-1].response
    assert final.output_text == response.output_text
    assert [item.type for item in final.output] == ["message"]
