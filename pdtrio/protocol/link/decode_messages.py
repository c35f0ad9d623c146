"""The router's decode runs on a worker's link: the start, its answer (accepted, rejected),
the tokens and their logprobs as they come, a failure, and the abort."""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from pdtrio.protocol.link.message_base import (
    MAX_TOKEN_IDS,
    KvHandle,
    MessageKind,
    Positional,
    TokenIds,
    TokenLogprob,
    Usage,
)
from pdtrio.protocol.sampling import MAX_CHOICES, SamplingParams


class RejectReason(enum.StrEnum):
    NO_ROOM = "no_room"
    LAYOUT_MISMATCH = "layout_mismatch"
    TRANSFER_FAILED = "transfer_failed"
    BAD_REQUEST = "bad_request"
    SHUTTING_DOWN = "shutting_down"
    # it runs here already, started over another link of the router's, one the router lost
    # and this worker has not yet seen go: another decode may take it
    ALREADY_RUNNING = "already_running"


def choice_request_id(request_id: str, choice: int) -> str:
    """The id choice ``choice`` of a request runs under on decode (its token entries,
    logprobs and failures name it): choice 0 keeps the request's own."""
    return request_id if choice == 0 else f"{request_id}/{choice}"


class DecodeStart(Positional, frozen=True, tag=int(MessageKind.START)):
    """Run a prefilled request.

    ``token_budget`` is the whole completion budget; ``tokens_generated`` how
    much of it is already spent (the first token, sampled by prefill, and for a
    continuation the tokens delivered before it).  ``generated_tokens``: for a
    continuation (see :class:`PrefillRequest`), how many of the last
    ``prompt_token_ids`` (the prefilled ids, all in the KV) are generated output;
    the prompt proper is the ids before them.
    """

    request_id: str
    prompt_token_ids: TokenIds
    first_token_id: int
    sampling: SamplingParams
    token_budget: int
    tokens_generated: int
    cached_tokens: int
    kv_handle: KvHandle
    generated_tokens: int = 0

    @property
    def own_prompt_tokens(self) -> int:
        """The prompt's own tokens, without those generated before (a continuation's)."""
        return len(self.prompt_token_ids) - self.generated_tokens


class DecodeStartChoices(DecodeStart, frozen=True, tag=int(MessageKind.START_CHOICES)):
    """A :class:`DecodeStart` of a request with ``n`` > 1: the choices still to run, as
    (choice, its first token id), those that did not finish at prefill.  Each runs as
    :func:`choice_request_id` on the prompt's one KV (its full blocks shared, the
    partial last one copied); ``first_token_id`` is the first choice's of them.  The
    router aborts each choice by its own id."""

    choices: Annotated[tuple[tuple[int, int], ...], msgspec.Meta(max_length=MAX_CHOICES)] = ()

    @classmethod
    def of(cls, start: DecodeStart, choices: tuple[tuple[int, int], ...]) -> DecodeStartChoices:
        """``start`` running ``choices`` (not empty), the first of them standing first."""
        return cls(
            start.request_id,
            start.prompt_token_ids,
            choices[0][1],
            start.sampling,
            start.token_budget,
            start.tokens_generated,
            start.cached_tokens,
            start.kv_handle,
            start.generated_tokens,
            choices,
        )


class DecodeStartTraced(DecodeStart, frozen=True, tag=int(MessageKind.START_TRACED)):
    """A :class:`DecodeStart` of a request the router traces (``traceparent``: the router's
    decode span; a kind of its own as :class:`~.prefill_messages.PrefillRequestTraced` is)."""

    traceparent: str = ""


class DecodeStartChoicesTraced(
    DecodeStartChoices, frozen=True, tag=int(MessageKind.START_CHOICES_TRACED)
):
    """A :class:`DecodeStartChoices` of a request the router traces."""

    traceparent: str = ""


def traced_start(start: DecodeStart, traceparent: str) -> DecodeStart:
    """``start`` carrying ``traceparent`` (as it is, for "": not traced)."""
    if not traceparent:
        return start
    base: type[DecodeStart] = DecodeStart
    kind: type[DecodeStart] = DecodeStartTraced
    if isinstance(start, DecodeStartChoices):
        base, kind = DecodeStartChoices, DecodeStartChoicesTraced
    fields = (getattr(start, name) for name in base.__struct_fields__)
    return kind(*fields, traceparent=traceparent)  # type: ignore[call-arg]


class DecodeAbort(Positional, frozen=True, tag=int(MessageKind.ABORT)):
    request_id: str


class DecodeAccepted(Positional, frozen=True, tag=int(MessageKind.ACCEPTED)):
    request_id: str


class DecodeRejected(Positional, frozen=True, tag=int(MessageKind.REJECTED)):
    request_id: str
    reason: RejectReason
    message: str


class DecodeFailed(Positional, frozen=True, tag=int(MessageKind.FAILED)):
    """A running request failed on decode after it was accepted."""

    request_id: str
    message: str


class TokenEntry(Positional, frozen=True):
    """New output of one request: the hot path, built by the engine, read by the router.

    ``usage`` is set on the entry that carries ``finish_reason``: decode's
    count is the one the client sees (it covers tokens cut by a stop string).
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None


class TokenFrame(Positional, frozen=True, tag=int(MessageKind.TOKENS)):
    entries: list[TokenEntry]


class TokenLogprobs(Positional, frozen=True, tag=int(MessageKind.LOGPROBS)):
    """The logprobs of a request's next tokens, one item per token in order.

    Sent only for a request that asked for them, ahead of the token frame that
    carries those tokens (so the token entry, the hot path, carries nothing for
    them): the router keeps them beside the request's stream and hands each
    delta the items of its tokens.
    """

    request_id: str
    items: Annotated[list[TokenLogprob], msgspec.Meta(max_length=MAX_TOKEN_IDS)]
