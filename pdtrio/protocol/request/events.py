"""The request machine's vocabulary: its phases, limits, events, commands and failures.

Frozen values, defined apart from the machine's table (``machine.py``), which
re-exports them: the shell reads them as ``rm.Arrived``, ``rm.SendPrefill``, ...
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping
from typing import Final, TypeAlias, final

import attrs

from pdtrio.protocol.errors import Reason

# --- the phases ------------------------------------------------------------------


class Phase(enum.Enum):
    __hash__ = object.__hash__  # (see Deadline's)

    NEW = "new"
    PLACING_PREFILL = "placing_prefill"  # SendPrefill is out: an instance is being picked
    # none could be picked: WaitForPrefill is out, for a prefill to connect (bounded)
    AWAITING_PREFILL = "awaiting_prefill"
    PREFILLING = "prefilling"  # the call is out to it (PrefillSent)
    PLACING_DECODE = "placing_decode"  # PlaceDecode is out: waiting for room, or a pick
    DECODE_SENDING = "decode_sending"  # the start is being queued on the link
    # a decode refused the start, or failed it before its first token: PlaceDecode is out
    # again, for the KV prefill holds (where prefill samples the first token, it went out
    # with the first start: not again)
    REPLACING_DECODE = "replacing_decode"
    DECODE_RESENDING = "decode_resending"
    DECODE_STARTING = "decode_starting"  # the start is out, not answered
    CONFIRMING_DECODE = "confirming_decode"  # decode accepted, sent no token yet
    STREAMING = "streaming"  # decode's tokens flow to the client
    # WaitForDecode is out: for another decode to pull prefill's KV again (decode failed
    # before its first token), or for one to continue a stream whose decode was lost
    AWAITING_RETRY = "awaiting_retry"
    AWAITING_MIGRATION = "awaiting_migration"
    DONE = "done"


class FirstToken(enum.Enum):
    """Which side samples the response's first token: a backend's rule, and so the table
    its requests' machines run by (chosen once, when one is built)."""

    __hash__ = object.__hash__  # (see Deadline's)

    # pdtrio's workers: the client gets prefill's token once the decode start is out; a
    # decode failing before its own first token is replaced while prefill holds the KV
    FROM_PREFILL = "from_prefill"
    # vLLM's KV connector, SGLang's bootstrap: decode generates every token from the
    # request again; one failing before its first sends the request again from prefill
    FROM_DECODE = "from_decode"


class MachineError(RuntimeError):
    """An event that cannot happen in the current phase: a bug in the shell."""


# --- configuration ---------------------------------------------------------------


@final
@attrs.frozen
class Limits:
    """The router's settings the request path decides by."""

    request_timeout_s: float
    prefill_timeout_s: float
    prefill_attempts: int = 3
    migration_limit: int = 0
    decode_reconnect_wait_s: float = 0.0
    lease_margin_s: float = 1.0  # decode must pull the KV this long before the lease ends
    # the prefill rounds a handoff may take: one whose KV no decode could take goes again
    # from a new prefill until this many rounds in all (1: it fails as the round ends)
    handoff_attempts: int = 1
    # a request that finds no prefill instance waits this long for one (0: refused at once)
    prefill_wait_s: float = 0.0


class Deadline(enum.Enum):
    # members are singletons: hashed by identity, in C (Enum's own hash is a Python call,
    # paid on every lookup of the armed deadlines)
    __hash__ = object.__hash__

    REQUEST = "request"  # the request's own timeout
    PREFILL = "prefill"  # one prefill call's
    KV_LEASE = "kv_lease"  # prefill frees the KV (less the margin): decode must be placed by it
    RECONNECT = "reconnect"  # a bounded wait for a decode not tried to (re)connect
    PREFILL_WAIT = "prefill_wait"  # a bounded wait for a prefill instance to connect


class MigrationReason(enum.StrEnum):
    """Why decode lost a request, as a migration after the loss is counted
    (``pdtrio_migrations_total``'s ``reason``, the access line's ``migrations``)."""

    LINK_LOST = "link_lost"  # the decode instance's link broke
    LINK_TIMEOUT = "link_timeout"  # its link went silent
    DECODE_FAILED = "decode_failed"  # decode failed the request (or nothing above says why)
    STALLED = "stalled"  # decode sent nothing for the request for the stream idle timeout
    # no decode could take prefill's KV (every pull failed, or none had room within its
    # lease): a new prefill, before decode's first token
    HANDOFF_FAILED = "handoff_failed"


class Ending(enum.Enum):
    """How the request ended, as the router counts it (``Outcome``'s names)."""

    OK = "ok"
    DISCONNECTED = "disconnected"
    REJECTED = "rejected"  # refused before any byte went out
    FAILED = "failed"  # an error after the stream had started


