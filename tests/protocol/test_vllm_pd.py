"""pdtrio.protocol.engines.vllm: vLLM's PD legs built, its answers and /metrics read."""

from __future__ import annotations

import json

import pytest

from pdtrio.protocol.engines.vllm import (
    PREFILL_KV_PARAMS,
    EngineAnswerError,
    EngineToolCalls,
    ToolCallDelta,
    choice_body,
    decode_body,
    parse_decode_event,
    parse_engine_metrics,
    parse_prefill_answer,
    prefill_body,
    release_body,
)
from pdtrio.protocol.link.wire import TokenLogprob, Usage
from pdtrio.protocol.openai.logprobs import completion_logprobs
from pdtrio.protocol.openai.tools import ToolCall

CLIENT = {
    "model": "m",
    "prompt": "hi",
    "max_tokens": 50,
    "max_completion_tokens": 50,
    "min_tokens": 5,
    "min_completion_tokens": 5,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.3,
}


def test_the_prefill_leg_is_one_unstreamed_token_keeping_the_kv_for_a_remote_decode() -> None:
    body = prefill_body(CLIENT)
    assert body["stream"] is False
    assert body["max_tokens"] == body["max_completion_tokens"] == 1
    for absent in ("stream_options", "min_tokens", "min_completion_tokens"):
        assert absent not in body
    assert body["kv_transfer_params"] == dict(PREFILL_KV_PARAMS)
    assert body["temperature"] == 0.3
    assert CLIENT["max_tokens"] == 50  # the client's body is not changed
    without = prefill_body({"model": "m", "prompt": "hi"})
    assert "max_completion_tokens" not in without


def test_the_decode_leg_is_the_clients_request_with_prefills_params_whole() -> None:
    params = {"remote_engine_id": "e", "remote_block_ids": [[1]], "future_field": 7}
    body = decode_body(CLIENT, params)
    assert body["kv_transfer_params"] == params
    assert body["max_tokens"] == 50 and body["min_tokens"] == 5
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert "kv_transfer_params" not in decode_body({**CLIENT, "kv_transfer_params": {}}, None)


def test_the_release_leg_pulls_the_blocks_for_one_token() -> None:
    body = release_body(CLIENT, {"remote_engine_id": "e"})
    assert body["max_tokens"] == 1 and body["stream"] is False
    assert body["kv_transfer_params"] == {"remote_engine_id": "e"}
    assert "min_tokens" not in body


def test_prefills_answer_gives_its_params_and_counts() -> None:
    answer = parse_prefill_answer(
        {
            "kv_transfer_params": {"remote_engine_id": "e"},
            "usage": {"prompt_tokens": 37, "prompt_tokens_details": {"cached_tokens": 16}},
        }
    )
    assert answer.kv_transfer_params == {"remote_engine_id": "e"}
    assert (answer.prompt_tokens, answer.cached_tokens) == (37, 16)
    plain = parse_prefill_answer({"kv_transfer_params": None, "usage": {"prompt_tokens": 3}})
    assert plain.kv_transfer_params is None and plain.cached_tokens == 0
    with pytest.raises(EngineAnswerError):
        parse_prefill_answer({"kv_transfer_params": [1]})
    with pytest.raises(EngineAnswerError):
        parse_prefill_answer([])


def test_decode_events_read_as_text_running_counts_finish_and_usage() -> None:
    chunk = parse_decode_event(
        '{"choices":[{"index":0,"delta":{"content":" Paris"},"finish_reason":null}],'
        '"usage":{"prompt_tokens":9,"completion_tokens":2}}',
        "chat",
    )
    assert chunk is not None
    assert (chunk.text, chunk.completion_tokens, chunk.finish_reason, chunk.usage) == (
        " Paris",
        2,
        None,
        None,
    )
    last = parse_decode_event(
        '{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4,'
        '"prompt_tokens_details":{"cached_tokens":1}}}',
        "completion",
    )
    assert last is not None and last.usage == Usage(9, 4, 1)
    text = parse_decode_event('{"choices":[{"text":"a","finish_reason":"stop"}]}', "completion")
    assert text is not None and (text.text, text.finish_reason) == ("a", "stop")
    error = parse_decode_event('{"error":{"message":"boom"}}', "chat")
    assert error is not None and error.error == "boom"
    assert parse_decode_event("[DONE]", "chat") is None
    with pytest.raises(EngineAnswerError):
        parse_decode_event("{not json", "chat")


