"""The router's event-loop load, and the task that feeds it to the egress policy.

The **busy fraction** of a window is the share of it the loop's thread was not
idle.  Two meters read it:

- :class:`ThreadSchedMeter` (used where Linux gives it): the kernel's account of
  the thread, ``/proc/thread-self/schedstat`` (time on a CPU, and time runnable
  but waiting for one), read once a window.  It costs nothing per loop
  iteration, where the instrument below runs two hooks on every iteration (and
  there are several a request).
- :class:`LoopLoadMeter` (elsewhere): a trio instrument that adds up the time
  the run loop spends waiting for I/O.

Time the loop's thread spends without a CPU it wants (other processes on the
core) counts as busy with either: the loop could not serve then.  Time another
thread holds the GIL counts as busy for the instrument and as idle for the
kernel's account; the router runs no Python thread beside its loop while it
serves.

:func:`run_egress_control` is what the router runs in its nursery: it opens a
meter for as long as it runs and, every ``interval_s``, feeds the busy fraction
to an :class:`~pdtrio.protocol.tokens.egress.EgressController`, whose ``spacing_s`` the
stream loop reads.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn, Protocol, final

import trio

from pdtrio.protocol.tokens.egress import EgressController

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


@final
class ThreadSchedMeter:
    """A thread's busy fraction per window from the kernel's scheduler statistics.

    ``path`` is the thread's ``schedstat`` file: nanoseconds on a CPU, nanoseconds
    runnable and waiting for one, and a count of time slices.  Raises
    :class:`OSError` when it cannot be read.
    """

    def __init__(self, path: str, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self._busy_ns = self._read_busy_ns()
        except (OSError, ValueError) as exc:
            os.close(self._fd)
            raise OSError(f"{path} is not a schedstat file") from exc
        self._window_started_at = clock()

    @classmethod
    def of_this_thread(cls) -> ThreadSchedMeter:
        return cls(f"/proc/self/task/{threading.get_native_id()}/schedstat")

    def _read_busy_ns(self) -> int:
        on_cpu, waiting, _slices = os.pread(self._fd, 128, 0).split()
        return int(on_cpu) + int(waiting)

    def take_busy_fraction(self) -> float:
        """The busy fraction since the last call (or since the meter was made), in [0, 1]."""
        now = self._clock()
        busy_ns = self._read_busy_ns()
        elapsed = now - self._window_started_at
        busy_s = (busy_ns - self._busy_ns) / 1e9
        self._window_started_at = now
        self._busy_ns = busy_ns
        if elapsed <= 0.0:
            return 0.0
        return min(1.0, max(0.0, busy_s / elapsed))

    def close(self) -> None:
        os.close(self._fd)


@contextmanager
def open_load_meter() -> Iterator[BusyFractionSource]:
    """A meter of the current thread's loop for the ``with`` block: the kernel's account
    where it can be read, else an instrument installed in the current run."""
    try:
        meter = ThreadSchedMeter.of_this_thread()
    except OSError:
        instrument = LoopLoadMeter()
        with installed(instrument):
            yield instrument
        return
    try:
        yield meter
    finally:
        meter.close()


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
    until_busy: Callable[[], Awaitable[bool]] | None = None,
) -> NoReturn:
    """Every ``interval_s``: the meter's busy fraction into ``controller``.

    ``on_spacing`` is called with each new spacing when it changes.  ``until_busy``:
    until a request runs (True: it waited for one); with no request to space and the
    spacing back to none, the sampler waits for one instead of waking an idle loop.
    """
    published = controller.spacing_s
    meter.take_busy_fraction()  # start the first window now
    while True:
        if until_busy is not None and controller.spacing_s == 0.0 and await until_busy():
            meter.take_busy_fraction()  # the window starts with the work, not before it
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
    until_busy: Callable[[], Awaitable[bool]] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep ``controller.spacing_s`` up to date with the loop's load until cancelled.

    With egress spacing off (``max_delay_s`` 0) it returns at once and opens no
    meter, so it costs nothing.
    """
    if not controller.config.enabled:
        task_status.started()
        return
    with open_load_meter() as meter:
        task_status.started()
        await run_egress_sampler(
            meter,
            controller,
            interval_s=interval_s,
            on_spacing=on_spacing,
            until_busy=until_busy,
        )
