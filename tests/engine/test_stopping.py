from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("tokenizers")

from pdtrio.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from pdtrio.engine.stopping import OutputProcessor  # noqa: E402
from pdtrio.engine.tokenizer import Tokenizer, tiny_tokenizer  # noqa: E402
from pdtrio.protocol.sampling import SamplingParams  # noqa: E402
from tests.examples import examples

TINY = tiny_tokenizer()
ENDOFTEXT, IM_START, IM_END = 0, 1, 2
PROMPT = TINY.encode_chat([("user", "hello")])


def byte_ids(text: str) -> list[int]:
    """One token per UTF-8 byte, so tests control where tokens split."""
    return [_byte_token(b) for b in text.encode()]


def _byte_token(b: int) -> int:
    # The tiny vocabulary's byte tokens are ids 3..258, in byte order.
    return 3 + b


def processor(
    sampling: SamplingParams,
    *,
    max_new_tokens: int,
    tokens_generated: int = 0,
    tokenizer: Tokenizer = TINY,
) -> OutputProcessor:
    return OutputProcessor(
        IncrementalDetokenizer(tokenizer, PROMPT),
        sampling,
        token_budget=max_new_tokens,
        tokens_generated=tokens_generated,
        eos_token_ids=tokenizer.eos_token_ids,
    )


def run(
    ids: list[int],
    *,
    max_new_tokens: int = 1000,
    tokenizer: Tokenizer = TINY,
    **sampling: Any,
) -> tuple[list[str], str | None, int]:
    proc = processor(SamplingParams(**sampling), max_new_tokens=max_new_tokens, tokenizer=tokenizer)
    pieces: list[str] = []
    reason: str | None = None
    for token_id in ids:
        text, reason = proc.push(token_id)
        pieces.append(text)
        if reason is not None:
            break
    assert proc.finish_reason == reason
    return pieces, reason, proc.num_generated


# ---------------------------------------------------------------------- EOS, length


def test_eos_stops_and_is_invisible() -> None:
    pieces, reason, n = run([*TINY.encode("Hi"), IM_END, *TINY.encode("more")])
    assert "".join(pieces) == "Hi" and reason == "stop" and n == 3
    pieces, reason, _ = run([*TINY.encode("Hi"), ENDOFTEXT])
    assert reason == "stop" and pieces[-1] == ""


def test_max_new_tokens_finishes_with_length() -> None:
    ids = TINY.encode("abcdef")
    pieces, reason, n = run(ids, max_new_tokens=3)
    assert reason == "length" and n == 3
    assert "".join(pieces) == TINY.decode(ids[:3])


def test_eos_on_the_last_allowed_token_is_stop() -> None:
    pieces, reason, n = run([*TINY.encode("ab"), IM_END], max_new_tokens=3)
    assert (reason, n, "".join(pieces)) == ("stop", 3, "ab")


def test_a_complete_grammar_stops_with_its_last_token_shown() -> None:
    proc = processor(SamplingParams(ignore_eos=True, min_tokens=5), max_new_tokens=3)
    a, b = byte_ids("ab")
    assert proc.push(a) == ("a", None)
    # the grammar admits nothing more: "stop", and this token's text still goes out
    assert proc.push(b, complete=True) == ("b", "stop")
    assert proc.num_generated == 2


def test_a_grammar_complete_on_the_last_budget_token_is_stop_not_length() -> None:
    proc = processor(SamplingParams(), max_new_tokens=1)
    assert proc.push(byte_ids("x")[0], complete=True) == ("x", "stop")


def test_ignore_eos_keeps_going_until_length() -> None:
    ids = [*TINY.encode("a"), IM_END, *TINY.encode("b"), ENDOFTEXT, *TINY.encode("c")]
    pieces, reason, n = run(ids, max_new_tokens=5, ignore_eos=True)
    assert (reason, n, "".join(pieces)) == ("length", 5, "abc")


def test_eos_before_min_tokens_is_an_ordinary_token() -> None:
    ids = [*TINY.encode("a"), IM_END, *TINY.encode("b"), IM_END]
    pieces, reason, n = run(ids, min_tokens=3)
    assert (reason, n, "".join(pieces)) == ("stop", 4, "ab")


