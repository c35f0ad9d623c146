"""pdtrio.protocol.vllm_pd: vLLM's PD legs built, its answers and /metrics read."""

from __future__ import annotations

import pytest

from pdtrio.protocol.vllm_pd import (
    PREFILL_KV_PARAMS,
    EngineAnswerError,
    decode_body,
    parse_decode_event,
    parse_engine_metrics,
    parse_prefill_answer,
    prefill_body,
    release_body,
)
from pdtrio.protocol.wire import Usage

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
