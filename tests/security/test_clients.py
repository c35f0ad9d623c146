"""Who may use the router: API keys (401 in OpenAI's shape) and concurrency limits (429)."""

from __future__ import annotations

import logging
from pathlib import Path

import openai
import pytest
import trio

from pdtrio.config import ConfigError, SecurityConfig
from pdtrio.security import ApiKeys
from tests.cluster import client, running_cluster, wait_for_stats, wait_until_idle

KEY = "sk-test-0123456789"
OTHER = "sk-other-9876543210"
BODY = {"model": "synthetic", "prompt": "hi", "max_tokens": 4}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_completions_need_one_of_the_keys_and_say_so_in_openai_shape(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with running_cluster(security=SecurityConfig(api_keys=(KEY, OTHER))) as cluster:
        async with client(cluster) as http:
            missing = await http.post("/v1/completions", json=BODY)
            wrong = await http.post("/v1/completions", json=BODY, headers=auth("sk-nope"))
            not_bearer = await http.post(
                "/v1/completions", json=BODY, headers={"authorization": KEY}
            )
            models = await http.get("/v1/models")
            ok = await http.post("/v1/completions", json=BODY, headers=auth(KEY))
            ok_other = await http.post("/v1/completions", json=BODY, headers=auth(OTHER))
            health = await http.get("/health")
            metrics = await http.get("/metrics")
        for refused in (missing, wrong, not_bearer, models):
            assert refused.status_code == 401, refused.text
            assert refused.headers["www-authenticate"] == "Bearer"
            error = refused.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert "didn't provide an API key" in missing.json()["error"]["message"]
        assert "Incorrect API key" in wrong.json()["error"]["message"]
        assert ok.status_code == 200 and ok_other.status_code == 200
        assert health.status_code == 200 and metrics.status_code == 200  # open by default
        await wait_until_idle(cluster)
    # no key, and nothing that names one, is ever logged
    assert KEY not in caplog.text and OTHER not in caplog.text and "sk-nope" not in caplog.text


async def test_health_and_metrics_can_be_protected_too() -> None:
    security = SecurityConfig(api_keys=(KEY,), protect_health=True, protect_metrics=True)
    async with running_cluster(security=security) as cluster:
        async with client(cluster) as http:
            assert (await http.get("/health")).status_code == 401
            assert (await http.get("/metrics")).status_code == 401
            assert (await http.get("/health", headers=auth(KEY))).status_code == 200
            assert (await http.get("/metrics", headers=auth(KEY))).status_code == 200


async def test_the_openai_client_with_its_api_key() -> None:
    async with running_cluster(security=SecurityConfig(api_keys=(KEY,))) as cluster:

        def call(key: str) -> str:
            with openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=key, max_retries=0) as api:
                answer = api.completions.create(model="synthetic", prompt="hi", max_tokens=3)
            return answer.choices[0].text

        assert len((await trio.to_thread.run_sync(call, KEY)).split()) == 3
        with pytest.raises(openai.AuthenticationError):
            await trio.to_thread.run_sync(call, "sk-wrong")


async def test_a_refused_request_is_refused_before_its_body_is_read() -> None:
    async with running_cluster(security=SecurityConfig(api_keys=(KEY,))) as cluster:
        host, port = cluster.url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            # a 100 MB body announced, none sent: the answer must come anyway
            await stream.send_all(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: 100000000\r\n\r\n"
            )
            with trio.fail_after(10):
                head = await stream.receive_some(4096)
        assert head.startswith(b"HTTP/1.1 401"), head


async def test_concurrent_requests_are_limited_per_key_and_in_all() -> None:
    security = SecurityConfig(
        api_keys=(KEY, OTHER), max_concurrent_requests_per_key=1, max_concurrent_requests=2
    )
    long_body = {**BODY, "max_tokens": 400, "stream": True}
    async with running_cluster(security=security) as cluster:
        async with client(cluster) as http, trio.open_nursery() as nursery:
            started = trio.Event()

            async def hold(key: str) -> None:
                async with http.stream(
                    "POST", "/v1/completions", json=long_body, headers=auth(key)
                ) as response:
                    assert response.status_code == 200
                    started.set()
                    async for _ in response.aiter_bytes():
                        pass

            nursery.start_soon(hold, KEY)
            await started.wait()
            same_key = await http.post("/v1/completions", json=BODY, headers=auth(KEY))
            assert same_key.status_code == 429, same_key.text
            assert same_key.headers["retry-after"] == "1"
            assert same_key.json()["error"]["code"] == "rate_limit_exceeded"
            other_key = await http.post("/v1/completions", json=BODY, headers=auth(OTHER))
            assert other_key.status_code == 200, other_key.text
            started = trio.Event()
            nursery.start_soon(hold, OTHER)
            await started.wait()
            # two running: the server's limit, whichever the key
            assert cluster.router_app.router is not None
            router = cluster.router_app.router
            assert router.client_limits.running == 2
        await wait_until_idle(cluster)
        await wait_for_stats(lambda: router.client_limits.running == 0)


def test_keys_come_from_the_environment_a_file_or_the_configuration(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# the team's keys\nsk-a\n\nsk-b\n")
    from_file = ApiKeys.resolve((), str(keys_file), {})
    assert len(from_file) == 2 and from_file.identify("Bearer sk-b") is not None
    from_env = ApiKeys.resolve(("sk-config",), str(keys_file), {"PDTRIO_API_KEYS": "sk-x, sk-y"})
    assert from_env.identify("Bearer sk-y") and not from_env.identify("Bearer sk-a")
    assert ApiKeys.resolve(("sk-config",), "", {}).identify("bearer  sk-config ")
    assert not ApiKeys.resolve((), "", {}).required
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="lists no key"):
        ApiKeys.resolve((), str(tmp_path / "empty"), {})
    with pytest.raises(ConfigError, match="cannot read"):
        ApiKeys.resolve((), str(tmp_path / "missing"), {})
    assert KEY not in repr(SecurityConfig(api_keys=(KEY,), worker_secret=KEY))


async def test_large_headers_get_a_clear_refusal() -> None:
    async with running_cluster() as cluster:
        async with client(cluster) as http:
            response = await http.post(
                "/v1/completions", json=BODY, headers={"x-padding": "a" * 200_000}
            )
        assert response.status_code in (400, 413, 431), response.status_code


async def test_a_client_without_keys_configured_needs_none() -> None:
    async with running_cluster() as cluster:
        async with client(cluster) as http:
            assert (await http.post("/v1/completions", json=BODY)).status_code == 200
