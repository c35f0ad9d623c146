"""Which instance gets the next request: a scheduling policy over a snapshot of candidates.

The caller describes each instance as a :class:`Candidate` (its load, whether it
is healthy, the KV blocks it last reported free) and asks a :class:`Scheduler`
to pick one; the scheduler keeps only what its policy needs between picks (the
id it picked last, a turn counter, a random generator) and never sees an
instance itself. Only healthy candidates outside ``exclude`` are usable.

* ``round_robin``: the usable instances in order of ``instance_id``, each pick
  the next one after the id picked last time, so an instance joining or
  leaving neither resets nor skews the rotation.
* ``least_loaded``: the fewest active requests, then the most free KV blocks
  (unknown counts as fewest); ties take turns.
* ``power_of_two``: two distinct usable instances drawn at random, the less
  loaded (as for ``least_loaded``) wins: near least-loaded balance without
  every router sending the next burst to the same instance.

Cache-aware (any policy, ``cache_weight`` > 0): a candidate may report how many of
the request's KV blocks it holds already (``cached_blocks``, from its prefix cache's
KV events).  When some candidate holds any, the policy chooses only among those
:func:`cache_favoured` keeps: the lowest ``active_requests - cache_weight * cached_blocks
/ most_cached``, so the instance with the longest cached prefix wins while it has
fewer than ``cache_weight`` requests more than another (a shorter prefix earns a share
of that; a tie goes by the policy).  With nothing cached anywhere (the prefix cache
off, or cold), every pick is the policy's alone.

:func:`pick_instance` is the older stateless form of ``least_loaded``.
"""

from __future__ import annotations

import bisect
import operator
import random
from collections.abc import Sequence
from typing import Final, Literal, final, get_args

import attrs

SchedulingPolicy = Literal["round_robin", "least_loaded", "power_of_two"]

SCHEDULING_POLICIES: Final[tuple[SchedulingPolicy, ...]] = get_args(SchedulingPolicy)


@final
@attrs.frozen
class Candidate:
    instance_id: str
    active_requests: int
    healthy: bool = True
    # the KV blocks the instance last reported free; None: it has not said
    free_blocks: int | None = None
    # of the request's KV blocks, how many it holds cached from the start of the prompt (in
    # front of engines: of the request's approximate prefix keys, how many it was sent;
    # any unit will do that is the same for every candidate of one pick)
    cached_blocks: int = 0


def cache_favoured(usable: Sequence[Candidate], cache_weight: float) -> list[Candidate]:
    """The candidates a cache-aware pick chooses among: those of the lowest
    ``active_requests - cache_weight * cached_blocks / most_cached`` (the most cached
    prefix is worth ``cache_weight`` requests of load, a shorter one its share); all
    of them when none holds any of the request's blocks or ``cache_weight`` is 0."""
    if cache_weight <= 0 or len(usable) == 1:
        return list(usable)
    most = max((c.cached_blocks for c in usable), default=0)
    if most <= 0:
        return list(usable)
    scores = [c.active_requests - cache_weight * c.cached_blocks / most for c in usable]
    best = min(scores)
    return [c for c, score in zip(usable, scores, strict=True) if score == best]


_instance_id = operator.attrgetter("instance_id")


def _load_key(candidate: Candidate) -> tuple[int, bool, int]:
    """Smaller is less loaded: fewer requests, then more free blocks (unknown last)."""
    free = candidate.free_blocks
    return (candidate.active_requests, free is None, -(free or 0))


@final
class Scheduler:
    """Picks instances by one policy, keeping what the policy remembers between picks."""

    def __init__(
        self,
        policy: SchedulingPolicy,
        *,
        rng: random.Random | None = None,
        cache_weight: float = 0.0,
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"unknown scheduling policy {policy!r} (one of {', '.join(SCHEDULING_POLICIES)})"
            )
        if not cache_weight >= 0:
            raise ValueError(f"cache_weight must be >= 0, got {cache_weight!r}")
        self._policy: SchedulingPolicy = policy
        self.cache_weight = cache_weight
        self._rng = rng if rng is not None else random.Random()
        self._last_picked: str | None = None  # round_robin resumes after this id
        self._turn = 0  # least_loaded's tie-breaker

    @property
    def policy(self) -> SchedulingPolicy:
        return self._policy

    def pick(
        self, candidates: Sequence[Candidate], *, exclude: frozenset[str] = frozenset()
    ) -> str | None:
        """The id of the instance to use, or None when no candidate is usable."""
        # sorted by id: the choice depends on who the candidates are, not how they were listed
        usable = sorted(
            [c for c in candidates if c.healthy and c.instance_id not in exclude],
            key=_instance_id,
        )
        if not usable:
            return None
        usable = cache_favoured(usable, self.cache_weight)
        if self._policy == "round_robin":
            chosen = self._next_in_rotation(usable)
        elif self._policy == "least_loaded":
            chosen = self._least_loaded(usable)
        else:
            chosen = self._power_of_two(usable)
        self._last_picked = chosen.instance_id
        return chosen.instance_id

    def _next_in_rotation(self, usable: list[Candidate]) -> Candidate:
        if self._last_picked is None:
            return usable[0]
        ids = [c.instance_id for c in usable]
        after = bisect.bisect_right(ids, self._last_picked)
        return usable[after % len(usable)]

    def _least_loaded(self, usable: list[Candidate]) -> Candidate:
        if len(usable) == 1:
            self._turn += 1  # (as a tie of one: the turn goes on)
            return usable[0]
        least = min(_load_key(c) for c in usable)
        tied = [c for c in usable if _load_key(c) == least]
        chosen = tied[self._turn % len(tied)]
        self._turn += 1
        return chosen

    def _power_of_two(self, usable: list[Candidate]) -> Candidate:
        if len(usable) == 1:
            return usable[0]
        first, second = self._rng.sample(usable, 2)
        # on a tie the first drawn wins, itself a random choice
        return second if _load_key(second) < _load_key(first) else first


def pick_instance(
    candidates: Sequence[Candidate], *, turn: int, exclude: frozenset[str] = frozenset()
) -> str | None:
    """The healthy candidate with the fewest active requests; ``turn`` rotates ties.

    ``free_blocks`` plays no part here (see :class:`Scheduler` for that).
    """
    usable = [c for c in candidates if c.healthy and c.instance_id not in exclude]
    if not usable:
        return None
    least = min(c.active_requests for c in usable)
    tied = [c for c in usable if c.active_requests == least]
    return tied[turn % len(tied)].instance_id
