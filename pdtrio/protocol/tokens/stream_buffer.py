"""The router's per-stream buffer between the worker link reader and a client.

The link reader must never block on one slow client, so it :meth:`push`-es
each token entry into the stream's :class:`StreamBuffer` without waiting, and
the stream's SSE task :meth:`take`-s everything pending as one merged
:class:`PendingDelta` whenever it is ready to write.  Merging is cheap: text
pieces are collected in a list and joined on take.

Limits: a push that would take the pending token count past
``max_pending_tokens`` is refused with :attr:`PushResult.OVERFLOW` (the
consumer is too slow: the caller ends the stream with an error and aborts
upstream) and the buffer is failed from then on.  A push when no tokens are
pending is accepted whatever its size (the consumer has kept up; decode may
merge many tokens into one entry under load), and a push of zero tokens (a
finish, a usage) never overflows.  So ``pending_tokens`` passes the limit only
by a single push.  After an overflow, what was pending before it can still be
taken.

States: open -> finished (a finish was pushed; pending data may still be
taken), or -> failed (overflow) / closed (the consumer went away).  Pushes into
a failed or closed buffer are :attr:`PushResult.DISCARDED` (entries still in
flight from decode race with the abort); a push after a finish is a
programming error and raises :class:`StreamBufferError`.
"""

from __future__ import annotations

import enum
from typing import final

import attrs

from pdtrio.protocol.link.wire import Usage


class StreamBufferError(RuntimeError):
    """The caller used the buffer wrong (e.g. pushed after a finish)."""


class PushResult(enum.Enum):
    ACCEPTED = "accepted"
    OVERFLOW = "overflow"
    """Refused, and the buffer is now failed: end the stream, abort upstream."""
    DISCARDED = "discarded"
    """The buffer was already failed or closed; nothing to do."""


@final
@attrs.frozen
class PendingDelta:
    text: str
    num_tokens: int
    finish_reason: str | None
    usage: Usage | None


@final
@attrs.frozen
class StreamBufferStatistics:
    pending_tokens: int
    max_pending_tokens: int
    tokens_pushed: int
    finished: bool
    failed: bool
    closed: bool


@final
class StreamBuffer:
    """Pending deltas of one stream, merged on take; never blocks the pusher."""

    def __init__(self, *, max_pending_tokens: int) -> None:
        if max_pending_tokens < 1:
            raise ValueError(f"max_pending_tokens must be >= 1, got {max_pending_tokens}")
        self._max_pending_tokens = max_pending_tokens
        self._pieces: list[str] = []
        self._tokens = 0
        self._has_delta = False  # something was pushed since the last take
        self._finish_reason: str | None = None
        self._usage: Usage | None = None
        self._finished = False
        self._failed = False
        self._closed = False
        self._tokens_pushed = 0

    @property
    def has_pending(self) -> bool:
        return self._has_delta

    @property
    def pending_tokens(self) -> int:
        return self._tokens

    @property
    def finished(self) -> bool:
        """A finish was pushed (it may still be pending)."""
        return self._finished

    @property
    def failed(self) -> bool:
        """A push overflowed the limit."""
        return self._failed

    @property
    def closed(self) -> bool:
        return self._closed

    def push(
        self,
        text: str,
        num_tokens: int,
        finish_reason: str | None,
        usage: Usage | None,
    ) -> PushResult:
        if self._failed or self._closed:
            return PushResult.DISCARDED
        if self._finished:
            raise StreamBufferError("push after the stream finished")
        if num_tokens < 0:
            raise StreamBufferError(f"num_tokens must be >= 0, got {num_tokens}")
        if self._tokens and num_tokens and self._tokens + num_tokens > self._max_pending_tokens:
            self._failed = True
            return PushResult.OVERFLOW
        if text:
            self._pieces.append(text)
        self._tokens += num_tokens
        self._tokens_pushed += num_tokens
        self._has_delta = True
        if finish_reason is not None:
            self._finish_reason = finish_reason
            self._finished = True
        if usage is not None:
            self._usage = usage
        return PushResult.ACCEPTED

    def take(self) -> PendingDelta | None:
        """Everything pending as one delta, or None when nothing is pending."""
        if not self._has_delta:
            return None
        pieces = self._pieces
        text = pieces[0] if len(pieces) == 1 else "".join(pieces)
        delta = PendingDelta(text, self._tokens, self._finish_reason, self._usage)
        self._pieces = []
        self._tokens = 0
        self._has_delta = False
        self._finish_reason = None
        self._usage = None
        return delta

    def close(self) -> None:
        """The consumer went away: drop what is pending, discard later pushes."""
        self._closed = True
        self._pieces = []
        self._tokens = 0
        self._has_delta = False
        self._finish_reason = None
        self._usage = None

    def statistics(self) -> StreamBufferStatistics:
        return StreamBufferStatistics(
            pending_tokens=self._tokens,
            max_pending_tokens=self._max_pending_tokens,
            tokens_pushed=self._tokens_pushed,
            finished=self._finished,
            failed=self._failed,
            closed=self._closed,
        )
