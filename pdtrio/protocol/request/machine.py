"""One request on the router as a sans-IO state machine: ``handle(event, now) -> commands``.

In the spirit of h11's ``_state.py``: the router's shell does the I/O (prefill
calls, decode starts, writes to the client, timers) and reports what happened
as an event; the machine answers with what to do next as commands.  The
machine holds every decision of the request path: admission, prefill attempts
and retries, decode placement and its retries before the first token, the
migration of a request whose decode was lost, which deadline applies, what
cleanup owes (:class:`~pdtrio.protocol.request.lifecycle.RequestLifecycle`, kept
as the KV-ownership table underneath), and how the client's response ends.

The whole rule is :data:`_TABLE`: (phase, event type) -> handler.  An event the
table does not list for the current phase is a bug in the shell
(:class:`MachineError`); once the request has ended, every event is answered
with no command (a stale timer, a late answer), so nothing follows the end.

Commands are backend-neutral: they name instances, never links or sockets.
Two kinds of backend: one whose prefill samples the first token (pdtrio's
workers: the client gets it as soon as the decode start is out, and a decode
that fails before its own first token is replaced while prefill holds the
KV), and one whose decode generates every token from the request again
(``first_token_from_prefill=False``: vLLM's KV connector, SGLang's bootstrap
protocol): the response starts with decode's first batch, and a decode that
fails before it sends the request again from a new prefill, prefill's KV
freed (it is not known to be pullable twice).  SGLang's prefill runs beside
its decode: its failure may be reported while decode starts.

Deadlines are explicit: :class:`WaitUntil` arms one, :class:`DeadlinePassed`
reports it; :meth:`RequestMachine.next_deadline` is the earliest armed, and
:attr:`RequestMachine.earliest_deadline_at` its time, which is all the shell's
timer needs.  Tokens streaming from decode do not pass
through here one by one: the shell reports the first batch from decode (prefill
may then free the KV) and the last.

Pure (sans-IO): no I/O, no clock read (``now`` comes with each event).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Hashable, Mapping
from types import MappingProxyType
from typing import Final, TypeAlias, final

import attrs

from pdtrio.protocol.errors import Reason
from pdtrio.protocol.request.lifecycle import Cleanup, RequestLifecycle, State
from pdtrio.protocol.request.lifecycle import Event as Kv

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


@final
class ChoiceRetry:
    """One choice of an ``n`` > 1 request whose decode regenerates every token, started
    again alone: it failed before any of its tokens went out, once other choices' had
    (the request can no longer go again whole).  Under the request's own limits: each
    decode it failed on is excluded, and each round from a new prefill tries at most
    ``prefill_attempts`` prefill instances."""

    __slots__ = ("_prefill_attempts", "excluded_decodes", "given_up", "tried_prefills")

    def __init__(self, limits: Limits) -> None:
        self._prefill_attempts = limits.prefill_attempts
        self.excluded_decodes: set[str] = set()
        self.tried_prefills: set[str] = set()  # this round's
        self.given_up = False  # its last failure is the request's

    def decode_failed(self, instance: str) -> None:
        """Its leg on ``instance`` failed: never there again, and a new round of prefills
        (as the request's own retry from prefill)."""
        self.excluded_decodes.add(instance)
        self.tried_prefills.clear()

    def prefill_sent(self, instance: str) -> None:
        self.tried_prefills.add(instance)

    def may_prefill(self) -> bool:
        return len(self.tried_prefills) < self._prefill_attempts


class Deadline(enum.Enum):
    # members are singletons: hashed by identity, in C (Enum's own hash is a Python call,
    # paid on every lookup of the armed deadlines)
    __hash__ = object.__hash__

    REQUEST = "request"  # the request's own timeout
    PREFILL = "prefill"  # one prefill call's
    KV_LEASE = "kv_lease"  # prefill frees the KV (less the margin): decode must be placed by it
    RECONNECT = "reconnect"  # a bounded wait for a decode not tried to (re)connect


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
    the answer passed on, nothing retried."""

    message: str
    retryable: bool
    exclude: bool = True  # retried elsewhere (False: NO_ROOM, a stale report: any may)
    layout_mismatch: bool = False
    failure: WorkerFailure | None = None


@final
@attrs.frozen
class DecodeTokens:
    """A batch from decode went to the client: its first, or its last (``final``)."""

    final: bool = False


@final
@attrs.frozen
class DecodeFailed:
    """Decode holds nothing of it any more.  ``reason``: a migration label, or other;
    ``migratable``: a loss the request may go on from; ``cut_off``: the link aborted it
    for a client too slow (``message`` is what the client is told)."""

    message: str
    reason: str = "decode_failed"
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
    of the prompt and the tokens delivered, after a migration); ``retry``: not the first."""

    exclude: frozenset[str]
    continuation: bool = False
    retry: bool = False


@final
@attrs.frozen
class PlaceDecode:
    """Place the request on a decode instance with room, not on a connection in
    ``exclude`` (name -> connection), and start it there; ``last_reason``: why the
    last one could not, for the failure if none can."""

    exclude: Mapping[str, Hashable]
    last_reason: str
    retry: bool = False


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
    """A new leg: the request goes on from a new prefill (``reason``: a migration label)."""

    reason: str
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

# --- the machine -------------------------------------------------------------------


class Phase(enum.Enum):
    __hash__ = object.__hash__  # (see Deadline's)

    NEW = "new"
    PREFILLING = "prefilling"  # SendPrefill is out (the call, once PrefillSent)
    PLACING_DECODE = "placing_decode"  # PlaceDecode is out: waiting for room, or a pick
    DECODE_SENDING = "decode_sending"  # the start is being queued on the link
    DECODE_STARTING = "decode_starting"  # the start is out, not answered
    DECODING = "decoding"  # decode accepted (its first token: the lifecycle says)
    AWAITING_DECODE = "awaiting_decode"  # WaitForDecode is out (a retry, or a migration)
    DONE = "done"


class MachineError(RuntimeError):
    """An event that cannot happen in the current phase: a bug in the shell."""


@final
class RequestMachine:
    """Where one request stands, and what it does next."""

    def __init__(
        self,
        limits: Limits,
        *,
        streaming: bool,
        keep_tokens: bool,
        first_token_from_prefill: bool = True,
    ) -> None:
        if keep_tokens and not first_token_from_prefill:
            # a continuation is prefill's to sample: a decode that regenerates from the
            # request cannot go on from the tokens delivered
            raise ValueError("a request whose decode regenerates every token cannot migrate")
        self.limits = limits
        self.first_token_from_prefill = first_token_from_prefill
        self.streaming = streaming
        self.keep_tokens = keep_tokens  # token ids are kept: a lost decode may migrate
        self.phase = Phase.NEW
        self.lifecycle = RequestLifecycle()  # what cleanup owes (KV on prefill, decode's run)
        self._armed: dict[Deadline, float] = {}
        # the earliest of them, kept until they change (the shell asks before every wait
        # and after every event)
        self._earliest: tuple[float, Deadline] | None = None
        self._armed_changed = False
        # the earliest armed deadline's time (inf: none), kept as they change: what the
        # shell's timer follows, read after every event without a call
        self.earliest_deadline_at = math.inf
        self.prefill_instance: str | None = None
        self.decode_instance: str | None = None
        self._decode_connection: Hashable = None
        self._prefill_tried: set[str] = set()
        self._prefill_failure: AnyFailure | None = None
        self._continuation = False
        self._lease_ends_at: float | None = None
        self._tried: dict[str, Hashable] = {}  # this leg's decode failures, by connection
        self._lost_on: dict[str, Hashable] = {}  # decodes lost mid-stream, every leg
        self._last_reason = "no decode instance is connected"
        self._decode_attempts = 0
        self._first_token_emitted = False  # this leg's prefill token, once whatever decode runs it
        self._any_token_emitted = False  # (streaming: the headers went out with it)
        self._awaiting_for_migration = False  # what AWAITING_DECODE waits for
        self._early: DecodeFailed | None = None  # the failure an AWAITING_DECODE retries
        # when the wait for a decode that followed the last loss ends: one wait per loss,
        # whether the KV prefill holds or a new prefill goes to the decode that connects
        self._reconnect_until = math.inf
        self.migrations: list[str] = []
        self.ended: End | None = None

    # --- the entry --------------------------------------------------------------

    def handle(self, event: Event, now: float) -> list[Command]:
        """Apply ``event`` (at ``now``); returns the commands to carry out, in order."""
        if self.phase is Phase.DONE:
            return []  # a late answer or a stale timer: nothing follows the end
        handler = _ENTRIES.get((self.phase, type(event)))
        if handler is None:
            raise MachineError(f"{type(event).__name__} cannot happen in phase {self.phase.name}")
        return handler(self, event, now)

    def next_deadline(self) -> tuple[float, Deadline] | None:
        """The earliest armed deadline: the shell's timer for whatever it awaits."""
        if self._armed_changed:
            self._armed_changed = False
            armed = self._armed
            if armed:
                deadline = min(armed, key=armed.__getitem__)
                self._earliest = armed[deadline], deadline
            else:
                self._earliest = None
        return self._earliest

    @property
    def headers_sent(self) -> bool:
        return self.streaming and self._any_token_emitted

    # --- helpers ----------------------------------------------------------------

    def _arm(self, deadline: Deadline, at: float, out: list[Command]) -> None:
        armed = self._armed
        armed[deadline] = at
        self._armed_changed = True
        self.earliest_deadline_at = min(armed.values())
        out.append(WaitUntil(deadline, at))

    def _disarm(self, deadline: Deadline) -> None:
        armed = self._armed
        if armed.pop(deadline, None) is not None:
            self._armed_changed = True
            self.earliest_deadline_at = min(armed.values(), default=math.inf)

    def _cleanup(self, out: list[Command]) -> None:
        owed = self.lifecycle.owed()
        if owed & Cleanup.ABORT_ON_DECODE and self.decode_instance is not None:
            out.append(AbortDecode(self.decode_instance))
        if owed & Cleanup.RELEASE_ON_PREFILL and self.prefill_instance is not None:
            out.append(ReleasePrefill(self.prefill_instance))
        self.lifecycle.handle(Kv.CLEANED)

    def _end(self, out: list[Command], ending: Ending, failure: AnyFailure | None = None) -> None:
        self._armed.clear()
        self._armed_changed = True
        self.earliest_deadline_at = math.inf
        self.phase = Phase.DONE
        end = self.ended = End(ending, failure)
        out.append(end)

    def _fail(self, failure: AnyFailure, *, torn: bool = False) -> list[Command]:
        """Clean up, then end the client's response with ``failure`` as it can be."""
        out: list[Command] = []
        self._cleanup(out)
        if not self.headers_sent:
            out.append(RespondWithError(failure))
            self._end(out, Ending.REJECTED, failure)
        else:
            if not torn:  # a write cut mid-way: more bytes would corrupt the stream
                out.append(StreamError(failure))
            self._end(out, Ending.FAILED, failure)
        return out

    def _send_prefill(self, out: list[Command]) -> list[Command]:
        if len(self._prefill_tried) >= self.limits.prefill_attempts:
            failure = self._prefill_failure or _no_prefill()
            return [*out, *self._fail(failure)]
        self.phase = Phase.PREFILLING
        out.append(
            SendPrefill(
                frozenset(self._prefill_tried),
                continuation=self._continuation,
                retry=bool(self._prefill_tried),
            )
        )
        return out

    def _place_decode(self, now: float, out: list[Command]) -> list[Command]:
        self.phase = Phase.PLACING_DECODE
        if self._lease_ends_at is not None:  # (None: an engine's, no lease known)
            self._arm(Deadline.KV_LEASE, self._lease_ends_at - self.limits.lease_margin_s, out)
        out.append(
            PlaceDecode(
                MappingProxyType(dict(self._tried)),
                self._last_reason,
                retry=self._decode_attempts > 0,
            )
        )
        self._decode_attempts += 1
        return out

    def _await_decode(
        self, until: float, exclude: dict[str, Hashable], *, any_layout: bool
    ) -> list[Command]:
        self.phase = Phase.AWAITING_DECODE
        out: list[Command] = []
        self._arm(Deadline.RECONNECT, until, out)
        out.append(WaitForDecode(MappingProxyType(dict(exclude)), any_layout=any_layout))
        return out

    def _lost(
        self, failure: DecodeFailed, now: float, *, torn: bool = False, waited: bool = False
    ) -> list[Command]:
        """Decode was lost after the first token went out: migrate, or fail as before.

        ``waited``: the request has waited for a decode since the loss was seen (to
        retry on prefill's KV): it waits for what is left of that wait, not a new one.
        """
        assert self.decode_instance is not None
        self._lost_on[self.decode_instance] = self._decode_connection
        if not self.keep_tokens or len(self.migrations) >= self.limits.migration_limit:
            return self._fail(_decode_failed(failure.message), torn=torn)
        self._early = failure
        self._awaiting_for_migration = True
        if not waited:
            self._reconnect_until = now + self.limits.decode_reconnect_wait_s
        request_deadline = self._armed[Deadline.REQUEST]
        # (a wait already spent: a decode connected now is still taken, none is waited for)
        until = max(now, min(self._reconnect_until, request_deadline))
        return self._await_decode(until, self._lost_on, any_layout=True)

    def _interrupted(self, failure: AnyFailure, torn: bool) -> list[Command]:
        return self._fail(failure, torn=torn)

    # --- handlers: (phase, event) -> commands --------------------------------------

    def _on_arrived(self, event: Arrived, now: float) -> list[Command]:
        if event.draining:
            out: list[Command] = []
            failure = Failure(Reason.SHUTTING_DOWN, DRAIN_REFUSAL)
            out.append(RespondWithError(failure))
            self._end(out, Ending.REJECTED, failure)
            return out
        if event.queue_full:
            return self._fail(Failure(Reason.QUEUE_FULL, QUEUE_FULL_MESSAGE))
        out = []
        self._arm(Deadline.REQUEST, now + self.limits.request_timeout_s, out)
        return self._send_prefill(out)

    def _on_prefill_sent(self, event: PrefillSent, now: float) -> list[Command]:
        self._prefill_tried.add(event.instance)
        self.prefill_instance = event.instance
        self.lifecycle.handle(Kv.PREFILL_SENT)
        out: list[Command] = []
        at = now + self.limits.prefill_timeout_s
        if at < self._armed[Deadline.REQUEST]:
            self._arm(Deadline.PREFILL, at, out)
        return out

    def _on_prefill_unavailable(self, event: PrefillUnavailable, now: float) -> list[Command]:
        return self._fail(self._prefill_failure or _no_prefill())

    def _prefill_answered(self) -> None:
        self._disarm(Deadline.PREFILL)

    def _on_prefill_not_sent(self, event: PrefillNotSent, now: float) -> list[Command]:
        self._prefill_answered()
        self.lifecycle.handle(Kv.PREFILL_NOT_SENT)
        return self._send_prefill([])

    def _on_prefill_lost(self, event: PrefillLost, now: float) -> list[Command]:
        self._prefill_answered()
        self.lifecycle.handle(Kv.PREFILL_LOST)
        self._prefill_failure = Failure(
            Reason.SERVICE_UNAVAILABLE, f"prefill instance failed: {event.message}"
        )
        return self._send_prefill([])

    def _on_prefill_failed(self, event: PrefillFailed, now: float) -> list[Command]:
        self._prefill_answered()
        if event.failure.status >= 500:
            # the instance's fault, not the request's: another may try
            self.lifecycle.handle(Kv.PREFILL_LOST)
            self._prefill_failure = event.failure
            return self._send_prefill([])
        self.lifecycle.handle(Kv.PREFILL_FAILED)  # the request's own (a 4xx): not retried
        return self._fail(event.failure)

    def _on_prefilled(self, event: Prefilled, now: float) -> list[Command]:
        self._prefill_answered()
        out: list[Command] = []
        if not self.first_token_from_prefill:
            # decode generates every token; prefill's KV, if it kept any, waits for it
            # (None: no lease known, or none kept: decode gets the plain request)
            self.lifecycle.handle(Kv.PREFILLED)
            self._lease_ends_at = event.lease_ends_at
            return self._place_decode(now, out)
        # a new leg's prefill sampled a token of its own (a migration's may be the last)
        self._first_token_emitted = False
        if event.lease_ends_at is None:
            self.lifecycle.handle(Kv.FINISHED_AT_PREFILL)
            self._first_token(out, final=True)
            out.append(Finish())
            self._end(out, Ending.OK)
            return out
        self.lifecycle.handle(Kv.PREFILLED)
        self._lease_ends_at = event.lease_ends_at
        self._tried = dict(self._lost_on)
        self._last_reason = "no decode instance is connected"
        self._decode_attempts = 0
        return self._place_decode(now, out)

    def _on_decode_start_sent(self, event: DecodeStartSent, now: float) -> list[Command]:
        self._disarm(Deadline.KV_LEASE)  # placed: the lease bounds the wait only
        self.phase = Phase.DECODE_SENDING
        self.decode_instance = event.instance
        self._decode_connection = event.connection
        self.lifecycle.handle(Kv.DECODE_START_SENT)
        return []

    def _on_decode_start_queued(self, event: DecodeStartQueued, now: float) -> list[Command]:
        self.phase = Phase.DECODE_STARTING
        if not self.first_token_from_prefill:
            return []  # the response starts with decode's first batch
        # the first token goes out once decode room is claimed and the start is sent
        return self._first_token([], final=False)

    def _on_decode_not_sent(self, event: DecodeNotSent, now: float) -> list[Command]:
        self.lifecycle.handle(Kv.DECODE_NOT_STARTED)
        assert self.decode_instance is not None
        self._tried[self.decode_instance] = self._decode_connection
        self._last_reason = event.message
        return self._place_decode(now, [])

    def _first_token(self, out: list[Command], *, final: bool) -> list[Command]:
        if not self._first_token_emitted:
            self._first_token_emitted = self._any_token_emitted = True
            out.append(EmitFirstToken(final=final))
        return out

    def _on_decode_unavailable(self, event: DecodeUnavailable, now: float) -> list[Command]:
        return self._fail(event.failure)

    def _on_decode_accepted(self, event: DecodeAccepted, now: float) -> list[Command]:
        self.lifecycle.handle(Kv.DECODE_ACCEPTED)
        self.phase = Phase.DECODING
        return []

    def _on_decode_rejected(self, event: DecodeRejected, now: float) -> list[Command]:
        out: list[Command] = []
        self.lifecycle.handle(Kv.DECODE_NOT_STARTED)
        self._last_reason = event.message
        if event.failure is not None:
            return self._fail(event.failure)  # the client's own error: passed on
        if event.retryable:
            if event.exclude:
                assert self.decode_instance is not None
                self._tried[self.decode_instance] = self._decode_connection
            return self._place_decode(now, out)
        if event.layout_mismatch:
            message = f"prefill and decode cannot be paired: {event.message}"
        else:
            message = f"decode rejected the request: {event.message}"
        return out + self._fail(Failure(Reason.INTERNAL, message))

    def _on_decode_failed_starting(self, event: DecodeFailed, now: float) -> list[Command]:
        # it had not answered: prefill still holds the KV, another may take it
        failure = DecodeFailed(f"decode failed to start: {event.message}", event.reason)
        return self._failed_early(failure, now)

    def _failed_early(self, event: DecodeFailed, now: float) -> list[Command]:
        """Decode failed before its first token: prefill still holds the KV, so another
        decode pulls it again, if one is connected before the lease ends.  (A decode that
        regenerates every token: the request goes again from a new prefill.)"""
        self.lifecycle.handle(Kv.DECODE_ENDED)
        assert self.decode_instance is not None
        self._tried[self.decode_instance] = self._decode_connection
        self._last_reason = event.message
        if not self.first_token_from_prefill:
            return self._again_from_prefill()
        self._early = event
        self._awaiting_for_migration = False
        assert self._lease_ends_at is not None
        lease_left = self._lease_ends_at - self.limits.lease_margin_s
        self._reconnect_until = now + self.limits.decode_reconnect_wait_s
        until = min(self._reconnect_until, lease_left)
        return self._await_decode(until, self._tried, any_layout=False)

    def _again_from_prefill(self) -> list[Command]:
        """Decode failed before its first token, and it regenerates every token: prefill's
        KV is freed and the request sent again from a new prefill (to another decode: the
        ones it failed on stay excluded)."""
        out: list[Command] = []
        assert self.prefill_instance is not None
        out.append(ReleasePrefill(self.prefill_instance))
        self.lifecycle.handle(Kv.KV_GIVEN_UP)
        self._prefill_tried = set()
        self._prefill_failure = None
        return self._send_prefill(out)

    def _on_prefill_failed_beside_decode(
        self, event: PrefillNotSent | PrefillLost | PrefillFailed, now: float
    ) -> list[Command]:
        """A prefill running beside its decode (SGLang's) failed: before decode's first
        token, decode waits for KV that will not come (it is aborted) and another prefill
        takes the request, as after a prefill's own failure; after it, decode had the KV."""
        if self.first_token_from_prefill:
            raise MachineError(f"{type(event).__name__} cannot happen while decode runs")
        if self.lifecycle.state is State.DECODING:
            return []  # decode pulled the KV: prefill's late word changes nothing
        out: list[Command] = []
        assert self.decode_instance is not None
        out.append(AbortDecode(self.decode_instance))
        self.lifecycle.handle(Kv.DECODE_ENDED)
        if isinstance(event, PrefillFailed) and event.failure.status < 500:
            self.lifecycle.handle(Kv.PREFILL_FAILED)  # the request's own: not retried
            return out + self._fail(event.failure)
        self.lifecycle.handle(Kv.PREFILL_LOST)
        if isinstance(event, PrefillFailed):
            self._prefill_failure = event.failure
        elif isinstance(event, PrefillLost):
            self._prefill_failure = Failure(
                Reason.SERVICE_UNAVAILABLE, f"prefill instance failed: {event.message}"
            )
        return self._send_prefill(out)

    def _on_decode_tokens(self, event: DecodeTokens, now: float) -> list[Command]:
        out: list[Command] = []
        self._any_token_emitted = True  # (an engine's: the response starts with them)
        if self.lifecycle.state is State.DECODE_CONFIRMING:
            # decode is alive: prefill may free the KV it kept until now
            self.lifecycle.handle(Kv.FIRST_DECODE_TOKEN)
            assert self.prefill_instance is not None
            out.append(ReleasePrefill(self.prefill_instance))
        if event.final:
            self.lifecycle.handle(Kv.DECODE_ENDED)
            out.append(Finish())
            self._end(out, Ending.OK)
        return out

    def _on_decode_failed(self, event: DecodeFailed, now: float) -> list[Command]:
        if event.cut_off:
            self.lifecycle.handle(Kv.DECODE_ENDED)
            return self._fail(Failure(Reason.CLIENT_TOO_SLOW, event.message))
        if self.lifecycle.state is State.DECODE_CONFIRMING:
            return self._failed_early(event, now)
        if event.migratable and self.keep_tokens:
            self.lifecycle.handle(Kv.DECODE_LOST)
            return self._lost(event, now)
        self.lifecycle.handle(Kv.DECODE_ENDED)
        return self._fail(_decode_failed(event.message))

    def _on_decode_connected(self, event: DecodeConnected, now: float) -> list[Command]:
        self._disarm(Deadline.RECONNECT)
        if self._awaiting_for_migration:
            return self._migrate()
        return self._place_decode(now, [])

    def _migrate(self) -> list[Command]:
        early = self._early
        assert early is not None and self.decode_instance is not None
        self.migrations.append(early.reason)
        out: list[Command] = [Migrate(early.reason, self.decode_instance)]
        self._continuation = True
        self._prefill_tried = set()
        self._prefill_failure = None
        return self._send_prefill(out)

    def _on_reconnect_passed(self, early: DecodeFailed, now: float, *, torn: bool) -> list[Command]:
        """No decode connected in time for the retry (or the migration) waited on."""
        if self._awaiting_for_migration:
            return self._fail(_decode_failed(early.message), torn=torn)
        if not self._first_token_emitted or not self.keep_tokens:
            return self._fail(_decode_failed(early.message), torn=torn)
        # no decode can pull prefill's KV before its lease ends: free it, and go on
        # from a new prefill, as one lost mid-stream does
        out: list[Command] = []
        assert self.prefill_instance is not None
        out.append(ReleasePrefill(self.prefill_instance))
        self.lifecycle.handle(Kv.KV_GIVEN_UP)
        # what is left of the same wait: a decode lost with requests placed just before
        # its loss was seen moves those when it moves the streams it had started
        return out + self._lost(early, now, torn=torn, waited=True)

    def _on_deadline(self, event: DeadlinePassed, now: float) -> list[Command]:
        armed = self._armed.get(event.deadline)
        if armed is None or armed > now:
            return []  # disarmed, or re-armed later since: stale
        self._disarm(event.deadline)
        if event.deadline is Deadline.REQUEST:
            message = TIMEOUT_MESSAGE.format(self.limits.request_timeout_s)
            return self._interrupted(Failure(Reason.TIMEOUT, message), event.torn)
        if event.deadline is Deadline.PREFILL:
            return self._interrupted(Failure(Reason.TIMEOUT, PREFILL_TIMEOUT_MESSAGE), event.torn)
        if event.deadline is Deadline.KV_LEASE:
            return self._interrupted(Failure(Reason.SERVICE_UNAVAILABLE, NO_LEASE_ROOM), event.torn)
        early = self._early
        assert early is not None
        return self._on_reconnect_passed(early, now, torn=event.torn)

    def _on_client_gone(self, event: ClientGone, now: float) -> list[Command]:
        out: list[Command] = []
        self._cleanup(out)
        self._end(out, Ending.DISCONNECTED)
        return out

    def _on_client_stalled(self, event: ClientStalled, now: float) -> list[Command]:
        # the shell hung up on the client: no byte goes to it any more
        return self._interrupted(Failure(Reason.CLIENT_TOO_SLOW, STALLED_MESSAGE), torn=True)

    def _on_drain_cut(self, event: DrainCut, now: float) -> list[Command]:
        return self._interrupted(Failure(Reason.SHUTTING_DOWN, DRAIN_CUT), event.torn)

    def _on_failed(self, event: Failed, now: float) -> list[Command]:
        return self._interrupted(event.failure, event.torn)


QUEUE_FULL_MESSAGE: Final = "the server is at capacity and its queue is full; retry shortly"


def _no_prefill() -> Failure:
    return Failure(Reason.SERVICE_UNAVAILABLE, "", explain_no_prefill=True)


def _decode_failed(message: str) -> Failure:
    """A decode worker failed the request: 502 (what a non-streaming client sees)."""
    return Failure(Reason.DECODE_FAILED, f"decode failed: {message}")


_M = RequestMachine
_ENTRIES: dict[tuple[Phase, type], Callable[..., list[Command]]] = {
    (Phase.NEW, Arrived): _M._on_arrived,
    (Phase.PREFILLING, PrefillSent): _M._on_prefill_sent,
    (Phase.PREFILLING, PrefillUnavailable): _M._on_prefill_unavailable,
    (Phase.PREFILLING, PrefillNotSent): _M._on_prefill_not_sent,
    (Phase.PREFILLING, PrefillLost): _M._on_prefill_lost,
    (Phase.PREFILLING, PrefillFailed): _M._on_prefill_failed,
    (Phase.PREFILLING, Prefilled): _M._on_prefilled,
    (Phase.PLACING_DECODE, DecodeStartSent): _M._on_decode_start_sent,
    (Phase.PLACING_DECODE, DecodeUnavailable): _M._on_decode_unavailable,
    (Phase.DECODE_SENDING, DecodeStartQueued): _M._on_decode_start_queued,
    (Phase.DECODE_SENDING, DecodeNotSent): _M._on_decode_not_sent,
    (Phase.DECODE_STARTING, DecodeAccepted): _M._on_decode_accepted,
    (Phase.DECODE_STARTING, DecodeRejected): _M._on_decode_rejected,
    (Phase.DECODE_STARTING, DecodeFailed): _M._on_decode_failed_starting,
    (Phase.DECODING, DecodeTokens): _M._on_decode_tokens,
    (Phase.DECODING, DecodeFailed): _M._on_decode_failed,
    (Phase.AWAITING_DECODE, DecodeConnected): _M._on_decode_connected,
}
# a prefill running beside its decode (the bootstrap protocol) may fail while decode starts
for _phase in (Phase.DECODE_STARTING, Phase.DECODING):
    for _event in (PrefillNotSent, PrefillLost, PrefillFailed):
        _ENTRIES[(_phase, _event)] = _M._on_prefill_failed_beside_decode
# what may cut any request short, whatever it waits on
for _phase in Phase:
    if _phase in (Phase.NEW, Phase.DONE):
        continue
    _ENTRIES[(_phase, DeadlinePassed)] = _M._on_deadline
    _ENTRIES[(_phase, ClientGone)] = _M._on_client_gone
    _ENTRIES[(_phase, ClientStalled)] = _M._on_client_stalled
    _ENTRIES[(_phase, DrainCut)] = _M._on_drain_cut
    _ENTRIES[(_phase, Failed)] = _M._on_failed

_TABLE: Final[Mapping[tuple[Phase, type], Callable[..., list[Command]]]] = MappingProxyType(
    _ENTRIES
)
"""The request path: (phase, event type) -> handler."""
