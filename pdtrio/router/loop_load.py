"""The router's event-loop load, and the task that feeds it to the egress policy.

:class:`LoopLoadMeter` is a trio instrument that adds up the time the run loop
spends waiting for I/O, that is, idle; over a window, the **busy fraction** is
``1 - idle / elapsed``.  It costs two clock reads per loop iteration that
actually waits, and nothing per task: a poll with a zero timeout (tasks are
runnable, so the loop is busy anyway) is not timed at all.  Time the loop's
thread spends without the CPU (other threads holding the GIL, other processes
on the core) counts as busy: the loop could not serve then either.

:func:`run_egress_control` is what the router runs in its nursery: it installs a
meter for as long as it runs and, every ``interval_s``, feeds the busy fraction
to an :class:`~pdtrio.protocol.egress.EgressController`, whose ``spacing_s`` the
stream loop reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn, Protocol, final

import trio

from pdtrio.protocol.egress import EgressController

SAMPLE_INTERVAL_S = 0.1


@final
class LoopLoadMeter(trio.abc.Instrument):
    """Time the run loop spends idle (waiting for I/O), read as a busy fraction per window.

    Read it from a task of the run it is installed in (the loop is then never
    inside a wait, so the window is exact).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._idle_s = 0.0
        self._wait_started_at = 0.0
        self._window_started_at = clock()

    def before_io_wait(self, timeout: float) -> None:
        if timeout > 0:
            self._wait_started_at = self._clock()

    def after_io_wait(self, timeout: float) -> None:
        if timeout > 0:
            self._idle_s += self._clock() - self._wait_started_at

    def take_busy_fraction(self) -> float:
        """The busy fraction since the last call (or since the meter was made), in [0, 1]."""
        now = self._clock()
        elapsed = now - self._window_started_at
        idle = self._idle_s
        self._window_started_at = now
        self._idle_s = 0.0
        if elapsed <= 0.0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - idle / elapsed))


@contextmanager
def installed(instrument: trio.abc.Instrument) -> Iterator[None]:
    """``instrument`` is installed in the current run for the ``with`` block."""
    trio.lowlevel.add_instrument(instrument)
    try:
        yield
    finally:
        trio.lowlevel.remove_instrument(instrument)


class BusyFractionSource(Protocol):
    def take_busy_fraction(self) -> float: ...


async def run_egress_sampler(
    meter: BusyFractionSource,
    controller: EgressController,
    *,
    interval_s: float = SAMPLE_INTERVAL_S,
    on_spacing: Callable[[float], None] | None = None,
) -> NoReturn:
    """Every ``interval_s``: the meter's busy fraction into ``controller``.

    ``on_spacing`` is called with each new spacing when it changes.
    """
    published = controller.spacing_s
    meter.take_busy_fraction()  # start the first window now
    while True:
        await trio.sleep(interval_s)
        spacing = controller.update(meter.take_busy_fraction())
        if on_spacing is not None and spacing != published:
            on_spacing(spacing)
        published = spacing


async def run_egress_control(
    controller: EgressController,
    *,
    interval_s: float = SAMPLE_INTERVAL_S,
    on_spacing: Callable[[float], None] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep ``controller.spacing_s`` up to date with the loop's load until cancelled.

    With egress spacing off (``max_delay_s`` 0) it returns at once and installs
    nothing, so it costs nothing.
    """
    if not controller.config.enabled:
        task_status.started()
        return
    meter = LoopLoadMeter()
    with installed(meter):
        task_status.started()
        await run_egress_sampler(meter, controller, interval_s=interval_s, on_spacing=on_spacing)
