"""Token logprobs through the real openai client, disaggregated and colocated.

The synthetic engine's logprobs are a made-up distribution in which the token it
produces is the likeliest (``pdtrio.engine.synthetic.synthetic_logprob``), a pure
function of the prompt and the position: the same in PD and colocated, however
decode's tokens are grouped into frames and events.
"""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest
import trio

from pdtrio.config import RouterConfig
from tests.cluster import running_cluster, wait_until_idle
from tests.router.test_adaptive_egress import _pin_spacing

TOPOLOGIES = [("prefill", "decode"), ("both",)]
CHAT = [{"role": "user", "content": "Tell me something"}]


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def _chat_entries(api: openai.OpenAI, stream: bool, **fields: Any) -> tuple[str, list[Any]]:
    """The reply's text and its logprobs entries (a stream's, chunk after chunk)."""
    body: dict[str, Any] = {"model": "synthetic", "messages": CHAT, "max_tokens": 9, **fields}
    if not stream:
        reply = api.chat.completions.create(**body)
        choice = reply.choices[0]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        return choice.message.content or "", choice.logprobs.content
    text, entries = "", []
    for chunk in api.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                entries += choice.logprobs.content
    return text, entries


def _completion_logprobs(api: openai.OpenAI, stream: bool, **fields: Any) -> dict[str, Any]:
    """The completion's text and logprobs fields (a stream's, joined)."""
    body: dict[str, Any] = {"model": "synthetic", "prompt": "Once", "max_tokens": 7, **fields}
    chunks = (
        list(api.completions.create(**body, stream=True))
        if stream
        else [api.completions.create(**body)]
    )
    joined: dict[str, Any] = {
        "text": "",
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for chunk in chunks:
        for choice in chunk.choices:
            joined["text"] += choice.text
            if choice.logprobs is not None:
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    joined[key] += getattr(choice.logprobs, key) or []
    return joined


def _check_chat_entries(text: str, entries: list[Any], top: int) -> None:
    assert "".join(entry.token for entry in entries) == text  # one entry per token
    assert len(entries) == 9
    for entry in entries:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == top
        if top:
            # the token produced is the likeliest (temperature 0: as a real model's)
            assert entry.top_logprobs[0].token == entry.token
            assert entry.top_logprobs[0].logprob == entry.logprob
            values = [alternative.logprob for alternative in entry.top_logprobs]
            assert values == sorted(values, reverse=True)
            assert sum(math.exp(value) for value in values) <= 1.0
        assert entry.logprob <= 0.0


@pytest.mark.parametrize("roles", TOPOLOGIES, ids=["pd", "colocated"])
async def test_chat_logprobs_are_one_per_token_streamed_or_not(roles: tuple[str, ...]) -> None:
    async with running_cluster(roles=roles) as cluster:

        def call() -> list[tuple[str, list[Any]]]:
            with _openai(cluster.url) as api:
                return [
                    _chat_entries(api, stream, logprobs=True, top_logprobs=top, temperature=0)
                    for stream in (False, True)
                    for top in (0, 3)
                ]

        answers = await trio.to_thread.run_sync(call)
        await wait_until_idle(cluster)
    for (text, entries), top in zip(answers, (0, 3, 0, 3), strict=True):
        _check_chat_entries(text, entries, top)
    whole, streamed = answers[1], answers[3]
    assert whole[0] == streamed[0]
    assert [e.model_dump() for e in whole[1]] == [e.model_dump() for e in streamed[1]]


@pytest.mark.parametrize("roles", TOPOLOGIES, ids=["pd", "colocated"])
async def test_completion_logprobs_have_offsets_into_the_text(roles: tuple[str, ...]) -> None:
    async with running_cluster(roles=roles) as cluster:

        def call() -> list[dict[str, Any]]:
            with _openai(cluster.url) as api:
                return [_completion_logprobs(api, stream, logprobs=2) for stream in (False, True)]

        whole, streamed = await trio.to_thread.run_sync(call)
        await wait_until_idle(cluster)
    assert whole == streamed
    text = whole["text"]
    assert "".join(whole["tokens"]) == text and len(whole["tokens"]) == 7
    for token, logprob, top, offset in zip(
        whole["tokens"],
        whole["token_logprobs"],
        whole["top_logprobs"],
        whole["text_offset"],
        strict=True,
    ):
        assert text[offset : offset + len(token)] == token
        # the 2 likeliest, and the sampled token (here the likeliest itself)
        assert len(top) == 2 and top[token] == logprob == max(top.values())


async def test_logprobs_are_the_same_disaggregated_and_colocated() -> None:
    results = []
    for roles in TOPOLOGIES:
        async with running_cluster(roles=roles) as cluster:

            def call() -> tuple[Any, ...]:
                with _openai(cluster.url) as api:
                    _, entries = _chat_entries(
                        api, True, logprobs=True, top_logprobs=5, temperature=0
                    )
                    return [e.model_dump() for e in entries], _completion_logprobs(
                        api, False, logprobs=5
                    )

            results.append(await trio.to_thread.run_sync(call))
    assert results[0] == results[1]


async def test_logprobs_stay_with_their_tokens_when_decode_groups_them() -> None:
    # several tokens per step and per frame, a stop string cutting text: still one entry
    # per token the client is charged for, in order, as one token a step gives
    answers = []
    for per_step in (1, 3):
        async with running_cluster(tokens_per_step=per_step) as cluster:

            def call() -> tuple[tuple[str, list[Any]], Any]:
                with _openai(cluster.url) as api:
                    streamed = _chat_entries(api, True, logprobs=True, top_logprobs=1)
                    whole = api.completions.create(
                        model="synthetic", prompt="Once", max_tokens=30, logprobs=1, stop=["9"]
                    )
                return streamed, whole

            answers.append(await trio.to_thread.run_sync(call))
            await wait_until_idle(cluster)
    (one_text, one_entries), one_whole = answers[0]
    (text, entries), whole = answers[1]
    assert (text, [e.model_dump() for e in entries]) == (
        one_text,
        [e.model_dump() for e in one_entries],
    )
    assert whole.choices[0].logprobs == one_whole.choices[0].logprobs
    assert whole.choices[0].finish_reason == "stop"  # (the stop string cut the text)
    assert len(whole.choices[0].logprobs.tokens) == whole.usage.completion_tokens


async def test_logprobs_stay_with_their_tokens_when_egress_groups_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the router's egress holds a stream's sends: the tokens of several entries go out as
    # one event, with theirs
    answers = []
    for spacing_s in (0.0, 0.05):
        _pin_spacing(monkeypatch, spacing_s)
        async with running_cluster(decode_step_s=0.005) as cluster:

            def call() -> tuple[list[Any], int]:
                with _openai(cluster.url) as api:
                    chunks = list(
                        api.completions.create(
                            model="synthetic",
                            prompt="Once",
                            max_tokens=40,
                            logprobs=1,
                            stream=True,
                        )
                    )
                events = [c.choices[0] for c in chunks if c.choices]
                for event in events:
                    assert event.logprobs is not None
                    assert "".join(event.logprobs.tokens or []) == event.text
                return [e.logprobs.model_dump() for e in events], len(events)

            answers.append(await trio.to_thread.run_sync(call))
            await wait_until_idle(cluster)
    (each, _), (grouped, events) = answers
    assert events < 20  # (40 tokens: they were grouped)

    def joined(parts: list[dict[str, Any]]) -> dict[str, list[Any]]:
        return {key: [v for part in parts for v in part[key]] for key in parts[0]}

    assert joined(grouped) == joined(each)


async def test_a_request_that_asks_no_logprobs_gets_none() -> None:
    async with running_cluster() as cluster:

        def call() -> tuple[Any, Any, list[Any]]:
            with _openai(cluster.url) as api:
                chat = api.chat.completions.create(model="synthetic", messages=CHAT, max_tokens=3)
                plain = api.completions.create(model="synthetic", prompt="Once", max_tokens=3)
                chunks = list(
                    api.chat.completions.create(
                        model="synthetic", messages=CHAT, max_tokens=3, stream=True
                    )
                )
            return chat, plain, chunks

        chat, plain, chunks = await trio.to_thread.run_sync(call)
        await wait_until_idle(cluster)
    assert chat.choices[0].logprobs is None and plain.choices[0].logprobs is None
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("chat", {"extra_body": {"logprobs": 2}}, "logprobs"),
        ("completion", {"logprobs": 21}, "logprobs"),
        ("completion", {"logprobs": -2}, "logprobs"),
        ("completion", {"extra_body": {"logprobs": "2"}}, "logprobs"),
        ("completion", {"logprobs": 2, "echo": True}, "echo"),
    ],
)
async def test_bad_logprobs_values_are_a_400_naming_the_param(
    endpoint: str, fields: dict[str, Any], param: str
) -> None:
    async with running_cluster(router=RouterConfig()) as cluster:

        def call() -> openai.BadRequestError:
            with _openai(cluster.url) as api, pytest.raises(openai.BadRequestError) as info:
                if endpoint == "chat":
                    api.chat.completions.create(
                        model="synthetic", messages=CHAT, max_tokens=4, **fields
                    )
                else:
                    api.completions.create(model="synthetic", prompt="Once", max_tokens=4, **fields)
            return info.value

        error = await trio.to_thread.run_sync(call)
    assert error.status_code == 400
    assert isinstance(error.body, dict) and error.body.get("param") == param, error.body
