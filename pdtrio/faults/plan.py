"""The fault proxy's pure parts: what a fault is, how it is written, and the bandwidth arithmetic.

No sockets and no clock of its own (the caller passes ``now``), so each rule is
unit-tested without timing anything: :class:`Fault` (the faults in force),
:class:`TokenBucket` (how long a chunk waits under a bandwidth cap), and the
parsers for the command line's addresses and the control port's lines.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Final, final

import attrs

KILOBITS: Final = 1000 / 8
"""Bytes per second in one kbps: ``--bandwidth-kbps`` counts kilobits, as link speeds do."""

DEFAULT_CHUNK_BYTES: Final = 65536
"""The most a proxy reads from one side at once when no bandwidth cap is in force."""

CAP_GRANULARITY_S: Final = 0.05
"""Under a bandwidth cap, a chunk is at most this long a send, so the cap is smooth, not bursty."""


class FaultSpecError(ValueError):
    """A fault, an address or a control line that cannot be understood; the message says why."""


def _non_negative(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 0 or math.isinf(value):  # also refuses NaN
        raise FaultSpecError(f"{attribute.name} must be a finite number >= 0, not {value!r}")


def _positive_or_none(
    instance: object, attribute: attrs.Attribute[float | None], value: float | None
) -> None:
    if value is not None and (not value > 0 or math.isinf(value)):
        raise FaultSpecError(f"{attribute.name} must be a finite number > 0 or None, not {value!r}")


def _as_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _request_prefixes(
    instance: object, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]
) -> None:
    if any(not prefix.strip() for prefix in value):
        raise FaultSpecError(f"{attribute.name} takes request lines' starts, not {value!r}")


def _count_or_none(
    instance: object, attribute: attrs.Attribute[int | None], value: int | None
) -> None:
    if value is not None and value < 0:
        raise FaultSpecError(f"{attribute.name} must be >= 0 or None, not {value!r}")


@final
@attrs.frozen(kw_only=True)
class Fault:
    """The faults in force on a proxy; the default is none (a transparent proxy).

    A frozen value: the proxy holds the current one and a change is a new value
    assigned to ``FaultProxy.fault``, so that the proxy can wake whatever waits
    on the old one (a stalled connection, a closed listener).
    """

    latency_s: float = attrs.field(default=0.0, validator=_non_negative)
    """Each chunk is forwarded this long after it arrived, in both directions, order kept."""
    bandwidth_bytes_per_s: float | None = attrs.field(default=None, validator=_positive_or_none)
    """A cap on each direction of each connection; None: uncapped."""
    stall: bool = False
    """Nothing is forwarded, either way, on any connection; new ones are accepted and held."""
    reset_after_bytes: int | None = attrs.field(default=None, validator=_count_or_none)
    """A connection is reset (RST both sides) once it has forwarded this many bytes, both ways."""
    refuse: bool = False
    """The listener is closed: a new connection is refused; open ones go on."""
    hold_requests: tuple[str, ...] = attrs.field(
        default=(), converter=_as_tuple, validator=_request_prefixes
    )
    """HTTP/1 requests whose request line starts with one of these (``"POST /v1/completions"``)
    are held, with whatever follows them on their connection, client to target: the
    target hears nothing of them until they are no longer held.  Every other request
    and connection passes, so one kind of request can be stalled while a server's
    health and metrics reads go on.  Seen where a chunk read from the client starts:
    a request line of a client that does not pipeline."""

    def holds(self, chunk: bytes) -> bool:
        """Whether ``chunk``, read from a client, starts a request that is held."""
        return any(chunk.startswith(prefix.encode()) for prefix in self.hold_requests)

    def chunk_bytes(self) -> int:
        """How much to read from one side at once: under a cap, a short send's worth."""
        if self.bandwidth_bytes_per_s is None:
            return DEFAULT_CHUNK_BYTES
        return max(1, min(DEFAULT_CHUNK_BYTES, int(self.bandwidth_bytes_per_s * CAP_GRANULARITY_S)))

    def describe(self) -> str:
        """One line for an operator, e.g. ``latency=50ms bandwidth=100kbps stall``."""
        parts = []
        if self.latency_s:
            parts.append(f"latency={self.latency_s * 1000:g}ms")
        if self.bandwidth_bytes_per_s is not None:
            parts.append(f"bandwidth={self.bandwidth_bytes_per_s / KILOBITS:g}kbps")
        if self.stall:
            parts.append("stall")
        if self.reset_after_bytes is not None:
            parts.append(f"reset-after={self.reset_after_bytes}B")
        if self.refuse:
            parts.append("refuse")
        if self.hold_requests:
            parts.append("hold=" + "|".join(repr(prefix) for prefix in self.hold_requests))
        return " ".join(parts) or "no fault"


def fault_from_options(
    *,
    latency_ms: float = 0.0,
    bandwidth_kbps: float | None = None,
    stall: bool = False,
    reset_after_bytes: int | None = None,
    refuse: bool = False,
) -> Fault:
    """The fault the command line's options describe (milliseconds and kilobits, as operators say)."""
    return Fault(
        latency_s=latency_ms / 1000,
        bandwidth_bytes_per_s=None if bandwidth_kbps is None else bandwidth_kbps * KILOBITS,
        stall=stall,
        reset_after_bytes=reset_after_bytes,
        refuse=refuse,
    )


