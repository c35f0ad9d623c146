"""One request's lifecycle on the router, and what its cleanup owes at any moment.

A request touches up to two instances: prefill may hold its KV blocks (from
the moment the prefill call is sent until it is told to release them, once
decode has produced its first token, or their lease ends) and decode may run
it (from the moment the start is sent until it finishes, fails or is
aborted).  A decode lost after its first token takes the request back to the
start (``DECODE_LOST``): a migration prefills its prompt and the tokens
delivered again, and goes through the same states; so may one whose KV no decode
could pull in time (``KV_GIVEN_UP``, once the caller has released it).  Prefill keeps the blocks until decode's first token so that a
decode that fails before it can be replaced by another, which pulls them
again.  Whatever ends the request, cleanup
asks :meth:`RequestLifecycle.owed` and does exactly that, then reports
:attr:`Event.CLEANED`; so cleanup is idempotent by construction, not by
booleans flipped in many places.

The whole rule is the two tables below: ``_TRANSITIONS`` (state, event) ->
state, and ``_OWED`` state -> cleanup.  An event that the table does not
list for the current state is a bug in the caller: :class:`LifecycleError`.
"""

from __future__ import annotations

import enum
from typing import Final, final


class State(enum.Enum):
    # members are singletons: hashed by identity, in C (Enum's own hash is a Python call,
    # paid on every transition's lookup)
    __hash__ = object.__hash__

    NEW = "new"
    """Nothing sent anywhere yet."""
    PREFILLING = "prefilling"
    """The prefill call is out: prefill may be allocating blocks for it."""
    PREFILLED = "prefilled"
    """Prefill answered with a KV handle: it holds the blocks under a lease."""
    DECODE_STARTING = "decode_starting"
    """The start is out to decode, not answered yet: both sides may hold blocks."""
    DECODE_CONFIRMING = "decode_confirming"
    """Decode accepted (it pulled the blocks) but has produced no token yet: prefill
    still holds them, so a failure now can be retried on another decode."""
    DECODING = "decoding"
    """Decode produced a token: prefill is told to release; decode runs the request."""
    DONE = "done"
    """Nothing is held anywhere: finished, failed upstream, or cleaned up."""


class Event(enum.Enum):
    __hash__ = object.__hash__  # (see State's)

    PREFILL_SENT = "prefill_sent"
    PREFILL_NOT_SENT = "prefill_not_sent"
    """The instance was unreachable: it never saw the request (try another)."""
    PREFILL_FAILED = "prefill_failed"
    """Prefill answered with an error: it freed whatever it had allocated."""
    PREFILL_LOST = "prefill_lost"
    """Prefill failed (5xx, or its link went down) and holds nothing: another may try."""
    PREFILLED = "prefilled"
    """Prefill answered with a KV handle."""
    FINISHED_AT_PREFILL = "finished_at_prefill"
    """Generation ended at the first token: prefill kept no blocks."""
    DECODE_START_SENT = "decode_start_sent"
    DECODE_NOT_STARTED = "decode_not_started"
    """The start could not be sent, or decode rejected it: decode holds nothing."""
    DECODE_ACCEPTED = "decode_accepted"
    FIRST_DECODE_TOKEN = "first_decode_token"
    """Decode produced its first token: the caller releases the blocks on prefill."""
    DECODE_ENDED = "decode_ended"
    """Decode sent the finish, reported a failure, or the link aborted the request
    itself (a slow client): nothing is left on decode or prefill."""
    DECODE_LOST = "decode_lost"
    """Decode failed after its first token (its link lost, its worker dead or failing):
    it holds nothing, and prefill was told to release at the first token.  The request
    may continue from a new prefill of its prompt and the tokens delivered (a migration),
    as a new request would, or end."""
    KV_GIVEN_UP = "kv_given_up"
    """No decode could pull prefill's KV in time (every one failed, none came back within
    its lease): the caller released it on prefill.  The request may continue from a new
    prefill, as after ``DECODE_LOST``, or end."""
    CLEANED = "cleaned"
    """Cleanup did what :meth:`RequestLifecycle.owed` said."""


