"""Router <-> worker messages, as plain lists ready for msgpack.

This module only builds and reads the list shapes; the shells pack them with
msgpack (never pickle).  Every message is ``[kind, ...fields]``.  The token
frame is the hot path: its entries stay plain lists so the router can read
them without building an object per token.
"""

from __future__ import annotations

import enum
from typing import Any, Final, final

import attrs

from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.sampling import SamplingParams


class WireError(ValueError):
    """The peer sent something that is not a valid message."""


class MessageKind(enum.IntEnum):
    START = 1
    ABORT = 2
    ACCEPTED = 3
    REJECTED = 4
    TOKENS = 5
    FAILED = 6


class RejectReason(enum.StrEnum):
    NO_ROOM = "no_room"
    LAYOUT_MISMATCH = "layout_mismatch"
    TRANSFER_FAILED = "transfer_failed"
    BAD_REQUEST = "bad_request"
    SHUTTING_DOWN = "shutting_down"


@final
@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_wire(self) -> list[int]:
        return [self.prompt_tokens, self.completion_tokens, self.cached_tokens]

    @classmethod
    def from_wire(cls, raw: list[Any]) -> Usage:
        return cls(int(raw[0]), int(raw[1]), int(raw[2]))


@final
@attrs.frozen
class KvHandle:
    """Where a request's prefilled KV blocks live and for how long."""

    request_id: str
    instance_id: str
    transfer_host: str
    transfer_port: int
    block_ids: tuple[int, ...]
    num_tokens: int
    layout: KvLayout
    lease_expiry: float  # wall-clock seconds (time.time()); prefill frees the blocks then

    def to_wire(self) -> list[Any]:
        return [
            self.request_id,
            self.instance_id,
            self.transfer_host,
            self.transfer_port,
            list(self.block_ids),
            self.num_tokens,
            self.layout.to_wire(),
            self.lease_expiry,
        ]

    @classmethod
    def from_wire(cls, raw: list[Any]) -> KvHandle:
        rid, instance, host, port, blocks, num_tokens, layout, expiry = raw
        return cls(
            request_id=str(rid),
            instance_id=str(instance),
            transfer_host=str(host),
            transfer_port=int(port),
            block_ids=tuple(int(b) for b in blocks),
            num_tokens=int(num_tokens),
            layout=KvLayout.from_wire(layout),
            lease_expiry=float(expiry),
        )


# --- prompts -----------------------------------------------------------------


@final
@attrs.frozen
class ChatPrompt:
    """Chat messages as (role, text) pairs; text parts are already joined."""

    messages: tuple[tuple[str, str], ...]


@final
@attrs.frozen
class TextPrompt:
    text: str


@final
@attrs.frozen
class TokenPrompt:
    token_ids: tuple[int, ...]


Prompt = ChatPrompt | TextPrompt | TokenPrompt


def prompt_to_wire(prompt: Prompt) -> list[Any]:
    if isinstance(prompt, ChatPrompt):
        return ["chat", [list(m) for m in prompt.messages]]
    if isinstance(prompt, TextPrompt):
        return ["text", prompt.text]
    return ["tokens", list(prompt.token_ids)]


def prompt_from_wire(raw: list[Any]) -> Prompt:
    kind, body = raw
    if kind == "chat":
        return ChatPrompt(tuple((str(role), str(text)) for role, text in body))
    if kind == "text":
        return TextPrompt(str(body))
    if kind == "tokens":
        return TokenPrompt(tuple(int(t) for t in body))
    raise WireError(f"unknown prompt kind {kind!r}")


# --- router -> prefill (HTTP body) --------------------------------------------


@final
@attrs.frozen
class PrefillRequest:
    request_id: str
    prompt: Prompt
    sampling: SamplingParams

    def to_wire(self) -> list[Any]:
        return [self.request_id, prompt_to_wire(self.prompt), self.sampling.to_wire()]

    @classmethod
    def from_wire(cls, raw: Any) -> PrefillRequest:
        try:
            rid, prompt, sampling = raw
            return cls(str(rid), prompt_from_wire(prompt), SamplingParams.from_wire(sampling))
        except (TypeError, ValueError, KeyError) as exc:
            raise WireError(f"malformed prefill request: {exc}") from exc


