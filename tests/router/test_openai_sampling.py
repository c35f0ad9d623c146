"""Sampling options through the real openai client, disaggregated and colocated.

The synthetic engine's words are ``" t<id>"``: a reply shows its token ids, so
stop_token_ids can be aimed at a token the same request produced before.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
import trio

from tests.cluster import running_cluster, wait_until_idle

TOPOLOGIES = [("prefill", "decode"), ("both",)]
CHAT = [{"role": "user", "content": "Tell me something"}]


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def _ids(text: str) -> list[int]:
    return [int(word[1:]) for word in text.split()]


@pytest.mark.parametrize("roles", TOPOLOGIES, ids=["pd", "colocated"])
async def test_the_same_seed_gives_the_same_output(roles: tuple[str, ...]) -> None:
    async with running_cluster(roles=roles) as cluster:

        def call() -> tuple[list[str], list[str]]:
            with _openai(cluster.url) as api:
                return _seeded_calls(api)

        chats, completions = await trio.to_thread.run_sync(call)
        await wait_until_idle(cluster)
    assert chats[0] == chats[1] != chats[2]
    assert completions[0] == completions[1]


def _seeded_calls(api: openai.OpenAI) -> tuple[list[str], list[str]]:
    chats = [
        api.chat.completions.create(
            model="synthetic", messages=CHAT, max_tokens=8, temperature=0.9, seed=seed
        )
        .choices[0]
        .message.content
        or ""
        for seed in (7, 7, 8)
    ]
    streamed = "".join(
        c.choices[0].text
        for c in api.completions.create(
            model="synthetic", prompt="Once", max_tokens=8, seed=7, stream=True
        )
        if c.choices
    )
    whole = api.completions.create(model="synthetic", prompt="Once", max_tokens=8, seed=7)
    return chats, [streamed, whole.choices[0].text]


async def test_seeded_output_is_the_same_disaggregated_and_colocated() -> None:
    texts = []
    for roles in TOPOLOGIES:
        async with running_cluster(roles=roles) as cluster:

            def call() -> str:
                with _openai(cluster.url) as api:
                    reply = api.chat.completions.create(
                        model="synthetic", messages=CHAT, max_tokens=10, seed=123, temperature=1.0
                    )
                return reply.choices[0].message.content or ""

            texts.append(await trio.to_thread.run_sync(call))
    assert texts[0] == texts[1] and len(texts[0].split()) == 10


@pytest.mark.parametrize("roles", TOPOLOGIES, ids=["pd", "colocated"])
@pytest.mark.parametrize("stream", [False, True])
async def test_stop_token_ids_end_the_reply_before_that_token(
    roles: tuple[str, ...], stream: bool
) -> None:
    async with running_cluster(roles=roles) as cluster:

        def call(stop_token_ids: list[int] | None = None) -> tuple[str, str | None]:
            extra = {} if stop_token_ids is None else {"stop_token_ids": stop_token_ids}
            with _openai(cluster.url) as api:
                return _chat(api, stream, extra_body=extra)

        plain, plain_finish = await trio.to_thread.run_sync(call)
        ids = _ids(plain)
        assert plain_finish == "length" and len(ids) == 8
        # the first token is prefill's, the fourth decode's: both stop the same way
        for at in (0, 3):
            text, finish = await trio.to_thread.run_sync(call, [ids[at], 1])
            assert finish == "stop"
            assert _ids(text) == ids[: ids.index(ids[at])]
        await wait_until_idle(cluster)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logit_bias": {"5": 150}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"min_p": 2}}, "min_p"),
        ({"extra_body": {"stop_token_ids": "7"}}, "stop_token_ids"),
        # not served yet: refused, naming the feature
        ({"n": 17}, "n"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        # the synthetic engine's tokens have no text a grammar could force a call in
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
            "tools",
        ),
    ],
)
async def test_bad_or_unserved_values_are_a_400_naming_the_param(
    fields: dict[str, Any], param: str, roles: tuple[str, ...] = ("prefill", "decode")
) -> None:
    async with running_cluster(roles=roles) as cluster:

        def call() -> openai.BadRequestError:
            with _openai(cluster.url) as api, pytest.raises(openai.BadRequestError) as info:
                api.chat.completions.create(
                    model="synthetic", messages=CHAT, max_tokens=4, **fields
                )
            return info.value

        error = await trio.to_thread.run_sync(call)
        await wait_until_idle(cluster)
    assert error.status_code == 400
    assert isinstance(error.body, dict) and error.body.get("param") == param, error.body


@pytest.mark.parametrize("roles", TOPOLOGIES, ids=["pd", "colocated"])
async def test_a_logit_bias_outside_the_vocabulary_is_a_400_from_prefill(
    roles: tuple[str, ...],
) -> None:
    # the vocabulary is the engine's to know: refused at prefill, still a 400 naming it
    await test_bad_or_unserved_values_are_a_400_naming_the_param(
        {"logit_bias": {"99999999": 1}}, "logit_bias", roles
    )


async def test_completions_take_penalties_and_refuse_echo() -> None:
    async with running_cluster() as cluster:

        def call() -> tuple[str, openai.BadRequestError]:
            with _openai(cluster.url) as api:
                return _penalized_completion(api)

        text, error = await trio.to_thread.run_sync(call)
        await wait_until_idle(cluster)
    assert len(text.split()) == 5
    assert isinstance(error.body, dict) and error.body.get("param") == "echo"


def _penalized_completion(api: openai.OpenAI) -> tuple[str, openai.BadRequestError]:
    reply = api.completions.create(
        model="synthetic",
        prompt="Once",
        max_tokens=5,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"5": -100},
        extra_body={"repetition_penalty": 1.2, "min_p": 0.1},
    )
    with pytest.raises(openai.BadRequestError) as info:
        # echo (the prompt back, with its logprobs) is not served
        api.completions.create(model="synthetic", prompt="Once", logprobs=2, echo=True)
    return reply.choices[0].text, info.value


def _chat(api: openai.OpenAI, stream: bool, **extra: Any) -> tuple[str, str | None]:
    fields: dict[str, Any] = {"model": "synthetic", "messages": CHAT, "max_tokens": 8, "seed": 4}
    if not stream:
        reply = api.chat.completions.create(**fields, **extra)
        return reply.choices[0].message.content or "", reply.choices[0].finish_reason
    chunks = list(api.chat.completions.create(**fields, stream=True, **extra))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]