def test_metrics_give_waiting_running_and_kv_usage() -> None:
    text = """# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:prompt_tokens_total{engine="0",model_name="m"} 1e3
broken line
"""
    load = parse_engine_metrics(text)
    assert (load.waiting, load.running, load.kv_usage) == (3, 3, 0.25)
    older = parse_engine_metrics('vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n')
    assert older.kv_usage == 0.5 and older.waiting == 0


def test_sglangs_metrics_give_the_same_figures() -> None:
    load = parse_engine_metrics(
        'sglang:num_queue_reqs{model_name="m"} 4\n'
        'sglang:num_running_reqs{model_name="m"} 2\n'
        'sglang:token_usage{model_name="m"} 0.125\n'
    )
    assert (load.waiting, load.running, load.kv_usage) == (4, 2, 0.125)


def test_decode_events_give_chat_logprobs_only_when_asked() -> None:
    event = (
        '{"choices":[{"delta":{"content":" a"},"logprobs":{"content":[{"token":" a",'
        '"logprob":-0.5,"bytes":[32,97],"top_logprobs":[{"token":" a","logprob":-0.5,'
        '"bytes":[32,97]},{"token":" b","logprob":-1,"bytes":[32,98]}]}]},'
        '"finish_reason":null}]}'
    )
    asked = parse_decode_event(event, "chat", with_logprobs=True)
    assert asked is not None
    assert asked.logprobs == (TokenLogprob(" a", -0.5, (" a", " b"), (-0.5, -1.0)),)
    plain = parse_decode_event(event, "chat")
    assert plain is not None and plain.logprobs is None and plain.text == " a"
    # a chunk of no token: no items; an engine that sends none: None
    role = parse_decode_event(
        '{"choices":[{"delta":{"role":"assistant"},"logprobs":null}]}', "chat", with_logprobs=True
    )
    assert role is not None and role.logprobs is None


def test_completion_logprobs_keep_the_likeliest_first_and_the_sampled_token() -> None:
    # vLLM's map: the sampled token (here not among the 2 likeliest) and the likeliest
    event = (
        '{"choices":[{"text":" c","logprobs":{"tokens":[" c"],"token_logprobs":[-3.0],'
        '"top_logprobs":[{" c":-3.0," a":-0.5," b":-1.0}],"text_offset":[7]},'
        '"finish_reason":null}]}'
    )
    chunk = parse_decode_event(event, "completion", with_logprobs=True)
    assert chunk is not None
    [item] = chunk.logprobs or ()
    assert (item.token, item.logprob) == (" c", -3.0)
    assert item.top_tokens == (" a", " b", " c") and item.top_logprobs == (-0.5, -1.0, -3.0)
    # shaped again for a request of 2 alternatives: the 2 likeliest and the sampled one
    assert completion_logprobs([item], 2)["top_logprobs"] == [{" a": -0.5, " b": -1.0, " c": -3.0}]
    no_tops = parse_decode_event(
        '{"choices":[{"text":"x","logprobs":{"tokens":["x"],"token_logprobs":[-1e9],'
        '"top_logprobs":null}}]}',
        "completion",
        with_logprobs=True,
    )
    assert no_tops is not None and no_tops.logprobs == (TokenLogprob("x", -1e9),)


