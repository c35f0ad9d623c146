"""One request on the router as a sans-IO state machine: ``handle(event, now) -> commands``.

In the spirit of h11's ``_state.py``: the router's shell does the I/O (prefill calls,
decode starts, writes to the client, timers) and reports what happened as an event;
the machine answers with what to do next as commands.  The machine holds every
decision of the request path: admission, prefill attempts and retries, decode
placement and its retries before the first token, the migration of a request whose
decode was lost, which deadline applies, what cleanup owes
(:class:`~pdtrio.protocol.request.lifecycle.RequestLifecycle`, the KV-ownership table
underneath), and how the client's response ends.  The shell and the legs ask it
questions (``done``, ``decode_unconfirmed``, ...), never its phase or lifecycle.

The whole rule is :data:`_TABLE`: (phase, event type) -> handler; every state the
request can be in is a phase of it (``events.Phase``).  An event the table does not
list for the current phase is a bug in the shell (``events.MachineError``); once the
request has ended, every event is answered with no command (a stale timer, a late
answer), so nothing follows the end.

Commands are backend-neutral: they name instances, never links or sockets. Two kinds of
backend: one whose prefill samples the first token (pdtrio's workers: the client gets it
as soon as the decode start is out, and a decode that fails before its own first token
is replaced while prefill holds the KV), and one whose decode generates every token from
the request again (``first_token_from_prefill=False``: vLLM's KV connector, SGLang's
bootstrap protocol): the response starts with decode's first batch, and a decode that
fails before it sends the request again from a new prefill, prefill's KV freed (it is
not known to be pullable twice). SGLang's prefill runs beside its decode: its failure
may be reported while decode starts.

Deadlines are explicit: ``WaitUntil`` arms one, ``DeadlinePassed`` reports it;
:meth:`RequestMachine.next_deadline` is the earliest armed, and
:attr:`RequestMachine.earliest_deadline_at` its time, all the shell's timer needs.
Tokens from decode do not pass through here one by one: the shell reports the first
batch (prefill may then free the KV) and the last.

Pure (sans-IO): no I/O, no clock read (``now`` comes with each event).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from types import MappingProxyType
from typing import Final, final

import pdtrio.protocol.request.events as ev
from pdtrio.protocol.errors import Reason, is_clients_fault
from pdtrio.protocol.request.lifecycle import Cleanup, RequestLifecycle, State
from pdtrio.protocol.request.lifecycle import Event as Kv

# --- the machine -------------------------------------------------------------------


@final
class RequestMachine:
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
        self.limits = limits
        self.first_token_from_prefill = first_token_from_prefill
        self.streaming = streaming
        self.keep_tokens = keep_tokens  # token ids are kept: a lost decode may migrate
        self.phase = ev.Phase.NEW
        self.lifecycle = RequestLifecycle()  # what cleanup owes (KV on prefill, decode's run)
        self._armed: dict[ev.Deadline, float] = {}
        # the earliest of them (None: none armed), kept as they change
        self._earliest: tuple[float, ev.Deadline] | None = None
        self.prefill_instance: str | None = None
        self.decode_instance: str | None = None
        self._decode_connection: Hashable = None
        self._prefill_tried: set[str] = set()
        self._prefill_failure: ev.AnyFailure | None = None
        self._continuation = False
        self._lease_ends_at: float | None = None
        self._tried: dict[str, Hashable] = {}  # this leg's decode failures, by connection
        self._lost_on: dict[str, Hashable] = {}  # decodes lost mid-stream, every leg
        self._last_reason = "no decode instance is connected"
        self._decode_attempts = 0
        self._first_token_emitted = False  # this leg's prefill token, once whatever decode runs it
        self._any_token_emitted = False  # (streaming: the headers went out with it)
        self._early: ev.DecodeFailed | None = None  # the failure an AWAITING_* phase retries
        # when the wait for a decode that followed the last loss ends: one wait per loss,
        # whether the KV prefill holds or a new prefill goes to the decode that connects
        self._reconnect_until = math.inf
        self.migrations: list[str] = []
        self.ended: ev.End | None = None

    # --- the entry --------------------------------------------------------------

    def handle(self, event: ev.Event, now: float) -> list[ev.Command]:
        """Apply ``event`` (at ``now``); returns the commands to carry out, in order."""
        if self.phase is ev.Phase.DONE:
            return []  # a late answer or a stale timer: nothing follows the end
        handler = _ENTRIES.get((self.phase, type(event)))
        if handler is None:
            raise ev.MachineError(
                f"{type(event).__name__} cannot happen in phase {self.phase.name}"
            )
        return handler(self, event, now)

    def next_deadline(self) -> tuple[float, ev.Deadline] | None:
        """The earliest armed deadline: the shell's timer for whatever it awaits."""
        return self._earliest

    @property
    def earliest_deadline_at(self) -> float:
        """When the earliest armed deadline passes (inf: none is armed)."""
        earliest = self._earliest
        return math.inf if earliest is None else earliest[0]

    @property
    def headers_sent(self) -> bool:
        return self.streaming and self._any_token_emitted

    # --- what the shell and the legs may ask (never the phase or the lifecycle) -------

    @property
    def done(self) -> bool:
        """The request has ended: nothing follows."""
        return self.phase is ev.Phase.DONE

    @property
    def phase_name(self) -> str:
        """Where the request is, for a log line."""
        return self.phase.name

    @property
    def decode_unconfirmed(self) -> bool:
        """Decode accepted and has sent no token yet: its first ones are to be reported
        (``DecodeTokens``), so that prefill may free the KV."""
        return self.lifecycle.state is State.DECODE_CONFIRMING

    @property
    def decode_confirmed(self) -> bool:
        """Decode's tokens are flowing: each one it pushed goes out to the client."""
        return self.lifecycle.state is State.DECODING

    @property
    def decode_under_way(self) -> bool:
        """The decode start is out (answered or not): a prefill running beside it may
        still fail the request (``PrefillFailed`` and its kind)."""
        return self.phase in _DECODE_UNDER_WAY

    # --- helpers ----------------------------------------------------------------

    def _arm(self, deadline: ev.Deadline, at: float, out: list[ev.Command]) -> None:
        self._armed[deadline] = at
        self._armed_changed()
        out.append(ev.WaitUntil(deadline, at))

    def _disarm(self, deadline: ev.Deadline) -> None:
        if self._armed.pop(deadline, None) is not None:
            self._armed_changed()

    def _armed_changed(self) -> None:
        armed = self._armed
        if armed:
            deadline = min(armed, key=armed.__getitem__)
            self._earliest = armed[deadline], deadline
        else:
            self._earliest = None

    def _cleanup(self, out: list[ev.Command]) -> None:
        owed = self.lifecycle.owed()
        if owed & Cleanup.ABORT_ON_DECODE and self.decode_instance is not None:
            out.append(ev.AbortDecode(self.decode_instance))
        if owed & Cleanup.RELEASE_ON_PREFILL and self.prefill_instance is not None:
            out.append(ev.ReleasePrefill(self.prefill_instance))
        self.lifecycle.handle(Kv.CLEANED)

    def _end(
        self, out: list[ev.Command], ending: ev.Ending, failure: ev.AnyFailure | None = None
    ) -> None:
        self._armed.clear()
        self._earliest = None
        self.phase = ev.Phase.DONE
        end = self.ended = ev.End(ending, failure)
        out.append(end)

    def _fail(self, failure: ev.AnyFailure, *, torn: bool = False) -> list[ev.Command]:
        """Clean up, then end the client's response with ``failure`` as it can be."""
        out: list[ev.Command] = []
        self._cleanup(out)
        if not self.headers_sent:
            out.append(ev.RespondWithError(failure))
            self._end(out, ev.Ending.REJECTED, failure)
        else:
            if not torn:  # a write cut mid-way: more bytes would corrupt the stream
                out.append(ev.StreamError(failure))
            self._end(out, ev.Ending.FAILED, failure)
        return out

    def _send_prefill(self, out: list[ev.Command]) -> list[ev.Command]:
        if len(self._prefill_tried) >= self.limits.prefill_attempts:
            failure = self._prefill_failure or ev.no_prefill()
            return [*out, *self._fail(failure)]
        self.phase = ev.Phase.PREFILLING
        out.append(
            ev.SendPrefill(
                frozenset(self._prefill_tried),
                continuation=self._continuation,
                retry=bool(self._prefill_tried),
            )
        )
        return out

    def _place_decode(self, now: float, out: list[ev.Command]) -> list[ev.Command]:
        self.phase = ev.Phase.PLACING_DECODE
        if self._lease_ends_at is not None:  # (None: an engine's, no lease known)
            self._arm(ev.Deadline.KV_LEASE, self._lease_ends_at - self.limits.lease_margin_s, out)
        out.append(
            ev.PlaceDecode(
                MappingProxyType(dict(self._tried)),
                self._last_reason,
                retry=self._decode_attempts > 0,
            )
        )
        self._decode_attempts += 1
        return out

    def _await_decode(
        self, phase: ev.Phase, until: float, exclude: dict[str, Hashable], *, any_layout: bool
    ) -> list[ev.Command]:
        self.phase = phase
        out: list[ev.Command] = []
        self._arm(ev.Deadline.RECONNECT, until, out)
        out.append(ev.WaitForDecode(MappingProxyType(dict(exclude)), any_layout=any_layout))
        return out

    def _lost(
        self, failure: ev.DecodeFailed, now: float, *, torn: bool = False, waited: bool = False
    ) -> list[ev.Command]:
        """Decode was lost after the first token went out: migrate, or fail as before.

        ``waited``: the request has waited for a decode since the loss was seen (to
        retry on prefill's KV): it waits for what is left of that wait, not a new one.
        """
        assert self.decode_instance is not None
        self._lost_on[self.decode_instance] = self._decode_connection
        if not self.keep_tokens or len(self.migrations) >= self.limits.migration_limit:
            return self._fail(ev.decode_failed(failure.message), torn=torn)
        self._early = failure
        if not waited:
            self._reconnect_until = now + self.limits.decode_reconnect_wait_s
        request_deadline = self._armed[ev.Deadline.REQUEST]
        # (a wait already spent: a decode connected now is still taken, none is waited for)
        until = max(now, min(self._reconnect_until, request_deadline))
        return self._await_decode(
            ev.Phase.AWAITING_MIGRATION, until, self._lost_on, any_layout=True
        )

    def _interrupted(self, failure: ev.AnyFailure, torn: bool) -> list[ev.Command]:
        return self._fail(failure, torn=torn)

    # --- handlers: (phase, event) -> commands --------------------------------------

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
        self._prefill_tried.add(event.instance)
        self.prefill_instance = event.instance
        self.lifecycle.handle(Kv.PREFILL_SENT)
        out: list[ev.Command] = []
        at = now + self.limits.prefill_timeout_s
        if at < self._armed[ev.Deadline.REQUEST]:
            self._arm(ev.Deadline.PREFILL, at, out)
        return out

    def _on_prefill_unavailable(self, event: ev.PrefillUnavailable, now: float) -> list[ev.Command]:
        return self._fail(self._prefill_failure or ev.no_prefill())

    def _prefill_answered(self) -> None:
        self._disarm(ev.Deadline.PREFILL)

    def _on_prefill_not_sent(self, event: ev.PrefillNotSent, now: float) -> list[ev.Command]:
        self._prefill_answered()
        self.lifecycle.handle(Kv.PREFILL_NOT_SENT)
        return self._send_prefill([])

    def _on_prefill_lost(self, event: ev.PrefillLost, now: float) -> list[ev.Command]:
        self._prefill_answered()
        self.lifecycle.handle(Kv.PREFILL_LOST)
        self._prefill_failure = ev.Failure(
            Reason.SERVICE_UNAVAILABLE, f"prefill instance failed: {event.message}"
        )
        return self._send_prefill([])

    def _on_prefill_failed(self, event: ev.PrefillFailed, now: float) -> list[ev.Command]:
        self._prefill_answered()
        if not is_clients_fault(event.failure.status):
            # the instance's fault, not the request's: another may try
            self.lifecycle.handle(Kv.PREFILL_LOST)
            self._prefill_failure = event.failure
            return self._send_prefill([])
        self.lifecycle.handle(Kv.PREFILL_FAILED)  # the request's own (a 4xx): not retried
        return self._fail(event.failure)

    def _on_prefilled(self, event: ev.Prefilled, now: float) -> list[ev.Command]:
        self._prefill_answered()
        out: list[ev.Command] = []
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
            out.append(ev.Finish())
            self._end(out, ev.Ending.OK)
            return out
        self.lifecycle.handle(Kv.PREFILLED)
        self._lease_ends_at = event.lease_ends_at
        self._tried = dict(self._lost_on)
        self._last_reason = "no decode instance is connected"
        self._decode_attempts = 0
        return self._place_decode(now, out)

    def _on_decode_start_sent(self, event: ev.DecodeStartSent, now: float) -> list[ev.Command]:
        self._disarm(ev.Deadline.KV_LEASE)  # placed: the lease bounds the wait only
        self.phase = ev.Phase.DECODE_SENDING
        self.decode_instance = event.instance
        self._decode_connection = event.connection
        self.lifecycle.handle(Kv.DECODE_START_SENT)
        return []

    def _on_decode_start_queued(self, event: ev.DecodeStartQueued, now: float) -> list[ev.Command]:
        self.phase = ev.Phase.DECODE_STARTING
        if not self.first_token_from_prefill:
            return []  # the response starts with decode's first batch
        # the first token goes out once decode room is claimed and the start is sent
        return self._first_token([], final=False)

    def _on_decode_not_sent(self, event: ev.DecodeNotSent, now: float) -> list[ev.Command]:
        self.lifecycle.handle(Kv.DECODE_NOT_STARTED)
        assert self.decode_instance is not None
        self._tried[self.decode_instance] = self._decode_connection
        self._last_reason = event.message
        return self._place_decode(now, [])

    def _first_token(self, out: list[ev.Command], *, final: bool) -> list[ev.Command]:
        if not self._first_token_emitted:
            self._first_token_emitted = self._any_token_emitted = True
            out.append(ev.EmitFirstToken(final=final))
        return out

    def _on_decode_unavailable(self, event: ev.DecodeUnavailable, now: float) -> list[ev.Command]:
        return self._fail(event.failure)

    def _on_decode_accepted(self, event: ev.DecodeAccepted, now: float) -> list[ev.Command]:
        self.lifecycle.handle(Kv.DECODE_ACCEPTED)
        self.phase = ev.Phase.DECODING
        return []

    def _on_decode_rejected(self, event: ev.DecodeRejected, now: float) -> list[ev.Command]:
        out: list[ev.Command] = []
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
        return out + self._fail(ev.Failure(Reason.INTERNAL, message))

    def _on_decode_failed_starting(self, event: ev.DecodeFailed, now: float) -> list[ev.Command]:
        # it had not answered: prefill still holds the KV, another may take it
        failure = ev.DecodeFailed(f"decode failed to start: {event.message}", event.reason)
        return self._failed_early(failure, now)

    def _failed_early(self, event: ev.DecodeFailed, now: float) -> list[ev.Command]:
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
        assert self._lease_ends_at is not None
        lease_left = self._lease_ends_at - self.limits.lease_margin_s
        self._reconnect_until = now + self.limits.decode_reconnect_wait_s
        until = min(self._reconnect_until, lease_left)
        return self._await_decode(ev.Phase.AWAITING_RETRY, until, self._tried, any_layout=False)

    def _again_from_prefill(self) -> list[ev.Command]:
        """Decode failed before its first token, and it regenerates every token: prefill's
        KV is freed and the request sent again from a new prefill (to another decode: the
        ones it failed on stay excluded)."""
        out: list[ev.Command] = []
        assert self.prefill_instance is not None
        out.append(ev.ReleasePrefill(self.prefill_instance))
        self.lifecycle.handle(Kv.KV_GIVEN_UP)
        self._prefill_tried = set()
        self._prefill_failure = None
        return self._send_prefill(out)

    def _on_prefill_failed_beside_decode(
        self, event: ev.PrefillNotSent | ev.PrefillLost | ev.PrefillFailed, now: float
    ) -> list[ev.Command]:
        """A prefill running beside its decode (SGLang's) failed: before decode's first
        token, decode waits for KV that will not come (it is aborted) and another prefill
        takes the request, as after a prefill's own failure; after it, decode had the KV."""
        if self.first_token_from_prefill:
            raise ev.MachineError(f"{type(event).__name__} cannot happen while decode runs")
        if self.lifecycle.state is State.DECODING:
            return []  # decode pulled the KV: prefill's late word changes nothing
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
            self._prefill_failure = ev.Failure(
                Reason.SERVICE_UNAVAILABLE, f"prefill instance failed: {event.message}"
            )
        return self._send_prefill(out)

    def _on_decode_tokens(self, event: ev.DecodeTokens, now: float) -> list[ev.Command]:
        out: list[ev.Command] = []
        self._any_token_emitted = True  # (an engine's: the response starts with them)
        if self.lifecycle.state is State.DECODE_CONFIRMING:
            # decode is alive: prefill may free the KV it kept until now
            self.lifecycle.handle(Kv.FIRST_DECODE_TOKEN)
            assert self.prefill_instance is not None
            out.append(ev.ReleasePrefill(self.prefill_instance))
        if event.final:
            self.lifecycle.handle(Kv.DECODE_ENDED)
            out.append(ev.Finish())
            self._end(out, ev.Ending.OK)
        return out

    def _on_decode_failed(self, event: ev.DecodeFailed, now: float) -> list[ev.Command]:
        if event.cut_off:
            self.lifecycle.handle(Kv.DECODE_ENDED)
            return self._fail(ev.Failure(Reason.CLIENT_TOO_SLOW, event.message))
        if self.lifecycle.state is State.DECODE_CONFIRMING:
            return self._failed_early(event, now)
        if event.migratable and self.keep_tokens:
            self.lifecycle.handle(Kv.DECODE_LOST)
            return self._lost(event, now)
        self.lifecycle.handle(Kv.DECODE_ENDED)
        return self._fail(ev.decode_failed(event.message))

    def _on_decode_connected_to_retry(
        self, event: ev.DecodeConnected, now: float
    ) -> list[ev.Command]:
        self._disarm(ev.Deadline.RECONNECT)
        return self._place_decode(now, [])

    def _on_decode_connected_to_migrate(
        self, event: ev.DecodeConnected, now: float
    ) -> list[ev.Command]:
        self._disarm(ev.Deadline.RECONNECT)
        return self._migrate()

    def _migrate(self) -> list[ev.Command]:
        early = self._early
        assert early is not None and self.decode_instance is not None
        self.migrations.append(early.reason)
        out: list[ev.Command] = [ev.Migrate(early.reason, self.decode_instance)]
        self._continuation = True
        self._prefill_tried = set()
        self._prefill_failure = None
        return self._send_prefill(out)

    def _on_reconnect_passed(
        self, early: ev.DecodeFailed, now: float, *, torn: bool
    ) -> list[ev.Command]:
        """No decode connected in time for the retry (or the migration) waited on."""
        if self.phase is ev.Phase.AWAITING_MIGRATION:
            return self._fail(ev.decode_failed(early.message), torn=torn)
        if not self._first_token_emitted or not self.keep_tokens:
            return self._fail(ev.decode_failed(early.message), torn=torn)
        # no decode can pull prefill's KV before its lease ends: free it, and go on
        # from a new prefill, as one lost mid-stream does
        out: list[ev.Command] = []
        assert self.prefill_instance is not None
        out.append(ev.ReleasePrefill(self.prefill_instance))
        self.lifecycle.handle(Kv.KV_GIVEN_UP)
        # what is left of the same wait: a decode lost with requests placed just before
        # its loss was seen moves those when it moves the streams it had started
        return out + self._lost(early, now, torn=torn, waited=True)

    def _on_deadline(self, event: ev.DeadlinePassed, now: float) -> list[ev.Command]:
        armed = self._armed.get(event.deadline)
        if armed is None or armed > now:
            return []  # disarmed, or re-armed later since: stale
        self._disarm(event.deadline)
        if event.deadline is ev.Deadline.REQUEST:
            message = ev.TIMEOUT_MESSAGE.format(self.limits.request_timeout_s)
            return self._interrupted(ev.Failure(Reason.TIMEOUT, message), event.torn)
        if event.deadline is ev.Deadline.PREFILL:
            return self._interrupted(
                ev.Failure(Reason.TIMEOUT, ev.PREFILL_TIMEOUT_MESSAGE), event.torn
            )
        if event.deadline is ev.Deadline.KV_LEASE:
            return self._interrupted(
                ev.Failure(Reason.SERVICE_UNAVAILABLE, ev.NO_LEASE_ROOM), event.torn
            )
        early = self._early
        assert early is not None
        return self._on_reconnect_passed(early, now, torn=event.torn)

    def _on_client_gone(self, event: ev.ClientGone, now: float) -> list[ev.Command]:
        out: list[ev.Command] = []
        self._cleanup(out)
        self._end(out, ev.Ending.DISCONNECTED)
        return out

    def _on_client_stalled(self, event: ev.ClientStalled, now: float) -> list[ev.Command]:
        # the shell hung up on the client: no byte goes to it any more
        return self._interrupted(ev.Failure(Reason.CLIENT_TOO_SLOW, ev.STALLED_MESSAGE), torn=True)

    def _on_drain_cut(self, event: ev.DrainCut, now: float) -> list[ev.Command]:
        return self._interrupted(ev.Failure(Reason.SHUTTING_DOWN, ev.DRAIN_CUT), event.torn)

    def _on_failed(self, event: ev.Failed, now: float) -> list[ev.Command]:
        return self._interrupted(event.failure, event.torn)


