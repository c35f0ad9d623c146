"""Huge requests are refused early, and big bodies parse exactly like json.loads."""

from __future__ import annotations

import json

import pytest

from pdtrio.protocol.openai import PIECEWISE_JSON_BYTES, _load_piecewise
from tests.cluster import client, running_cluster


async def test_token_prompt_longer_than_context_is_refused_by_the_router() -> None:
    body = {"model": "synthetic", "prompt": list(range(100, 300_100))}
    async with running_cluster() as cluster, client(cluster) as http:
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["param"] == "prompt"
        # refused before forwarding: prefill never saw it
        assert cluster.workers[0].stats()["served_prefills"] == 0


async def test_token_prompt_plus_max_tokens_over_context_is_refused() -> None:
    body = {"model": "synthetic", "prompt": [100] * 8000, "max_tokens": 500}
    async with running_cluster() as cluster, client(cluster) as http:
        response = await http.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


async def test_big_chat_body_is_parsed_off_the_loop_and_answered() -> None:
    messages = [{"role": "user", "content": f"m{i}"} for i in range(40_000)]
    body = json.dumps({"model": "synthetic", "messages": messages}).encode()
    assert len(body) > PIECEWISE_JSON_BYTES
    async with running_cluster() as cluster, client(cluster) as http:
        response = await http.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
    assert response.status_code == 400  # longer than the synthetic context (8192)
    assert "maximum context length" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "value",
    [
        {"prompt": list(range(50_000)), "x": [[1, -2.5e3, 0], {"a": [1, 'b\\"c\u00e9']}]},
        {"prompt": [[i % 7 for i in range(60_000)]], "stop": None, "t": True},
        {"messages": [{"role": "user", "content": "x" * 10} for _ in range(20_000)]},
    ],
)
@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_piecewise_parse_equals_json_loads(value: object, separators: tuple[str, str]) -> None:
    body = json.dumps(value, separators=separators).encode()
    assert _load_piecewise(body) == json.loads(body)


@pytest.mark.parametrize(
    "body",
    [b'{"a":[1,2,]}', b'{"a":[1,2', b'{"a":1}x', b'{"a":[01,2]}', b"\xff", b'{"a" 1}', b"[1,"],
)
def test_piecewise_parse_rejects_what_json_loads_rejects(body: bytes) -> None:
    with pytest.raises(ValueError):
        json.loads(body)
    with pytest.raises(ValueError):
        _load_piecewise(body)
