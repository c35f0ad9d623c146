"""A prefill call with a long prompt, encoded a slice at a time, is the same bytes as encoded whole."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdtrio.protocol.link.wire import (
    PIECEWISE_TEXT_CHARS,
    ChatPrompt,
    PrefillRequest,
    Prompt,
    TextPrompt,
    TokenPrompt,
    encode,
    encode_in_pieces,
    prompt_is_long,
    to_worker_decoder,
)
from pdtrio.protocol.sampling import SamplingParams
from tests.examples import examples

LONG = PIECEWISE_TEXT_CHARS
PIECE_BYTES = 64 * 1024


@pytest.mark.parametrize(
    "prompt",
    [
        TextPrompt("a" * (3 * LONG + 5)),
        TextPrompt("\u00e9\U0001f600x" * LONG),
        ChatPrompt(
            (("system", "s"), ("user", "b" * LONG), ("assistant", ""), ("user", "\u4e2d" * LONG))
        ),
        TextPrompt("short"),
        TokenPrompt((1, 2, 3)),
    ],
)
def test_pieces_join_to_the_whole_encoding_none_longer_than_asked(prompt: Prompt) -> None:
    # a client's stop string that looks like the stand-in the encoder puts for a long text
    sampling = SamplingParams(stop=("\x00pdtrio-long-text-", "\x00pdtrio-long-text-0"))
    request = PrefillRequest("req-1", prompt, sampling, 16)
    pieces = list(encode_in_pieces(request, PIECE_BYTES))
    assert b"".join(pieces) == encode(request)
    assert max(map(len, pieces)) <= PIECE_BYTES
    assert (len(pieces) > 1) == prompt_is_long(prompt)
    assert to_worker_decoder.decode(b"".join(pieces)) == request


@settings(max_examples=examples(30), deadline=None)
@given(text=st.text(min_size=1, max_size=20), repeat=st.integers(LONG // 20, LONG // 5))
def test_any_long_text_encodes_in_pieces_as_whole(text: str, repeat: int) -> None:
    long_text = (text * repeat).encode("utf-8", "replace").decode("utf-8")  # no lone surrogates
    request = PrefillRequest("r", TextPrompt(long_text), SamplingParams())
    assert b"".join(encode_in_pieces(request, PIECE_BYTES)) == encode(request)
