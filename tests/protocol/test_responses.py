"""/v1/responses sans-IO: the request parsed to a chat request, the Response object and
the stream's events, checked against the openai client's own models."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pdtrio.protocol.link.wire import Usage
from pdtrio.protocol.openai import OpenAIError, bad_request, parse_chat_completion_request
from pdtrio.protocol.openai.answers import answer_shape
from pdtrio.protocol.openai.responses import (
    ResponsesRequest,
    engine_chat_body,
    parse_responses_request,
)
from pdtrio.protocol.openai.responses_sse import ResponsesStreamShaper
from pdtrio.protocol.sampling import StructuredOutput

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
_events = TypeAdapter(ResponseStreamEvent)


def _parse(**fields: Any) -> ResponsesRequest:
    body = {"model": "m", "input": "hi", **fields}
    return parse_responses_request(
        json.dumps(body).encode(), served_models={"m"}, max_tokens_limit=100
    )


def _error(**fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        _parse(**fields)
    assert info.value.status == 400
    return info.value


def test_a_string_input_is_one_user_message_and_instructions_lead() -> None:
    request = _parse(instructions="be brief", max_output_tokens=7, temperature=0.2, top_p=0.9)
    chat = request.chat
    assert chat.prompt.messages == (("system", "be brief"), ("user", "hi"))
    assert chat.max_tokens == 7
    assert chat.sampling.temperature == 0.2 and chat.sampling.top_p == 0.9
    assert chat.sampling.structured is None
    assert not chat.stream and not chat.include_usage
    assert (request.temperature, request.top_p) == (0.2, 0.9)


def test_unsent_temperature_and_top_p_echo_what_sampled() -> None:
    # OpenAI's Response says 1.0 for either left out, not null
    request = _parse()
    assert (request.temperature, request.top_p) == (1.0, 1.0)


def test_items_map_to_messages_in_both_forms() -> None:
    request = _parse(
        input=[
            {"role": "developer", "content": "rules"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": "b"},
                    {"type": "output_text", "text": "c"},
                ],
            },
        ]
    )
    assert request.chat.prompt.messages == (
        ("developer", "rules"),
        ("user", "a"),
        ("assistant", "bc"),
    )


def test_text_format_is_parsed_as_the_chat_response_format_is() -> None:
    responses = _parse(
        text={"format": {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}}
    )
    chat = parse_chat_completion_request(
        json.dumps(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                },
            }
        ).encode(),
        served_models={"m"},
        max_tokens_limit=100,
    )
    assert responses.chat.sampling.structured == chat.sampling.structured
    assert responses.chat.sampling.structured == StructuredOutput(
        "json_schema", json.dumps(SCHEMA, separators=(",", ":"))
    )
    assert _parse(text={"format": {"type": "json_object"}}).chat.sampling.structured == (
        StructuredOutput("json_object")
    )
    assert _parse(text={"format": {"type": "text"}}).chat.sampling.structured is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": None}, "input"),
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"input": [{"role": "user"}]}, "input.[0].content"),
        ({"input": [{"content": "x"}]}, "input.[0].role"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.[0].role"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input.[0].call_id"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input.[0].content.[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input.[0].content.[0].text",
        ),
        ({"instructions": 3}, "instructions"),
        ({"max_output_tokens": 101}, "max_output_tokens"),
        ({"max_output_tokens": "5"}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"seed": "7"}, "seed"),
        (
            {"text": {"format": {"type": "json_schema", "name": "bad name", "schema": {}}}},
            "text.format.name",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": []}}},
            "text.format.schema",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "strict": 1}}},
            "text.format.strict",
        ),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"text": {"format": "json"}}, "text.format"),
        ({"text": "json"}, "text"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "p"}}, "prompt"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools.[0].type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"truncation": "auto"}, "truncation"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"store": "no"}, "store"),
        ({"stream_options": {}}, "stream_options"),
    ],
)
def test_bad_or_unserved_fields_are_a_400_naming_the_param(
    fields: dict[str, Any], param: str
) -> None:
    assert _error(**fields).param == param


def test_accepted_no_op_values() -> None:
    request = _parse(
        store=False,
        tools=[],
        tool_choice="none",
        include=[],
        truncation="disabled",
        top_logprobs=0,
        parallel_tool_calls=False,
        user="u",
        stream=True,
        stream_options={"include_obfuscation": False},
    )
    assert request.store is False and request.tool_choice == "none"
    assert request.chat.stream and request.chat.user == "u"


def test_a_seed_samples_as_on_chat() -> None:
    assert _parse(seed=7).chat.sampling.seed == 7
    assert _parse().chat.sampling.seed is None


def _engine_body(**fields: Any) -> dict[str, Any]:
    body = {"model": "m", "input": "hi", **fields}
    return engine_chat_body(body, _parse(**fields))


def test_an_engine_is_sent_the_chat_body_the_response_stands_for() -> None:
    body = _engine_body(
        instructions="sys",
        max_output_tokens=5,
        temperature=0.3,
        seed=2,
        user="u",
        stream=True,
        stream_options={"include_obfuscation": False},
        metadata={"a": "b"},
        store=False,
        text={"format": {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}},
    )
    assert body == {
        "model": "m",
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 5,
        "temperature": 0.3,
        "seed": 2,
        "user": "u",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
        },
    }
    assert _engine_body(text={"format": {"type": "json_object"}})["response_format"] == {
        "type": "json_object"
    }
    plain = _engine_body(text={"format": {"type": "text"}}, tools=[], tool_choice="auto")
    assert plain == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False}


def test_an_engine_is_sent_chats_tools_and_the_calls_history() -> None:
    tool = {"type": "function", "name": "f", "parameters": SCHEMA, "strict": True}
    body = _engine_body(
        input=[
            {"role": "developer", "content": "rules"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "done"},
        ],
        tools=[tool],
        tool_choice={"type": "function", "name": "f"},
        parallel_tool_calls=False,
    )
    assert body["messages"] == [
        {"role": "developer", "content": "rules"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "content": "done", "tool_call_id": "c1"},
    ]
    assert body["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": SCHEMA, "strict": True}}
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["parallel_tool_calls"] is False
    assert _engine_body(tools=[tool], tool_choice="none")["tool_choice"] == "none"


def test_the_whole_body_parses_as_the_clients_response() -> None:
    request = _parse(instructions="sys", metadata={"a": "b"}, max_output_tokens=4)
    shape = answer_shape("responses", request)
    assert shape.run is request.chat and shape.id_prefix == "resp_"
    for finish, status in (("stop", "completed"), ("length", "incomplete")):
        assert shape.own_body is not None
        body = shape.own_body(
            request_id="resp_1",
            created=10,
            text="hello",
            finish_reason=finish,
            usage=Usage(3, 4, 1),
            logprobs=None,
            top_logprobs=0,
        )
        response = Response.model_validate(body)
        assert response.status == status
        assert response.output_text == "hello"
        assert response.output[0].status == status  # type: ignore[union-attr]
        assert (response.incomplete_details is None) == (status == "completed")
        assert response.usage is not None
        assert (response.usage.input_tokens, response.usage.output_tokens) == (3, 4)
        assert response.usage.input_tokens_details.cached_tokens == 1
        assert response.usage.total_tokens == 7
        assert response.metadata == {"a": "b"} and response.instructions == "sys"


def _stream_events(data: bytes) -> list[Any]:
    events = []
    for block in data.decode().split("\n\n")[:-1]:
        kind, payload = block.split("\n")
        assert kind.startswith("event: ")
        event = _events.validate_python(json.loads(payload.removeprefix("data: ")))
        assert event.type == kind.removeprefix("event: ")
        events.append(event)
    return events


def test_a_stream_is_the_clients_typed_events_in_sequence() -> None:
    shaper = ResponsesStreamShaper(request=_parse(), response_id="resp_7", created_at=1)
    shaper.set_prompt_usage(5, 0)
    data = shaper.delta("", 1, None)  # (an incomplete character: its token still counts)
    data += shaper.delta("Hé", 1, None) + shaper.delta(" there", 1, "stop", Usage(5, 3, 2))
    assert shaper.finished and not shaper.closed and shaper.completion_tokens == 3
    data += shaper.done()
    assert shaper.closed
    assert b"[DONE]" not in data
    events = _stream_events(data)
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {"msg_7"}
    assert events[6].text == "Hé there"
    final = events[-1].response
    assert final.status == "completed" and final.output_text == "Hé there"
    assert final.usage.output_tokens == 3 and final.usage.input_tokens_details.cached_tokens == 2
    with pytest.raises(ValueError):
        shaper.done()


def test_a_stream_cut_at_the_limit_ends_incomplete() -> None:
    shaper = ResponsesStreamShaper(request=_parse(), response_id="resp_8", created_at=1)
    events = _stream_events(shaper.delta("a", 1, "length", Usage(1, 1)) + shaper.done())
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-2].item.status == "incomplete"


def test_an_error_after_the_headers_ends_with_error_and_failed() -> None:
    shaper = ResponsesStreamShaper(request=_parse(), response_id="resp_9", created_at=1)
    data = shaper.delta("partial", 1, None)
    data += shaper.error(OpenAIError("decode lost", status=502, type="server_error"))
    events = _stream_events(data)
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].message == "decode lost"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.message == "decode lost"
    assert failed.output_text == "partial"
    with pytest.raises(ValueError):
        shaper.delta("more", 1, None)


def test_an_error_before_any_delta_still_opens_the_response() -> None:
    shaper = ResponsesStreamShaper(request=_parse(), response_id="resp_10", created_at=1)
    events = _stream_events(shaper.error(bad_request("no", param="x")))
    assert [e.type for e in events] == ["response.created", "response.in_progress"] + [
        "response.output_item.added",
        "response.content_part.added",
        "error",
        "response.failed",
    ]
    assert events[-2].param == "x"


def test_worker_errors_name_the_responses_fields() -> None:
    shape = answer_shape("responses", _parse())
    assert shape.client_param("response_format") == "text.format"
    assert shape.client_param("max_tokens") == "max_output_tokens"
    assert shape.client_param("logit_bias") == "logit_bias"
    assert shape.client_param(None) is None
    chat = answer_shape("chat", _parse().chat)
    assert chat.client_param("response_format") == "response_format"
    assert chat.own_body is None  # (the client response builds it, tool calls read back)
    with pytest.raises(ValueError):
        answer_shape("chat", _parse())
