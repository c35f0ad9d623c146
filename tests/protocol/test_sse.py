"""The SSE stream shaper: bytes out, parsed back into events (sync, no IO)."""

from __future__ import annotations

import json
from typing import Any, Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdtrio.protocol.openai import OpenAIError, service_unavailable
from pdtrio.protocol.openai.sse import DONE_EVENT, StreamShaper

DONE = "[DONE]"
ROLE_DELTA = {"role": "assistant", "content": ""}


def shaper(
    kind: Literal["chat", "completion"] = "chat",
    *,
    include_usage: bool = False,
    continuous_usage_stats: bool = False,
) -> StreamShaper:
    return StreamShaper(
        kind=kind,
        request_id="req-1",
        model="tiny",
        created=1700000000,
        include_usage=include_usage,
        continuous_usage_stats=continuous_usage_stats,
    )


def events(data: bytes) -> list[Any]:
    """Split SSE bytes into events: parsed JSON objects, or DONE."""
    text = data.decode("utf-8")
    if not text:
        return []
    assert text.endswith("\n\n")
    out: list[Any] = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: "), block
        assert "\n" not in block
        payload = block[len("data: ") :]
        out.append(DONE if payload == "[DONE]" else json.loads(payload))
    return out


def assert_envelope(event: dict[str, Any], kind: str = "chat") -> None:
    assert event["id"] == "req-1"
    assert event["object"] == ("chat.completion.chunk" if kind == "chat" else "text_completion")
    assert event["created"] == 1700000000
    assert event["model"] == "tiny"


def choice(event: dict[str, Any]) -> dict[str, Any]:
    [only] = event["choices"]
    assert only["index"] == 0
    assert only["logprobs"] is None
    assert isinstance(only, dict)
    return only


# --- chat -----------------------------------------------------------------------


def test_chat_role_goes_with_first_text() -> None:
    s = shaper()
    assert s.delta("", 1, None) == b""  # incomplete UTF-8: nothing yet
    first = events(s.delta("Hel", 2, None))
    assert len(first) == 2
    for event in first:
        assert_envelope(event)
        assert "usage" not in event
    assert choice(first[0]) == {
        "index": 0,
        "delta": ROLE_DELTA,
        "logprobs": None,
        "finish_reason": None,
    }
    assert choice(first[1])["delta"] == {"content": "Hel"}
    assert choice(first[1])["finish_reason"] is None
    last = events(s.delta("lo", 1, "stop"))
    assert len(last) == 1
    assert choice(last[0])["delta"] == {"content": "lo"}
    assert choice(last[0])["finish_reason"] == "stop"
    assert s.finished and not s.closed
    assert s.completion_tokens == 4
    assert events(s.done()) == [DONE]
    assert s.closed


def test_chat_finish_with_empty_text_before_any_text() -> None:
    s = shaper()
    assert s.delta("", 3, None) == b""
    out = events(s.delta("", 1, "length"))
    assert [choice(e)["delta"] for e in out] == [ROLE_DELTA, {}]
    assert choice(out[1])["finish_reason"] == "length"
    assert choice(out[0])["finish_reason"] is None
    assert s.completion_tokens == 4


def test_chat_finish_with_empty_text_after_text() -> None:
    s = shaper()
    events(s.delta("a", 1, None))
    out = events(s.delta("", 0, "stop"))
    assert len(out) == 1
    assert choice(out[0]) == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}


def test_chat_done_without_anything_still_sends_role() -> None:
    s = shaper()
    out = events(s.done())
    assert [choice(e)["delta"] for e in out[:-1]] == [ROLE_DELTA]
    assert out[-1] == DONE


def test_chat_error_before_text_sends_role_then_error() -> None:
    s = shaper()
    s.delta("", 1, None)
    err = service_unavailable("decode instance went away")
    out = events(s.error(err))
    assert len(out) == 3
    assert choice(out[0])["delta"] == ROLE_DELTA
    assert out[1] == err.to_body()
    assert out[1]["error"]["type"] == "server_error"
    assert out[2] == DONE
    assert s.closed


def test_error_after_text_has_no_second_role() -> None:
    s = shaper()
    s.delta("x", 1, None)
    out = events(s.error(OpenAIError("boom", status=500, type="server_error")))
    assert out == [
        {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}},
        DONE,
    ]


