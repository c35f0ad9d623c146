"""``n`` > 1 through the real openai client, disaggregated and colocated (synthetic engine).

One prefill samples every choice's first token; decode runs the choices on the
prompt's one KV.  The synthetic engine's output is a pure function of (prompt,
seed, position), so seeded choice ``i`` must equal a single request with seed
``seed + i``.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import msgspec
import openai
import pytest
import trio

from pdtrio.engine.api import EngineError
from tests.cluster import (
    Cluster,
    client,
    raw_post_then_hang_up,
    running_cluster,
    synthetic_worker,
    wait_for_stats,
    wait_until_idle,
)

TOPOLOGIES = [("prefill", "decode"), ("both",)]
CHAT = [{"role": "user", "content": "Tell me something"}]


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def _chat_choices(api: openai.OpenAI, stream: bool, **fields: Any) -> list[tuple[str, str]]:
    """Each choice's (text, finish_reason), by index."""
    if not stream:
        reply = api.chat.completions.create(model="synthetic", messages=CHAT, **fields)
        assert [c.index for c in reply.choices] == list(range(len(reply.choices)))
        return [(c.message.content or "", c.finish_reason) for c in reply.choices]
    chunks = api.chat.completions.create(model="synthetic", messages=CHAT, stream=True, **fields)
    return list(streamed_choices(list(chunks)).values())


def streamed_choices(chunks: list[Any]) -> dict[int, tuple[str, str]]:
    """Each choice's (text, finish_reason) from an openai client's chat chunks, checking
    each choice has one role chunk and one finish."""
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    roles: list[int] = []
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.delta.role == "assistant":
                roles.append(choice.index)
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                assert choice.index not in finishes  # one finish per choice
                finishes[choice.index] = choice.finish_reason
    assert sorted(roles) == sorted(texts) == sorted(finishes)  # one role chunk per choice
    return {index: (texts[index], finishes[index]) for index in sorted(texts)}


@pytest.mark.parametrize("roles", TOPOLOGIES, ids=["pd", "colocated"])
async def test_seeded_choices_are_single_requests_with_seed_plus_index(
    roles: tuple[str, ...],
) -> None:
    async with running_cluster(roles=roles) as cluster:

        def call() -> tuple[list[Any], list[Any], list[Any]]:
            with _openai(cluster.url) as api:
                fields = {"max_tokens": 6, "temperature": 1.0, "seed": 40}
                whole = _chat_choices(api, False, n=3, **fields)
                streamed = _chat_choices(api, True, n=3, **fields)
                singles = [
                    _chat_choices(api, False, max_tokens=6, temperature=1.0, seed=40 + i)[0]
                    for i in range(3)
                ]
                return whole, streamed, singles

        whole, streamed, singles = await trio.to_thread.run_sync(call)
        await wait_until_idle(cluster)
    assert whole == streamed == singles
    assert len({text for text, _ in whole}) == 3  # different seeds, different answers
    assert all(finish == "length" and len(text.split()) == 6 for text, finish in whole)


@pytest.mark.parametrize("roles", TOPOLOGIES, ids=["pd", "colocated"])
async def test_usage_counts_the_prompt_once_and_every_choice(roles: tuple[str, ...]) -> None:
    async with running_cluster(roles=roles) as cluster:

        def call() -> tuple[Any, Any, Any]:
            with _openai(cluster.url) as api:
                one = api.completions.create(model="synthetic", prompt="Once", max_tokens=5)
                four = api.completions.create(model="synthetic", prompt="Once", max_tokens=5, n=4)
                chunks = list(
                    api.completions.create(
                        model="synthetic",
                        prompt="Once",
                        max_tokens=5,
                        n=4,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                )
                return one, four, chunks

        one, four, chunks = await trio.to_thread.run_sync(call)
        await wait_until_idle(cluster)
    assert len(four.choices) == 4
    assert four.usage.prompt_tokens == one.usage.prompt_tokens
    assert four.usage.completion_tokens == 4 * one.usage.completion_tokens == 20
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0].choices == []
    assert usage_chunks[0].usage.completion_tokens == 20
    assert {choice.index for c in chunks for choice in c.choices} == {0, 1, 2, 3}


@pytest.mark.parametrize("roles", TOPOLOGIES, ids=["pd", "colocated"])
async def test_logprobs_come_with_each_choice(roles: tuple[str, ...]) -> None:
    async with running_cluster(roles=roles) as cluster:

        def call() -> tuple[Any, list[Any]]:
            with _openai(cluster.url) as api:
                fields: dict[str, Any] = {
                    "model": "synthetic",
                    "messages": CHAT,
                    "max_tokens": 4,
                    "n": 2,
                    "logprobs": True,
                    "top_logprobs": 2,
                    "seed": 3,
                }
                whole = api.chat.completions.create(**fields)
                chunks = list(api.chat.completions.create(stream=True, **fields))
                return whole, chunks

        whole, chunks = await trio.to_thread.run_sync(call)
        await wait_until_idle(cluster)
    for choice in whole.choices:
        assert choice.logprobs is not None and len(choice.logprobs.content) == 4
        assert "".join(item.token for item in choice.logprobs.content) == choice.message.content
    streamed: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                streamed[choice.index] += [item.token for item in choice.logprobs.content]
    assert streamed == {c.index: [item.token for item in c.logprobs.content] for c in whole.choices}


