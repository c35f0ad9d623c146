"""The real openai client against a real hypercorn router and real workers."""

from __future__ import annotations

import json

import openai
import trio

from tests.cluster import client, running_cluster, wait_until_idle


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


async def test_chat_stream_with_usage_and_max_completion_tokens() -> None:
    async with running_cluster() as cluster:

        def call() -> list:
            stream = _openai(cluster.url).chat.completions.create(
                model="synthetic",
                messages=[{"role": "user", "content": "Hello there"}],
                stream=True,
                stream_options={"include_usage": True},
                max_completion_tokens=7,
            )
            return list(stream)

        chunks = await trio.to_thread.run_sync(call)
        content_chunks = [c for c in chunks if c.choices]
        assert content_chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
        assert len(text.split()) == 7
        assert [c.choices[0].finish_reason for c in content_chunks][-1] == "length"
        assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
        assert all(c.usage is None for c in content_chunks)
        usage = chunks[-1].usage
        assert chunks[-1].choices == []
        assert usage.completion_tokens == 7
        assert usage.prompt_tokens > 0
        assert usage.total_tokens == usage.prompt_tokens + 7
        await wait_until_idle(cluster)


async def test_completion_stream_and_non_stream_agree() -> None:
    async with running_cluster() as cluster:

        def call() -> tuple[str, str, object]:
            api = _openai(cluster.url)
            streamed = "".join(
                c.choices[0].text
                for c in api.completions.create(
                    model="synthetic", prompt="Once upon", max_tokens=9, seed=3, stream=True
                )
                if c.choices
            )
            whole = api.completions.create(
                model="synthetic", prompt="Once upon", max_tokens=9, seed=3
            )
            return streamed, whole.choices[0].text, whole.usage

        streamed, whole, usage = await trio.to_thread.run_sync(call)
        assert streamed == whole
        assert len(whole.split()) == 9
        assert usage.completion_tokens == 9  # type: ignore[attr-defined]


async def test_chat_non_stream_and_models() -> None:
    async with running_cluster() as cluster:

        def call() -> tuple:
            api = _openai(cluster.url)
            reply = api.chat.completions.create(
                model="synthetic",
                messages=[{"role": "user", "content": [{"type": "text", "text": "parts"}]}],
                max_tokens=3,
            )
            return reply, [m.id for m in api.models.list()]

        reply, models = await trio.to_thread.run_sync(call)
        assert models == ["synthetic"]
        assert reply.choices[0].message.role == "assistant"
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 3


async def test_first_token_finishing_at_prefill_still_ends_stream() -> None:
    async with running_cluster() as cluster:
        async with client(cluster) as http:
            response = await http.post(
                "/v1/chat/completions",
                json={
                    "model": "synthetic",
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 1,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
        events = [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 1
        assert cluster.stats()[1]["decode_requests"] == 0
        await wait_until_idle(cluster)


async def test_stop_string_ends_with_stop() -> None:
    async with running_cluster() as cluster:
        async with client(cluster) as http:
            base = {"model": "synthetic", "prompt": "stop me", "max_tokens": 30, "seed": 1}
            whole = (await http.post("/v1/completions", json=base)).json()
            text = whole["choices"][0]["text"]
            stop = text.split()[4]
            cut = (await http.post("/v1/completions", json={**base, "stop": [stop]})).json()
        assert cut["choices"][0]["finish_reason"] == "stop"
        assert cut["choices"][0]["text"] == text[: text.index(stop)]
        await wait_until_idle(cluster)


async def test_curl_style_stream_is_well_formed() -> None:
    async with running_cluster() as cluster:
        async with client(cluster) as http:
            async with http.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "model": "synthetic",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 5,
                    "stream": True,
                },
            ) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                body = b"".join([chunk async for chunk in response.aiter_bytes()])
        events = body.decode().split("\n\n")
        assert events[-1] == ""
        assert events[-2] == "data: [DONE]"
        for event in events[:-2]:
            payload = json.loads(event.removeprefix("data: "))
            assert payload["object"] == "chat.completion.chunk"
            assert "usage" not in payload