def test_unicode_content_round_trips() -> None:
    s = shaper()
    text = 'héllo \u4e16\u754c 🌍 "quoted" \\ \n\t\x00'
    out = events(s.delta(text, 5, None))
    assert choice(out[1])["delta"]["content"] == text


def test_custom_finish_reason() -> None:
    s = shaper("completion")
    out = events(s.delta("x", 1, "abort"))
    assert choice(out[0])["finish_reason"] == "abort"
    s = shaper()
    out = events(s.delta("x", 1, 'we"ird'))
    assert choice(out[-1])["finish_reason"] == 'we"ird'


# --- completions -------------------------------------------------------------------


def test_completion_has_no_role_chunk() -> None:
    s = shaper("completion")
    assert s.delta("", 1, None) == b""
    out = events(s.delta("Once", 1, None))
    assert len(out) == 1
    assert_envelope(out[0], "completion")
    assert choice(out[0]) == {"index": 0, "text": "Once", "logprobs": None, "finish_reason": None}
    out = events(s.delta("", 1, "length"))
    assert choice(out[0]) == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
    assert events(s.done()) == [DONE]


def test_completion_error_has_no_role() -> None:
    s = shaper("completion")
    out = events(s.error(OpenAIError("bad")))
    assert out == [OpenAIError("bad").to_body(), DONE]


