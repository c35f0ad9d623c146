"""A KV lease crosses hosts as a TTL: each receiver counts it from its own clock."""

from __future__ import annotations

import math

import pytest

from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.link import wire
from pdtrio.protocol.link.wire import KvHandle, lease_deadline, with_lease_left

_LAYOUT = KvLayout("fp", 1, 1, 1, 16, "float32")
_HOURS = 3600.0


def _handle(ttl_s: float) -> KvHandle:
    return KvHandle("r", "prefill-0", "10.0.0.5", 9000, (0, 1), 20, _LAYOUT, ttl_s, "grant")


def test_the_ttl_counts_from_the_receivers_own_clock() -> None:
    sent = _handle(30.0)
    # whatever the receiver's clock reads (its monotonic clock has its own origin, and its
    # wall clock may be hours off the sender's), the lease lasts its 30 s from receipt
    for receiver_now in (0.0, 12.5, 7 * _HOURS, -5 * _HOURS, 1.7e9):
        received = wire.Decoder(KvHandle).decode(wire.encode(sent))
        assert lease_deadline(received, receiver_now) == receiver_now + 30.0


def test_passing_it_on_sends_what_is_left() -> None:
    handle = _handle(30.0)
    deadline = lease_deadline(handle, 5 * _HOURS)
    assert with_lease_left(handle, deadline, 5 * _HOURS + 12.0).lease_ttl_s == pytest.approx(18.0)
    assert with_lease_left(handle, deadline, 5 * _HOURS + 31.0).lease_ttl_s == 0.0
    kept = with_lease_left(handle, deadline, 5 * _HOURS)
    assert kept == handle  # nothing else changes


@pytest.mark.parametrize("ttl", [-1.0, -math.inf, math.nan])
def test_a_ttl_that_is_not_a_duration_has_ended_on_receipt(ttl: float) -> None:
    assert lease_deadline(_handle(ttl), 100.0) == 100.0
