"""Tools on a chat request: parsing, the grammar that forces a call, reading calls back."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdtrio.protocol.link.wire import ChatPrompt, ChatPromptWithTools, Prompt, Usage, encode
from pdtrio.protocol.openai import OpenAIError, chat_completion_body, parse_chat_completion_request
from pdtrio.protocol.openai.sse import StreamShaper
from pdtrio.protocol.openai.tools import (
    MAX_FORCED_CALLS,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCallParser,
    call_text,
    parse_tool_calls,
)

MODEL = "tiny"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def parse(**fields: Any) -> Any:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat_completion_request(
        json.dumps(body).encode(), served_models={MODEL}, max_tokens_limit=100
    )


def error(**fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(**fields)
    assert info.value.status == 400
    return info.value


def test_auto_shows_the_tools_without_a_grammar() -> None:
    request = parse(tools=[WEATHER, TIME])
    assert request.tools is not None and request.tools.mode == "auto"
    assert request.sampling.structured is None
    assert isinstance(request.prompt, ChatPromptWithTools)
    shown = json.loads(request.prompt.tools_json)
    assert [tool["function"]["name"] for tool in shown] == ["get_weather", "get_time"]
    assert shown[0]["function"]["parameters"] == WEATHER["function"]["parameters"]
    assert shown[1]["function"]["parameters"] == {"type": "object", "properties": {}}
    # the new prompt round-trips on the wire, and a plain chat keeps its own tag
    assert msgspec.msgpack.decode(encode(request.prompt), type=Prompt) == request.prompt
    assert type(parse().prompt) is ChatPrompt


def test_none_leaves_the_tools_out() -> None:
    request = parse(tools=[WEATHER], tool_choice="none")
    assert request.tools is None
    assert type(request.prompt) is ChatPrompt
    assert request.sampling.structured is None


@pytest.mark.parametrize(
    ("choice", "names"),
    [
        ("required", ["get_weather", "get_time"]),
        ({"type": "function", "function": {"name": "get_time"}}, ["get_time"]),
    ],
)
def test_a_forced_call_gets_a_grammar_of_the_functions(choice: Any, names: list[str]) -> None:
    request = parse(tools=[WEATHER, TIME], tool_choice=choice)
    structured = request.sampling.structured
    assert structured is not None and structured.kind == "tool_call"
    grammar = structured.spec
    assert grammar.startswith("start: call")
    assert TOOL_CALL_OPEN in grammar and TOOL_CALL_CLOSE in grammar
    schema = json.loads(grammar.split("%json ", 1)[1])
    assert [alt["properties"]["name"]["const"] for alt in schema["anyOf"]] == names
    # the answer is still read for calls of any of the request's tools
    assert request.tools is not None and len(request.tools.functions) == 2


def test_parallel_calls_off_allows_one_forced_call() -> None:
    one = parse(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    many = parse(tools=[WEATHER], tool_choice="required")
    assert "{0," not in one.sampling.structured.spec
    assert f"{{0,{MAX_FORCED_CALLS - 1}}}" in many.sampling.structured.spec


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": 3}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "code"}}, "tool_choice.type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools.[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.[0].function.name"),
        ({"tools": [{"type": "function"}]}, "tools.[0].function"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
            "tools.[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]},
            "tools.[0].function.description",
        ),
        ({"tools": [WEATHER] * 129}, "tools"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(fields: dict[str, Any], param: str) -> None:
    assert error(**fields).param == param


def test_history_of_calls_and_results_reaches_the_template() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    request = parse(
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        ],
    )
    prompt = request.prompt
    assert isinstance(prompt, ChatPromptWithTools)
    assert prompt.messages[1] == ("assistant", "")
    extras = [json.loads(e) if e else None for e in prompt.message_extras]
    assert extras[0] is None
    # arguments as an object: what templates render with tojson
    assert extras[1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }
    assert extras[2] == {"tool_call_id": "call_1"}


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "x"}, "messages.[1].tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": [{}]}, "messages.[1].tool_calls"),
        ({"role": "assistant", "tool_calls": "x"}, "messages.[1].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"id": 1}]}, "messages.[1].tool_calls.[0].id"),
        (
            {
                "role": "assistant",
                "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": {}}}],
            },
            "messages.[1].tool_calls.[0].function.arguments",
        ),
    ],
)
def test_bad_history_is_a_400(message: dict[str, Any], param: str) -> None:
    messages = [{"role": "user", "content": "hi"}, message]
    assert error(messages=messages).param == param


# --- reading calls back ----------------------------------------------------------------

NAMES = ["get_weather", "get_time"]


def test_a_whole_answer_with_text_and_two_calls() -> None:
    text = (
        "Let me look.\n"
        + call_text("get_weather", {"city": "Paris"})
        + "\n"
        + call_text("get_time", {})
    )
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me look.\n"
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Paris"}),
        (1, "get_time", {}),
    ]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id


@pytest.mark.parametrize(
    "block",
    [
        '{"name": "unknown", "arguments": {}}',
        '{"name": "get_time", "arguments": [1]}',
        '{"name": "get_time", "arguments": {',
        "[1, 2]",
    ],
)
def test_a_block_that_is_no_call_stays_content(block: str) -> None:
    text = f"{TOOL_CALL_OPEN}{block}{TOOL_CALL_CLOSE}"
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_a_call_cut_short_stays_content() -> None:
    text = f'{TOOL_CALL_OPEN}\n{{"name": "get_time", "argu'
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_plain_text_passes_untouched() -> None:
    for text in ("", " ", "a < b <tool", "<tool_cal", "x\n\n"):
        assert parse_tool_calls(text, NAMES) == (text, [])


@given(st.lists(st.integers(min_value=0, max_value=40), max_size=12), st.sampled_from(range(4)))
def test_streaming_in_any_pieces_reads_the_same_as_whole(cuts: list[int], variant: int) -> None:
    texts = [
        "Sure." + call_text("get_weather", {"city": "Rome"}),
        call_text("get_time", {}) + "\n" + call_text("get_weather", {"city": "Oslo"}),
        "no tools here, a <b> tag and <tool_ca",
        call_text("get_time", {}) + "\nDone <tool_call>oops",
    ]
    text = texts[variant]
    whole_content, whole_calls = parse_tool_calls(text, NAMES)
    parser = ToolCallParser(NAMES)
    content, calls = [], []
    at = 0
    for cut in sorted(cuts):
        piece, at = text[at : max(at, cut)], max(at, cut)
        out, got = parser.feed(piece)
        content.append(out)
        calls += got
    out, got = parser.feed(text[at:])
    content.append(out)
    calls += got
    out, got = parser.finish()
    content.append(out)
    calls += got
    assert "".join(content) == whole_content
    assert [(c.index, c.name, c.arguments) for c in calls] == [
        (c.index, c.name, c.arguments) for c in whole_calls
    ]


def test_text_that_cannot_begin_a_tag_goes_out_at_once() -> None:
    parser = ToolCallParser(NAMES)
    assert parser.feed("Hello") == ("Hello", [])
    assert parser.feed(" <tool") == ("", [])  # held: it may become a call
    assert parser.feed("box>") == (" <toolbox>", [])


# --- the OpenAI shapes --------------------------------------------------------------------


def test_non_streamed_body_with_calls() -> None:
    _, calls = parse_tool_calls(call_text("get_time", {}), NAMES)
    body = chat_completion_body(
        request_id="chatcmpl-1",
        model=MODEL,
        created=1,
        text="",
        finish_reason="tool_calls",
        usage=Usage(3, 4, 0),
        tool_calls=calls,
    )
    message = body["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [
        {
            "id": calls[0].id,
            "type": "function",
            "function": {"name": "get_time", "arguments": "{}"},
        }
    ]


def test_streamed_chunk_with_calls() -> None:
    shaper = StreamShaper(
        kind="chat",
        request_id="chatcmpl-1",
        model=MODEL,
        created=1,
        include_usage=False,
        continuous_usage_stats=False,
    )
    _, calls = parse_tool_calls(call_text("get_weather", {"city": "Paris"}), NAMES)
    events = (shaper.tool_calls(calls) + shaper.delta("", 5, "tool_calls")).decode()
    chunks = [json.loads(line[6:]) for line in events.split("\n\n") if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    delta = chunks[1]["choices"][0]["delta"]
    assert delta["tool_calls"][0]["index"] == 0
    assert delta["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    assert chunks[2]["choices"][0]["finish_reason"] == "tool_calls"
    with pytest.raises(ValueError, match="ended"):
        shaper.tool_calls(calls)
