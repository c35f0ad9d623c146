"""Function calling: a chat request's ``tools``, ``tool_choice`` and tool-call history,
and the calls read back out of the model's text.

Sans-IO.  The model is shown the tools (by its chat template, or, where the
template knows none, by a system block in Hermes' words) and asked to answer a
call as ``<tool_call>`` + ``{"name": ..., "arguments": {...}}`` + ``</tool_call>``,
the format most open models are tuned on (Hermes, Qwen, SmolLM's own). The
router reads those blocks back into OpenAI's ``tool_calls``, as they stream.

``tool_choice`` ``required`` or a named function is enforced, not asked for: the
request gets a Lark grammar (kind ``tool_call``) whose ``%json`` part is each
function's parameter schema, so even a small model answers with a valid call.
``auto`` lets the model choose (no grammar); ``none`` leaves the tools out of
the prompt altogether.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any, Final, Literal, final

import attrs

from pdtrio.protocol.openai.errors import bad_request, invalid_type, show_client_text
from pdtrio.protocol.openai.structured import (
    MAX_STRUCTURED_SPEC_BYTES,
    openai_name,
    schema_text,
)
from pdtrio.protocol.sampling import StructuredOutput

__all__ = [
    "MAX_TOOLS",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ChatTools",
    "ToolCall",
    "ToolCallParser",
    "ToolFunction",
    "call_text",
    "message_extras",
    "parse_chat_tools",
    "parse_tool_calls",
    "tool_finish_reason",
]

TOOL_CALL_OPEN: Final = "<tool_call>"
TOOL_CALL_CLOSE: Final = "</tool_call>"
MAX_TOOLS: Final = 128  # OpenAI's limit
# calls in one forced answer: more would be a model looping, not an answer
MAX_FORCED_CALLS: Final = 8
_EMPTY_PARAMETERS: Final = '{"type":"object","properties":{}}'
# the JSON a forced call is written in: what the open models are tuned on, and one form
_JSON_STYLE: Final = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

ToolMode = Literal["auto", "none", "required", "function"]


@final
@attrs.frozen
class ToolFunction:
    name: str
    description: str | None
    parameters_json: str  # its JSON Schema, as compact JSON text


@final
@attrs.frozen
class ChatTools:
    """What a chat request says of tools. ``forced``: the function tool_choice names."""

    functions: tuple[ToolFunction, ...]
    mode: ToolMode
    forced: str | None
    parallel: bool

    @property
    def shown(self) -> bool:
        """Whether the model is shown the tools (and its answer read for calls)."""
        return self.mode != "none" and bool(self.functions)

    def tools_json(self) -> str:
        """The tools as the chat template takes them (OpenAI's shape), as JSON text."""
        if not self.shown:
            return ""
        return json.dumps(
            [
                {
                    "type": "function",
                    "function": {
                        "name": f.name,
                        **({} if f.description is None else {"description": f.description}),
                        "parameters": json.loads(f.parameters_json),
                    },
                }
                for f in self.functions
            ],
            ensure_ascii=False,
        )

    def structured(self) -> StructuredOutput | None:
        """The grammar that enforces a call (``required`` or a named function), else None."""
        if self.mode == "required":
            return StructuredOutput("tool_call", tool_call_grammar(self.functions, self.parallel))
        if self.mode == "function":
            chosen = tuple(f for f in self.functions if f.name == self.forced)
            return StructuredOutput("tool_call", tool_call_grammar(chosen, parallel=False))
        return None


def parse_chat_tools(obj: dict[str, Any], *, flat: bool = False) -> ChatTools | None:
    """The request's tools, or None when it has none; raises ``OpenAIError`` (400).

    ``flat``: the Responses API's shapes, a function's fields on the tool itself
    (``tools.[i].name``) and a named ``tool_choice`` as ``{"type": "function",
    "name": ...}``; else chat's, under ``function``."""
    if not flat:
        for legacy in ("functions", "function_call"):
            if obj.get(legacy) is not None:
                raise bad_request(
                    f"'{legacy}' (the deprecated function-calling form) is not supported; "
                    "use 'tools' and 'tool_choice'.",
                    param=legacy,
                )
    raw = obj.get("tools")
    choice = obj.get("tool_choice")
    parallel = obj.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid_type("parallel_tool_calls", "a boolean", parallel)
    if raw is None or raw == []:
        if choice is not None and choice not in ("none", "auto"):
            raise bad_request(
                "Invalid value for 'tool_choice': a tool must be chosen from 'tools', "
                "and the request has none.",
                param="tool_choice",
            )
        return None
    if not isinstance(raw, list):
        raise invalid_type("tools", "an array", raw)
    if len(raw) > MAX_TOOLS:
        raise bad_request(
            f"Invalid 'tools': array too long. Expected an array with maximum length "
            f"{MAX_TOOLS}, but got an array with length {len(raw)} instead.",
            param="tools",
            code="array_above_max_length",
        )
    functions = tuple(_tool(tool, f"tools.[{i}]", flat) for i, tool in enumerate(raw))
    names = [f.name for f in functions]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(
                f"Invalid 'tools': function name {show_client_text(name)} is given twice.",
                param=f"tools.[{i}].name" if flat else f"tools.[{i}].function.name",
            )
    mode, forced = _tool_choice(choice, names, flat)
    tools = ChatTools(functions, mode, forced, parallel is not False)
    structured = tools.structured()
    if structured is not None and len(structured.spec.encode()) > MAX_STRUCTURED_SPEC_BYTES:
        raise bad_request(
            f"Invalid 'tools': their schemas are larger than {MAX_STRUCTURED_SPEC_BYTES} bytes.",
            param="tools",
        )
    return tools


def _tool(tool: Any, where: str, flat: bool) -> ToolFunction:
    if not isinstance(tool, dict):
        raise invalid_type(where, "an object", tool)
    kind = tool.get("type")
    if kind != "function":
        # (on /v1/responses: web_search, file_search, mcp, custom, ... are OpenAI's own)
        raise bad_request(
            f"Invalid value for '{where}.type': only 'function' tools are supported.",
            param=f"{where}.type",
        )
    if flat:
        return _function(tool, where)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise invalid_type(f"{where}.function", "an object", function)
    return _function(function, f"{where}.function")


def _function(function: dict[str, Any], where: str) -> ToolFunction:
    """A function's name, description and parameters, its fields at ``where``."""
    name = openai_name(function, where)
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid_type(f"{where}.description", "a string", description)
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_type(f"{where}.strict", "a boolean", strict)
    parameters = function.get("parameters")
    if parameters is None:
        parameters_json = _EMPTY_PARAMETERS
    else:
        parameters_json = schema_text(parameters, f"{where}.parameters")
    return ToolFunction(name, description, parameters_json)


def _tool_choice(choice: Any, names: Sequence[str], flat: bool) -> tuple[ToolMode, str | None]:
    if choice is None or choice == "auto":
        return "auto", None
    if choice == "none":
        return "none", None
    if choice == "required":
        return "required", None
    if isinstance(choice, str):
        raise bad_request(
            f"Invalid value for 'tool_choice': {show_client_text(choice)}. Supported values "
            "are: 'none', 'auto', 'required', or an object naming a function.",
            param="tool_choice",
        )
    if not isinstance(choice, dict):
        raise invalid_type("tool_choice", "a string or an object", choice)
    if choice.get("type") != "function":
        # (on /v1/responses: allowed_tools, a hosted tool's type, custom, mcp, ...)
        raise bad_request(
            "Invalid value for 'tool_choice.type': only 'function' is supported.",
            param="tool_choice" if flat else "tool_choice.type",
        )
    if flat:
        name, name_param = choice.get("name"), "tool_choice.name"
    else:
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        name_param = "tool_choice.function.name"
    if not isinstance(name, str):
        raise bad_request(f"Missing required parameter: '{name_param}'.", param=name_param)
    if name not in names:
        raise bad_request(
            f"Invalid value for 'tool_choice': function {show_client_text(name)} is not "
            "one of 'tools'.",
            param=name_param,
        )
    return "function", name


def tool_call_grammar(functions: Sequence[ToolFunction], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) for one call of any of ``functions`` (up to
    :data:`MAX_FORCED_CALLS` with ``parallel``), each a ``<tool_call>`` block."""
    alternatives = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f.name},
                "arguments": json.loads(f.parameters_json),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = {"anyOf": alternatives, "x-guidance": _JSON_STYLE}
    repeat = f'("\\n" call){{0,{MAX_FORCED_CALLS - 1}}}' if parallel else ""
    return (
        f"start: call {repeat}\n"
        f'call: "{TOOL_CALL_OPEN}\\n" body "\\n{TOOL_CALL_CLOSE}"\n'
        f"body: %json {json.dumps(schema, ensure_ascii=False)}\n"
    )


# --- history: the calls and results of earlier turns ------------------------------


def message_extras(message: dict[str, Any], role: str, where: str) -> str:
    """What a message carries besides its text, for the chat template, as JSON text
    ("" for none): an assistant's ``tool_calls`` (arguments as objects, as templates
    take them), a tool result's ``tool_call_id`` (and ``name``). A plain message has
    none: its prompt stays a plain ChatPrompt."""
    extras: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls is not None and calls != []:
        if role != "assistant":
            raise bad_request(
                "Only assistant messages may carry 'tool_calls'.", param=f"{where}.tool_calls"
            )
        if not isinstance(calls, list):
            raise invalid_type(f"{where}.tool_calls", "an array", calls)
        extras["tool_calls"] = [
            _history_call(call, f"{where}.tool_calls.[{i}]") for i, call in enumerate(calls)
        ]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad_request(
                f"Missing required parameter: '{where}.tool_call_id'.",
                param=f"{where}.tool_call_id",
            )
        extras["tool_call_id"] = call_id
        # the function a result is of, in the older form some templates render
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise invalid_type(f"{where}.name", "a string", name)
            extras["name"] = name
    return json.dumps(extras, ensure_ascii=False) if extras else ""


def _history_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise invalid_type(where, "an object", call)
    call_id = call.get("id")
    if not isinstance(call_id, str):
        raise invalid_type(f"{where}.id", "a string", call_id)
    if call.get("type", "function") != "function":
        raise bad_request(
            f"Invalid value for '{where}.type': only 'function' is supported.",
            param=f"{where}.type",
        )
    function = call.get("function")
    if not isinstance(function, dict):
        raise invalid_type(f"{where}.function", "an object", function)
    name = function.get("name")
    if not isinstance(name, str):
        raise invalid_type(f"{where}.function.name", "a string", name)
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise invalid_type(f"{where}.function.arguments", "a string", arguments)
    try:
        parsed: Any = json.loads(arguments)
    except ValueError:
        parsed = arguments  # shown to the model as it was sent
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it (how earlier calls are shown to a model whose
    template knows no tools)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


# --- reading calls out of the model's text -------------------------------------------


@final
@attrs.frozen
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_body(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@final
class ToolCallParser:
    """Splits streamed model text into content and ``<tool_call>`` blocks.

    :meth:`feed` each delta, then :meth:`finish`; each returns the content to
    send now and the calls completed now.  Text that might be the start of a
    ``<tool_call>`` tag is held until it is known not to be; a block whose
    JSON is not a call (a model that misspoke, a call cut by max_tokens) goes
    out as the content it was.  Whitespace between calls is not content.
    """

    __slots__ = ("_buffer", "_calls", "_inside", "_names")

    def __init__(self, names: Sequence[str]) -> None:
        self._names = frozenset(names)
        self._buffer = ""
        self._inside = False
        self._calls = 0

    @property
    def called(self) -> bool:
        return self._calls > 0

    def finish_reason(self, reason: str) -> str:
        return tool_finish_reason(reason, self.called)

    def adopt(self, call: ToolCall) -> ToolCall:
        """A call the engine read out of its answer itself (vLLM's or SGLang's tool parser),
        numbered among this answer's calls; its id kept (one made if it had none)."""
        adopted = attrs.evolve(
            call, index=self._calls, id=call.id or "call_" + secrets.token_hex(12)
        )
        self._calls += 1
        return adopted

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._inside:
                end = self._buffer.find(TOOL_CALL_CLOSE)
                if end < 0:
                    break
                block = self._buffer[:end]
                self._buffer = self._buffer[end + len(TOOL_CALL_CLOSE) :]
                self._inside = False
                self._take_block(block, content, calls, closed=True)
                continue
            start = self._buffer.find(TOOL_CALL_OPEN)
            if start < 0:
                break
            before = self._buffer[:start]
            if before.strip():
                content.append(before)
            self._buffer = self._buffer[start + len(TOOL_CALL_OPEN) :]
            self._inside = True
        if not self._inside:
            content.append(self._release_outside())
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        if self._inside:
            self._inside = False
            self._take_block(self._buffer, content, calls, closed=False)
        elif self._buffer.strip() or not self._calls:
            content.append(self._buffer)
        self._buffer = ""
        return "".join(content), calls

    def _release_outside(self) -> str:
        """The held text that can go out now: all but a tail that may begin a tag, and
        nothing while it is only whitespace (it may be the gap before a call)."""
        buffer = self._buffer
        keep = _partial_tag_length(buffer)
        ready = buffer[: len(buffer) - keep]
        if not ready.strip():
            return ""
        self._buffer = buffer[len(ready) :]
        return ready

    def _take_block(
        self, block: str, content: list[str], calls: list[ToolCall], *, closed: bool
    ) -> None:
        call = self._call(block)
        if call is None:
            content.append(TOOL_CALL_OPEN + block + (TOOL_CALL_CLOSE if closed else ""))
        else:
            calls.append(call)

    def _call(self, block: str) -> ToolCall | None:
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        name = obj.get("name")
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(name, str) or name not in self._names:
            return None
        if not isinstance(arguments, dict):
            return None
        call = ToolCall(
            self._calls,
            "call_" + secrets.token_hex(12),
            name,
            json.dumps(arguments, ensure_ascii=False),
        )
        self._calls += 1
        return call


def _partial_tag_length(text: str) -> int:
    """How long a tail of ``text`` is a proper prefix of ``<tool_call>``."""
    for length in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-length:]):
            return length
    return 0


def parse_tool_calls(text: str, names: Sequence[str]) -> tuple[str, list[ToolCall]]:
    """A whole answer's content and calls."""
    parser = ToolCallParser(names)
    content, calls = parser.feed(text)
    more, more_calls = parser.finish()
    return content + more, calls + more_calls


def tool_finish_reason(reason: str, called: bool) -> str:
    """An answer's finish as OpenAI says it: ``tool_calls`` when it stopped after
    calling (one cut by max_tokens keeps its ``length``)."""
    return "tool_calls" if called and reason == "stop" else reason
