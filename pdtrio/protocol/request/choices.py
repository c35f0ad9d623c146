"""The choices of an ``n`` > 1 request run again alone, sans-IO: what the request machine
decides for them (:attr:`RequestMachine.choice_reruns`), and the commands a leg carries out.

A request whose decode regenerates every token runs each choice as a PD flow of its own.
One choice failing before any of its tokens went out, once other choices' had (the
request can no longer go again whole), runs again alone under the request's own limits:
each decode it failed on is excluded, each round from a new prefill tries at most
``prefill_attempts`` prefill instances, and a failure that is the request's own (a 4xx),
or a client too far behind, is not retried: its failure is the request's.

Pure (sans-IO): no I/O, no clock read.
"""

from __future__ import annotations

from typing import final

import attrs

import pdtrio.protocol.request.events as ev
from pdtrio.protocol.errors import is_clients_fault


@final
@attrs.frozen
class RerunChoice:
    """Run choice ``choice`` again alone: a decode not in ``exclude_decodes``, and a new
    prefill for it (each one asked for with :meth:`ChoiceReruns.next_prefill`)."""

    choice: int
    exclude_decodes: frozenset[str]


@final
@attrs.frozen
class SendChoicePrefill:
    """Choice ``choice``'s rerun: a prefill on an instance not in ``exclude``."""

    choice: int
    exclude: frozenset[str]


@attrs.define
class _Choice:
    excluded_decodes: set[str] = attrs.Factory(set)
    tried_prefills: set[str] = attrs.Factory(set)  # this round's
    given_up: bool = False  # its last failure is the request's


@final
class ChoiceReruns:
    """Every rerun choice's exclusions and limits; its answers are what the leg does."""

    __slots__ = ("_choices", "_prefill_attempts")

    def __init__(self, limits: ev.Limits) -> None:
        self._prefill_attempts = limits.prefill_attempts
        self._choices: dict[int, _Choice] = {}

    def failed(
        self, choice: int, *, cut_off: bool, decode: str | None, prefill: str | None
    ) -> RerunChoice | None:
        """Choice ``choice`` failed before any of its tokens went out, once other choices'
        had: run it again, or None (its failure is the request's).  ``decode``: the decode
        it failed on, if the decode is to blame; ``prefill``: its first run's prefill."""
        if cut_off:
            return None  # its client is too far behind: a rerun would not catch up
        state = self._choices.get(choice)
        if state is None:
            state = self._choices[choice] = _Choice()
            if prefill is not None:
                state.tried_prefills.add(prefill)
        if state.given_up:
            return None
        if decode is not None:
            self._decode_failed(state, decode)
        return RerunChoice(choice, frozenset(state.excluded_decodes))

    @property
    def failed_decodes(self) -> frozenset[str]:
        """The decodes some choice failed on (to blame): none of them served the request,
        whatever the other choices did there."""
        return frozenset().union(*(state.excluded_decodes for state in self._choices.values()))

    def next_prefill(self, choice: int) -> SendChoicePrefill | None:
        """The rerun's next prefill, or None: this round tried as many as the request may
        (the leg gives the choice up)."""
        tried = self._choices[choice].tried_prefills
        if len(tried) >= self._prefill_attempts:
            return None
        return SendChoicePrefill(choice, frozenset(tried))

    def prefill_sent(self, choice: int, instance: str) -> None:
        self._choices[choice].tried_prefills.add(instance)

    def prefill_failed(
        self, choice: int, failed: ev.PrefillNotSent | ev.PrefillLost | ev.PrefillFailed
    ) -> bool:
        """The rerun's prefill failed: whether another may take it (False: the failure is
        the request's own, a 4xx, and the choice is given up)."""
        if isinstance(failed, ev.PrefillFailed) and is_clients_fault(failed.failure.status):
            self._choices[choice].given_up = True
            return False
        return True

    def decode_refused(
        self, choice: int, decode: str, refusal: ev.DecodeRejected | ev.DecodeFailed
    ) -> None:
        """The rerun's decode leg did not start: refused as the request's own (a 4xx, the
        choice is given up), or failed (never that decode again for it)."""
        state = self._choices[choice]
        if isinstance(refusal, ev.DecodeRejected):
            state.given_up = True
        else:
            self._decode_failed(state, decode)

    def give_up(self, choice: int) -> None:
        """No instance is left for the rerun: its failure is the request's."""
        self._choices[choice].given_up = True

    @staticmethod
    def _decode_failed(state: _Choice, decode: str) -> None:
        # never on that decode again, and a new round of prefills (as the request's own
        # retry from prefill)
        state.excluded_decodes.add(decode)
        state.tried_prefills.clear()
