"""The fault proxy's pure parts: the bandwidth arithmetic and the fault descriptions."""

from __future__ import annotations

import math

import attrs
import pytest

from pdtrio.faults.plan import (
    DEFAULT_CHUNK_BYTES,
    KILOBITS,
    ControlCommand,
    Fault,
    FaultSpecError,
    TokenBucket,
    fault_from_options,
    parse_address,
    parse_control_line,
)


def test_a_full_bucket_sends_its_burst_at_once_then_paces_at_the_rate() -> None:
    bucket = TokenBucket(rate=1000.0, capacity=100.0, tokens=100.0)
    assert bucket.take(100, now=0.0) == 0.0
    # empty: the next 100 bytes wait for 100 bytes' worth of time
    assert bucket.take(100, now=0.0) == pytest.approx(0.1)
    # sent on time (at 0.1 s) the debt is paid; the next waits its own share
    assert bucket.take(100, now=0.1) == pytest.approx(0.1)


def test_a_chunk_larger_than_the_bucket_goes_into_debt() -> None:
    bucket = TokenBucket(rate=1000.0, capacity=100.0, tokens=100.0)
    assert bucket.take(600, now=0.0) == pytest.approx(0.5)
    assert bucket.take(100, now=0.5) == pytest.approx(0.1)


def test_a_long_transfer_averages_the_rate() -> None:
    bucket = TokenBucket.for_rate(10_000.0)
    now = 0.0
    for _ in range(100):
        now += bucket.take(1000, now)
    # 100 kB at 10 kB/s: 10 s, less the one burst the full bucket allowed
    assert now == pytest.approx(10.0 - bucket.capacity / bucket.rate)


def test_an_idle_bucket_saves_up_at_most_its_capacity() -> None:
    bucket = TokenBucket(rate=1000.0, capacity=100.0, tokens=0.0)
    bucket.take(0, now=0.0)
    assert bucket.take(100, now=60.0) == 0.0
    assert bucket.take(100, now=60.0) == pytest.approx(0.1)


def test_time_going_backwards_changes_nothing() -> None:
    bucket = TokenBucket(rate=1000.0, capacity=100.0, tokens=0.0)
    bucket.take(0, now=5.0)
    assert bucket.take(100, now=4.0) == pytest.approx(0.1)


def test_a_new_rate_keeps_the_savings_within_its_capacity() -> None:
    bucket = TokenBucket.for_rate(10_000.0)  # 500 bytes saved
    bucket.set_rate(1000.0, now=0.0)  # capacity 50
    assert bucket.tokens == pytest.approx(50.0)
    assert bucket.take(150, now=0.0) == pytest.approx(0.1)
    with pytest.raises(FaultSpecError):
        bucket.set_rate(0.0, now=0.0)


def test_a_bucket_needs_a_positive_rate() -> None:
    with pytest.raises(FaultSpecError):
        TokenBucket(rate=0.0, capacity=1.0)
    with pytest.raises(FaultSpecError):
        TokenBucket(rate=math.nan, capacity=1.0)


def test_the_default_fault_is_none() -> None:
    assert Fault().describe() == "no fault"
    assert Fault().chunk_bytes() == DEFAULT_CHUNK_BYTES


def test_a_fault_describes_every_part_in_operator_units() -> None:
    fault = fault_from_options(
        latency_ms=50, bandwidth_kbps=100, stall=True, reset_after_bytes=1000, refuse=True
    )
    assert fault.latency_s == pytest.approx(0.05)
    assert fault.bandwidth_bytes_per_s == pytest.approx(12_500)
    assert fault.describe() == "latency=50ms bandwidth=100kbps stall reset-after=1000B refuse"


def test_held_requests_are_told_by_the_start_of_their_request_line() -> None:
    fault = Fault(hold_requests=["POST /v1/completions", "POST /v1/chat/completions"])
    assert fault.hold_requests == ("POST /v1/completions", "POST /v1/chat/completions")
    assert fault.holds(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n\r\n{}")
    assert fault.holds(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert not fault.holds(b"GET /health HTTP/1.1\r\n")
    assert not fault.holds(b"GET /metrics HTTP/1.1\r\n")
    assert not Fault().holds(b"POST /v1/completions HTTP/1.1\r\n")
    assert fault.describe() == "hold='POST /v1/completions'|'POST /v1/chat/completions'"
    with pytest.raises(FaultSpecError):
        Fault(hold_requests=(" ",))


def test_under_a_cap_chunks_are_short_sends() -> None:
    assert Fault(bandwidth_bytes_per_s=20_000).chunk_bytes() == 1000
    assert Fault(bandwidth_bytes_per_s=1).chunk_bytes() == 1
    assert Fault(bandwidth_bytes_per_s=1e12).chunk_bytes() == DEFAULT_CHUNK_BYTES


@pytest.mark.parametrize(
    "changes",
    [
        {"latency_s": -1.0},
        {"latency_s": math.nan},
        {"latency_s": math.inf},
        {"bandwidth_bytes_per_s": 0.0},
        {"reset_after_bytes": -1},
    ],
)
def test_a_fault_out_of_range_is_refused(changes: dict[str, float]) -> None:
    with pytest.raises(FaultSpecError):
        Fault(**changes)  # type: ignore[arg-type]


def test_addresses() -> None:
    assert parse_address("127.0.0.1:9000") == ("127.0.0.1", 9000)
    assert parse_address("[::1]:0") == ("::1", 0)
    assert parse_address("localhost:80") == ("localhost", 80)
    for bad in ("9000", ":9000", "host:", "host:port", "host:70000"):
        with pytest.raises(FaultSpecError):
            parse_address(bad)


def test_control_lines_change_one_thing_each() -> None:
    current = Fault(latency_s=0.01)
    assert parse_control_line("latency 50", current).fault.latency_s == pytest.approx(0.05)
    assert parse_control_line("bandwidth 8", current).fault.bandwidth_bytes_per_s == KILOBITS * 8
    capped = attrs.evolve(current, bandwidth_bytes_per_s=1000.0)
    assert parse_control_line("bandwidth off", capped).fault == current
    assert parse_control_line("STALL on", current).fault == attrs.evolve(current, stall=True)
    assert parse_control_line("refuse on", current).fault.refuse
    assert not parse_control_line("refuse off", current).fault.refuse
    assert parse_control_line("reset-after 1000", current).fault.reset_after_bytes == 1000
    limited = attrs.evolve(current, reset_after_bytes=5)
    assert parse_control_line("reset-after off", limited).fault == current
    assert parse_control_line("reset", current) == ControlCommand(current, reset_all=True)
    assert parse_control_line("clear", current) == ControlCommand(Fault())
    assert parse_control_line("show", current) == ControlCommand(current)


@pytest.mark.parametrize(
    "line",
    [
        "",
        "latency",
        "latency -5",
        "latency soon",
        "bandwidth 0",
        "stall maybe",
        "reset-after 1.5",
        "reset now",
        "explode",
    ],
)
def test_a_bad_control_line_is_refused_with_a_reason(line: str) -> None:
    with pytest.raises(FaultSpecError, match=r"\w"):
        parse_control_line(line, Fault())