async def test_a_client_leaving_frees_every_choice_on_every_worker() -> None:
    async with running_cluster(roles=("prefill", "decode"), decode_step_s=0.02) as cluster:
        body = json.dumps(
            {"model": "synthetic", "prompt": "Once", "max_tokens": 500, "n": 4, "stream": True}
        ).encode()
        # a few events: every choice is running on decode
        await raw_post_then_hang_up(cluster.url, "/v1/completions", body, events=12)
        await wait_until_idle(cluster)


async def test_the_choices_share_the_prompts_kv_on_decode() -> None:
    # a long prompt (many full blocks), a short budget: sharing shows in the blocks held
    prompt = " ".join(["word"] * 300)

    async def blocks_held(cluster: Cluster, n: int) -> int:
        async with client(cluster) as http:
            async with trio.open_nursery() as nursery:
                body = {"model": "synthetic", "prompt": prompt, "max_tokens": 200, "n": n}
                nursery.start_soon(partial(http.post, "/v1/completions", json=body))
                decode = cluster.workers[1]
                await wait_for_stats(lambda: decode.engine.statistics().running_requests == n)
                held = decode.engine.statistics().kv_blocks_in_use
                nursery.cancel_scope.cancel()
        await wait_until_idle(cluster)
        return held

    async with running_cluster(roles=("prefill", "decode"), decode_step_s=0.05) as cluster:
        one = await blocks_held(cluster, 1)
        three = await blocks_held(cluster, 3)
    assert one < three < 3 * one


@pytest.mark.parametrize("n", [0, 17, "2"])
async def test_bad_n_is_a_400_naming_it(n: Any) -> None:
    async with running_cluster() as cluster, client(cluster) as http:
        reply = await http.post(
            "/v1/chat/completions", json={"model": "synthetic", "messages": CHAT, "n": n}
        )
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "n"


async def test_a_worker_answering_one_choice_is_an_error_not_a_hang() -> None:
    """A prefill worker from before n > 1 answers with choice 0 alone: the client gets a
    clear error, and nothing is left held."""

    def old_worker(role: str) -> Any:
        worker = synthetic_worker(role)
        prefill = worker.engine.prefill

        async def one_choice(request_id: str, ids: list[int], sampling: Any, *args: Any) -> Any:
            return await prefill(request_id, ids, msgspec.structs.replace(sampling, n=1), *args)

        worker.engine.prefill = one_choice  # type: ignore[method-assign]
        return worker

    async with running_cluster(make_worker=old_worker) as cluster, client(cluster) as http:
        reply = await http.post(
            "/v1/completions", json={"model": "synthetic", "prompt": "Once", "n": 2}
        )
        assert reply.status_code == 500
        assert "choices" in reply.json()["error"]["message"]
        await wait_until_idle(cluster)


async def _first_word(http: Any, seed: int) -> str:
    reply = await http.post(
        "/v1/completions",
        json={"model": "synthetic", "prompt": "Once", "max_tokens": 1, "seed": seed},
    )
    return str(reply.json()["choices"][0]["text"])


@pytest.mark.parametrize("roles", TOPOLOGIES, ids=["pd", "colocated"])
async def test_choice_zero_ending_at_prefill_leaves_the_others_running(
    roles: tuple[str, ...],
) -> None:
    async with running_cluster(roles=roles) as cluster, client(cluster) as http:
        # a stop string that is choice 0's first word (seed 9) ends it at prefill
        stop = await _first_word(http, 9)
        assert stop != await _first_word(http, 10)
        body = {"model": "synthetic", "prompt": "Once", "max_tokens": 5, "seed": 9, "n": 2}
        reply = (await http.post("/v1/completions", json={**body, "stop": [stop]})).json()
        first, second = reply["choices"]
        assert (first["text"], first["finish_reason"]) == ("", "stop")
        assert second["finish_reason"] in ("length", "stop") and second["text"]
        assert reply["usage"]["completion_tokens"] == 1 + len(second["text"].split())
        await wait_until_idle(cluster)


async def test_decode_failing_to_start_the_choices_is_an_error_for_every_choice() -> None:
    """Decode accepted, then could not start: with choice 0 ended at prefill, the
    failure still reaches the running choices (each hears it by its own id)."""

    def failing_decode(role: str) -> Any:
        worker = synthetic_worker(role)
        if role == "decode":

            async def refuse(*args: Any, **kwargs: Any) -> None:
                raise EngineError("a fault of the test")

            worker.engine.start_decode = refuse  # type: ignore[method-assign]
        return worker

    async with running_cluster(make_worker=failing_decode) as cluster, client(cluster) as http:
        stop = await _first_word(http, 9)
        body = {"model": "synthetic", "prompt": "Once", "max_tokens": 5, "seed": 9, "n": 2}
        with trio.fail_after(20):
            reply = await http.post("/v1/completions", json={**body, "stop": [stop]})
        assert reply.status_code >= 500
        assert "did not start" in reply.json()["error"]["message"]
        await wait_until_idle(cluster)