@pytest.mark.parametrize(
    ("endpoint", "logprobs"),
    [
        ("chat", '"no"'),
        ("chat", '{"content":"no"}'),
        ("chat", '{"content":[{"token":1,"logprob":-1}]}'),
        ("chat", '{"content":[{"token":"a","logprob":"low"}]}'),
        ("chat", '{"content":[{"token":"a","logprob":true}]}'),
        ("chat", '{"content":[{"token":"a","logprob":-1,"top_logprobs":[1]}]}'),
        ("completion", '{"tokens":["a","b"],"token_logprobs":[-1]}'),
        ("completion", '{"tokens":["a"],"token_logprobs":[null]}'),
        ("completion", '{"tokens":["a"],"token_logprobs":[-1],"top_logprobs":[]}'),
        ("completion", '{"tokens":["a"],"token_logprobs":[-1],"top_logprobs":[["a"]]}'),
        ("completion", '{"tokens":["a"],"token_logprobs":[-1],"top_logprobs":[{"a":"x"}]}'),
    ],
)
def test_malformed_logprobs_are_the_engines_broken_answer(endpoint: str, logprobs: str) -> None:
    field = '"delta":{"content":"a"}' if endpoint == "chat" else '"text":"a"'
    event = '{"choices":[{' + field + ',"logprobs":' + logprobs + "}]}"
    with pytest.raises(EngineAnswerError, match="logprob"):
        parse_decode_event(event, endpoint, with_logprobs=True)  # type: ignore[arg-type]
    assert parse_decode_event(event, endpoint) is not None  # (not asked: not looked at)


def test_a_choice_runs_alone_with_the_seed_plus_its_index() -> None:
    client = {**CLIENT, "n": 3, "best_of": 3, "seed": 10}
    assert choice_body(client, 0) == {**CLIENT, "seed": 10}
    assert choice_body(client, 2) == {**CLIENT, "seed": 12}
    assert choice_body({**CLIENT, "n": 2}, 1) == CLIENT  # no seed: none made up
    assert choice_body({**CLIENT, "seed": True}, 1)["seed"] is True  # (not a number: as is)


def _call_event(*calls: dict[str, object], finish: str | None = None) -> str:
    delta = {"tool_calls": list(calls)}
    return json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def test_an_engines_streamed_tool_calls_are_gathered_into_whole_calls() -> None:
    events = [
        _call_event({"index": 0, "id": "c0", "type": "function", "function": {"name": "f"}}),
        _call_event({"index": 0, "function": {"arguments": '{"a": '}}),
        _call_event({"index": 0, "function": {"arguments": "1}"}}),
        # a call of a function without parameters may come without arguments
        _call_event({"index": 1, "id": "c1", "function": {"name": "g"}}),
        _call_event(finish="tool_calls"),
    ]
    gathered = EngineToolCalls()
    whole: list[ToolCall] = []
    for event in events:
        chunk = parse_decode_event(event, "chat")
        assert chunk is not None
        whole += gathered.feed(chunk.tool_calls)
    # the first call is whole once the next one begins; the last once the answer ends
    assert whole == [ToolCall(0, "c0", "f", '{"a": 1}')]
    assert gathered.finish() == [ToolCall(1, "c1", "g", "{}")]


@pytest.mark.parametrize(
    "pieces",
    [
        [ToolCallDelta(0, "c0", None, "{}")],  # never named
        [
            ToolCallDelta(0, "c0", "f", "{}"),
            ToolCallDelta(1, "c1", "g", ""),
            ToolCallDelta(0, None, None, "more"),
        ],  # more of a call after a later one began
    ],
)
def test_an_engines_tool_calls_out_of_shape_are_its_broken_answer(
    pieces: list[ToolCallDelta],
) -> None:
    gathered = EngineToolCalls()
    with pytest.raises(EngineAnswerError):
        gathered.feed(pieces)
        gathered.finish()


@pytest.mark.parametrize(
    "tool_calls",
    [
        '"calls"',
        '["call"]',
        '[{"index": -1, "function": {"name": "f"}}]',
        '[{"index": 0, "function": "f"}]',
        '[{"index": 0, "function": {"name": 42}}]',
    ],
)
def test_malformed_tool_calls_are_the_engines_broken_answer(tool_calls: str) -> None:
    delta = {"tool_calls": json.loads(tool_calls)}
    event = json.dumps({"choices": [{"index": 0, "delta": delta}]})
    with pytest.raises(EngineAnswerError):
        parse_decode_event(event, "chat")