# --- failures: a typed reason, mapped to a status by pdtrio.protocol.errors ---------


@final
@attrs.frozen
class Failure:
    """Why the request failed: a :class:`Reason` (its status in ``ERRORS``) and a message.

    ``explain_no_prefill``: the message is the shell's account of why no prefill
    instance takes the request (it knows the instance table; the machine does not).
    """

    reason: Reason
    message: str
    param: str | None = None
    explain_no_prefill: bool = False


@final
@attrs.frozen
class WorkerFailure:
    """A worker's own answer passed on (its status through ``status_for_worker_failure``)."""

    status: int
    error_type: str
    message: str
    param: str | None = None


AnyFailure: TypeAlias = Failure | WorkerFailure

STALLED_MESSAGE: Final = "the client read nothing for too long; the router hung up"
TIMEOUT_MESSAGE: Final = "the request did not complete within {:g}s"
PREFILL_TIMEOUT_MESSAGE: Final = "prefill did not answer in time"
DRAIN_REFUSAL: Final = "the router is shutting down"
DRAIN_CUT: Final = "the router is shutting down; the request was cut short"
NO_LEASE_ROOM: Final = "no decode capacity came free within the prefill KV lease"

# --- events ----------------------------------------------------------------------


@final
@attrs.frozen
class Arrived:
    draining: bool = False
    queue_full: bool = False  # no place in the router's decode queue


@final
@attrs.frozen
class PrefillSent:
    instance: str


@final
@attrs.frozen
class PrefillUnavailable:
    """No prefill instance is left to send to."""


@final
@attrs.frozen
class PrefillConnected:
    """A prefill instance the request may go to is connected (after :class:`WaitForPrefill`)."""


@final
@attrs.frozen
class PrefillNotSent:
    """The instance's link was closed: it never saw the request."""


@final
@attrs.frozen
class PrefillLost:
    """The link went down with the call out: the worker dropped it."""

    message: str


@final
@attrs.frozen
class PrefillFailed:
    failure: WorkerFailure


@final
@attrs.frozen
class Prefilled:
    """Prefill answered; ``lease_ends_at``: when it frees the KV, None if it kept none
    (generation ended at the first token)."""

    lease_ends_at: float | None


@final
@attrs.frozen
class DecodeStartSent:
    """The start is going out to ``instance`` (decode may run it from now)."""

    instance: str
    connection: Hashable  # which of the instance's connections: exclusion is by connection


@final
@attrs.frozen
class DecodeStartQueued:
    """The start is out (queued on the link); decode's answer comes next."""


@final
@attrs.frozen
class DecodeUnavailable:
    """Placement found no decode for it: none, none that could hold it, the queue."""

    failure: Failure


@final
@attrs.frozen
class DecodeNotSent:
    """The start could not be sent (the link is closed): decode never saw it."""

    message: str


@final
@attrs.frozen
class DecodeAccepted:
    pass


@final
@attrs.frozen
class DecodeRejected:
    """``failure``: the instance refused the request as the client's own (a 4xx):
    the answer passed on, nothing retried.  ``kv_source_failed``: decode could not pull
    prefill's KV as prefill wrote it (its KV port unreachable, stalled or refusing, a
    digest mismatch, the lease over): prefill's side is to blame, not this decode's, so
    a new prefill round avoids that prefill and may come back to this decode."""

    message: str
    retryable: bool
    exclude: bool = True  # retried elsewhere (False: NO_ROOM, a stale report: any may)
    layout_mismatch: bool = False
    kv_source_failed: bool = False
    failure: WorkerFailure | None = None


@final
@attrs.frozen
class DecodeTokens:
    """A batch from decode went to the client: its first, or its last (``final``)."""

    final: bool = False


@final
@attrs.frozen
class DecodeFailed:
    """Decode holds nothing of it any more.  ``reason``: how a migration after it is
    counted; ``migratable``: a loss the request may go on from; ``cut_off``: the router
    ended it for a client too slow (``message`` is what the client is told)."""

    message: str
    reason: MigrationReason = MigrationReason.DECODE_FAILED
    migratable: bool = False
    cut_off: bool = False


@final
@attrs.frozen
class DecodeConnected:
    """A decode the request has not failed on is connected (after :class:`WaitForDecode`)."""


@final
@attrs.frozen
class DeadlinePassed:
    deadline: Deadline
    torn: bool = False  # no byte may go to the client any more (a write was cut mid-way)


@final
@attrs.frozen
class ClientGone:
    pass


