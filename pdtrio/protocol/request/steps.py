"""The request machine's state, and the moves its handlers share (``machine.py`` holds the
handlers and the tables that say which one answers what).

Pure (sans-IO): no I/O, no clock read (``now`` comes with each event).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from types import MappingProxyType

import pdtrio.protocol.request.events as ev
from pdtrio.protocol.request.choices import ChoiceReruns
from pdtrio.protocol.request.lifecycle import Cleanup, RequestLifecycle
from pdtrio.protocol.request.lifecycle import Event as Kv

P = ev.Phase


class MachineState:
    """What one request holds as it goes: its phase, its lifecycle, its armed deadlines
    and the data its decisions read."""

    def __init__(
        self,
        limits: ev.Limits,
        *,
        streaming: bool,
        keep_tokens: bool,
    ) -> None:
        self.limits = limits
        self.phase = P.NEW
        self.lifecycle = RequestLifecycle()  # what cleanup owes (KV on prefill, decode's run)
        # data, not state: the response's shape, the client's choice for the whole request
        self.streaming = streaming
        # data: a budget (a request whose token ids are not kept cannot continue elsewhere)
        self._migration_limit = limits.migration_limit if keep_tokens else 0
        # data: what the client was sent, which any phase from then on (a migration's new
        # prefill among them) may follow
        self._response_started = False
        self._armed: dict[ev.Deadline, float] = {}
        # the earliest of them (None: none armed), kept as they change
        self._earliest: tuple[float, ev.Deadline] | None = None
        self.prefill_instance: str | None = None
        self.decode_instance: str | None = None
        self._decode_connection: Hashable = None
        # the prefills excluded from its next one, and how many it was sent to (the bound: a
        # prefill lost with its link may take it again once back, and counts again)
        self._prefill_tried: set[str] = set()
        self._prefill_sent = 0
        self._prefill_failure: ev.AnyFailure | None = None
        # taken only when no other prefill is left: the one a failed handoff blamed
        self._prefill_avoid: frozenset[str] = frozenset()
        # when the wait for a prefill to connect ends: one wait until a prefill answers
        self._prefill_wait_until: float | None = None
        # the prefill rounds this request's handoffs took beyond the first, and how many
        # it may take in all (set by the machine: 1 where it cannot go again)
        self._handoff_rounds = 0
        self._handoff_limit = 1
        # whether a new round is a continuation (a new leg: prefill samples the first token,
        # which may have gone out) or the request sent again (decode regenerates every token)
        self._new_round_continues = False
        # a decode of this round could not pull prefill's KV: that prefill is to blame
        self._kv_blamed = False
        self._lease_ends_at: float | None = None
        self._tried: dict[str, Hashable] = {}  # this leg's decode failures, by connection
        # decodes that failed the request themselves (lost mid-stream, or failed a start),
        # every leg: a new leg does not go to them (a reconnected one may take it again)
        self._lost_on: dict[str, Hashable] = {}
        self._last_reason = "no decode instance is connected"
        self._decode_attempts = 0
        self._early: ev.DecodeFailed | None = None  # the failure an AWAITING_* phase retries
        # when the wait for a decode that followed the last loss ends: one wait per loss,
        # whether the KV prefill holds or a new prefill goes to the decode that connects
        self._reconnect_until = math.inf
        self.migrations: list[str] = []  # why each one happened (after one: a continuation)
        self.ended: ev.End | None = None
        # data: each choice's own, beside the request's phase (an n > 1 request's, once one
        # of its choices runs again alone)
        self._choice_reruns: ChoiceReruns | None = None

    def next_deadline(self) -> tuple[float, ev.Deadline] | None:
        """The earliest armed deadline: the shell's timer for whatever it awaits."""
        return self._earliest

    @property
    def earliest_deadline_at(self) -> float:
        """When the earliest armed deadline passes (inf: none is armed)."""
        earliest = self._earliest
        return math.inf if earliest is None else earliest[0]

    def armed_at(self, deadline: ev.Deadline) -> float | None:
        """When ``deadline`` passes (None: it is not armed)."""
        return self._armed.get(deadline)

    @property
    def headers_sent(self) -> bool:
        return self.streaming and self._response_started

    @property
    def choice_reruns(self) -> ChoiceReruns:
        """What an ``n`` > 1 request's choices run again alone may do: the leg carries out
        its answers (made on first use: most requests have one choice)."""
        reruns = self._choice_reruns
        if reruns is None:
            reruns = self._choice_reruns = ChoiceReruns(self.limits)
        return reruns

    # --- moves the handlers share --------------------------------------------------

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
        self.phase = P.DONE
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
        if self._prefill_sent >= self.limits.prefill_attempts:
            failure = self._prefill_failure or ev.no_prefill()
            return [*out, *self._fail(failure)]
        self.phase = P.PLACING_PREFILL
        out.append(
            ev.SendPrefill(
                frozenset(self._prefill_tried),
                continuation=bool(self.migrations),
                retry=self._prefill_sent > 0,
                avoid=self._prefill_avoid,
            )
        )
        return out

    def _place_decode(self, phase: ev.Phase, out: list[ev.Command]) -> list[ev.Command]:
        self.phase = phase
        if self._lease_ends_at is not None:  # (None: an engine's, no lease known)
            self._arm(ev.Deadline.KV_LEASE, self._lease_ends_at - self.limits.lease_margin_s, out)
        out.append(
            ev.PlaceDecode(
                MappingProxyType(dict(self._tried)),
                self._last_reason,
                retry=self._decode_attempts > 0,
                await_link=not (self._kv_blamed and self._handoff_rounds_left),
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
        """Decode was lost after the first token went out: migrate, or fail.

        ``waited``: the request has waited for a decode since the loss was seen (to
        retry on prefill's KV): it waits for what is left of that wait, not a new one.
        """
        assert self.decode_instance is not None
        self._lost_on[self.decode_instance] = self._decode_connection
        if self._migrations_after_loss >= self._migration_limit:
            return self._fail(ev.decode_failed(failure.message), torn=torn)
        self._early = failure
        if not waited:
            self._reconnect_until = now + self.limits.decode_reconnect_wait_s
        request_deadline = self._armed[ev.Deadline.REQUEST]
        # (a wait already spent: a decode connected now is still taken, none is waited for)
        until = max(now, min(self._reconnect_until, request_deadline))
        return self._await_decode(P.AWAITING_MIGRATION, until, self._lost_on, any_layout=True)

    def _first_token(self, out: list[ev.Command], *, final: bool) -> list[ev.Command]:
        """This leg's prefill token goes out (once per leg: the table says when)."""
        self._response_started = True
        out.append(ev.EmitFirstToken(final=final))
        return out

    def _decode_failed_early(self, event: ev.DecodeFailed) -> None:
        """Decode failed before its first token: it is not tried again."""
        self.lifecycle.handle(Kv.DECODE_ENDED)
        assert self.decode_instance is not None
        self._tried[self.decode_instance] = self._decode_connection
        self._lost_on[self.decode_instance] = self._decode_connection  # its own failure
        self._last_reason = event.message

    def _await_retry(self, event: ev.DecodeFailed, now: float) -> list[ev.Command]:
        """Decode failed before its first token: prefill still holds the KV, so another
        decode pulls it again, if one is connected before the lease ends."""
        self._decode_failed_early(event)
        self._early = event
        assert self._lease_ends_at is not None
        lease_left = self._lease_ends_at - self.limits.lease_margin_s
        self._reconnect_until = now + self.limits.decode_reconnect_wait_s
        until = min(self._reconnect_until, lease_left)
        return self._await_decode(P.AWAITING_RETRY, until, self._tried, any_layout=False)

    def _again_from_prefill(self, event: ev.DecodeFailed) -> list[ev.Command]:
        """Decode failed before its first token, and it regenerates every token: the request
        goes again from a new prefill (to another decode: the ones it failed on stay
        excluded), within the handoff's rounds."""
        self._decode_failed_early(event)
        return self._handoff_again(ev.no_decode_took_it(event.message))

    @property
    def _handoff_rounds_left(self) -> bool:
        return self._handoff_rounds + 1 < self._handoff_limit

    @property
    def _migrations_after_loss(self) -> int:
        """The migrations of decodes lost mid-stream (a handoff's new rounds not counted:
        they have a bound of their own)."""
        handoff = ev.MigrationReason.HANDOFF_FAILED
        return sum(1 for reason in self.migrations if reason != handoff)

    def _handoff_again(self, failure: ev.AnyFailure, *, torn: bool = False) -> list[ev.Command]:
        """No decode could take prefill's KV: it is freed and the request goes again from a
        new prefill (the one its pull blamed avoided), a new leg where prefill samples the
        first token; past the handoff's rounds (or a client no byte may reach) it fails
        with ``failure``."""
        if torn or not self._handoff_rounds_left:
            return self._fail(failure, torn=torn)
        self._disarm(ev.Deadline.KV_LEASE)
        out: list[ev.Command] = []
        assert self.prefill_instance is not None
        out.append(ev.ReleasePrefill(self.prefill_instance))
        self.lifecycle.handle(Kv.KV_GIVEN_UP)
        self._handoff_rounds += 1
        blamed = self._kv_blamed
        self._prefill_avoid = frozenset({self.prefill_instance}) if blamed else frozenset()
        self._prefill_tried = set()
        self._prefill_sent = 0
        self._prefill_failure = None
        if self._new_round_continues:
            reason = ev.MigrationReason.HANDOFF_FAILED
            self.migrations.append(reason)
            out.append(ev.Migrate(reason, self.decode_instance or "-"))
        return self._send_prefill(out)
