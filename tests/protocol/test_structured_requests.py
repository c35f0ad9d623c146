"""response_format and vLLM's guided_* extras become SamplingParams.structured, or a 400."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from pdtrio.protocol.openai import OpenAIError
from pdtrio.protocol.openai.requests import parse_chat_completion_request, parse_completion_request
from pdtrio.protocol.openai.structured import MAX_STRUCTURED_SPEC_BYTES
from pdtrio.protocol.sampling import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
    "required": ["b", "a"],
}


def _chat(**fields: Any) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat_completion_request(
        json.dumps(body).encode(), served_models={"m"}, max_tokens_limit=100
    )


def _completion(**fields: Any) -> Any:
    body = {"model": "m", "prompt": "hi", **fields}
    return parse_completion_request(
        json.dumps(body).encode(), served_models={"m"}, max_tokens_limit=100
    )


def _error(**fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        _chat(**fields)
    assert info.value.status == 400
    return info.value


def test_no_constraint_by_default_and_for_text() -> None:
    assert _chat().sampling.structured is None
    assert _chat(response_format={"type": "text"}).sampling.structured is None


def test_json_object() -> None:
    structured = _chat(response_format={"type": "json_object"}).sampling.structured
    assert structured == StructuredOutput("json_object")


def test_json_schema_keeps_the_schema_and_its_key_order() -> None:
    structured = _chat(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
        }
    ).sampling.structured
    assert structured is not None and structured.kind == "json_schema"
    assert json.loads(structured.spec) == SCHEMA
    # the model writes properties in the schema's order: it must survive
    assert list(json.loads(structured.spec)["properties"]) == ["b", "a"]


def test_json_schema_without_a_schema_is_any_object() -> None:
    structured = _chat(
        response_format={"type": "json_schema", "json_schema": {"name": "x"}}
    ).sampling.structured
    assert structured == StructuredOutput("json_object")


def test_completions_take_response_format_too() -> None:
    structured = _completion(response_format={"type": "json_object"}).sampling.structured
    assert structured == StructuredOutput("json_object")


def test_guided_extras() -> None:
    assert _chat(guided_json=SCHEMA).sampling.structured.kind == "json_schema"
    assert _chat(guided_json=json.dumps(SCHEMA)).sampling.structured.kind == "json_schema"
    assert _chat(guided_regex="[0-9]+").sampling.structured == StructuredOutput("regex", "[0-9]+")
    lark = 'start: "yes" | "no"'
    assert _chat(guided_grammar=lark).sampling.structured == StructuredOutput("lark", lark)
    assert _chat(structured_outputs={"regex": "a+"}).sampling.structured == StructuredOutput(
        "regex", "a+"
    )


def test_guided_choice_is_a_regex_matching_exactly_the_choices() -> None:
    choices = ["yes", "a.b (c)", "x|y", "$1+2?"]
    structured = _chat(guided_choice=choices).sampling.structured
    assert structured is not None and structured.kind == "regex"
    # Python's re reads these escapes as llguidance's (Rust) regex does
    pattern = re.compile(structured.spec)
    for choice in choices:
        assert pattern.fullmatch(choice)
    for other in ("ab (c)", "x", "1+2", "yes "):
        assert not pattern.fullmatch(other)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {}}, "response_format.type"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
            "response_format.json_schema.name",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": [1]},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"},
                }
            },
            "response_format.json_schema.strict",
        ),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice.[1]"),
        ({"structured_outputs": {"xml": "x"}}, "structured_outputs"),
        ({"structured_outputs": "json"}, "structured_outputs"),
        # two constraints at once: which would win is not for the server to guess
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_regex": "a" * (MAX_STRUCTURED_SPEC_BYTES + 1)}, "guided_regex"),
    ],
)
def test_bad_constraints_are_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    error = _error(**fields)
    assert error.param == param
    assert error.to_body()["error"]["message"]
