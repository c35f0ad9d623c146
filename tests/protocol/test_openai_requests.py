"""OpenAI request validation and response bodies (sync, no IO)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdtrio.protocol.link.wire import ChatPrompt, TextPrompt, TokenPrompt, Usage
from pdtrio.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    chat_completion_body,
    completion_body,
    context_length_exceeded,
    gateway_timeout,
    models_list_body,
    not_found_model,
    parse_chat_completion_request,
    parse_completion_request,
    server_error,
    service_unavailable,
)
from pdtrio.protocol.sampling import MAX_CHOICES, SamplingParams
from tests.examples import examples

MODEL = "tiny"
LIMIT = 512


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat_completion_request(
        json.dumps(body).encode(), served_models={MODEL}, max_tokens_limit=LIMIT
    )


def completion(**fields: Any) -> CompletionRequest:
    body = {"model": MODEL, "prompt": "once upon", **fields}
    return parse_completion_request(
        json.dumps(body).encode(), served_models={MODEL}, max_tokens_limit=LIMIT
    )


def chat_error(**fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        chat(**fields)
    return info.value


def completion_error(**fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        completion(**fields)
    return info.value


def assert_bad(error: OpenAIError, param: str | None) -> None:
    assert error.status == 400
    assert error.type == "invalid_request_error"
    assert error.param == param
    body = error.to_body()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    json.dumps(body)  # serialisable


# --- happy paths ---------------------------------------------------------------


def test_minimal_chat_defaults() -> None:
    request = chat()
    assert request == ChatCompletionRequest(
        model=MODEL,
        prompt=ChatPrompt((("user", "hi"),)),
        sampling=SamplingParams(),
        max_tokens=None,
        stream=False,
        include_usage=False,
        continuous_usage_stats=False,
        user=None,
    )


def test_minimal_completion_defaults() -> None:
    request = completion()
    assert request == CompletionRequest(
        model=MODEL,
        prompt=TextPrompt("once upon"),
        sampling=SamplingParams(),
        max_tokens=None,
        stream=False,
        include_usage=False,
        continuous_usage_stats=False,
        user=None,
    )


def test_chat_messages_roles_and_parts() -> None:
    request = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "developer", "content": [{"type": "text", "text": "really"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                "name": "bob",
            },
            {"role": "assistant", "content": None},
            {"role": "assistant"},
            {"role": "tool", "content": "42", "tool_call_id": "x"},
            {"role": "user", "content": []},
        ]
    )
    assert request.prompt.messages == (
        ("system", "be brief"),
        ("developer", "really"),
        ("user", "ab"),
        ("assistant", ""),
        ("assistant", ""),
        ("tool", "42"),
        ("user", ""),
    )


def test_full_sampling() -> None:
    request = chat(
        max_tokens=10,
        min_tokens=3,
        temperature=0,
        top_p=0.5,
        top_k=40,
        seed=-7,
        stop=["\n", "END"],
        ignore_eos=True,
        user="u1",
    )
    assert request.max_tokens == 10
    assert request.sampling == SamplingParams(
        temperature=0.0,
        top_p=0.5,
        top_k=40,
        seed=-7,
        min_tokens=3,
        stop=("\n", "END"),
        ignore_eos=True,
    )
    assert request.user == "u1"
    assert isinstance(request.sampling.temperature, float)


def test_penalties_bias_min_p_and_stop_token_ids() -> None:
    request = chat(
        presence_penalty=0.5,
        frequency_penalty=-2,
        repetition_penalty=3.5,
        min_p=0.05,
        logit_bias={"7": 100, "3": -100, "12": 2.5},
        stop_token_ids=[9, 2, 9],
    )
    assert request.sampling == SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=-2.0,
        repetition_penalty=3.5,
        min_p=0.05,
        logit_bias=((3, -100.0), (7, 100.0), (12, 2.5)),
        stop_token_ids=(2, 9),
    )
    assert request.sampling.adjusts_logits and request.sampling.penalizes
    for api in (chat, completion):
        plain = api().sampling
        assert not plain.adjusts_logits and not plain.penalizes
        assert api(presence_penalty=0, logit_bias={}, stop_token_ids=[]).sampling == plain
        assert api(logit_bias={"1": 1}).sampling.adjusts_logits
        assert not api(logit_bias={"1": 1}).sampling.penalizes


@pytest.mark.parametrize("api", ["chat", "completion"])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": "1"}}, "logit_bias.5"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["5"]}, "stop_token_ids.[0]"),
    ],
)
def test_bad_penalties_bias_min_p_and_stop_token_ids(
    api: str, fields: dict[str, Any], param: str
) -> None:
    error = chat_error(**fields) if api == "chat" else completion_error(**fields)
    assert_bad(error, param)


def test_logit_bias_nan_is_refused() -> None:
    body = b'{"model": "%s", "prompt": "x", "logit_bias": {"5": NaN}}' % MODEL.encode()
    with pytest.raises(OpenAIError) as info:
        parse_completion_request(body, served_models={MODEL}, max_tokens_limit=LIMIT)
    assert info.value.param == "logit_bias"


def test_max_completion_tokens_takes_precedence() -> None:
    assert chat(max_tokens=100, max_completion_tokens=7).max_tokens == 7
    assert chat(max_completion_tokens=LIMIT).max_tokens == LIMIT
    assert chat(max_tokens=None, max_completion_tokens=None).max_tokens is None


@pytest.mark.parametrize(("top_k", "stored"), [(-1, 0), (0, 0), (1, 1), (None, 0)])
def test_top_k_off_values(top_k: int | None, stored: int) -> None:
    assert chat(top_k=top_k).sampling.top_k == stored


def test_stop_string() -> None:
    assert completion(stop="x").sampling.stop == ("x",)
    assert completion(stop=[]).sampling.stop == ()
    assert completion(stop=["a", "b", "c", "d"]).sampling.stop == ("a", "b", "c", "d")


def test_stream_options() -> None:
    r = chat(stream=True, stream_options={"include_usage": True})
    assert (r.stream, r.include_usage, r.continuous_usage_stats) == (True, True, False)
    r = chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert (r.stream, r.include_usage, r.continuous_usage_stats) == (True, True, True)
    # continuous stats mean nothing without include_usage
    r = chat(stream=True, stream_options={"continuous_usage_stats": True})
    assert (r.include_usage, r.continuous_usage_stats) == (False, False)
    r = chat(stream=True, stream_options=None)
    assert (r.stream, r.include_usage) == (True, False)
    c = completion(stream=False, stream_options=None)
    assert (c.stream, c.include_usage) == (False, False)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", TextPrompt("hello")),
        (["hello"], TextPrompt("hello")),
        ([1, 2, 3], TokenPrompt((1, 2, 3))),
        ([0], TokenPrompt((0,))),
        ([[5, 6]], TokenPrompt((5, 6))),
    ],
)
def test_completion_prompt_forms(prompt: Any, expected: TextPrompt | TokenPrompt) -> None:
    assert completion(prompt=prompt).prompt == expected


def test_tolerated_fields_are_ignored() -> None:
    request = chat(
        frequency_penalty=0,
        presence_penalty=0.0,
        logit_bias=None,
        parallel_tool_calls=True,
        metadata={"a": "b"},
        store=False,
        n=1,
        logprobs=False,
        top_logprobs=None,
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        some_vendor_extension={"x": 1},
    )
    assert request.sampling == SamplingParams()
    request2 = completion(echo=False, best_of=1, logprobs=None, suffix=None, n=None)
    assert request2.sampling == SamplingParams()


def test_user_strings_pass_through_unicode() -> None:
    request = chat(messages=[{"role": "user", "content": "héllo 🌍 \u4e16\u754c"}])
    assert request.prompt.messages == (("user", "héllo 🌍 \u4e16\u754c"),)


# --- errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [b"", b"{", b"not json", b"\xff\xfe\x00garbage", b"[" * 100_000, b'{"a": 1e}'],
)
def test_malformed_json(body: bytes) -> None:
    for parse in (parse_chat_completion_request, parse_completion_request):
        with pytest.raises(OpenAIError) as info:
            parse(body, served_models={MODEL}, max_tokens_limit=LIMIT)
        assert_bad(info.value, None)
        assert "JSON" in info.value.message


@pytest.mark.parametrize("body", [b"[]", b"1", b'"x"', b"null", b"true", b"[{}]"])
def test_non_object_body(body: bytes) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_chat_completion_request(body, served_models={MODEL}, max_tokens_limit=LIMIT)
    assert_bad(info.value, None)
    assert "object" in info.value.message


def test_model_missing_wrong_type_and_unknown() -> None:
    for parse in (parse_chat_completion_request, parse_completion_request):
        with pytest.raises(OpenAIError) as info:
            parse(b"{}", served_models={MODEL}, max_tokens_limit=LIMIT)
        assert_bad(info.value, "model")
        with pytest.raises(OpenAIError) as info:
            parse(b'{"model": 3}', served_models={MODEL}, max_tokens_limit=LIMIT)
        assert_bad(info.value, "model")
    error = chat_error(model="gpt-9")
    assert error.status == 404
    assert error.code == "model_not_found"
    assert error.type == "invalid_request_error"
    assert "gpt-9" in error.message
    assert completion_error(model="gpt-9").status == 404


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ("hi", "messages"),
        ({"role": "user"}, "messages"),
        ([], "messages"),
        (["hi"], "messages.[0]"),
        ([{"content": "x"}], "messages.[0].role"),
        ([{"role": 1, "content": "x"}], "messages.[0].role"),
        ([{"role": "wizard", "content": "x"}], "messages.[0].role"),
        ([{"role": "function", "content": "x"}], "messages.[0].role"),
        ([{"role": "user"}], "messages.[0].content"),
        ([{"role": "user", "content": None}], "messages.[0].content"),
        ([{"role": "system", "content": None}], "messages.[0].content"),
        ([{"role": "user", "content": 5}], "messages.[0].content"),
        ([{"role": "user", "content": {"type": "text"}}], "messages.[0].content"),
        ([{"role": "user", "content": ["x"]}], "messages.[0].content.[0]"),
        ([{"role": "user", "content": [{"text": "x"}]}], "messages.[0].content.[0].type"),
        ([{"role": "user", "content": [{"type": 1}]}], "messages.[0].content.[0].type"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages.[0].content.[0].text"),
        (
            [{"role": "user", "content": [{"type": "text", "text": 3}]}],
            "messages.[0].content.[0].text",
        ),
        (
            [
                {"role": "user", "content": "ok"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
            ],
            "messages.[1].tool_calls.[0].function",
        ),
        (
            [{"role": "assistant", "content": "", "function_call": {"name": "f"}}],
            "messages.[0].function_call",
        ),
    ],
)
def test_bad_messages(messages: Any, param: str) -> None:
    assert_bad(chat_error(messages=messages), param)


def test_lone_surrogate_rejected() -> None:
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    with pytest.raises(OpenAIError) as info:
        parse_chat_completion_request(body, served_models={MODEL}, max_tokens_limit=LIMIT)
    assert_bad(info.value, "messages.[0].content")
    body = b'{"model": "tiny", "prompt": "\\udfff"}'
    with pytest.raises(OpenAIError) as info:
        parse_completion_request(body, served_models={MODEL}, max_tokens_limit=LIMIT)
    assert_bad(info.value, "prompt")


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "file", "refusal"])
def test_non_text_parts_unsupported(kind: str) -> None:
    error = chat_error(
        messages=[{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": kind}]}]
    )
    assert_bad(error, "messages.[0].content.[1].type")
    assert "not supported" in error.message
    assert kind in error.message


@pytest.mark.parametrize(
    ("prompt", "param", "words"),
    [
        (None, "prompt", "Missing"),
        (5, "prompt", "type"),
        ({"text": "x"}, "prompt", "type"),
        ("", "prompt", "empty"),
        ([], "prompt", "empty"),
        ([""], "prompt.[0]", "empty"),
        ([[]], "prompt.[0]", "empty"),
        (["a", "b"], "prompt", "not supported"),
        ([[1], [2]], "prompt", "not supported"),
        ([1, "a"], "prompt.[1]", "type"),
        ([1, 2.0], "prompt.[1]", "type"),
        ([True], "prompt.[0]", "type"),
        ([1, None], "prompt.[1]", "type"),
        ([-1], "prompt.[0]", "token id"),
        ([2**64], "prompt.[0]", "token id"),
        ([[1, -2]], "prompt.[0].[1]", "token id"),
    ],
)
def test_bad_prompts(prompt: Any, param: str, words: str) -> None:
    error = completion_error(prompt=prompt)
    assert_bad(error, param)
    assert words in error.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        # types
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": 10.0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_completion_tokens": False}, "max_completion_tokens"),
        ({"min_tokens": True}, "min_tokens"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": [1]}, "top_p"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"seed": "1"}, "seed"),
        ({"seed": False}, "seed"),
        ({"stop": 3}, "stop"),
        ({"stop": {"a": 1}}, "stop"),
        ({"stop": ["a", 3]}, "stop.[1]"),
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"user": 7}, "user"),
        ({"n": "1"}, "n"),
        ({"n": True}, "n"),
        ({"stream": True, "stream_options": "usage"}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": "y"}},
            "stream_options.continuous_usage_stats",
        ),
        ({"frequency_penalty": "0"}, "frequency_penalty"),
        ({"logit_bias": [1]}, "logit_bias"),
        # ranges
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": LIMIT + 1}, "max_tokens"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": LIMIT + 1}, "max_completion_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 11, "max_tokens": 10}, "min_tokens"),
        ({"min_tokens": 11, "max_tokens": 100, "max_completion_tokens": 10}, "min_tokens"),
        ({"min_tokens": LIMIT + 1}, "min_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": 10**400}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**40}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"n": 0}, "n"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {}}, "stream_options"),
    ],
)
def test_bad_fields_both_endpoints(fields: dict[str, Any], param: str) -> None:
    assert_bad(chat_error(**fields), param)
    if "max_completion_tokens" not in fields:
        assert_bad(completion_error(**fields), param)


def test_n_choices_up_to_the_maximum() -> None:
    assert chat(n=2).sampling.n == 2
    assert completion(n=MAX_CHOICES).sampling.n == MAX_CHOICES
    assert chat(n=1).sampling == chat().sampling  # n = 1 is the plain request
    for error in (chat_error(n=MAX_CHOICES + 1), completion_error(n=MAX_CHOICES + 1)):
        assert_bad(error, "n")
        assert str(MAX_CHOICES) in error.message


def test_best_of_only_as_n() -> None:
    assert completion(n=3, best_of=3).sampling.n == 3
    assert completion(best_of=1).sampling.n == 1
    for fields in ({"best_of": 2}, {"n": 2, "best_of": 4}):
        error = completion_error(**fields)
        assert_bad(error, "best_of")
        assert "vLLM" in error.message


def test_non_finite_numbers_rejected() -> None:
    for literal in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):
        body = b'{"model": "tiny", "prompt": "x", "temperature": ' + literal + b"}"
        with pytest.raises(OpenAIError) as info:
            parse_completion_request(body, served_models={MODEL}, max_tokens_limit=LIMIT)
        assert_bad(info.value, "temperature")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "retrieval"}]}, "tools.[0].type"),
        ({"tools": "f"}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function"}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema.name",
        ),
        ({"response_format": "json"}, "response_format"),
    ],
)
def test_unsupported_chat_features(fields: dict[str, Any], param: str) -> None:
    assert_bad(chat_error(**fields), param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"echo": True}, "echo"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"echo": "yes"}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"best_of": "2"}, "best_of"),
        ({"suffix": "tail"}, "suffix"),
        ({"suffix": 1}, "suffix"),
    ],
)
def test_unsupported_completion_features(fields: dict[str, Any], param: str) -> None:
    assert_bad(completion_error(**fields), param)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"logprobs": True}, 0),
        ({"logprobs": True, "top_logprobs": 0}, 0),
        ({"logprobs": True, "top_logprobs": 20}, 20),
        ({"logprobs": False, "top_logprobs": 0}, -1),
        ({"logprobs": False}, -1),
        ({}, -1),
    ],
)
def test_chat_logprobs_become_the_sampling_count(fields: dict[str, Any], expected: int) -> None:
    sampling = chat(**fields).sampling
    assert sampling.logprobs == expected
    assert sampling.wants_logprobs is (expected >= 0)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": 1}, "logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 1.5}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
    ],
)
def test_bad_chat_logprobs_are_a_400_naming_the_param(fields: dict[str, Any], param: str) -> None:
    assert_bad(chat_error(**fields), param)


@pytest.mark.parametrize(("value", "expected"), [(0, 0), (5, 5), (20, 20), (None, -1), (False, -1)])
def test_completion_logprobs_are_a_count(value: Any, expected: int) -> None:
    assert completion(logprobs=value).sampling.logprobs == expected


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": "x"}, "logprobs"),
        ({"logprobs": 1.0}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_completion_logprobs_are_a_400_naming_the_param(
    fields: dict[str, Any], param: str
) -> None:
    assert_bad(completion_error(**fields), param)


def test_error_helpers() -> None:
    error = not_found_model("m")
    assert (error.status, error.type, error.code, error.param) == (
        404,
        "invalid_request_error",
        "model_not_found",
        "model",
    )
    assert server_error("boom").status == 500
    assert server_error("boom").type == "server_error"
    assert service_unavailable("busy").status == 503
    assert gateway_timeout("slow").status == 504
    ctx = context_length_exceeded(prompt_tokens=5000, max_tokens=10, context_length=4096)
    assert (ctx.status, ctx.code, ctx.param) == (400, "context_length_exceeded", "messages")
    assert OpenAIError("x").to_body() == {
        "error": {"message": "x", "type": "invalid_request_error", "param": None, "code": None}
    }
    assert str(OpenAIError("x")) == "x"


# --- never anything but OpenAIError ---------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=30,
)

_FIELDS = [
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "ignore_eos",
    "n",
    "user",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "repetition_penalty",
    "min_p",
    "stop_token_ids",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "echo",
    "best_of",
    "suffix",
]

# Bodies close to valid: a valid one with a few fields set to arbitrary JSON, so
# generation reaches every check instead of stopping at the first.
_VALID_BASE: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    "prompt": "hi",
    "stream": True,
    "stream_options": {"include_usage": True},
}
_NESTED = [
    ("messages", 0, "role"),
    ("messages", 0, "content"),
    ("messages", 0, "tool_calls"),
    ("stream_options", "include_usage"),
    ("stream_options", "continuous_usage_stats"),
]


@st.composite
def near_valid(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(json.dumps(_VALID_BASE))
    for field in draw(st.lists(st.sampled_from(_FIELDS), min_size=1, max_size=3)):
        body[field] = draw(json_values)
    for path in draw(st.lists(st.sampled_from(_NESTED), max_size=2)):
        target: Any = body
        for key in path[:-1]:
            try:
                target = target[key]
            except (KeyError, IndexError, TypeError):
                break
        else:
            if isinstance(target, dict):
                target[path[-1]] = draw(json_values)
    return body


def _parse_both(body: bytes) -> None:
    for parse in (parse_chat_completion_request, parse_completion_request):
        try:
            parse(body, served_models={MODEL}, max_tokens_limit=LIMIT)
        except OpenAIError as error:
            assert error.status in (400, 404)
            json.dumps(error.to_body())


@settings(max_examples=examples(300))
@given(json_values)
def test_arbitrary_json_only_raises_openai_error(value: Any) -> None:
    _parse_both(json.dumps(value).encode())


@settings(max_examples=examples(500))
@given(near_valid())
def test_near_valid_json_only_raises_openai_error(value: Any) -> None:
    _parse_both(json.dumps(value).encode())


@settings(max_examples=examples(300))
@given(st.binary(max_size=200))
def test_arbitrary_bytes_only_raise_openai_error(body: bytes) -> None:
    _parse_both(body)


@given(
    st.text(min_size=1),
    st.integers(min_value=1, max_value=LIMIT),
    st.floats(min_value=0, max_value=2),
)
def test_valid_requests_round_trip(text: str, max_tokens: int, temperature: float) -> None:
    request = chat(
        messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens,
        temperature=temperature,
    )
    assert request.prompt.messages == (("user", text),)
    assert request.max_tokens == max_tokens
    assert request.sampling.temperature == temperature


# --- response bodies -----------------------------------------------------------


def test_models_list_body() -> None:
    assert models_list_body(["a", "b"], created=123) == {
        "object": "list",
        "data": [
            {"id": "a", "object": "model", "created": 123, "owned_by": "pdtrio"},
            {"id": "b", "object": "model", "created": 123, "owned_by": "pdtrio"},
        ],
    }
    assert models_list_body([], created=1, owned_by="me") == {"object": "list", "data": []}


def test_chat_completion_body() -> None:
    body = chat_completion_body(
        request_id="chatcmpl-1",
        model=MODEL,
        created=99,
        text="hello",
        finish_reason="stop",
        usage=Usage(prompt_tokens=5, completion_tokens=2, cached_tokens=3),
    )
    assert body == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 99,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hello"},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 2,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 3},
        },
    }


def test_completion_body() -> None:
    body = completion_body(
        request_id="cmpl-1",
        model=MODEL,
        created=99,
        text="there",
        finish_reason="length",
        usage=Usage(prompt_tokens=1, completion_tokens=4),
    )
    assert body == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 99,
        "model": MODEL,
        "choices": [{"index": 0, "text": "there", "finish_reason": "length", "logprobs": None}],
        "usage": {
            "prompt_tokens": 1,
            "completion_tokens": 4,
            "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }


def _chat_with(messages: int, context_length: int) -> ChatCompletionRequest:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "m"}] * messages}
    return parse_chat_completion_request(
        json.dumps(body).encode(),
        served_models={MODEL},
        max_tokens_limit=LIMIT,
        context_lengths={MODEL: context_length},
    )


def test_chat_with_as_many_messages_as_context_tokens_is_refused() -> None:
    # every message is at least one token, and the completion needs one more
    assert len(_chat_with(99, context_length=100).prompt.messages) == 99
    with pytest.raises(OpenAIError) as refused:
        _chat_with(100, context_length=100)
    assert refused.value.status == 400
    assert refused.value.code == "context_length_exceeded"
    assert refused.value.param == "messages"
    assert "100 messages" in refused.value.message


def test_huge_chat_is_refused_with_its_message_count_before_the_messages_are_built() -> None:
    # past the longest context the messages are counted, not checked: a bad one is not seen
    messages: list[Any] = [{"role": "user", "content": "m"}] * 100_000 + [{"role": 1}]
    body = json.dumps({"model": MODEL, "messages": messages}).encode()
    with pytest.raises(OpenAIError) as refused:
        parse_chat_completion_request(
            body, served_models={MODEL}, max_tokens_limit=LIMIT, context_lengths={MODEL: 8192}
        )
    assert refused.value.code == "context_length_exceeded"
    assert refused.value.param == "messages"
    assert "100001 messages" in refused.value.message
    assert "8192 tokens" in refused.value.message


def test_another_servers_models_list_is_read_or_refused_as_a_value_error() -> None:
    from pdtrio.protocol.openai import listed_models

    body = {"data": [{"id": "a", "max_model_len": 2048}, {"id": "b", "object": "model"}]}
    assert listed_models(body) == [("a", 2048), ("b", 0)]
    assert listed_models({"object": "list", "data": []}) == []
    for bad in (
        [],
        {"data": None},
        {"data": ["a"]},
        {"data": [{"object": "model"}]},
        {"data": [{"id": "a", "max_model_len": "long"}]},
        {"data": [{"id": "a", "max_model_len": True}]},
    ):
        with pytest.raises(ValueError):
            listed_models(bad)