@final
@attrs.frozen
class PrefillReply:
    """The prompt is in the cache; here is the first token and where the KV lives.

    ``remaining_tokens`` is the decode budget left after the first token.
    ``kv_handle`` is None when generation already finished at the first token
    (prefill has then released the blocks itself).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    cached_tokens: int
    first_token_id: int
    first_text: str
    finish_reason: str | None
    remaining_tokens: int
    kv_handle: KvHandle | None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def to_wire(self) -> list[Any]:
        return [
            self.request_id,
            list(self.prompt_token_ids),
            self.cached_tokens,
            self.first_token_id,
            self.first_text,
            self.finish_reason,
            self.remaining_tokens,
            None if self.kv_handle is None else self.kv_handle.to_wire(),
        ]

    @classmethod
    def from_wire(cls, raw: Any) -> PrefillReply:
        try:
            rid, prompt_ids, cached, first_id, first_text, finish, remaining, handle = raw
            return cls(
                request_id=str(rid),
                prompt_token_ids=tuple(int(t) for t in prompt_ids),
                cached_tokens=int(cached),
                first_token_id=int(first_id),
                first_text=str(first_text),
                finish_reason=None if finish is None else str(finish),
                remaining_tokens=int(remaining),
                kv_handle=None if handle is None else KvHandle.from_wire(handle),
            )
        except (TypeError, ValueError) as exc:
            raise WireError(f"malformed prefill reply: {exc}") from exc


# --- router <-> decode (websocket frames) --------------------------------------


@final
@attrs.frozen
class DecodeStart:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    first_token_id: int
    sampling: SamplingParams
    remaining_tokens: int
    cached_tokens: int
    kv_handle: KvHandle

    def to_wire(self) -> list[Any]:
        return [
            MessageKind.START,
            self.request_id,
            list(self.prompt_token_ids),
            self.first_token_id,
            self.sampling.to_wire(),
            self.remaining_tokens,
            self.cached_tokens,
            self.kv_handle.to_wire(),
        ]


@final
@attrs.frozen
class DecodeAbort:
    request_id: str

    def to_wire(self) -> list[Any]:
        return [MessageKind.ABORT, self.request_id]


@final
@attrs.frozen
class DecodeAccepted:
    request_id: str

    def to_wire(self) -> list[Any]:
        return [MessageKind.ACCEPTED, self.request_id]


@final
@attrs.frozen
class DecodeRejected:
    request_id: str
    reason: RejectReason
    message: str

    def to_wire(self) -> list[Any]:
        return [MessageKind.REJECTED, self.request_id, str(self.reason), self.message]


@final
@attrs.frozen
class DecodeFailed:
    """A running request failed on decode after it was accepted."""

    request_id: str
    message: str

    def to_wire(self) -> list[Any]:
        return [MessageKind.FAILED, self.request_id, self.message]


# A token entry on the wire: [request_id, token_ids, text, finish_reason, usage]
ENTRY_REQUEST_ID: Final = 0
ENTRY_TOKEN_IDS: Final = 1
ENTRY_TEXT: Final = 2
ENTRY_FINISH: Final = 3
ENTRY_USAGE: Final = 4


@final
@attrs.frozen
class TokenEntry:
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None

    def to_wire(self) -> list[Any]:
        return [
            self.request_id,
            list(self.token_ids),
            self.text,
            self.finish_reason,
            None if self.usage is None else self.usage.to_wire(),
        ]

    @classmethod
    def from_wire(cls, raw: list[Any]) -> TokenEntry:
        rid, ids, text, finish, usage = raw
        return cls(
            str(rid),
            tuple(ids),
            str(text),
            finish,
            None if usage is None else Usage.from_wire(usage),
        )


@final
@attrs.frozen
class TokenFrame:
    entries: tuple[TokenEntry, ...]

    def to_wire(self) -> list[Any]:
        return [MessageKind.TOKENS, [e.to_wire() for e in self.entries]]


def token_frame_wire(entries: list[list[Any]]) -> list[Any]:
    """A token frame from entries already in wire form (the sender's fast path)."""
    return [MessageKind.TOKENS, entries]


DecodeMessage = (
    DecodeStart | DecodeAbort | DecodeAccepted | DecodeRejected | DecodeFailed | TokenFrame
)


def decode_message(raw: Any) -> DecodeMessage:
    """Turn an unpacked websocket frame into a message; raises WireError."""
    if not isinstance(raw, list) or not raw:
        raise WireError("a frame must be a non-empty array")
    try:
        kind = MessageKind(raw[0])
    except ValueError as exc:
        raise WireError(f"unknown message kind {raw[0]!r}") from exc
    try:
        if kind is MessageKind.START:
            _, rid, prompt_ids, first, sampling, remaining, cached, handle = raw
            return DecodeStart(
                request_id=str(rid),
                prompt_token_ids=tuple(int(t) for t in prompt_ids),
                first_token_id=int(first),
                sampling=SamplingParams.from_wire(sampling),
                remaining_tokens=int(remaining),
                cached_tokens=int(cached),
                kv_handle=KvHandle.from_wire(handle),
            )
        if kind is MessageKind.ABORT:
            return DecodeAbort(str(raw[1]))
        if kind is MessageKind.ACCEPTED:
            return DecodeAccepted(str(raw[1]))
        if kind is MessageKind.REJECTED:
            return DecodeRejected(str(raw[1]), RejectReason(raw[2]), str(raw[3]))
        if kind is MessageKind.FAILED:
            return DecodeFailed(str(raw[1]), str(raw[2]))
        return TokenFrame(tuple(TokenEntry.from_wire(e) for e in raw[1]))
    except (TypeError, ValueError, IndexError) as exc:
        raise WireError(f"malformed {kind.name} message: {exc}") from exc
