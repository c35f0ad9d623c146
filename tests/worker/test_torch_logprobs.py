"""Logprobs of the torch engine through the openai client: tiny-random, PD and colocated.

They are the model's raw log-probabilities (vLLM's default ``raw_logprobs``):
at temperature 0 the likeliest token is the one produced, a logit bias changes
the token produced but not the logprobs reported, and disaggregated they are
exactly what colocated gives.
"""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest
import trio

pytest.importorskip("torch")

from pdtrio.config import EngineConfig, WorkerConfig  # noqa: E402
from pdtrio.engine.torch.engine import TorchEngine  # noqa: E402
from pdtrio.worker.server import Worker  # noqa: E402
from tests.cluster import running_cluster, wait_until_idle  # noqa: E402

# (the prefix cache off: a cached prefix's logits may differ in their last bits, and the
# topologies' caches hold different prompts)
TINY = EngineConfig(
    kind="torch",
    model="tiny-random",
    dtype="float64",
    num_kv_blocks=256,
    max_batch_size=8,
    prefix_cache=False,
)
MODEL = "tiny-random"
TOPOLOGIES = (("prefill", "decode"), ("both",))
CHAT = [{"role": "user", "content": "pd trio kv cache"}]


@pytest.fixture(scope="module")
def engines() -> dict[str, TorchEngine]:
    return {role: TorchEngine.from_config(TINY) for role in ("prefill", "decode", "both")}


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _calls(api: openai.OpenAI, **extra: Any) -> dict[str, Any]:
    """A chat streamed and not, and a completion streamed and not, all with logprobs."""
    chat: dict[str, Any] = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 4,
        **extra,
    }
    whole = api.chat.completions.create(**chat)
    assert whole.choices[0].logprobs is not None
    streamed: list[Any] = []
    for chunk in api.chat.completions.create(**chat, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    completion: dict[str, Any] = {
        "model": MODEL,
        "prompt": "pd trio",
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 3,
        **extra,
    }
    text = api.completions.create(**completion)
    text_streamed: list[Any] = []
    for chunk in api.completions.create(**completion, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            text_streamed.append(chunk.choices[0].logprobs.model_dump())
    return {
        "chat": [e.model_dump() for e in whole.choices[0].logprobs.content or []],
        "chat_tokens": whole.usage.completion_tokens if whole.usage else None,
        "chat_streamed": [e.model_dump() for e in streamed],
        "completion": text.choices[0].logprobs.model_dump() if text.choices[0].logprobs else None,
        "completion_streamed": text_streamed,
    }


async def _served(engines: dict[str, TorchEngine], **extra: Any) -> dict[tuple[str, ...], Any]:
    answers = {}
    for roles in TOPOLOGIES:

        def make(role: str) -> Worker:
            return Worker(WorkerConfig(role=role, engine=TINY), engines[role])  # type: ignore[arg-type]

        async with running_cluster(roles=roles, make_worker=make) as cluster:

            def call() -> dict[str, Any]:
                with _openai(cluster.url) as api:
                    return _calls(api, **extra)

            answers[roles] = await trio.to_thread.run_sync(call)
            await wait_until_idle(cluster)
    return answers


def _by_token(answer: dict[str, Any]) -> dict[str, Any]:
    """``answer`` with its streamed completion's chunks joined into one."""
    parts = answer["completion_streamed"]
    joined = {key: [item for part in parts for item in part[key]] for key in parts[0]}
    return {**answer, "completion_streamed": joined}


async def test_greedy_logprobs_are_the_same_disaggregated_and_colocated(
    engines: dict[str, TorchEngine],
) -> None:
    answers = await _served(engines)
    pd, colocated = answers[("prefill", "decode")], answers[("both",)]
    # a streamed answer's chunking follows the timing (the egress merges tokens that wait):
    # compared token by token
    assert _by_token(pd) == _by_token(colocated)
    entries = pd["chat"]
    assert len(entries) == pd["chat_tokens"] == 8
    assert pd["chat_streamed"] == entries
    for entry in entries:
        top = entry["top_logprobs"]
        assert len(top) == 4
        assert top[0]["token"] == entry["token"] and top[0]["logprob"] == entry["logprob"]
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert sum(math.exp(t["logprob"]) for t in top) <= 1.0 + 1e-6
        assert entry["bytes"] == list(entry["token"].encode("utf-8", errors="replace"))
    completion = pd["completion"]
    assert len(completion["tokens"]) == 6
    for token, logprob, top in zip(
        completion["tokens"], completion["token_logprobs"], completion["top_logprobs"], strict=True
    ):
        assert top[token] == logprob == max(top.values())
    # streamed: the same tokens and logprobs, a chunk at a time
    assert [t for part in pd["completion_streamed"] for t in part["tokens"]] == completion["tokens"]


async def test_a_logit_bias_changes_the_token_not_the_logprobs_reported(
    engines: dict[str, TorchEngine],
) -> None:
    plain = (await _served(engines))[("both",)]["chat"]
    forced_id = 77
    answers = await _served(engines, logit_bias={str(forced_id): 100})
    biased = answers[("prefill", "decode")]["chat"]
    assert answers[("both",)]["chat"] == biased
    # the same token every time, its raw logprob under the model's own likeliest
    assert len({entry["token"] for entry in biased}) == 1
    first = biased[0]
    assert first["token"] != plain[0]["token"]  # (the bias did change the token)
    assert first["top_logprobs"] == plain[0]["top_logprobs"]  # the prompt's own distribution
    assert first["logprob"] <= first["top_logprobs"][0]["logprob"]
