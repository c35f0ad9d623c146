"""An instance that fails leaves rotation for a while: the one back-off rule of every backend.

Each failure in a row doubles the time out of rotation, from the configured base, up
to ``MAX_SUSPENSION_S``; the next request after it probes the instance, and one it
serves puts it back in full rotation.
"""

from __future__ import annotations

from typing import Final, Protocol

MAX_SUSPENSION_S: Final = 30.0


class Suspendable(Protocol):
    """An instance as the rule reads and writes it (a worker's or an engine's)."""

    failures_in_a_row: int
    suspended_until: float


def suspend(instance: Suspendable, now: float, base_s: float) -> float:
    """``instance`` failed once more: out of rotation until later; returns for how long."""
    instance.failures_in_a_row += 1
    backoff = min(base_s * 2.0 ** (instance.failures_in_a_row - 1), MAX_SUSPENSION_S)
    instance.suspended_until = now + backoff
    return backoff


def reinstate(instance: Suspendable) -> None:
    """``instance`` served: back in full rotation."""
    if instance.failures_in_a_row:
        instance.failures_in_a_row = 0
        instance.suspended_until = 0.0