class Cleanup(enum.Flag):
    NOTHING = 0
    RELEASE_ON_PREFILL = enum.auto()
    ABORT_ON_DECODE = enum.auto()


class LifecycleError(RuntimeError):
    """An event that cannot happen in the current state: a bug in the caller."""


_TRANSITIONS: Final[dict[tuple[State, Event], State]] = {
    (State.NEW, Event.PREFILL_SENT): State.PREFILLING,
    (State.PREFILLING, Event.PREFILL_NOT_SENT): State.NEW,
    (State.PREFILLING, Event.PREFILL_FAILED): State.DONE,
    (State.PREFILLING, Event.PREFILL_LOST): State.NEW,
    (State.PREFILLING, Event.PREFILLED): State.PREFILLED,
    (State.PREFILLING, Event.FINISHED_AT_PREFILL): State.DONE,
    (State.PREFILLED, Event.DECODE_START_SENT): State.DECODE_STARTING,
    (State.DECODE_STARTING, Event.DECODE_NOT_STARTED): State.PREFILLED,
    (State.DECODE_STARTING, Event.DECODE_ACCEPTED): State.DECODE_CONFIRMING,
    # decode may fail a start it has not answered yet (e.g. its link broke)
    (State.DECODE_STARTING, Event.DECODE_ENDED): State.PREFILLED,
    (State.DECODE_CONFIRMING, Event.FIRST_DECODE_TOKEN): State.DECODING,
    # ended before its first token (failed, or finished at once): prefill still holds
    (State.DECODE_CONFIRMING, Event.DECODE_ENDED): State.PREFILLED,
    (State.DECODING, Event.DECODE_ENDED): State.DONE,
    (State.DECODING, Event.DECODE_LOST): State.NEW,
    (State.PREFILLED, Event.KV_GIVEN_UP): State.NEW,
    # a prefill running beside its decode (SGLang's bootstrap protocol) failed once decode
    # held nothing of it: it freed its blocks, or the request was the client's fault
    (State.PREFILLED, Event.PREFILL_LOST): State.NEW,
    (State.PREFILLED, Event.PREFILL_FAILED): State.DONE,
}
# cleanup may come at any moment, and more than once
for _state in State:
    _TRANSITIONS[(_state, Event.CLEANED)] = State.DONE

_OWED: Final[dict[State, Cleanup]] = {
    State.NEW: Cleanup.NOTHING,
    # a cancelled prefill call may have left blocks behind: release is harmless if not
    State.PREFILLING: Cleanup.RELEASE_ON_PREFILL,
    State.PREFILLED: Cleanup.RELEASE_ON_PREFILL,
    # decode may have pulled the blocks, or not yet: abort there, release here
    State.DECODE_STARTING: Cleanup.RELEASE_ON_PREFILL | Cleanup.ABORT_ON_DECODE,
    State.DECODE_CONFIRMING: Cleanup.RELEASE_ON_PREFILL | Cleanup.ABORT_ON_DECODE,
    State.DECODING: Cleanup.ABORT_ON_DECODE,
    State.DONE: Cleanup.NOTHING,
}


@final
class RequestLifecycle:
    """Where one request stands; answers what cleanup owes."""

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state = State.NEW

    @property
    def state(self) -> State:
        return self._state

    def handle(self, event: Event) -> State:
        """Apply ``event``; returns the new state. Raises :class:`LifecycleError`."""
        try:
            self._state = _TRANSITIONS[(self._state, event)]
        except KeyError:
            raise LifecycleError(
                f"{event.name} cannot happen in state {self._state.name}"
            ) from None
        return self._state

    def owed(self) -> Cleanup:
        """What cleanup must do now."""
        return _OWED[self._state]
