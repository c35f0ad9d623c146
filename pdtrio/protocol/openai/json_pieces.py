"""``json.loads`` for big request bodies, one small C call at a time.

A single json.loads of megabytes holds the GIL for tens of milliseconds, so even on
a worker thread it stalls the event loop; :func:`load_piecewise` parses the same
JSON in pieces, and can count an over-long array instead of building it
(:class:`CountedArray`).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable
from typing import Any, Final, final

import attrs

# Bodies above this are parsed piece by piece: json.loads holds the GIL for the whole body.
PIECEWISE_JSON_BYTES: Final = 256 * 1024

# The C scanners json.loads is built on (untyped in typeshed): one value, one string.
_scan_value: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
_scan_string: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_WHITESPACE_CHARS: Final = frozenset(" \t\n\r")
# At most this many characters go to one C call (a fraction of a millisecond).
_CHUNK_CHARS: Final = 64 * 1024
# A run of plain numbers, each followed by a comma: loaded as one chunk, at C speed.
_NUMBER_RUN = re.compile(r"(?:-?[0-9][-+0-9.eE]*[ \t\n\r]*,[ \t\n\r]*)+")
_NUMBER_HEADS: Final = frozenset("-0123456789")
_PIECEWISE_DEPTH: Final = 3  # body > prompt > [token ids]: the deepest arrays always split
# An object or array deeper than that is one scanner call if it ends this soon,
# else split too (a message whose content is megabytes).
_SMALL_VALUE_CHARS: Final = 4096
# Of a string's content, what can be cut off and decoded on its own: plain runs,
# escapes, and a high surrogate escape only with its low one or with enough after it
# to see that none follows (a pair cut in two would decode as two lone surrogates).
# It stops at the closing quote, a control character, a bad escape, or the window's end.
_STRING_RUN = re.compile(
    r"""(?:[^"\\\x00-\x1f]+"""
    r"""|\\["\\/bfnrt]"""
    r"""|\\u(?![dD][89abAB])[0-9a-fA-F]{4}"""
    r"""|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"""
    r"""|\\u[dD][89abAB][0-9a-fA-F]{2}(?=[^\\]|\\[^u]|\\u[^dD]|\\u[dD][^c-fC-F])"""
    r""")*"""
)
# The most characters _STRING_RUN needs past a cut to decide on an escape (a pair).
_LONGEST_ESCAPE: Final = 12
# Bytes decoded to text per C call (a megabyte of UTF-8 is about a millisecond).
_DECODE_CHUNK_BYTES: Final = 1024 * 1024


@final
@attrs.frozen
class CountedArray:
    """A JSON array of which only the length was kept: it was longer than any use of it."""

    length: int


def load_piecewise(body: bytes | bytearray, count_past: tuple[str, int] | None = None) -> Any:
    """``json.loads`` for big bodies, one small C call at a time.

    A single json.loads of megabytes holds the GIL for tens of milliseconds, so
    even on a worker thread it stalls the event loop; between these pieces the
    interpreter can hand the GIL back.  The body is decoded a megabyte at a
    time; arrays (token ids, messages) are split into elements, runs of numbers
    into 64 KiB chunks, long strings into 64 KiB windows, and an object that
    does not end within 4 KiB into its members.  Raises ValueError
    (JSONDecodeError, bad UTF-8) like json.loads.

    ``count_past=(key, limit)``: an array under the top-level ``key`` (or an
    array in it) longer than ``limit`` becomes a :class:`CountedArray`; the
    numbers past the limit are counted, not built (nor checked one by one), and
    other elements (messages) are dropped as soon as they are parsed.
    """
    text = _decode_piecewise(body)
    pos = _skip_whitespace(text, 0)
    if text.startswith("\ufeff", pos):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM", text, pos)
    value, pos = _piece(text, pos, 1, count_past)
    pos = _skip_whitespace(text, pos)
    if pos != len(text):
        raise json.JSONDecodeError("Extra data", text, pos)
    return value


def _decode_piecewise(body: bytes | bytearray) -> str:
    """``body.decode`` as json.loads does it, a megabyte per call; joining is a copy."""
    decoder = codecs.getincrementaldecoder(json.detect_encoding(body))("surrogatepass")
    view = memoryview(body)
    parts = [
        decoder.decode(view[start : start + _DECODE_CHUNK_BYTES])
        for start in range(0, len(view), _DECODE_CHUNK_BYTES)
    ]
    parts.append(decoder.decode(b"", final=True))
    return "".join(parts)


def _skip_whitespace(text: str, pos: int) -> int:
    if pos < len(text) and text[pos] in _WHITESPACE_CHARS:
        match = _WHITESPACE.match(text, pos)
        assert match is not None  # the pattern matches the empty string
        return match.end()
    return pos


def _piece(
    text: str, pos: int, depth: int, count_past: tuple[str, int] | None = None
) -> tuple[Any, int]:
    """The value at ``pos``; ``count_past``: at depth 1, what to count (see load_piecewise)."""
    head = text[pos : pos + 1]
    if head == '"':
        return _string_piecewise(text, pos)
    if head == "{":
        if depth > 1 and (small := _scan_small(text, pos)) is not None:
            return small
        return _object_piecewise(text, pos, depth, count_past if depth == 1 else None)
    if head == "[":
        if depth > _PIECEWISE_DEPTH and (small := _scan_small(text, pos)) is not None:
            return small
        return _array_piecewise(text, pos, depth)
    try:
        value, end = _scan_value(text, pos)
    except StopIteration as stop:
        # (the scanner's "no value starts here": json.loads's own words, nothing lost)
        raise json.JSONDecodeError("Expecting value", text, stop.value) from None
    return value, end


def _scan_small(text: str, pos: int) -> tuple[Any, int] | None:
    """The object or array at ``pos`` in one scanner call, if it ends within a few KiB.

    None if it does not, or if it is malformed: the piecewise parse then finds
    where.  Scanning a copy of the window bounds the call whatever follows; an
    object or array is whole once its closing bracket is in.
    """
    window = text[pos : pos + _SMALL_VALUE_CHARS]
    try:
        value, end = _scan_value(window, 0)
    except (ValueError, StopIteration, RecursionError):
        return None
    return value, pos + end


def _string_piecewise(text: str, pos: int) -> tuple[str, int]:
    """The string whose opening quote is at ``pos``, one window of its content at a time."""
    pieces: list[str] = []
    start = pos + 1
    size = len(text)
    while True:
        window_end = min(size, start + _CHUNK_CHARS)
        run = _STRING_RUN.match(text, start, window_end)
        assert run is not None  # the pattern matches the empty string
        stop = run.end()
        if stop > start:
            piece = text[start:stop]
            if "\\" in piece:
                piece = _scan_string(piece + '"', 0)[0]
            pieces.append(piece)
        if stop < size and text[stop] == '"':
            return "".join(pieces), stop + 1
        if window_end < size and (
            stop == window_end or (text[stop] == "\\" and stop + _LONGEST_ESCAPE > window_end)
        ):
            start = stop  # the window cut the content, perhaps mid-escape: go on from there
            continue
        raise _string_error(text, pos, stop)


def _string_error(text: str, quote: int, stop: int) -> json.JSONDecodeError:
    """Why the string opened at ``quote`` cannot go on at ``stop``, as json.loads says it."""
    if stop >= len(text):
        return json.JSONDecodeError("Unterminated string starting at", text, quote)
    if text[stop] == "\\":
        if text[stop + 1 : stop + 2] == "u":
            return json.JSONDecodeError("Invalid \\uXXXX escape", text, stop + 1)
        return json.JSONDecodeError("Invalid \\escape", text, stop)
    return json.JSONDecodeError("Invalid control character at", text, stop)


def _object_piecewise(
    text: str, pos: int, depth: int, count_past: tuple[str, int] | None = None
) -> tuple[dict[str, Any], int]:
    obj: dict[str, Any] = {}
    pos = _skip_whitespace(text, pos + 1)
    if text[pos : pos + 1] == "}":
        return obj, pos + 1
    while True:
        if text[pos : pos + 1] != '"':
            raise json.JSONDecodeError(
                "Expecting property name enclosed in double quotes", text, pos
            )
        key, pos = _string_piecewise(text, pos)
        pos = _skip_whitespace(text, pos)
        if text[pos : pos + 1] != ":":
            raise json.JSONDecodeError("Expecting ':' delimiter", text, pos)
        pos = _skip_whitespace(text, pos + 1)
        if count_past is not None and key == count_past[0] and text[pos : pos + 1] == "[":
            value, pos = _array_piecewise(text, pos, depth + 1, count_past[1])
        else:
            value, pos = _piece(text, pos, depth + 1)
        obj[key] = value
        pos = _skip_whitespace(text, pos)
        delimiter = text[pos : pos + 1]
        if delimiter == "}":
            return obj, pos + 1
        if delimiter != ",":
            raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
        pos = _skip_whitespace(text, pos + 1)


def _array_piecewise(
    text: str, pos: int, depth: int, limit: int | None = None
) -> tuple[list[Any] | CountedArray, int]:
    """The array at ``pos``; past ``limit`` elements, only counted (then a CountedArray)."""
    items: list[Any] = []
    counted = 0  # elements past the limit, not kept
    pos = _skip_whitespace(text, pos + 1)
    if text[pos : pos + 1] == "]":
        return items, pos + 1
    while True:
        counting = limit is not None and len(items) > limit
        run = (
            _NUMBER_RUN.match(text[pos : pos + _CHUNK_CHARS])
            if text[pos : pos + 1] in _NUMBER_HEADS
            else None
        )
        if run is not None:
            # the run ends just after a comma: the array goes on past it
            chunk = run.group().rstrip().removesuffix(",")
            if counting:
                counted += chunk.count(",") + 1
            else:
                try:
                    items.extend(json.loads(f"[{chunk}]"))
                except json.JSONDecodeError as exc:
                    # the same error, placed in the whole body instead of the chunk
                    raise json.JSONDecodeError(exc.msg, text, pos + max(0, exc.pos - 1)) from None
            pos = _skip_whitespace(text, pos + run.end())  # the window may cut the spaces
        if limit is not None and text[pos : pos + 1] == "[":
            value, pos = _array_piecewise(text, pos, depth + 1, limit)  # [[ids]]: one prompt
        else:
            value, pos = _piece(text, pos, depth + 1)
        if counting:
            counted += 1
        else:
            items.append(value)
        pos = _skip_whitespace(text, pos)
        delimiter = text[pos : pos + 1]
        if delimiter == "]":
            if counted:
                return CountedArray(len(items) + counted), pos + 1
            return items, pos + 1
        if delimiter != ",":
            raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
        pos = _skip_whitespace(text, pos + 1)