def test_length_flushes_an_unfinished_character() -> None:
    ids = byte_ids("a😀")
    pieces, reason, _ = run(ids[:3], max_new_tokens=3)
    assert pieces == ["a", "", "\ufffd"] and reason == "length"


def test_push_after_finish_is_an_error() -> None:
    proc = processor(SamplingParams(), max_new_tokens=1)
    assert proc.push(TINY.encode("a")[0]) == ("a", "length")
    with pytest.raises(RuntimeError):
        proc.push(TINY.encode("b")[0])


# ---------------------------------------------------------------------- stop strings


def test_stop_string_held_back_across_tokens() -> None:
    pieces, reason, _ = run(byte_ids("xabyz"), stop=("abc",))
    assert pieces == ["x", "", "", "aby", "z"] and reason is None


def test_stop_string_split_across_tokens_cuts_before_it() -> None:
    pieces, reason, n = run(byte_ids("hi STOP there"), stop=("STOP",))
    assert "".join(pieces) == "hi " and reason == "stop" and n == 7


def test_stop_string_inside_one_token() -> None:
    the = TINY.encode(" the")
    assert len(the) == 1
    pieces, reason, _ = run([*byte_ids("x"), *the, *byte_ids("y")], stop=("h",))
    assert pieces == ["x", " t"] and reason == "stop"


def test_stop_at_start() -> None:
    pieces, reason, n = run(byte_ids("STOPxyz"), stop=("STOP",))
    assert pieces == ["", "", "", ""] and reason == "stop" and n == 4


def test_overlapping_stop_strings_first_completed_wins() -> None:
    # "bc" completes before "abcd" could: cut before "bc".
    pieces, reason, _ = run(byte_ids("xabcd"), stop=("abcd", "bc"))
    assert "".join(pieces) == "xa" and reason == "stop"
    # Both complete on the same token: cut at the earlier start.
    pieces, reason, _ = run(byte_ids("xab"), stop=("b", "ab"))
    assert "".join(pieces) == "x" and reason == "stop"


def test_self_overlapping_stop_string() -> None:
    pieces, reason, _ = run(byte_ids("aaab"), stop=("aab",))
    assert pieces == ["", "", "a", ""] and reason == "stop"


def test_multibyte_stop_string_and_neighbours() -> None:
    pieces, reason, _ = run(byte_ids("é😀!x"), stop=("😀!",))
    assert "".join(pieces) == "é" and reason == "stop"
    pieces, reason, _ = run(byte_ids("aé b"), stop=("é",))
    assert pieces == ["a", "", ""] and reason == "stop"
    # A stop string that starts like a multi-byte character but is not it.
    pieces, reason, _ = run(byte_ids("😀😁"), stop=("😁",), max_new_tokens=8)
    assert "".join(pieces) == "😀" and reason == "stop"


def test_held_back_text_is_flushed_on_eos_and_length() -> None:
    pieces, reason, _ = run([*byte_ids("xST"), IM_END], stop=("STOP",))
    assert "".join(pieces) == "xST" and pieces[-1] == "ST" and reason == "stop"
    pieces, reason, _ = run(byte_ids("xST"), stop=("STOP",), max_new_tokens=3)
    assert "".join(pieces) == "xST" and reason == "length"


def test_stop_string_completed_on_the_last_allowed_token_wins_over_length() -> None:
    pieces, reason, _ = run(byte_ids("xSTOP"), stop=("STOP",), max_new_tokens=5)
    assert "".join(pieces) == "x" and reason == "stop"


def test_stop_strings_need_min_tokens_first() -> None:
    # As vLLM: a stop string completed within the first min_tokens tokens is plain text.
    pieces, reason, n = run(byte_ids("abab"), stop=("b",), min_tokens=2)
    assert "".join(pieces) == "aba" and reason == "stop" and n == 4
    # A match that completes after min_tokens may start before it.
    pieces, reason, _ = run(byte_ids("xab"), stop=("ab",), min_tokens=2)
    assert "".join(pieces) == "x" and reason == "stop"


def test_a_processor_with_no_budget_left_is_an_error() -> None:
    with pytest.raises(ValueError):
        processor(SamplingParams(), max_new_tokens=0)
    with pytest.raises(ValueError):
        processor(SamplingParams(), max_new_tokens=3, tokens_generated=3)


