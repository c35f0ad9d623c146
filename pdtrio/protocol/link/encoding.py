"""Link messages to bytes and back: the one encoder, a long prompt encoded a slice at a time,
the typed decoders, and a worker's batch told apart from one message."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any, Final, Generic, TypeVar, final

import msgspec

from pdtrio.protocol.link.message_base import WireError
from pdtrio.protocol.link.prefill_messages import (
    ChatPrompt,
    PrefillRequest,
    Prompt,
    TextPrompt,
)

MSGPACK_CONTENT_TYPE = "application/msgpack"

_encoder = msgspec.msgpack.Encoder()
_T = TypeVar("_T")


def encode(message: Any) -> bytes:
    """Any wire message (or list of them) as msgpack bytes."""
    return _encoder.encode(message)


# A prompt text at least this long is encoded a slice at a time (a fraction of a millisecond).
PIECEWISE_TEXT_CHARS: Final = 256 * 1024


def prompt_is_long(prompt: Prompt) -> bool:
    """Whether :func:`encode_in_pieces` would cut ``prompt``'s text (else: just encode)."""
    if type(prompt) is TextPrompt:
        return len(prompt.text) >= PIECEWISE_TEXT_CHARS
    if isinstance(prompt, ChatPrompt):
        return any(len(text) >= PIECEWISE_TEXT_CHARS for _, text in prompt.messages)
    return False


def encode_in_pieces(request: PrefillRequest, piece_bytes: int) -> Iterator[bytes]:
    """``encode(request)``, as consecutive pieces: a long prompt text a slice at a time.

    One msgpack call over a prompt of megabytes holds the GIL (the event loop)
    for milliseconds, 5-8 for 15 MB, most of it the page faults of its fresh
    output buffer; slices of at most ``piece_bytes`` bytes cost a fraction of
    one, each made just before it is sent.  A text's UTF-8 length comes first
    (msgpack's header): ASCII's is its length, anything else is encoded once
    to count it, a slice per step, with an empty piece after each (nothing to
    send, a moment for others).
    """
    long_texts: list[str] = []

    def stand_in(text: str) -> str:
        if len(text) < PIECEWISE_TEXT_CHARS:
            return text
        long_texts.append(text)
        return f"{marker}{len(long_texts) - 1}"

    # random: no client string can be mistaken for one
    marker = f"\x00pdtrio-long-text-{secrets.token_hex(8)}-"
    prompt = request.prompt
    if type(prompt) is TextPrompt:
        prompt = TextPrompt(stand_in(prompt.text))
    elif isinstance(prompt, ChatPrompt):
        messages = tuple((role, stand_in(text)) for role, text in prompt.messages)
        prompt = msgspec.structs.replace(prompt, messages=messages)
    skeleton = encode(msgspec.structs.replace(request, prompt=prompt))
    del prompt
    start = 0
    for index, text in enumerate(long_texts):
        stand_in_bytes = encode(f"{marker}{index}")
        at = skeleton.index(stand_in_bytes, start)
        yield skeleton[start:at]
        start = at + len(stand_in_bytes)
        yield from _text_in_pieces(text, piece_bytes)
    yield skeleton[start:]


def _text_in_pieces(text: str, piece_bytes: int) -> Iterator[bytes]:
    """A msgpack str, header first, then the UTF-8 bytes a slice at a time."""
    if text.isascii():  # O(1): CPython keeps the flag
        size, chars = len(text), piece_bytes
    else:
        chars = piece_bytes // 4  # at most 4 bytes a character
        size = 0
        for start in range(0, len(text), chars):
            size += len(text[start : start + chars].encode())
            yield b""
    yield _STR32_HEADER + size.to_bytes(4, "big")
    for start in range(0, len(text), chars):
        yield text[start : start + chars].encode()


_STR32_HEADER: Final = b"\xdb"  # msgpack str, 32-bit length: a long text always is one


@final
class Decoder(Generic[_T]):
    """Decodes one message type (or tagged union); every failure is a :class:`WireError`."""

    __slots__ = ("_decoder", "decode_raw")

    def __init__(self, message_type: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(message_type)
        # for a caller that maps msgspec's errors itself, to save a call on the hot path
        self.decode_raw = self._decoder.decode

    def decode(self, data: bytes | bytearray | memoryview) -> _T:
        try:
            return self._decoder.decode(data)  # type: ignore[no-any-return]
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireError(str(exc)) from None


# what decode_raw raises for bytes that are not the expected message
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)


# msgpack array headers: fixarray (0x90-0x9f, the length inside), array 16 and array 32
_ARRAY16: Final = 0xDC
_ARRAY32: Final = 0xDD


def is_batch(data: bytes) -> bool:
    """Whether ``data`` is a batch of messages (an array of arrays), not one message.

    A message is an array whose first item is its tag, an integer; a batch is
    an array whose first item is a message: an array.
    """
    if not data:
        return False
    first = data[0]
    if 0x90 <= first <= 0x9F:
        item = 1
    elif first == _ARRAY16:
        item = 3
    elif first == _ARRAY32:
        item = 5
    else:
        return False
    if len(data) <= item:
        return True  # an empty array: no message has no tag, so an empty batch
    head = data[item]
    return 0x90 <= head <= 0x9F or head == _ARRAY16 or head == _ARRAY32