_DECODE_UNDER_WAY = frozenset({ev.Phase.DECODE_STARTING, ev.Phase.DECODING})
_M = RequestMachine
_ENTRIES: dict[tuple[ev.Phase, type], Callable[..., list[ev.Command]]] = {
    (ev.Phase.NEW, ev.Arrived): _M._on_arrived,
    (ev.Phase.PREFILLING, ev.PrefillSent): _M._on_prefill_sent,
    (ev.Phase.PREFILLING, ev.PrefillUnavailable): _M._on_prefill_unavailable,
    (ev.Phase.PREFILLING, ev.PrefillNotSent): _M._on_prefill_not_sent,
    (ev.Phase.PREFILLING, ev.PrefillLost): _M._on_prefill_lost,
    (ev.Phase.PREFILLING, ev.PrefillFailed): _M._on_prefill_failed,
    (ev.Phase.PREFILLING, ev.Prefilled): _M._on_prefilled,
    (ev.Phase.PLACING_DECODE, ev.DecodeStartSent): _M._on_decode_start_sent,
    (ev.Phase.PLACING_DECODE, ev.DecodeUnavailable): _M._on_decode_unavailable,
    (ev.Phase.DECODE_SENDING, ev.DecodeStartQueued): _M._on_decode_start_queued,
    (ev.Phase.DECODE_SENDING, ev.DecodeNotSent): _M._on_decode_not_sent,
    (ev.Phase.DECODE_STARTING, ev.DecodeAccepted): _M._on_decode_accepted,
    (ev.Phase.DECODE_STARTING, ev.DecodeRejected): _M._on_decode_rejected,
    (ev.Phase.DECODE_STARTING, ev.DecodeFailed): _M._on_decode_failed_starting,
    (ev.Phase.DECODING, ev.DecodeTokens): _M._on_decode_tokens,
    (ev.Phase.DECODING, ev.DecodeFailed): _M._on_decode_failed,
    (ev.Phase.AWAITING_RETRY, ev.DecodeConnected): _M._on_decode_connected_to_retry,
    (ev.Phase.AWAITING_MIGRATION, ev.DecodeConnected): _M._on_decode_connected_to_migrate,
}
# a prefill running beside its decode (the bootstrap protocol) may fail while decode starts
for _phase in (ev.Phase.DECODE_STARTING, ev.Phase.DECODING):
    for _event in (ev.PrefillNotSent, ev.PrefillLost, ev.PrefillFailed):
        _ENTRIES[(_phase, _event)] = _M._on_prefill_failed_beside_decode
# what may cut any request short, whatever it waits on
for _phase in ev.Phase:
    if _phase in (ev.Phase.NEW, ev.Phase.DONE):
        continue
    _ENTRIES[(_phase, ev.DeadlinePassed)] = _M._on_deadline
    _ENTRIES[(_phase, ev.ClientGone)] = _M._on_client_gone
    _ENTRIES[(_phase, ev.ClientStalled)] = _M._on_client_stalled
    _ENTRIES[(_phase, ev.DrainCut)] = _M._on_drain_cut
    _ENTRIES[(_phase, ev.Failed)] = _M._on_failed

_TABLE: Final[Mapping[tuple[ev.Phase, type], Callable[..., list[ev.Command]]]] = MappingProxyType(
    _ENTRIES
)
"""The request path: (phase, event type) -> handler."""
