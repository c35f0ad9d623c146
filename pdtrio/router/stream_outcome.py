"""What became of a decode stream, as one typed value every backend's stream holds.

A stream starts :data:`UNANSWERED` (the start is out, decode has not answered it); a
worker's becomes :data:`ACCEPTED` at decode's accept, or :class:`StreamRejected` (an
engine's exists once decode answered 200: it starts accepted).  It ends well with its
finish, in its buffer, or :class:`StreamFailed`: decode failed it, its link was lost,
or the router ended it (a client too far behind, a stall, an abort).  Whoever reads
the instance sets it; the request's decode leg reads it and tells the machine.
"""

from __future__ import annotations

import enum
from types import MappingProxyType
from typing import Final, TypeAlias, final

import attrs

from pdtrio.protocol import request as rm
from pdtrio.protocol.link.wire import DecodeRejected

CUT_OFF_MESSAGE = "the client fell too far behind the token stream and was cut off"


class DecodeLoss(enum.Enum):
    """Why a stream failed: whose doing it was, and how the request may go on."""

    DECODE_FAILED = "decode_failed"  # the decode instance failed it
    STALLED = "stalled"  # decode sent nothing for it for the stream idle timeout
    LINK_LOST = "link_lost"  # the link to its decode broke
    LINK_TIMEOUT = "link_timeout"  # the link to its decode went silent
    CUT_OFF = "cut_off"  # its client fell too far behind (CUT_OFF_MESSAGE)
    ABORTED = "aborted"  # the router ended it on decode
    # another part of the request failed it (an engine choice's prefill, or no instance
    # for a choice started again alone): not decode's failure
    NOT_DECODES_FAULT = "not_decodes_fault"

    @property
    def is_link_loss(self) -> bool:
        """The link's, not decode's word on the request: one loss fails every stream on
        it at once, so it does not count as that many failures of the instance."""
        return self is DecodeLoss.LINK_LOST or self is DecodeLoss.LINK_TIMEOUT

    @property
    def may_migrate(self) -> bool:
        """Whether the request may go on elsewhere from the tokens it delivered."""
        return self in _MIGRATIONS

    @property
    def migration_reason(self) -> rm.MigrationReason:
        """How a migration after this loss is counted."""
        return _MIGRATIONS.get(self, rm.MigrationReason.DECODE_FAILED)


_MIGRATIONS: Final = MappingProxyType(
    {
        DecodeLoss.DECODE_FAILED: rm.MigrationReason.DECODE_FAILED,
        DecodeLoss.STALLED: rm.MigrationReason.STALLED,
        DecodeLoss.LINK_LOST: rm.MigrationReason.LINK_LOST,
        DecodeLoss.LINK_TIMEOUT: rm.MigrationReason.LINK_TIMEOUT,
    }
)


@final
@attrs.frozen
class StreamUnanswered:
    """The start is out; decode has not answered it."""


@final
@attrs.frozen
class StreamAccepted:
    """Decode runs the request: its tokens come into the stream's buffer."""


@final
@attrs.frozen
class StreamRejected:
    """Decode refused the start: it holds nothing of the request."""

    rejection: DecodeRejected


@final
@attrs.frozen
class StreamFailed:
    """The stream ended before its finish: decode holds nothing of the request any more.

    ``message``: what the request is told; ``accepted``: decode had accepted the start
    (the tokens pushed before the failure go out first).
    """

    message: str
    loss: DecodeLoss
    accepted: bool = True

    @property
    def cut_off(self) -> bool:
        """The router ended it: its client fell too far behind."""
        return self.loss is DecodeLoss.CUT_OFF


StreamOutcome: TypeAlias = StreamUnanswered | StreamAccepted | StreamRejected | StreamFailed

UNANSWERED: Final = StreamUnanswered()
ACCEPTED: Final = StreamAccepted()
