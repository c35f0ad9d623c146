"""One request on the router as a sans-IO state machine: ``handle(event, now) -> commands``.

In the spirit of h11's ``_state.py``: the router's shell does the I/O (prefill calls,
decode starts, writes to the client, timers) and reports what happened as an event;
the machine answers with what to do next as commands.  The machine holds every
decision of the request path: admission, prefill attempts and retries, decode
placement and its retries before the first token, a failed handoff's new prefill
rounds, the bounded wait for a prefill when none is up, the migration of a request whose
decode was lost, which deadline applies, what cleanup owes
(:class:`~pdtrio.protocol.request.lifecycle.RequestLifecycle`, the KV-ownership table
underneath), and how the client's response ends.  The shell and the legs ask it
questions (``done``, ``decode_unconfirmed``, ...), never its phase or lifecycle.

The whole rule is a table: (phase, event) -> handler; every state the request can be in
is a phase of it (``events.Phase``), and every deadline passing is an event of it
(``DeadlinePassed`` of that deadline).  An event the table does not list for the current
phase is a bug in the shell (``events.MachineError``); once the request has ended, every
event is answered with no command (a late answer), and so is a deadline no longer armed
or re-armed later (a stale timer).

Commands are backend-neutral: they name instances, never links or sockets.  A backend's
rules are its own table (:data:`TABLES`), chosen when the machine is built: one whose
prefill samples the first token (pdtrio's workers: the client gets it as soon as the
decode start is out, and a decode that fails before its own first token is replaced
while prefill holds the KV), and one whose decode generates every token from the
request again (``first_token_from_prefill=False``: vLLM's KV connector, SGLang's
bootstrap protocol): the response starts with decode's first batch, and a decode that
fails before it sends the request again from a new prefill, prefill's KV freed (it is
not known to be pullable twice).  SGLang's prefill runs beside its decode: its failure
may be reported while decode starts.

Deadlines are explicit: ``WaitUntil`` arms one, ``DeadlinePassed`` reports it;
:meth:`RequestMachine.next_deadline` is the earliest armed, and
:attr:`RequestMachine.earliest_deadline_at` its time, all the shell's timer needs.
Tokens from decode do not pass through here one by one: the shell reports the first
batch (prefill may then free the KV) and the last.

Pure (sans-IO): no I/O, no clock read (``now`` comes with each event).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final, TypeAlias, final

import pdtrio.protocol.request.events as ev
from pdtrio.protocol.errors import Reason, is_clients_fault
from pdtrio.protocol.request.lifecycle import Event as Kv
from pdtrio.protocol.request.steps import MachineState

P = ev.Phase
Handler: TypeAlias = Callable[..., list[ev.Command]]
EventKey: TypeAlias = "type | ev.Deadline"  # an event's type, or the deadline that passed
Table: TypeAlias = Mapping[tuple[ev.Phase, EventKey], Handler]

# --- the machine -------------------------------------------------------------------


@final
class RequestMachine(MachineState):
    """Where one request stands, and what it does next."""

    def __init__(
        self,
        limits: ev.Limits,
        *,
        streaming: bool,
        keep_tokens: bool,
        first_token_from_prefill: bool = True,
    ) -> None:
        if keep_tokens and not first_token_from_prefill:
            # a continuation is prefill's to sample: a decode that regenerates from the
            # request cannot go on from the tokens delivered
            raise ValueError("a request whose decode regenerates every token cannot migrate")
        super().__init__(limits, streaming=streaming, keep_tokens=keep_tokens)
        self.first_token = (
            ev.FirstToken.FROM_PREFILL if first_token_from_prefill else ev.FirstToken.FROM_DECODE
        )
        self._table = _ENTRIES[self.first_token]  # the backend's rules (TABLES' dict)
        # a failed handoff goes again from a new prefill: where prefill samples the first
        # token, as a continuation of the tokens delivered (which must be kept for it)
        if keep_tokens or not first_token_from_prefill:
            self._handoff_limit = limits.handoff_attempts
        self._new_round_continues = first_token_from_prefill

    # --- the entry --------------------------------------------------------------

    def handle(self, event: ev.Event, now: float) -> list[ev.Command]:
        """Apply ``event`` (at ``now``); returns the commands to carry out, in order."""
        if self.phase is P.DONE:
            return []  # a late answer or a stale timer: nothing follows the end
        key: EventKey = type(event)
        if isinstance(event, ev.DeadlinePassed):
            key = deadline = event.deadline
            armed = self._armed.get(deadline)
            if armed is None or armed > now:
                return []  # disarmed, or re-armed later since: a stale timer
            self._disarm(deadline)
        handler = self._table.get((self.phase, key))
        if handler is None:
            raise ev.MachineError(f"{event_name(key)} cannot happen in phase {self.phase.name}")
        return handler(self, event, now)

    # --- what the shell and the legs may ask (never the phase or the lifecycle) -------

    @property
    def done(self) -> bool:
        """The request has ended: nothing follows."""
        return self.phase is P.DONE

    @property
    def phase_name(self) -> str:
        """Where the request is, for a log line."""
        return self.phase.name

    @property
    def decode_unconfirmed(self) -> bool:
        """Decode accepted and has sent no token yet: its first ones are to be reported
        (``DecodeTokens``), so that prefill may free the KV."""
        return self.phase is P.CONFIRMING_DECODE

    @property
    def decode_confirmed(self) -> bool:
        """Decode's tokens are flowing: each one it pushed goes out to the client."""
        return self.phase is P.STREAMING

    @property
    def decode_under_way(self) -> bool:
        """The decode start is out (answered or not): a prefill running beside it may
        still fail the request (``PrefillFailed`` and its kind)."""
        return self.phase in _DECODE_UNDER_WAY

    # --- handlers: the request's way, prefill first -------------------------------------

    def _on_arrived(self, event: ev.Arrived, now: float) -> list[ev.Command]:
        if event.draining:
            out: list[ev.Command] = []
            failure = ev.Failure(Reason.SHUTTING_DOWN, ev.DRAIN_REFUSAL)
            out.append(ev.RespondWithError(failure))
            self._end(out, ev.Ending.REJECTED, failure)
            return out
        if event.queue_full:
            return self._fail(ev.Failure(Reason.QUEUE_FULL, ev.QUEUE_FULL_MESSAGE))
        out = []
        self._arm(ev.Deadline.REQUEST, now + self.limits.request_timeout_s, out)
        return self._send_prefill(out)

    def _on_prefill_sent(self, event: ev.PrefillSent, now: float) -> list[ev.Command]:
        self.phase = P.PREFILLING
        self._prefill_tried.add(event.instance)
        self._prefill_sent += 1
        self.prefill_instance = event.instance
        self.lifecycle.handle(Kv.PREFILL_SENT)
        out: list[ev.Command] = []
        at = now + self.limits.prefill_timeout_s
        if at < self._armed[ev.Deadline.REQUEST]:
            self._arm(ev.Deadline.PREFILL, at, out)
        return out

    def _on_prefill_unavailable(self, event: ev.PrefillUnavailable, now: float) -> list[ev.Command]:
        """No prefill instance takes it: wait (what is left of one wait) for one to connect,
        unless the last one answered with an error of its own (that answer is passed on)."""
        failure = self._prefill_failure
        until = self._prefill_wait_until
        if until is None:
            until = self._prefill_wait_until = now + self.limits.prefill_wait_s
        until = min(until, self._armed[ev.Deadline.REQUEST])
        if until <= now or isinstance(failure, ev.WorkerFailure):
            return self._fail(failure or ev.no_prefill())
        self.phase = P.AWAITING_PREFILL
        out: list[ev.Command] = []
        self._arm(ev.Deadline.PREFILL_WAIT, until, out)
        out.append(ev.WaitForPrefill(frozenset(self._prefill_tried)))
        return out

    def _on_prefill_connected(self, event: ev.PrefillConnected, now: float) -> list[ev.Command]:
        self._disarm(ev.Deadline.PREFILL_WAIT)
        return self._send_prefill([])

    def _on_prefill_wait_passed(self, event: ev.DeadlinePassed, now: float) -> list[ev.Command]:
        return self._fail(self._prefill_failure or ev.no_prefill(), torn=event.torn)

    def _on_prefill_not_sent(self, event: ev.PrefillNotSent, now: float) -> list[ev.Command]:
        self._disarm(ev.Deadline.PREFILL)
        self.lifecycle.handle(Kv.PREFILL_NOT_SENT)
        return self._send_prefill([])

    def _on_prefill_lost(self, event: ev.PrefillLost, now: float) -> list[ev.Command]:
        self._disarm(ev.Deadline.PREFILL)
        self.lifecycle.handle(Kv.PREFILL_LOST)
        self._prefill_failure = _prefill_lost(event)
        self._lost_prefill_may_return()
        return self._send_prefill([])

    def _lost_prefill_may_return(self) -> None:
        """A prefill lost with its link (a partition, a restart) is out of rotation until
        its link is back; then it may take the request again, within the attempts."""
        if self.prefill_instance is not None:
            self._prefill_tried.discard(self.prefill_instance)

    def _on_prefill_failed(self, event: ev.PrefillFailed, now: float) -> list[ev.Command]:
        self._disarm(ev.Deadline.PREFILL)
        if not is_clients_fault(event.failure.status):
            # the instance's fault, not the request's: another may try
            self.lifecycle.handle(Kv.PREFILL_LOST)
            self._prefill_failure = event.failure
            return self._send_prefill([])
        self.lifecycle.handle(Kv.PREFILL_FAILED)  # the request's own (a 4xx): not retried
        return self._fail(event.failure)

    def _on_prefilled(self, event: ev.Prefilled, now: float) -> list[ev.Command]:
        """Prefill sampled a token of its own (a new leg's: a migration's may be the last)."""
        self._disarm(ev.Deadline.PREFILL)
        out: list[ev.Command] = []
        if event.lease_ends_at is None:
            self.lifecycle.handle(Kv.FINISHED_AT_PREFILL)
            self._first_token(out, final=True)
            out.append(ev.Finish())
            self._end(out, ev.Ending.OK)
            return out
        self.lifecycle.handle(Kv.PREFILLED)
        self._prefilled()
        self._lease_ends_at = event.lease_ends_at
        self._tried = dict(self._lost_on)
        self._last_reason = "no decode instance is connected"
        self._decode_attempts = 0
        return self._place_decode(P.PLACING_DECODE, out)

    def _on_prefilled_for_decode(self, event: ev.Prefilled, now: float) -> list[ev.Command]:
        """Decode generates every token; prefill's KV, if it kept any, waits for it (None:
        no lease known, or none kept: decode gets the plain request)."""
        self._disarm(ev.Deadline.PREFILL)
        self.lifecycle.handle(Kv.PREFILLED)
        self._prefilled()
        self._lease_ends_at = event.lease_ends_at
        return self._place_decode(P.PLACING_DECODE, [])

    def _prefilled(self) -> None:
        """A prefill answered: a later outage waits afresh; a new round's avoidance and
        blame were this one's."""
        self._prefill_wait_until = None
        self._prefill_avoid = frozenset()
        self._kv_blamed = False

    # --- handlers: decode's placement and start -----------------------------------------

    def _decode_start_sent(self, event: ev.DecodeStartSent, phase: ev.Phase) -> list[ev.Command]:
        self._disarm(ev.Deadline.KV_LEASE)  # placed: the lease bounds the wait only
        self.phase = phase
        self.decode_instance = event.instance
        self._decode_connection = event.connection
        self.lifecycle.handle(Kv.DECODE_START_SENT)
        return []

    def _on_decode_start_sent(self, event: ev.DecodeStartSent, now: float) -> list[ev.Command]:
        return self._decode_start_sent(event, P.DECODE_SENDING)

    def _on_decode_start_resent(self, event: ev.DecodeStartSent, now: float) -> list[ev.Command]:
        return self._decode_start_sent(event, P.DECODE_RESENDING)

    def _on_decode_start_queued(self, event: ev.DecodeStartQueued, now: float) -> list[ev.Command]:
        self.phase = P.DECODE_STARTING
        return []

    def _on_decode_start_queued_first(
        self, event: ev.DecodeStartQueued, now: float
    ) -> list[ev.Command]:
        # the leg's first token goes out once decode room is claimed and the start is sent
        self.phase = P.DECODE_STARTING
        return self._first_token([], final=False)

    def _decode_not_sent(self, event: ev.DecodeNotSent, phase: ev.Phase) -> list[ev.Command]:
        self.lifecycle.handle(Kv.DECODE_NOT_STARTED)
        assert self.decode_instance is not None
        self._tried[self.decode_instance] = self._decode_connection
        self._last_reason = event.message
        return self._place_decode(phase, [])

    def _on_decode_not_sent(self, event: ev.DecodeNotSent, now: float) -> list[ev.Command]:
        return self._decode_not_sent(event, P.PLACING_DECODE)

    def _on_decode_not_resent(self, event: ev.DecodeNotSent, now: float) -> list[ev.Command]:
        return self._decode_not_sent(event, P.REPLACING_DECODE)

    def _on_decode_unavailable(self, event: ev.DecodeUnavailable, now: float) -> list[ev.Command]:
        return self._fail(event.failure)

    def _on_no_decode_left(self, event: ev.DecodeUnavailable, now: float) -> list[ev.Command]:
        """Every decode that could take prefill's KV failed it: a new prefill, if one of
        them blamed prefill's KV (it may take a new prefill's) and the handoff has rounds
        left; decodes that failed themselves would not take a new one either."""
        if event.failure.reason is not Reason.SERVICE_UNAVAILABLE or not self._kv_blamed:
            return self._fail(event.failure)
        return self._handoff_again(event.failure)

    def _on_decode_accepted(self, event: ev.DecodeAccepted, now: float) -> list[ev.Command]:
        self.lifecycle.handle(Kv.DECODE_ACCEPTED)
        self.phase = P.CONFIRMING_DECODE
        return []

    def _on_decode_rejected(self, event: ev.DecodeRejected, now: float) -> list[ev.Command]:
        out: list[ev.Command] = []
        self.lifecycle.handle(Kv.DECODE_NOT_STARTED)
        self._last_reason = event.message
        if event.failure is not None:
            return self._fail(event.failure)  # the client's own error: passed on
        if event.retryable:
            self._kv_blamed = self._kv_blamed or event.kv_source_failed
            if event.exclude:
                assert self.decode_instance is not None
                self._tried[self.decode_instance] = self._decode_connection
            return self._place_decode(P.REPLACING_DECODE, out)
        if event.layout_mismatch:
            message = f"prefill and decode cannot be paired: {event.message}"
        else:
            message = f"decode rejected the request: {event.message}"
        return out + self._fail(ev.Failure(Reason.INTERNAL, message))

    def _on_start_failed(self, event: ev.DecodeFailed, now: float) -> list[ev.Command]:
        # it had not answered: prefill still holds the KV, another may take it
        return self._await_retry(_failed_to_start(event), now)

    def _on_start_failed_for_decode(self, event: ev.DecodeFailed, now: float) -> list[ev.Command]:
        return self._again_from_prefill(_failed_to_start(event))

    # --- handlers: decode's tokens ------------------------------------------------------

    def _on_first_decode_tokens(self, event: ev.DecodeTokens, now: float) -> list[ev.Command]:
        """Decode is alive: prefill may free the KV it kept until now."""
        self.phase = P.STREAMING
        self._response_started = True  # (an engine's: the response starts with them)
        self.lifecycle.handle(Kv.FIRST_DECODE_TOKEN)
        assert self.prefill_instance is not None
        return self._finish_if_final(event, [ev.ReleasePrefill(self.prefill_instance)])

    def _on_decode_tokens(self, event: ev.DecodeTokens, now: float) -> list[ev.Command]:
        return self._finish_if_final(event, [])

    def _finish_if_final(self, event: ev.DecodeTokens, out: list[ev.Command]) -> list[ev.Command]:
        if event.final:
            self.lifecycle.handle(Kv.DECODE_ENDED)
            out.append(ev.Finish())
            self._end(out, ev.Ending.OK)
        return out

    def _cut_off(self, event: ev.DecodeFailed) -> list[ev.Command]:
        self.lifecycle.handle(Kv.DECODE_ENDED)
        return self._fail(ev.Failure(Reason.CLIENT_TOO_SLOW, event.message))

    def _on_decode_failed_confirming(self, event: ev.DecodeFailed, now: float) -> list[ev.Command]:
        if event.cut_off:
            return self._cut_off(event)
        return self._await_retry(event, now)

    def _on_decode_failed_confirming_for_decode(
        self, event: ev.DecodeFailed, now: float
    ) -> list[ev.Command]:
        if event.cut_off:
            return self._cut_off(event)
        return self._again_from_prefill(event)

    def _on_decode_failed_streaming(self, event: ev.DecodeFailed, now: float) -> list[ev.Command]:
        if event.cut_off:
            return self._cut_off(event)
        if event.migratable:
            self.lifecycle.handle(Kv.DECODE_LOST)
            return self._lost(event, now)
        self.lifecycle.handle(Kv.DECODE_ENDED)
        return self._fail(ev.decode_failed(event.message))

    def _on_prefill_failed_beside_decode(
        self, event: ev.PrefillNotSent | ev.PrefillLost | ev.PrefillFailed, now: float
    ) -> list[ev.Command]:
        """A prefill running beside its decode (SGLang's) failed before decode's first
        token: decode waits for KV that will not come (it is aborted) and another prefill
        takes the request, as after a prefill's own failure."""
        out: list[ev.Command] = []
        assert self.decode_instance is not None
        out.append(ev.AbortDecode(self.decode_instance))
        self.lifecycle.handle(Kv.DECODE_ENDED)
        if isinstance(event, ev.PrefillFailed) and is_clients_fault(event.failure.status):
            self.lifecycle.handle(Kv.PREFILL_FAILED)  # the request's own: not retried
            return out + self._fail(event.failure)
        self.lifecycle.handle(Kv.PREFILL_LOST)
        if isinstance(event, ev.PrefillFailed):
            self._prefill_failure = event.failure
        elif isinstance(event, ev.PrefillLost):
            self._prefill_failure = _prefill_lost(event)
            self._lost_prefill_may_return()
        return self._send_prefill(out)

    def _on_prefill_failed_after_decode_pulled(
        self, event: ev.PrefillNotSent | ev.PrefillLost | ev.PrefillFailed, now: float
    ) -> list[ev.Command]:
        return []  # decode had the KV: prefill's late word changes nothing

    # --- handlers: waiting for a decode ---------------------------------------------------

    def _on_decode_connected_to_retry(
        self, event: ev.DecodeConnected, now: float
    ) -> list[ev.Command]:
        self._disarm(ev.Deadline.RECONNECT)
        return self._place_decode(P.REPLACING_DECODE, [])

    def _on_decode_connected_to_migrate(
        self, event: ev.DecodeConnected, now: float
    ) -> list[ev.Command]:
        self._disarm(ev.Deadline.RECONNECT)
        early = self._early
        assert early is not None and self.decode_instance is not None
        self.migrations.append(early.reason)
        out: list[ev.Command] = [ev.Migrate(early.reason, self.decode_instance)]
        self._prefill_tried = set()
        self._prefill_sent = 0
        self._prefill_failure = None
        self._prefill_avoid = frozenset()
        return self._send_prefill(out)

    # --- handlers: deadlines (each one's, in the phases it may be armed in) ----------------

    def _on_request_deadline(self, event: ev.DeadlinePassed, now: float) -> list[ev.Command]:
        message = ev.TIMEOUT_MESSAGE.format(self.limits.request_timeout_s)
        return self._fail(ev.Failure(Reason.TIMEOUT, message), torn=event.torn)

    def _on_prefill_deadline(self, event: ev.DeadlinePassed, now: float) -> list[ev.Command]:
        return self._fail(ev.Failure(Reason.TIMEOUT, ev.PREFILL_TIMEOUT_MESSAGE), torn=event.torn)

    def _on_lease_deadline(self, event: ev.DeadlinePassed, now: float) -> list[ev.Command]:
        """No decode took prefill's KV within its lease: a new prefill, within the rounds."""
        failure = ev.Failure(Reason.SERVICE_UNAVAILABLE, ev.NO_LEASE_ROOM)
        return self._handoff_again(failure, torn=event.torn)

    def _on_retry_wait_passed(self, event: ev.DeadlinePassed, now: float) -> list[ev.Command]:
        """No decode can pull prefill's KV before its lease ends: it is freed, and the
        request goes on from a new prefill: a new round of its handoff where a decode
        blamed prefill's KV (it may take a new prefill's), as one lost mid-stream does
        otherwise (or fails, as one that may not migrate)."""
        early = self._early
        assert early is not None and self.prefill_instance is not None
        if self._kv_blamed and self._handoff_rounds_left and not event.torn:
            return self._handoff_again(ev.decode_failed(early.message))
        out: list[ev.Command] = [ev.ReleasePrefill(self.prefill_instance)]
        self.lifecycle.handle(Kv.KV_GIVEN_UP)
        # what is left of the same wait: a decode lost with requests placed just before
        # its loss was seen moves those when it moves the streams it had started
        return out + self._lost(early, now, torn=event.torn, waited=True)

    def _on_migration_wait_passed(self, event: ev.DeadlinePassed, now: float) -> list[ev.Command]:
        early = self._early
        assert early is not None
        return self._fail(ev.decode_failed(early.message), torn=event.torn)

    # --- handlers: what may cut any request short -----------------------------------------

    def _on_client_gone(self, event: ev.ClientGone, now: float) -> list[ev.Command]:
        out: list[ev.Command] = []
        self._cleanup(out)
        self._end(out, ev.Ending.DISCONNECTED)
        return out

    def _on_client_stalled(self, event: ev.ClientStalled, now: float) -> list[ev.Command]:
        # the shell hung up on the client: no byte goes to it any more
        return self._fail(ev.Failure(Reason.CLIENT_TOO_SLOW, ev.STALLED_MESSAGE), torn=True)

    def _on_drain_cut(self, event: ev.DrainCut, now: float) -> list[ev.Command]:
        return self._fail(ev.Failure(Reason.SHUTTING_DOWN, ev.DRAIN_CUT), torn=event.torn)

    def _on_failed(self, event: ev.Failed, now: float) -> list[ev.Command]:
        return self._fail(event.failure, torn=event.torn)


