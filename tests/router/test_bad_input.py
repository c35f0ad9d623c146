"""Bad input gets an OpenAI error body with the right status, never a 500."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster import Cluster, client, cluster_in_a_thread, running_cluster

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

CASES = [
    (CHAT, b"{not json", 400, None),
    (CHAT, b"[1, 2]", 400, None),
    (CHAT, {"messages": MSG}, 400, "model"),
    (CHAT, {"model": "synthetic"}, 400, "messages"),
    (CHAT, {"model": "synthetic", "messages": "hi"}, 400, "messages"),
    (CHAT, {"model": "synthetic", "messages": MSG, "max_tokens": -1}, 400, "max_tokens"),
    (CHAT, {"model": "synthetic", "messages": MSG, "max_tokens": "5"}, 400, "max_tokens"),
    (CHAT, {"model": "synthetic", "messages": MSG, "max_tokens": 10**12}, 400, "max_tokens"),
    (
        CHAT,
        {"model": "synthetic", "messages": MSG, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    (CHAT, {"model": "synthetic", "messages": MSG, "n": 17}, 400, "n"),
    (CHAT, {"model": "synthetic", "messages": MSG, "logprobs": 1}, 400, "logprobs"),
    (CHAT, {"model": "synthetic", "messages": MSG, "top_logprobs": 1}, 400, "top_logprobs"),
    (CHAT, {"model": "synthetic", "messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    (
        CHAT,
        {"model": "synthetic", "messages": MSG, "response_format": {"type": "json_object"}},
        400,
        "response_format",
    ),
    (CHAT, {"model": "synthetic", "messages": MSG, "temperature": "hot"}, 400, "temperature"),
    (
        CHAT,
        {"model": "synthetic", "messages": MSG, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    (CHAT, {"model": "nope", "messages": MSG}, 404, "model"),
    (COMPLETIONS, {"model": "synthetic"}, 400, "prompt"),
    (COMPLETIONS, {"model": "synthetic", "prompt": ["a", "b"]}, 400, "prompt"),
    (COMPLETIONS, {"model": "synthetic", "prompt": [1, -2]}, 400, "prompt"),
    (COMPLETIONS, {"model": "synthetic", "prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
]


@pytest.fixture(scope="module")
def shared() -> Iterator[Cluster]:
    """One cluster for the module's cases that only send a request and read the answer."""
    with cluster_in_a_thread() as cluster:
        yield cluster


@pytest.mark.parametrize(("path", "body", "status", "param"), CASES)
async def test_bad_request_gets_openai_error(
    shared: Cluster, path: str, body: object, status: int, param: str | None
) -> None:
    async with client(shared) as http:
        if isinstance(body, bytes):
            response = await http.post(
                path, content=body, headers={"content-type": "application/json"}
            )
        else:
            response = await http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"].startswith(param)
    assert "Traceback" not in response.text


async def test_prompt_longer_than_context_is_400_before_decode() -> None:
    async with running_cluster(max_model_len=64) as cluster:
        async with client(cluster) as http:
            response = await http.post(
                COMPLETIONS, json={"model": "synthetic", "prompt": "x" * 200, "stream": True}
            )
            too_many = await http.post(
                COMPLETIONS, json={"model": "synthetic", "prompt": "x", "max_tokens": 100}
            )
        assert not cluster.busy()
    assert response.status_code == 400
    assert "maximum context length" in response.json()["error"]["message"]
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "max_tokens"


async def test_unknown_route_and_method() -> None:
    async with running_cluster() as cluster:
        async with client(cluster) as http:
            missing = await http.get("/v1/nothing")
            wrong_method = await http.get(CHAT)
            health = await http.get("/health")
            metrics = await http.get("/metrics")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"]
    assert wrong_method.status_code == 405
    assert health.json()["status"] == "ok"
    assert "pdtrio_requests_active" in metrics.text


async def test_out_of_range_token_ids_rejected_by_prefill() -> None:
    async with running_cluster() as cluster:
        async with client(cluster) as http:
            response = await http.post(
                COMPLETIONS, json={"model": "synthetic", "prompt": [5, 99999]}
            )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