@final
@attrs.define
class TokenBucket:
    """A bandwidth cap for one direction: how long each chunk must wait before it is sent.

    A chunk is taken whole, even beyond the tokens there are: the bucket then
    goes into debt, and the chunk waits until the debt is paid back at ``rate``.
    So a long transfer runs at ``rate`` on average, and an idle bucket saves up
    at most ``capacity`` bytes for a burst.
    """

    rate: float
    """Bytes per second."""
    capacity: float
    """The most an idle bucket saves up."""
    tokens: float = 0.0
    updated_at: float | None = None

    def __attrs_post_init__(self) -> None:
        if not self.rate > 0 or not self.capacity >= 0:
            raise FaultSpecError(f"a token bucket needs rate > 0 and capacity >= 0, not {self!r}")
        self.tokens = min(self.tokens, self.capacity)

    @classmethod
    def for_rate(cls, rate: float) -> TokenBucket:
        """A bucket that starts full with one short send's worth (:data:`CAP_GRANULARITY_S`)."""
        capacity = rate * CAP_GRANULARITY_S
        return cls(rate=rate, capacity=capacity, tokens=capacity)

    def _refill(self, now: float) -> None:
        if self.updated_at is not None and now > self.updated_at:
            self.tokens = min(self.capacity, self.tokens + (now - self.updated_at) * self.rate)
        if self.updated_at is None or now > self.updated_at:
            self.updated_at = now

    def take(self, size: int, now: float) -> float:
        """Take ``size`` bytes at ``now``; the seconds to wait before sending them (0: at once)."""
        self._refill(now)
        self.tokens -= size
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate

    def set_rate(self, rate: float, now: float) -> None:
        """Change the cap; what was saved up so far keeps, within the new capacity."""
        self._refill(now)
        if not rate > 0:
            raise FaultSpecError(f"a bandwidth cap must be > 0, not {rate!r}")
        self.rate = rate
        self.capacity = rate * CAP_GRANULARITY_S
        self.tokens = min(self.tokens, self.capacity)


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as a host and a port."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise FaultSpecError(f"{text!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise FaultSpecError(f"{text!r}: the port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise FaultSpecError(f"{text!r}: the port must be within 0..65535")
    return host, port


@final
@attrs.frozen
class ControlCommand:
    """What a control line asks for: the fault to put in force, and whether to reset every
    open connection now."""

    fault: Fault
    reset_all: bool = False


CONTROL_HELP: Final = (
    "commands: latency MS | bandwidth KBPS|off | stall on|off | refuse on|off | "
    "reset-after BYTES|off | reset (RST every open connection) | clear | show | help"
)


def _switch(word: str, value: str) -> bool:
    if value in ("on", "1", "true", "yes"):
        return True
    if value in ("off", "0", "false", "no"):
        return False
    raise FaultSpecError(f"{word} takes on or off, not {value!r}")


def _number(word: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise FaultSpecError(f"{word} takes a number, not {value!r}") from None
    if not number >= 0 or math.isinf(number):
        raise FaultSpecError(f"{word} takes a finite number >= 0, not {value!r}")
    return number


def parse_control_line(line: str, current: Fault) -> ControlCommand:
    """One line an operator typed on the control port, applied to the fault in force.

    ``latency 50`` (ms; 0 turns it off), ``bandwidth 100`` (kbps) or ``bandwidth off``,
    ``stall on``, ``refuse off``, ``reset-after 1000`` or ``reset-after off``, ``reset``,
    ``clear`` (no fault), ``show`` and ``help`` (change nothing).
    """
    words = line.split()
    if not words:
        raise FaultSpecError("empty line; " + CONTROL_HELP)
    word, args = words[0].lower(), [w.lower() for w in words[1:]]
    if word in ("show", "help", "reset", "clear"):
        if args:
            raise FaultSpecError(f"{word} takes no argument")
        if word == "reset":
            return ControlCommand(current, reset_all=True)
        return ControlCommand(Fault() if word == "clear" else current)
    if len(args) != 1:
        raise FaultSpecError(f"{word!r} takes one argument; " + CONTROL_HELP)
    value = args[0]
    if word == "latency":
        return ControlCommand(attrs.evolve(current, latency_s=_number(word, value) / 1000))
    if word == "bandwidth":
        if value == "off":
            return ControlCommand(attrs.evolve(current, bandwidth_bytes_per_s=None))
        kbps = _number(word, value)
        if kbps == 0:
            raise FaultSpecError(
                "bandwidth 0 would forward nothing: use stall on (or bandwidth off)"
            )
        return ControlCommand(attrs.evolve(current, bandwidth_bytes_per_s=kbps * KILOBITS))
    if word == "stall":
        return ControlCommand(attrs.evolve(current, stall=_switch(word, value)))
    if word == "refuse":
        return ControlCommand(attrs.evolve(current, refuse=_switch(word, value)))
    if word == "reset-after":
        if value == "off":
            return ControlCommand(attrs.evolve(current, reset_after_bytes=None))
        count = _number(word, value)
        if count != int(count):
            raise FaultSpecError(f"reset-after takes a whole number of bytes, not {value!r}")
        return ControlCommand(attrs.evolve(current, reset_after_bytes=int(count)))
    raise FaultSpecError(f"unknown command {word!r}; " + CONTROL_HELP)
