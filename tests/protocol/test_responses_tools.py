"""Function tools on /v1/responses, sans-IO: the flat shapes parsed as chat's are, the
calls history rendered as chat's is, and the model's calls as ``function_call`` output
items, whole and streamed, checked against the openai client's own models."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pdtrio.protocol.link.wire import ChatPrompt, ChatPromptWithTools, Usage
from pdtrio.protocol.openai import OpenAIError, parse_chat_completion_request
from pdtrio.protocol.openai.answers import answer_shape
from pdtrio.protocol.openai.responses import ResponsesRequest, parse_responses_request
from pdtrio.protocol.openai.responses_sse import ResponsesStreamShaper
from pdtrio.protocol.openai.tools import ToolCall, call_text

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
# the same two tools, in each API's shape
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": WEATHER_PARAMETERS,
    "strict": True,
}
TIME = {"type": "function", "name": "get_time"}
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER_PARAMETERS,
            "strict": True,
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
NAMES = ["get_weather", "get_time"]
_events = TypeAdapter(ResponseStreamEvent)


def _parse(**fields: Any) -> ResponsesRequest:
    body = {"model": "m", "input": "hi", **fields}
    return parse_responses_request(
        json.dumps(body).encode(), served_models={"m"}, max_tokens_limit=100
    )


def _chat(**fields: Any) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat_completion_request(
        json.dumps(body).encode(), served_models={"m"}, max_tokens_limit=100
    )


@pytest.mark.parametrize(
    ("choice", "chat_choice"),
    [
        (None, None),
        ("auto", "auto"),
        ("required", "required"),
        (
            {"type": "function", "name": "get_time"},
            {"type": "function", "function": {"name": "get_time"}},
        ),
    ],
)
def test_tools_are_the_chat_requests_tools(choice: Any, chat_choice: Any) -> None:
    extra = {} if choice is None else {"tool_choice": choice}
    chat_extra = {} if chat_choice is None else {"tool_choice": chat_choice}
    responses = _parse(tools=[WEATHER, TIME], parallel_tool_calls=False, **extra).chat
    chat = _chat(tools=CHAT_TOOLS, parallel_tool_calls=False, **chat_extra)
    assert responses.tools is not None and responses.tools == chat.tools
    assert responses.prompt == chat.prompt
    assert isinstance(responses.prompt, ChatPromptWithTools)
    # the forced call's grammar, or none for auto
    assert responses.sampling.structured == chat.sampling.structured
    assert (responses.sampling.structured is None) == (choice in (None, "auto"))


def test_tool_choice_none_shows_no_tools_but_echoes_them() -> None:
    request = _parse(tools=[WEATHER], tool_choice="none")
    assert request.chat.tools is None and type(request.chat.prompt) is ChatPrompt
    assert request.tool_choice == "none" and [t["name"] for t in request.tools] == ["get_weather"]


def test_calls_and_their_outputs_are_the_chat_history() -> None:
    responses = _parse(
        tools=[WEATHER, TIME],
        input=[
            {"role": "user", "content": "Weather and time in Paris?"},
            {"type": "message", "role": "assistant", "content": "Checking."},
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_a",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
                "status": "completed",
            },
            {"type": "function_call", "call_id": "call_b", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "call_b",
                "output": [{"type": "input_text", "text": "noon"}],
            },
        ],
    )
    chat = _chat(
        tools=CHAT_TOOLS,
        messages=[
            {"role": "user", "content": "Weather and time in Paris?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    },
                    {
                        "id": "call_b",
                        "type": "function",
                        "function": {"name": "get_time", "arguments": "{}"},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_a", "name": "get_weather", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_b", "name": "get_time", "content": "noon"},
        ],
    )
    assert responses.chat.prompt == chat.prompt
    assert len(responses.chat.prompt.messages) == 4


def test_a_call_history_without_tools_is_still_rendered() -> None:
    prompt = _parse(
        input=[
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "done"},
            {"role": "user", "content": "and now?"},
        ]
    ).chat.prompt
    assert isinstance(prompt, ChatPromptWithTools) and prompt.tools_json == ""
    assert [role for role, _ in prompt.messages] == ["assistant", "tool", "user"]
    assert json.loads(prompt.message_extras[1]) == {"tool_call_id": "c1", "name": "f"}


CALL = {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": ["get_time"]}, "tools.[0]"),
        ({"tools": [TIME, {"type": "web_search"}]}, "tools.[1].type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools.[0].type"),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools.[0].type"),
        ({"tools": [{"type": "custom", "name": "x"}]}, "tools.[0].type"),
        ({"tools": [{"type": "function"}]}, "tools.[0].name"),
        ({"tools": [{"type": "function", "name": "a b"}]}, "tools.[0].name"),
        # the chat shape is not the flat one
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools.[0].name"),
        ({"tools": [{**TIME, "parameters": []}]}, "tools.[0].parameters"),
        ({"tools": [{**TIME, "strict": "yes"}]}, "tools.[0].strict"),
        ({"tools": [{**TIME, "description": 3}]}, "tools.[0].description"),
        ({"tools": [TIME, TIME]}, "tools.[1].name"),
        ({"tools": [TIME] * 129}, "tools"),
        ({"tools": [TIME], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [TIME], "tool_choice": 1}, "tool_choice"),
        ({"tools": [TIME], "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"tools": [TIME], "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
        ({"tools": [TIME], "tool_choice": {"type": "function"}}, "tool_choice.name"),
        ({"tools": [TIME], "tool_choice": {"type": "function", "name": "x"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice"),
        ({"tools": [TIME], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {
                "tools": [TIME],
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            "tool_choice",
        ),
        ({"input": [{**CALL, "call_id": None}]}, "input.[0].call_id"),
        ({"input": [{**CALL, "call_id": 5}]}, "input.[0].call_id"),
        ({"input": [{**CALL, "name": ["f"]}]}, "input.[0].name"),
        ({"input": [{**CALL, "arguments": {}}]}, "input.[0].arguments"),
        ({"input": [{**CALL, "arguments": "\ud800"}]}, "input.[0].arguments"),
        (
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    CALL,
                    {"type": "function_call_output", "call_id": "c2", "output": "x"},
                ]
            },
            "input.[2].call_id",
        ),
        (
            {"input": [CALL, {"type": "function_call_output", "call_id": "c1"}]},
            "input.[1].output",
        ),
        (
            {"input": [CALL, {"type": "function_call_output", "call_id": "c1", "output": 3}]},
            "input.[1].output",
        ),
        (
            {
                "input": [
                    CALL,
                    {
                        "type": "function_call_output",
                        "call_id": "c1",
                        "output": [{"type": "input_image", "image_url": "x"}],
                    },
                ]
            },
            "input.[1].output.[0].type",
        ),
        ({"input": [{"type": "custom_tool_call", "call_id": "c"}]}, "input.[0].type"),
    ],
)
def test_bad_tool_shapes_are_a_400_naming_the_param(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        _parse(**fields)
    assert info.value.status == 400
    assert info.value.param == param


def _body(request: ResponsesRequest, text: str, finish: str = "stop") -> dict[str, Any]:
    shape = answer_shape("responses", request)
    assert shape.own_body is not None
    return shape.own_body(
        request_id="resp_1",
        created=1,
        text=text,
        finish_reason=finish,
        usage=Usage(3, 9, 0),
        logprobs=None,
        top_logprobs=0,
    )


def test_the_response_echoes_tools_and_tool_choice() -> None:
    request = _parse(
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
    )
    response = Response.model_validate(_body(request, ""))
    assert [tool.model_dump(exclude_none=True) for tool in response.tools] == [WEATHER, TIME]
    assert response.tool_choice.type == "function"  # type: ignore[union-attr]
    assert response.tool_choice.name == "get_weather"  # type: ignore[union-attr]
    assert response.parallel_tool_calls is False
    plain = Response.model_validate(_body(_parse(tools=[TIME], tool_choice="required"), ""))
    assert plain.tool_choice == "required" and plain.parallel_tool_calls is True


def test_a_whole_answer_is_its_message_then_its_calls() -> None:
    text = (
        "Let me look."
        + call_text("get_weather", {"city": "Paris"})
        + "\n"
        + call_text("get_time", {})
    )
    response = Response.model_validate(_body(_parse(tools=[WEATHER, TIME]), text))
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["message", "function_call", "function_call"]
    assert response.output_text == "Let me look."
    first, second = response.output[1], response.output[2]
    assert first.type == "function_call" and second.type == "function_call"
    assert (first.id, second.id) == ("fc_1_1", "fc_1_2")
    assert first.call_id.startswith("call_") and first.call_id != second.call_id
    assert (first.name, json.loads(first.arguments)) == ("get_weather", {"city": "Paris"})
    assert (second.name, second.arguments, second.status) == ("get_time", "{}", "completed")


def test_an_answer_that_only_calls_has_no_message() -> None:
    response = Response.model_validate(_body(_parse(tools=[TIME]), call_text("get_time", {})))
    assert [item.type for item in response.output] == ["function_call"]
    assert response.output_text == ""
    # no tools: a <tool_call> block is only text
    plain = Response.model_validate(_body(_parse(), call_text("get_time", {})))
    assert [item.type for item in plain.output] == ["message"]
    # with tools and no call, an empty answer is still an (empty) message
    empty = Response.model_validate(_body(_parse(tools=[TIME]), ""))
    assert [item.type for item in empty.output] == ["message"]


def _stream_events(data: bytes) -> list[Any]:
    events = []
    for block in data.decode().split("\n\n")[:-1]:
        kind, payload = block.split("\n")
        event = _events.validate_python(json.loads(payload.removeprefix("data: ")))
        assert event.type == kind.removeprefix("event: ")
        events.append(event)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    return events


def _call(name: str, arguments: str, index: int = 0) -> ToolCall:
    return ToolCall(index, f"call_{index}", name, arguments)


def test_a_streamed_call_is_its_item_and_arguments_events() -> None:
    request = _parse(tools=[WEATHER, TIME], stream=True)
    shaper = ResponsesStreamShaper(request=request, response_id="resp_2", created_at=1)
    shaper.set_prompt_usage(3, 0)
    calls = [_call("get_weather", '{"city": "Paris"}'), _call("get_time", "{}", 1)]
    data = shaper.delta("", 1, None)  # (text held: it may begin a call)
    data += shaper.delta("Let me look.", 2, None)
    data += shaper.tool_calls(calls)
    data += shaper.delta("", 0, "tool_calls", Usage(3, 9, 0)) + shaper.done()
    events = _stream_events(data)
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        *[
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
        ]
        * 2,
        "response.completed",
    ]
    added, delta, done, item_done = events[8:12]
    assert added.output_index == delta.output_index == done.output_index == 1
    assert added.item.type == "function_call" and added.item.arguments == ""
    assert added.item.status == "in_progress" and added.item.id == delta.item_id == "fc_2_1"
    assert (delta.delta, done.arguments) == ('{"city": "Paris"}', '{"city": "Paris"}')
    assert item_done.item.status == "completed" and item_done.item.call_id == "call_0"
    assert events[12].output_index == 2 and events[12].item.name == "get_time"
    final = events[-1].response
    assert final.status == "completed" and final.usage.output_tokens == 9
    assert [item.type for item in final.output] == ["message", "function_call", "function_call"]
    # the same as the whole body of that answer
    whole = _body(request, "Let me look.")
    assert final.output[0].model_dump() == Response.model_validate(whole).output[0].model_dump() | {
        "id": "msg_2"
    }
    assert [item.model_dump() for item in final.output[1:]] == [
        item_done.item.model_dump(),
        events[15].item.model_dump(),
    ]


def test_a_streamed_answer_that_only_calls_opens_no_message() -> None:
    shaper = ResponsesStreamShaper(
        request=_parse(tools=[TIME], stream=True), response_id="resp_3", created_at=1
    )
    data = shaper.delta("", 4, None) + shaper.tool_calls([_call("get_time", "{}")])
    data += shaper.delta("", 1, "tool_calls", Usage(1, 5)) + shaper.done()
    events = _stream_events(data)
    assert not [
        e for e in events if e.type.startswith(("response.output_text", "response.content"))
    ]
    assert [e.output_index for e in events if hasattr(e, "output_index")] == [0, 0, 0, 0]
    assert [item.id for item in events[-1].response.output] == ["fc_3_0"]
    with pytest.raises(ValueError):
        shaper.tool_calls([_call("get_time", "{}")])


def test_text_after_a_call_is_a_message_of_its_own() -> None:
    shaper = ResponsesStreamShaper(
        request=_parse(tools=[TIME], stream=True), response_id="resp_4", created_at=1
    )
    data = shaper.tool_calls([_call("get_time", "{}")]) + shaper.delta("done", 1, "stop")
    events = _stream_events(data + shaper.done())
    final = events[-1].response
    assert [(item.type, item.id) for item in final.output] == [
        ("function_call", "fc_4_0"),
        ("message", "msg_4_1"),
    ]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [(e.item_id, e.output_index, e.delta) for e in deltas] == [("msg_4_1", 1, "done")]


def test_with_tools_and_nothing_said_the_stream_has_an_empty_message() -> None:
    shaper = ResponsesStreamShaper(
        request=_parse(tools=[TIME], stream=True), response_id="resp_5", created_at=1
    )
    events = _stream_events(shaper.delta("", 1, "length", Usage(1, 1)) + shaper.done())
    final = events[-1].response
    assert final.status == "incomplete"
    assert [(item.type, item.status) for item in final.output] == [("message", "incomplete")]


def test_an_error_after_a_call_keeps_the_call() -> None:
    shaper = ResponsesStreamShaper(
        request=_parse(tools=[TIME], stream=True), response_id="resp_6", created_at=1
    )
    data = shaper.tool_calls([_call("get_time", "{}")]) + shaper.delta("and", 1, None)
    data += shaper.error(OpenAIError("decode lost", status=502, type="server_error"))
    failed = _stream_events(data)[-1].response
    assert failed.status == "failed"
    assert [(item.type, item.status) for item in failed.output] == [
        ("function_call", "completed"),
        ("message", "incomplete"),
    ]