# --- usage ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_include_usage(kind: Literal["chat", "completion"]) -> None:
    s = shaper(kind, include_usage=True)
    s.set_prompt_usage(10, 4)
    chunks = events(s.delta("a", 1, None)) + events(s.delta("b", 2, "stop"))
    for event in chunks:
        assert event["usage"] is None
    tail = events(s.done())
    assert tail[-1] == DONE
    [usage_chunk] = tail[:-1]
    assert_envelope(usage_chunk, kind)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_continuous_usage_stats() -> None:
    s = shaper(include_usage=True, continuous_usage_stats=True)
    s.set_prompt_usage(7, 0)
    s.delta("", 2, None)
    out = events(s.delta("hi", 1, None))
    # the role chunk reports what was generated before this delta
    assert out[0]["usage"]["completion_tokens"] == 2
    assert out[1]["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    out = events(s.delta("!", 1, "stop"))
    assert out[0]["usage"]["completion_tokens"] == 4
    tail = events(s.done())
    assert tail[0]["choices"] == []
    assert tail[0]["usage"]["total_tokens"] == 11


def test_continuous_usage_without_include_usage_is_ignored() -> None:
    s = shaper(continuous_usage_stats=True)
    for event in events(s.delta("x", 1, "stop")) + events(s.done()):
        assert event == DONE or "usage" not in event


def test_no_usage_chunk_without_include_usage() -> None:
    s = shaper()
    s.set_prompt_usage(3, 0)
    s.delta("x", 1, "stop")
    assert s.done() == DONE_EVENT


# --- misuse -----------------------------------------------------------------------------


def test_calls_after_close_raise() -> None:
    s = shaper()
    s.done()
    with pytest.raises(ValueError):
        s.delta("x", 1, None)
    with pytest.raises(ValueError):
        s.done()
    with pytest.raises(ValueError):
        s.error(OpenAIError("x"))
    s = shaper()
    s.error(OpenAIError("x"))
    with pytest.raises(ValueError):
        s.delta("", 0, None)


def test_delta_after_finish_raises() -> None:
    s = shaper()
    s.delta("x", 1, "stop")
    with pytest.raises(ValueError):
        s.delta("y", 1, None)
    events(s.done())  # finishing normally still works


def test_negative_tokens_raise() -> None:
    with pytest.raises(ValueError):
        shaper().delta("x", -1, None)


# --- properties ---------------------------------------------------------------------------


def utf8_like_splits(text: str) -> st.SearchStrategy[list[tuple[str, int]]]:
    """Pieces of ``text`` in order, with "" pieces where a detokenizer would stall."""
    cuts = st.lists(st.integers(0, len(text)), max_size=12).map(sorted)

    def to_pieces(points: list[int]) -> st.SearchStrategy[list[tuple[str, int]]]:
        bounds = [0, *points, len(text)]
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        return st.tuples(*(st.tuples(st.just(p), st.integers(0, 4)) for p in pieces)).map(list)

    return cuts.flatmap(to_pieces)


def run_stream(
    kind: Literal["chat", "completion"],
    pieces: list[tuple[str, int]],
    finish: str | None,
    include_usage: bool,
    continuous: bool,
) -> tuple[StreamShaper, list[Any]]:
    s = shaper(kind, include_usage=include_usage, continuous_usage_stats=continuous)
    s.set_prompt_usage(11, 5)
    out: list[Any] = []
    for i, (text, n) in enumerate(pieces):
        last = i == len(pieces) - 1
        out += events(s.delta(text, n, finish if last else None))
    out += events(s.done())
    return s, out


split_streams = st.text().flatmap(lambda text: st.tuples(st.just(text), utf8_like_splits(text)))


@given(
    split_streams,
    st.sampled_from(["chat", "completion"]),
    st.sampled_from(["stop", "length", None]),
    st.booleans(),
    st.booleans(),
)
def test_any_split_reassembles(
    text_and_pieces: tuple[str, list[tuple[str, int]]],
    kind: Literal["chat", "completion"],
    finish: str | None,
    include_usage: bool,
    continuous: bool,
) -> None:
    text, pieces = text_and_pieces
    s, out = run_stream(kind, pieces, finish, include_usage, continuous)

    assert out[-1] == DONE
    assert out.count(DONE) == 1
    chunks: list[dict[str, Any]] = out[:-1]
    for event in chunks:
        assert_envelope(event, kind)
    if include_usage:
        usage_chunk = chunks.pop()
        assert usage_chunk["choices"] == []
        total = sum(n for _, n in pieces)
        assert usage_chunk["usage"]["completion_tokens"] == total
        assert usage_chunk["usage"]["prompt_tokens"] == 11
        assert usage_chunk["usage"]["total_tokens"] == 11 + total
        assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    for event in chunks:
        if include_usage and continuous:
            assert event["usage"]["prompt_tokens"] == 11
        elif include_usage:
            assert event["usage"] is None
        else:
            assert "usage" not in event
    assert s.completion_tokens == sum(n for _, n in pieces)

    choices = [choice(e) for e in chunks]
    if kind == "chat":
        deltas = [c["delta"] for c in choices]
        # the role chunk is first, exactly once, and right before the first text
        assert deltas[0] == ROLE_DELTA
        assert deltas.count(ROLE_DELTA) == 1
        if text:
            assert deltas[1]["content"] != ""
            assert deltas[1]["content"] == next(p for p, _ in pieces if p)
        content = "".join(d.get("content", "") for d in deltas[1:])
        assert all(d == {} or d["content"] for d in deltas[1:])
    else:
        content = "".join(c["text"] for c in choices)
        assert all(c["text"] for c in choices[:-1])
    assert content == text

    reasons = [c["finish_reason"] for c in choices]
    if finish is None:
        assert set(reasons) <= {None}
        assert not s.finished
    else:
        assert reasons[-1] == finish
        assert set(reasons[:-1]) <= {None}
        assert s.finished


@given(
    split_streams,
    st.data(),
    st.sampled_from(["chat", "completion"]),
    st.booleans(),
    st.booleans(),
)
def test_error_at_any_point(
    text_and_pieces: tuple[str, list[tuple[str, int]]],
    data: st.DataObject,
    kind: Literal["chat", "completion"],
    include_usage: bool,
    continuous: bool,
) -> None:
    _, pieces = text_and_pieces
    cut = data.draw(st.integers(0, len(pieces)), label="deltas before the failure")
    s = shaper(kind, include_usage=include_usage, continuous_usage_stats=continuous)
    out: list[Any] = []
    for text, n in pieces[:cut]:
        out += events(s.delta(text, n, None))
    err = OpenAIError("decode failed", status=500, type="server_error")
    tail = events(s.error(err))
    out += tail
    assert s.closed

    assert tail[-1] == DONE
    assert tail[-2] == err.to_body()
    assert out.count(DONE) == 1
    assert [e for e in out if e != DONE and "error" in e] == [err.to_body()]
    chunks = out[:-2]
    if kind == "chat":
        assert chunks, "the role chunk always goes out"
        assert choice(chunks[0])["delta"] == ROLE_DELTA
        assert [choice(c)["delta"] for c in chunks].count(ROLE_DELTA) == 1
        sent = "".join(choice(c)["delta"].get("content", "") for c in chunks)
    else:
        sent = "".join(choice(c)["text"] for c in chunks)
    assert sent == "".join(p for p, _ in pieces[:cut])
    for c in chunks:
        assert choice(c)["finish_reason"] is None
    with pytest.raises(ValueError):
        s.delta("more", 1, None)
