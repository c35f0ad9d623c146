"""How far apart a stream's sends go out: the load-adaptive egress policy.

Under light load every token goes to its client at once.  When the router's
event loop gets busy, each stream's sends are spaced by a delay that grows with
the load, so one SSE event carries several tokens and the router's CPU per token
falls instead of its queue growing.  The delay never exceeds
``EgressConfig.max_delay_s`` (``router.egress_max_delay_s``; 0 turns it off).

Two pieces, both pure:

* :class:`EgressController` turns the loop's **busy fraction**, measured once per
  sampling window by the shell (``pdtrio.router.loop_load``, every 0.1 s), into
  the current per-stream spacing: :meth:`EgressController.update`.
* :func:`send_deadline` says, for one stream, whether to send now or the time to
  wait for, given its last send, the current spacing and now.  The finish chunk
  and errors are never held: the shell sends them at once, with whatever has
  gathered, whatever this says.

The controller
--------------
An integral controller with a dead band (hysteresis), on the spacing ``d``
in ``[0, max_delay_s]``, with busy fraction ``b`` in ``[0, 1]`` per update::

    b > busy_high:  d += gain * max_delay_s * (b - busy_high)
    b < busy_low:   d -= gain * max_delay_s * (busy_low - b)   (below min_delay_s: 0)
    otherwise:      d unchanged

Why this shape:

* **Zero under light load.**  ``d`` starts at 0 and only grows while ``b`` is
  above ``busy_high``; a loop that never gets that busy never pays a delay.
* **Converges, does not oscillate.**  Spacing only removes work, so ``b`` falls
  (weakly) as ``d`` grows.  ``d`` moves towards the band at a rate proportional
  to how far ``b`` is outside it and stops once ``b`` is inside: steps shrink as
  ``b`` nears the band, and the band (0.2 wide by default) absorbs measurement
  noise and a step's overshoot.  AIMD was the alternative; its sawtooth is by
  design (probing for capacity among competing flows), but here there is one
  controller and a target to hold, so it would only add periodic latency swings.
* **Integral, not proportional.**  Spacing shorter than a stream's inter-token
  time changes nothing (each token already arrives after the deadline), so the
  plant has a flat region; an integral term keeps ramping through it, where a
  proportional one would stall at a spacing that does nothing.
* **Bounded and back to zero.**  ``d`` is clamped to ``[0, max_delay_s]``; once
  the load goes away (``b`` below ``busy_low``) it shrinks, and a spacing under
  ``min_delay_s`` (too short to merge tokens) drops to exactly 0.

With the defaults and a 0.1 s window, a saturated loop (``b`` = 1) takes the
spacing from 0 to the cap in about 0.7 s; an idle one takes it back in about 0.2 s.
The band sits high (0.65-0.85): spacing costs latency, so it engages only when
the loop nears saturation (the router at 128 paced streams, about 70% busy,
sends every token at once).
Each step is scaled by the cap, so the rates do not depend on its value.
"""

from __future__ import annotations

import math
from typing import Any, final

import attrs


def _fraction(instance: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be within [0, 1], got {value!r}")


@final
@attrs.frozen(kw_only=True)
class EgressConfig:
    max_delay_s: float = attrs.field(default=0.05, validator=attrs.validators.ge(0.0))
    """The most a stream's sends are spaced by; 0: every token goes out at once."""
    busy_high: float = attrs.field(default=0.85, validator=_fraction)
    """Above this busy fraction the spacing grows."""
    busy_low: float = attrs.field(default=0.65, validator=_fraction)
    """Below this busy fraction the spacing shrinks; between the two it holds."""
    gain: float = attrs.field(default=1.0, validator=attrs.validators.gt(0.0))
    """Per update: the fraction of ``max_delay_s`` the spacing moves per unit of busy
    fraction outside the band."""
    min_delay_s: float = attrs.field(default=0.001, validator=attrs.validators.ge(0.0))
    """A shrinking spacing below this becomes 0 (too short to merge any tokens)."""

    def __attrs_post_init__(self) -> None:
        if self.busy_low > self.busy_high:
            raise ValueError(
                f"busy_low ({self.busy_low}) must not exceed busy_high ({self.busy_high})"
            )

    @property
    def enabled(self) -> bool:
        return self.max_delay_s > 0.0


def next_spacing(config: EgressConfig, spacing_s: float, busy_fraction: float) -> float:
    """The spacing after one sampling window that measured ``busy_fraction``.

    A measurement outside ``[0, 1]`` is clamped; NaN changes nothing.
    """
    if not config.enabled:
        return 0.0
    if math.isnan(busy_fraction):
        return spacing_s
    busy = min(1.0, max(0.0, busy_fraction))
    step = config.gain * config.max_delay_s
    if busy > config.busy_high:
        return min(config.max_delay_s, spacing_s + step * (busy - config.busy_high))
    if busy < config.busy_low:
        shrunk = spacing_s - step * (config.busy_low - busy)
        return 0.0 if shrunk < config.min_delay_s else shrunk
    return spacing_s


@final
class EgressController:
    """The current per-stream send spacing; :meth:`update` once per sampling window."""

    __slots__ = ("busy_fraction", "config", "spacing_s")

    def __init__(self, config: EgressConfig) -> None:
        self.config = config
        self.spacing_s = 0.0
        """How far apart a stream's sends go out now, in seconds."""
        self.busy_fraction = 0.0
        """The last measurement (for metrics)."""

    def update(self, busy_fraction: float) -> float:
        """Feed one window's busy fraction; returns the new spacing."""
        self.busy_fraction = busy_fraction
        self.spacing_s = next_spacing(self.config, self.spacing_s, busy_fraction)
        return self.spacing_s


def send_deadline(last_sent_at: float | None, spacing_s: float, now: float) -> float | None:
    """None: send now.  Otherwise the time to send at, with whatever has gathered by then.

    ``last_sent_at``: when this stream last sent (None: it has not yet).  All
    three on the shell's one clock.
    """
    if last_sent_at is None or spacing_s <= 0.0:
        return None
    deadline = last_sent_at + spacing_s
    return None if now >= deadline else deadline
