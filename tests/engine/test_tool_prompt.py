"""Tools in the prompt: through a template that renders them, or written in for one that
does not (SmolLM2's, plain ChatML)."""

from __future__ import annotations

import json

from pdtrio.engine.tokenizer import Tokenizer, tiny_tokenizer
from pdtrio.protocol.openai.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, call_text

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
MESSAGES = [
    ("user", "weather in Paris?"),
    ("assistant", ""),
    ("tool", "sunny"),
]
EXTRAS = ["", json.dumps({"tool_calls": [CALL]}), json.dumps({"tool_call_id": "call_1"})]

# the shape of Qwen's and Hermes' templates: tools into the system turn, calls as blocks
_TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}"
    "{{ t.function.name }};{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}{% endif %}"
    "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_without_tools_gets_them_written_in() -> None:
    text = tiny_tokenizer().apply_chat_template(
        MESSAGES, tools_json=json.dumps(TOOLS), message_extras=EXTRAS
    )
    system, user, assistant, tool = text.split("<|im_start|>")[1:5]
    assert system.startswith("system\n") and "<tools>" in system
    assert json.dumps(TOOLS[0]) in system
    assert TOOL_CALL_OPEN in system and TOOL_CALL_CLOSE in system  # the format to answer in
    assert user == "user\nweather in Paris?<|im_end|>\n"
    assert call_text("get_weather", {"city": "Paris"}) in assistant
    assert tool == "tool\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"


def test_an_existing_system_message_keeps_its_words_first() -> None:
    text = tiny_tokenizer().apply_chat_template(
        [("system", "Be brief."), ("user", "hi")], tools_json=json.dumps(TOOLS)
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n")
    assert text.count("<|im_start|>system") == 1


def test_a_template_that_renders_tools_gets_them_as_they_are() -> None:
    plain = tiny_tokenizer()
    tokenizer = Tokenizer(
        plain._tok,
        bos_token=None,
        eos_token="<|im_end|>",
        add_bos=False,
        chat_template=_TOOL_TEMPLATE,
    )
    text = tokenizer.apply_chat_template(
        MESSAGES, tools_json=json.dumps(TOOLS), message_extras=EXTRAS
    )
    assert text.startswith("<|im_start|>system\nTOOLS:get_weather;<|im_end|>\n")
    assert 'CALL get_weather {"city": "Paris"}' in text
    assert "<|im_start|>tool\nsunny(for call_1)<|im_end|>" in text
    assert "<tools>" not in text
    # without tools the same template renders the plain chat
    assert tokenizer.apply_chat_template([("user", "hi")]).startswith("<|im_start|>user\nhi")


def test_no_tools_renders_as_before() -> None:
    tokenizer = tiny_tokenizer()
    messages = [("user", "hi")]
    assert tokenizer.apply_chat_template(messages) == tokenizer.apply_chat_template(
        messages, tools_json="", message_extras=("",)
    )