def _prefill_lost(event: ev.PrefillLost) -> ev.Failure:
    return ev.Failure(Reason.SERVICE_UNAVAILABLE, f"prefill instance failed: {event.message}")


def _failed_to_start(event: ev.DecodeFailed) -> ev.DecodeFailed:
    return ev.DecodeFailed(f"decode failed to start: {event.message}", event.reason)


def event_name(key: EventKey) -> str:
    """How the table names an event: its type's name, a deadline's with the deadline."""
    if isinstance(key, ev.Deadline):
        return f"DeadlinePassed({key.name})"
    return key.__name__


# --- the tables: one per backend's rules --------------------------------------------------

_DECODE_UNDER_WAY = frozenset({P.DECODE_STARTING, P.CONFIRMING_DECODE, P.STREAMING})
_M = RequestMachine
_D = ev.Deadline
_PREFILL_FAILURES = (ev.PrefillNotSent, ev.PrefillLost, ev.PrefillFailed)

# what both backends do alike
_SHARED: dict[tuple[ev.Phase, EventKey], Handler] = {
    (P.NEW, ev.Arrived): _M._on_arrived,
    (P.PLACING_PREFILL, ev.PrefillSent): _M._on_prefill_sent,
    (P.PLACING_PREFILL, ev.PrefillUnavailable): _M._on_prefill_unavailable,
    (P.AWAITING_PREFILL, ev.PrefillConnected): _M._on_prefill_connected,
    (P.AWAITING_PREFILL, _D.PREFILL_WAIT): _M._on_prefill_wait_passed,
    (P.PREFILLING, ev.PrefillNotSent): _M._on_prefill_not_sent,
    (P.PREFILLING, ev.PrefillLost): _M._on_prefill_lost,
    (P.PREFILLING, ev.PrefillFailed): _M._on_prefill_failed,
    (P.PREFILLING, _D.PREFILL): _M._on_prefill_deadline,
    (P.PLACING_DECODE, ev.DecodeStartSent): _M._on_decode_start_sent,
    (P.PLACING_DECODE, ev.DecodeUnavailable): _M._on_decode_unavailable,
    (P.PLACING_DECODE, _D.KV_LEASE): _M._on_lease_deadline,
    (P.DECODE_SENDING, ev.DecodeNotSent): _M._on_decode_not_sent,
    (P.REPLACING_DECODE, ev.DecodeStartSent): _M._on_decode_start_resent,
    (P.REPLACING_DECODE, ev.DecodeUnavailable): _M._on_no_decode_left,
    (P.REPLACING_DECODE, _D.KV_LEASE): _M._on_lease_deadline,
    (P.DECODE_RESENDING, ev.DecodeStartQueued): _M._on_decode_start_queued,
    (P.DECODE_RESENDING, ev.DecodeNotSent): _M._on_decode_not_resent,
    (P.DECODE_STARTING, ev.DecodeAccepted): _M._on_decode_accepted,
    (P.DECODE_STARTING, ev.DecodeRejected): _M._on_decode_rejected,
    (P.CONFIRMING_DECODE, ev.DecodeTokens): _M._on_first_decode_tokens,
    (P.STREAMING, ev.DecodeTokens): _M._on_decode_tokens,
    (P.STREAMING, ev.DecodeFailed): _M._on_decode_failed_streaming,
}

