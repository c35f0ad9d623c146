"""405 carries Allow; a POST that is not JSON gets 415 before its body is read."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster import Cluster, client, cluster_in_a_thread

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def shared() -> Iterator[Cluster]:
    """One cluster for the module's cases that only send a request and read the answer."""
    with cluster_in_a_thread() as cluster:
        yield cluster


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/completions", "POST"),
        ("POST", "/health", "GET"),
        ("DELETE", "/v1/models", "GET"),
        ("POST", "/metrics", "GET"),
    ],
)
async def test_wrong_method_is_405_with_allow(
    shared: Cluster, method: str, path: str, allow: str
) -> None:
    async with client(shared) as http:
        response = await http.request(method, path)
    assert response.status_code == 405
    assert response.headers["allow"] == allow
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "application/json; charset=latin-1",
    ],
)
async def test_non_json_post_is_415(shared: Cluster, content_type: str) -> None:
    headers = {"content-type": content_type}
    body = b'{"model": "synthetic", "messages": [{"role": "user", "content": "hi"}]}'
    async with client(shared) as http:
        response = await http.post("/v1/chat/completions", content=body, headers=headers)
    assert response.status_code == 415
    assert response.json()["error"]["code"] == "unsupported_media_type"


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=utf-8", "Application/JSON", None]
)
async def test_json_with_charset_or_no_type_is_served(
    shared: Cluster, content_type: str | None
) -> None:
    body = (
        b'{"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    )
    async with client(shared) as http:
        response = await http.post(
            "/v1/chat/completions",
            content=body,
            headers={} if content_type is None else {"content-type": content_type},
        )
    assert response.status_code == 200, response.text
