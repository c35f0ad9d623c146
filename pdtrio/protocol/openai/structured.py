"""A request's output constraint: OpenAI's ``response_format`` and vLLM's extras.

Sans-IO.  Reads, from a request object already parsed as JSON:

- ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``
  (any JSON object), ``{"type": "json_schema", "json_schema": {"name",
  "schema", "strict", "description"}}``;
- vLLM's ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``
  (a Lark grammar) and their newer form ``structured_outputs: {"json",
  "regex", "choice", "grammar"}``.

At most one may be given.  The result is a
:class:`~pdtrio.protocol.sampling.StructuredOutput` whose spec is text: the
engine compiles it (and answers a grammar that does not compile with a 400
naming ``response_format``); here only the shape is checked.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from pdtrio.protocol.openai.errors import bad_request, invalid_type, show_client_text
from pdtrio.protocol.sampling import StructuredOutput

__all__ = [
    "MAX_STRUCTURED_SPEC_BYTES",
    "openai_name",
    "response_format_output",
    "schema_text",
    "structured_output",
]

# a schema or grammar larger than this is refused before any engine compiles it
MAX_STRUCTURED_SPEC_BYTES: Final = 64 * 1024
MAX_CHOICES: Final = 256
# OpenAI's rule for response_format.json_schema.name and a function's name
_OPENAI_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# what a Rust regex (llguidance's) takes escaped: every metacharacter, nothing else
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")
_GUIDED_KEYS: Final = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_STRUCTURED_OUTPUTS_KEYS: Final = {
    "json": "structured_outputs.json",
    "regex": "structured_outputs.regex",
    "choice": "structured_outputs.choice",
    "grammar": "structured_outputs.grammar",
}


def structured_output(obj: dict[str, Any]) -> StructuredOutput | None:
    """The request's constraint, or None; raises ``OpenAIError`` (400) for a bad shape."""
    found: list[tuple[str, StructuredOutput]] = []
    response_format = response_format_output(obj.get("response_format"))
    if response_format is not None:
        found.append(("response_format", response_format))
    for key in _GUIDED_KEYS:
        value = obj.get(key)
        if value is not None:
            found.append((key, _guided(key.removeprefix("guided_"), value, key)))
    extras = obj.get("structured_outputs")
    if extras is not None:
        if not isinstance(extras, dict):
            raise invalid_type("structured_outputs", "an object", extras)
        for key, value in extras.items():
            where = _STRUCTURED_OUTPUTS_KEYS.get(key)
            if where is None:
                raise bad_request(
                    f"structured_outputs.{show_client_text(str(key))} is not supported "
                    "(only json, regex, choice and grammar).",
                    param="structured_outputs",
                )
            if value is not None:
                found.append((where, _guided(key, value, where)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(
            f"Only one output constraint may be given per request (got {names}).",
            param=found[1][0],
        )
    return found[0][1] if found else None


def response_format_output(
    value: Any, *, where: str = "response_format", json_schema_where: str | None = None
) -> StructuredOutput | None:
    """A chat ``response_format`` object's constraint, or None.

    ``where`` names the object in errors, ``json_schema_where`` the object holding
    ``name``/``schema``/``strict`` (default ``{where}.json_schema``): the Responses API
    translates its flat ``text.format`` into this shape and has its own names told.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_type(where, "an object", value)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        return _json_schema_format(
            value.get("json_schema"), json_schema_where or f"{where}.json_schema"
        )
    if not isinstance(kind, str):
        raise bad_request(
            f"Missing or invalid '{where}.type': expected 'text', 'json_object' or 'json_schema'.",
            param=f"{where}.type",
        )
    raise bad_request(
        f"{where} type {show_client_text(kind)} is not supported "
        "(only 'text', 'json_object' and 'json_schema').",
        param=f"{where}.type",
    )


def openai_name(value: dict[str, Any], where: str) -> str:
    """``value``'s ``name``, as OpenAI names a schema or a function."""
    name = value.get("name")
    if not isinstance(name, str) or _OPENAI_NAME.fullmatch(name) is None:
        raise bad_request(
            f"Invalid '{where}.name': expected 1 to 64 letters, digits, '_' or '-'.",
            param=f"{where}.name",
        )
    return name


def _json_schema_format(value: Any, where: str) -> StructuredOutput:
    if not isinstance(value, dict):
        raise bad_request(
            f"Missing required parameter: '{where}' (an object with 'name' and 'schema').",
            param=where,
        )
    openai_name(value, where)
    strict = value.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_type(f"{where}.strict", "a boolean", strict)
    schema = value.get("schema")
    if schema is None:
        # OpenAI makes the schema optional: then any JSON object will do
        return StructuredOutput("json_object")
    return StructuredOutput("json_schema", schema_text(schema, f"{where}.schema"))


def _guided(kind: str, value: Any, where: str) -> StructuredOutput:
    if kind == "json":
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad_request(
                    f"Invalid '{where}': not a JSON schema (it does not parse as JSON: {exc}).",
                    param=where,
                ) from exc
        return StructuredOutput("json_schema", schema_text(value, where))
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise invalid_type(where, "a non-empty array of strings", value)
        if len(value) > MAX_CHOICES:
            raise bad_request(
                f"Invalid '{where}': at most {MAX_CHOICES} choices are allowed.", param=where
            )
        for i, choice in enumerate(value):
            if not isinstance(choice, str) or not choice:
                raise invalid_type(f"{where}.[{i}]", "a non-empty string", choice)
        pattern = "|".join(f"({_regex_literal(choice)})" for choice in value)
        return StructuredOutput("regex", _checked_size(pattern, where))
    if not isinstance(value, str) or not value:
        raise invalid_type(where, "a non-empty string", value)
    return StructuredOutput("regex" if kind == "regex" else "lark", _checked_size(value, where))


def schema_text(schema: Any, where: str) -> str:
    # a JSON Schema is an object (or true/false, which accept anything or nothing)
    if not isinstance(schema, dict):
        raise invalid_type(where, "a JSON Schema object", schema)
    # the key order is kept: it is the order the model writes the properties in
    return _checked_size(json.dumps(schema, ensure_ascii=False, separators=(",", ":")), where)


def _checked_size(text: str, where: str) -> str:
    if len(text.encode()) > MAX_STRUCTURED_SPEC_BYTES:
        raise bad_request(
            f"Invalid '{where}': larger than {MAX_STRUCTURED_SPEC_BYTES} bytes.", param=where
        )
    return text


def _regex_literal(text: str) -> str:
    return "".join(f"\\{c}" if c in _REGEX_META else c for c in text)