_FROM_PREFILL: dict[tuple[ev.Phase, EventKey], Handler] = {
    **_SHARED,
    (P.PREFILLING, ev.Prefilled): _M._on_prefilled,
    (P.DECODE_SENDING, ev.DecodeStartQueued): _M._on_decode_start_queued_first,
    (P.DECODE_STARTING, ev.DecodeFailed): _M._on_start_failed,
    (P.CONFIRMING_DECODE, ev.DecodeFailed): _M._on_decode_failed_confirming,
    (P.AWAITING_RETRY, ev.DecodeConnected): _M._on_decode_connected_to_retry,
    (P.AWAITING_RETRY, _D.RECONNECT): _M._on_retry_wait_passed,
    (P.AWAITING_MIGRATION, ev.DecodeConnected): _M._on_decode_connected_to_migrate,
    (P.AWAITING_MIGRATION, _D.RECONNECT): _M._on_migration_wait_passed,
}

_FROM_DECODE: dict[tuple[ev.Phase, EventKey], Handler] = {
    **_SHARED,
    (P.PREFILLING, ev.Prefilled): _M._on_prefilled_for_decode,
    (P.DECODE_SENDING, ev.DecodeStartQueued): _M._on_decode_start_queued,
    (P.DECODE_STARTING, ev.DecodeFailed): _M._on_start_failed_for_decode,
    (P.CONFIRMING_DECODE, ev.DecodeFailed): _M._on_decode_failed_confirming_for_decode,
}
# a prefill running beside its decode (the bootstrap protocol) may fail while decode starts
for _failure in _PREFILL_FAILURES:
    _FROM_DECODE[(P.DECODE_STARTING, _failure)] = _M._on_prefill_failed_beside_decode
    _FROM_DECODE[(P.CONFIRMING_DECODE, _failure)] = _M._on_prefill_failed_beside_decode
    _FROM_DECODE[(P.STREAMING, _failure)] = _M._on_prefill_failed_after_decode_pulled

# what may cut any request short, whatever it waits on
for _entries in (_FROM_PREFILL, _FROM_DECODE):
    _running = {phase for phase, _ in _entries} - {P.NEW}
    for _phase in [phase for phase in P if phase in _running]:
        _entries[(_phase, _D.REQUEST)] = _M._on_request_deadline
        _entries[(_phase, ev.ClientGone)] = _M._on_client_gone
        _entries[(_phase, ev.ClientStalled)] = _M._on_client_stalled
        _entries[(_phase, ev.DrainCut)] = _M._on_drain_cut
        _entries[(_phase, ev.Failed)] = _M._on_failed

# (the machine looks a handler up in the dict itself: one indirection less per event)
_ENTRIES: Final = {
    ev.FirstToken.FROM_PREFILL: _FROM_PREFILL,
    ev.FirstToken.FROM_DECODE: _FROM_DECODE,
}
TABLES: Final[Mapping[ev.FirstToken, Table]] = MappingProxyType(
    {first_token: MappingProxyType(entries) for first_token, entries in _ENTRIES.items()}
)
"""Each backend's rules: (phase, event type or deadline passed) -> handler."""