@pytest.mark.parametrize("text", ["a cat dog", "cat dog", "ab"])
def test_replay_of_the_first_token_continues_where_prefill_stopped(text: str) -> None:
    """Decode rebuilds the state by replaying the first token, without counting it again."""
    sampling = SamplingParams(stop=("cat dog",), min_tokens=2)
    ids = byte_ids(text)
    prefill = processor(sampling, max_new_tokens=len(ids))
    whole = [prefill.push(i) for i in ids]
    decode = processor(sampling, max_new_tokens=len(ids), tokens_generated=1)
    decode.replay(ids[0])
    assert decode.num_generated == 1
    assert [decode.push(i) for i in ids[1:]] == whole[1:]
    assert decode.num_generated == prefill.num_generated == len(ids)
    assert decode.finish_reason == prefill.finish_reason is not None


# ---------------------------------------------------------------------- property


def reference(
    ids: list[int], stops: tuple[str, ...], min_tokens: int, max_new: int, ignore_eos: bool
) -> tuple[str, str | None]:
    """Brute force over whole texts: what a client must have received in the end."""

    def visible(k: int) -> str:
        # The streamed text after k tokens: decoded, unless it ends inside a character.
        for j in range(k, -1, -1):
            text = TINY.decode(ids[:j])
            if j == 0 or not text.endswith("\ufffd"):
                return text
        raise AssertionError

    def first_stop(text: str, after: int) -> int | None:
        starts = [
            i
            for s in stops
            for i in range(len(text))
            if text.startswith(s, i) and i + len(s) > after
        ]
        return min(starts) if starts else None

    for k in range(1, len(ids) + 1):
        token_id = ids[k - 1]
        past_min = k > min_tokens
        previous = visible(k - 1)
        if past_min and not ignore_eos and token_id in TINY.eos_token_ids:
            final, reason = TINY.decode(ids[: k - 1]), "stop"
        elif k == max_new:
            final, reason = TINY.decode(ids[:k]), "length"
        else:
            final, reason = visible(k), None
        cut = first_stop(final, len(previous)) if past_min and stops else None
        if cut is not None:
            return final[:cut], "stop"
        if reason is not None:
            return final, reason
    return visible(len(ids)), None


pieces_alphabet = st.sampled_from(["a", "b", " ", "é", "😀", " the", "<|im_end|>", "<|endoftext|>"])


@st.composite
def token_streams(draw: st.DrawFn) -> list[int]:
    ids: list[int] = []
    for piece in draw(st.lists(pieces_alphabet, max_size=12)):
        if piece.startswith("<|") or piece == " the":
            ids.extend(TINY.encode(piece))
        else:
            ids.extend(byte_ids(piece))
    # Shuffle some bytes in: invalid UTF-8 must not break anything.
    for _ in range(draw(st.integers(0, 2))):
        ids.insert(draw(st.integers(0, len(ids))), _byte_token(draw(st.integers(0x80, 0xFF))))
    return ids


@settings(max_examples=examples(400), deadline=None)
@given(
    ids=token_streams(),
    stops=st.lists(st.text(alphabet="ab é😀th", min_size=1, max_size=4), max_size=3),
    min_tokens=st.integers(0, 4),
    max_new=st.integers(1, 40),
    ignore_eos=st.booleans(),
)
def test_emitted_text_matches_reference(
    ids: list[int], stops: list[str], min_tokens: int, max_new: int, ignore_eos: bool
) -> None:
    sampling = SamplingParams(stop=tuple(stops), min_tokens=min_tokens, ignore_eos=ignore_eos)
    proc = processor(sampling, max_new_tokens=max_new)
    emitted = ""
    reason = None
    for token_id in ids:
        text, reason = proc.push(token_id)
        emitted += text
        if reason is not None:
            break
    expected_text, expected_reason = reference(ids, tuple(stops), min_tokens, max_new, ignore_eos)
    if reason is None:
        # Not finished yet: only held-back text (a possible stop-string start) may be missing.
        assert expected_reason is None
        assert expected_text.startswith(emitted)
        held = expected_text[len(emitted) :]
        assert not held or any(s.startswith(held) and len(held) < len(s) for s in stops)
    else:
        assert (emitted, reason) == (expected_text, expected_reason)
        assert proc.num_generated <= max_new
