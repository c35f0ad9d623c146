"""The loop's busy fraction, measured by a trio instrument, and the task that feeds it to
the egress policy."""

from __future__ import annotations

import functools
import time

import pytest
import trio
import trio.testing

from pdtrio.protocol.egress import EgressConfig, EgressController, next_spacing
from pdtrio.router import loop_load
from pdtrio.router.loop_load import (
    LoopLoadMeter,
    installed,
    run_egress_control,
    run_egress_sampler,
)
from tests.cluster import wait_for_stats


async def burn_cpu(seconds: float) -> None:
    """Keep the loop busy: spin in slices, yielding between them without ever waiting."""
    end = time.perf_counter() + seconds
    while (now := time.perf_counter()) < end:
        slice_end = min(end, now + 0.005)
        while time.perf_counter() < slice_end:
            pass
        await trio.lowlevel.checkpoint()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_busy_fraction_is_one_minus_the_idle_share_of_the_window() -> None:
    clock = FakeClock()
    meter = LoopLoadMeter(clock)
    clock.now += 1.0  # busy
    meter.before_io_wait(5.0)
    clock.now += 3.0  # idle
    meter.after_io_wait(5.0)
    meter.before_io_wait(0)  # a poll while tasks are runnable: not timed
    clock.now += 0.5
    meter.after_io_wait(0)
    clock.now += 0.5  # busy
    assert meter.take_busy_fraction() == pytest.approx(2.0 / 5.0)
    # a new window starts with each reading
    meter.before_io_wait(1.0)
    clock.now += 2.0
    meter.after_io_wait(1.0)
    assert meter.take_busy_fraction() == 0.0
    clock.now += 1.0
    assert meter.take_busy_fraction() == 1.0
    assert meter.take_busy_fraction() == 0.0  # an empty window


async def test_a_spinning_loop_is_busier_than_a_sleeping_one() -> None:
    meter = LoopLoadMeter()
    with installed(meter):
        meter.take_busy_fraction()
        await trio.sleep(0.3)  # the thing measured: a loop that sleeps
        sleeping = meter.take_busy_fraction()
        await burn_cpu(0.3)
        spinning = meter.take_busy_fraction()
    assert sleeping < 0.5 < spinning, (sleeping, spinning)


async def test_installed_removes_the_instrument_on_exit() -> None:
    meter = LoopLoadMeter()
    with installed(meter):
        pass
    with pytest.raises(KeyError):
        trio.lowlevel.remove_instrument(meter)


class ScriptedMeter:
    """Busy fractions from a list, one per window (then idle)."""

    def __init__(self, windows: list[float]) -> None:
        self.windows = windows
        self.readings = 0

    def take_busy_fraction(self) -> float:
        self.readings += 1
        # the first reading only starts the first window
        index = self.readings - 2
        return self.windows[index] if 0 <= index < len(self.windows) else 0.0


async def test_the_sampler_feeds_each_window_to_the_controller(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = EgressConfig()
    windows = [0.2, 1.0, 1.0, 0.95, 0.6, 0.0, 0.0, 0.0, 0.0, 0.0]
    expected = [0.0]
    for busy in windows:
        expected.append(next_spacing(config, expected[-1], busy))
    controller = EgressController(config)
    published: list[float] = []
    seen: list[float] = []
    async with trio.open_nursery() as nursery:
        meter = ScriptedMeter(windows)
        nursery.start_soon(
            functools.partial(
                run_egress_sampler, meter, controller, interval_s=0.1, on_spacing=published.append
            )
        )
        # (the mock clock's time, instant) halfway through each window
        await trio.sleep(0.05)
        for _ in windows:
            await trio.sleep(0.1)
            seen.append(controller.spacing_s)
        nursery.cancel_scope.cancel()
    assert seen == expected[1:]
    changes = [b for a, b in zip(expected, expected[1:], strict=False) if b != a]
    assert published == changes
    assert published[-1] == 0.0 and max(published) > 0.0


async def test_egress_control_off_installs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[LoopLoadMeter] = []
    monkeypatch.setattr(loop_load, "LoopLoadMeter", lambda: made.append(LoopLoadMeter()))
    controller = EgressController(EgressConfig(max_delay_s=0.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(run_egress_control, controller)
    assert made == []


async def test_egress_control_spaces_sends_while_the_loop_is_busy_and_stops_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[LoopLoadMeter] = []

    def make_meter() -> LoopLoadMeter:
        made.append(LoopLoadMeter())
        return made[-1]

    monkeypatch.setattr(loop_load, "LoopLoadMeter", make_meter)
    controller = EgressController(EgressConfig())
    async with trio.open_nursery() as nursery:
        await nursery.start(run_egress_control, controller)
        assert controller.spacing_s == 0.0
        # a saturated loop: bounded by windows, not by a time of ours
        for _ in range(100):
            await burn_cpu(0.1)
            if controller.spacing_s > 0.0:
                break
        assert controller.spacing_s > 0.0, controller.busy_fraction
        await wait_for_stats(
            lambda: controller.spacing_s == 0.0,
            10,
            what=lambda: f"no spacing once idle (busy {controller.busy_fraction})",
        )
        nursery.cancel_scope.cancel()
    [meter] = made
    with pytest.raises(KeyError):
        trio.lowlevel.remove_instrument(meter)  # removed when the task ended
