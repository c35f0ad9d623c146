"""Which instance gets the next request: least loaded, ties broken in turn."""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import attrs


@final
@attrs.frozen
class Candidate:
    instance_id: str
    active_requests: int
    healthy: bool = True


def pick_instance(
    candidates: Sequence[Candidate], *, turn: int, exclude: frozenset[str] = frozenset()
) -> str | None:
    """The healthy candidate with the fewest active requests; ``turn`` rotates ties."""
    usable = [c for c in candidates if c.healthy and c.instance_id not in exclude]
    if not usable:
        return None
    least = min(c.active_requests for c in usable)
    tied = [c for c in usable if c.active_requests == least]
    return tied[turn % len(tied)].instance_id