@final
@attrs.frozen
class ClientStalled:
    """A write waited on the client past its timeout: the shell hung up on it."""


@final
@attrs.frozen
class DrainCut:
    torn: bool = False


@final
@attrs.frozen
class Failed:
    """The shell found a failure of its own (a bad KV handle, a finish without counts)."""

    failure: Failure
    torn: bool = False


Event: TypeAlias = (
    Arrived
    | PrefillSent
    | PrefillUnavailable
    | PrefillConnected
    | PrefillNotSent
    | PrefillLost
    | PrefillFailed
    | Prefilled
    | DecodeStartSent
    | DecodeStartQueued
    | DecodeUnavailable
    | DecodeNotSent
    | DecodeAccepted
    | DecodeRejected
    | DecodeTokens
    | DecodeFailed
    | DecodeConnected
    | DeadlinePassed
    | ClientGone
    | ClientStalled
    | DrainCut
    | Failed
)

# --- commands --------------------------------------------------------------------


@final
@attrs.frozen
class WaitUntil:
    deadline: Deadline
    at: float


@final
@attrs.frozen
class SendPrefill:
    """Pick a prefill instance not in ``exclude`` and send it the call (``continuation``:
    of the prompt and the tokens delivered, after a migration); ``retry``: not the first;
    ``avoid``: taken only when no other is left (the prefill a failed handoff blamed)."""

    exclude: frozenset[str]
    continuation: bool = False
    retry: bool = False
    avoid: frozenset[str] = frozenset()


@final
@attrs.frozen
class WaitForPrefill:
    """Report :class:`PrefillConnected` once a prefill instance not in ``exclude`` could
    take the request (now, or before the PREFILL_WAIT deadline armed with it)."""

    exclude: frozenset[str]


@final
@attrs.frozen
class PlaceDecode:
    """Place the request on a decode instance with room, not on a connection in
    ``exclude`` (name -> connection), and start it there; ``last_reason``: why the
    last one could not, for the failure if none can.  ``await_link``: with no decode
    left, wait (as a lost one does) for one to connect before :class:`DecodeUnavailable`;
    not when a new prefill round is the better hope (prefill's KV was to blame)."""

    exclude: Mapping[str, Hashable]
    last_reason: str
    retry: bool = False
    await_link: bool = True


@final
@attrs.frozen
class WaitForDecode:
    """Report :class:`DecodeConnected` once a decode not in ``exclude`` is connected
    (now, or before the RECONNECT deadline armed with it); ``any_layout``: for a new
    prefill (a migration), not for the KV prefill holds now."""

    exclude: Mapping[str, Hashable]
    any_layout: bool = False


@final
@attrs.frozen
class EmitFirstToken:
    """Send prefill's token (``final``: it ends the response)."""

    final: bool = False


@final
@attrs.frozen
class ReleasePrefill:
    """Prefill may free the request's KV."""

    instance: str


@final
@attrs.frozen
class AbortDecode:
    instance: str


@final
@attrs.frozen
class Migrate:
    """A new leg: the request goes on from a new prefill (``reason``: why decode lost it)."""

    reason: MigrationReason
    lost_on: str


@final
@attrs.frozen
class Finish:
    """End the response well (what is left of it: [DONE], or the whole body)."""


@final
@attrs.frozen
class RespondWithError:
    """No byte went out yet: the error is the response (its status)."""

    failure: AnyFailure


@final
@attrs.frozen
class StreamError:
    """The stream had started: the error ends it as an event (the status stays 200)."""

    failure: AnyFailure


@final
@attrs.frozen
class End:
    """The request is over; nothing follows.  ``failure``: the status it is counted with."""

    ending: Ending
    failure: AnyFailure | None = None


Command: TypeAlias = (
    WaitUntil
    | SendPrefill
    | WaitForPrefill
    | PlaceDecode
    | WaitForDecode
    | EmitFirstToken
    | ReleasePrefill
    | AbortDecode
    | Migrate
    | Finish
    | RespondWithError
    | StreamError
    | End
)

QUEUE_FULL_MESSAGE: Final = "the server is at capacity and its queue is full; retry shortly"


def no_prefill() -> Failure:
    return Failure(Reason.SERVICE_UNAVAILABLE, "", explain_no_prefill=True)


def no_decode_took_it(last_reason: str) -> Failure:
    """No decode could take the request (each one tried failed, or none is left)."""
    return Failure(
        Reason.SERVICE_UNAVAILABLE, f"no decode instance could take the request: {last_reason}"
    )


def decode_failed(message: str) -> Failure:
    """A decode worker failed the request: 502 (what a non-streaming client sees)."""
    return Failure(Reason.DECODE_FAILED, f"decode failed: {message}")
