"""Tools shown to a model whose chat template knows none: a system block, in Hermes' words.

Most open models' templates render ``tools`` themselves (Hermes, Qwen, Llama
3.1); a template that never reads ``tools`` (SmolLM2's, plain ChatML) would
drop them, so the messages are rewritten before it renders them: the tools go
into the system message with the ``<tool_call>`` format the router reads back,
earlier calls become the text the model would have written, and tool results
are wrapped as Hermes wraps them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

from pdtrio.protocol.openai.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, call_text

__all__ = ["messages_for_plain_template"]

_INSTRUCTIONS: Final = (
    "You are a function calling AI model. The functions you may call are described, one "
    "JSON signature a line, within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n"
    "Do not guess values the user did not give. To call a function, answer with a JSON "
    'object holding its name and arguments within {open}{close} XML tags:\n{open}\n{{"name": '
    '<function-name>, "arguments": <args-dict>}}\n{close}'
)


def tools_system_text(tools: Sequence[Any]) -> str:
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return _INSTRUCTIONS.format(tools=listed, open=TOOL_CALL_OPEN, close=TOOL_CALL_CLOSE)


def messages_for_plain_template(
    messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None
) -> list[dict[str, Any]]:
    """``messages`` (template dicts, with ``tool_calls``/``tool_call_id`` where given) as
    plain role and content ones, the tools in the system message."""
    plain: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message["content"]
        calls = message.get("tool_calls")
        if calls:
            written = "\n".join(
                call_text(call["function"]["name"], call["function"]["arguments"]) for call in calls
            )
            content = f"{content}\n{written}" if content else written
        elif role == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        plain.append({"role": role, "content": content})
    if tools:
        block = tools_system_text(tools)
        if plain and plain[0]["role"] == "system":
            plain[0] = {"role": "system", "content": f"{plain[0]['content']}\n\n{block}"}
        else:
            plain.insert(0, {"role": "system", "content": block})
    return plain
