"""The loop's busy fraction, measured by the kernel's account of the loop's thread or by a
trio instrument, and the task that feeds it to the egress policy."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio
import trio.testing

from pdtrio.protocol.tokens.egress import EgressConfig, EgressController, next_spacing
from pdtrio.router import loop_load
from pdtrio.router.loop_load import (
    BusyFractionSource,
    LoopLoadMeter,
    ThreadSchedMeter,
    installed,
    open_load_meter,
    run_egress_control,
    run_egress_sampler,
)
from pdtrio.router.request.running_requests import RunningRequests
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


def test_the_kernels_account_counts_time_on_a_cpu_and_waiting_for_one(tmp_path: Path) -> None:
    schedstat = tmp_path / "schedstat"
    schedstat.write_text("1000000000 500000000 10\n")
    clock = FakeClock()
    meter = ThreadSchedMeter(str(schedstat), clock)
    try:
        clock.now += 4.0
        schedstat.write_text("2000000000 1000000000 30\n")  # 1 s on a CPU, 0.5 s waiting
        assert meter.take_busy_fraction() == pytest.approx(1.5 / 4.0)
        clock.now += 1.0
        assert meter.take_busy_fraction() == 0.0  # a new window starts with each reading
        assert meter.take_busy_fraction() == 0.0  # an empty window
    finally:
        meter.close()


def test_a_file_that_is_not_a_schedstat_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "status"
    other.write_text("Name: python\n")
    with pytest.raises(OSError, match="not a schedstat"):
        ThreadSchedMeter(str(other))
    with pytest.raises(OSError):
        ThreadSchedMeter(str(tmp_path / "missing"))


async def test_the_kernels_account_of_a_spinning_loop_is_busier_than_a_sleeping_one() -> None:
    try:
        meter = ThreadSchedMeter.of_this_thread()
    except OSError:
        pytest.skip("this kernel gives no schedstat")
    try:
        meter.take_busy_fraction()
        await trio.sleep(0.3)
        sleeping = meter.take_busy_fraction()
        await burn_cpu(0.3)
        spinning = meter.take_busy_fraction()
    finally:
        meter.close()
    assert sleeping < 0.5 < spinning, (sleeping, spinning)


async def test_without_the_kernels_account_the_instrument_measures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unreadable() -> ThreadSchedMeter:
        raise OSError("no schedstat here")

    monkeypatch.setattr(ThreadSchedMeter, "of_this_thread", unreadable)
    with open_load_meter() as meter:
        assert isinstance(meter, LoopLoadMeter)
    with pytest.raises(KeyError):
        trio.lowlevel.remove_instrument(meter)  # removed on exit


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


async def test_an_idle_router_samples_nothing_until_a_request_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # with nothing to space (no request, spacing back to none) the sampler waits for a
    # request rather than wake the loop ten times a second; a busy spell that ended is
    # sampled until its spacing is gone
    config = EgressConfig()
    controller = EgressController(config)
    requests: list[bool] = []  # running requests
    arrived = trio.lowlevel.ParkingLot()

    async def until_busy() -> bool:
        if requests:
            return False
        await arrived.park()
        return True

    meter = ScriptedMeter([1.0, 1.0])  # then idle
    async with trio.open_nursery() as nursery:
        requests.append(True)
        nursery.start_soon(
            functools.partial(
                run_egress_sampler, meter, controller, interval_s=0.1, until_busy=until_busy
            )
        )
        await trio.sleep(0.25)
        assert controller.spacing_s > 0.0  # the busy windows
        requests.clear()
        await trio.sleep(60)
        assert controller.spacing_s == 0.0  # idle windows took it back to none ...
        readings = meter.readings
        await trio.sleep(60)
        assert meter.readings == readings  # ... and then nothing was sampled
        requests.append(True)
        arrived.unpark_all()
        await trio.sleep(0.25)
        # a reading to start the window with the request, and one a window since
        assert meter.readings == readings + 3
        nursery.cancel_scope.cancel()


async def test_running_requests_wake_what_waits_for_the_first_request() -> None:
    requests = RunningRequests(lambda _: None, write_timeout_s=10.0, cut_grace_s=1.0)
    woke: list[bool] = []
    async with trio.open_nursery() as nursery:

        async def wait() -> None:
            woke.append(await requests.until_busy())

        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert woke == []
        scope = trio.CancelScope()
        requests.started(scope, object(), 0.0)  # type: ignore[arg-type]
        await trio.testing.wait_all_tasks_blocked()
        assert woke == [True]
        assert await requests.until_busy() is False  # one runs: no wait
        requests.ended(scope)


async def test_egress_control_off_opens_no_meter(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[object] = []

    @contextmanager
    def recorded() -> Iterator[BusyFractionSource]:
        opened.append(object())
        yield LoopLoadMeter()

    monkeypatch.setattr(loop_load, "open_load_meter", recorded)
    controller = EgressController(EgressConfig(max_delay_s=0.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(run_egress_control, controller)
    assert opened == []


@pytest.mark.parametrize("meter_kind", ["kernel", "instrument"])
async def test_egress_control_spaces_sends_while_the_loop_is_busy_and_stops_after(
    monkeypatch: pytest.MonkeyPatch, meter_kind: str
) -> None:
    made: list[BusyFractionSource] = []
    open_meter = loop_load.open_load_meter
    if meter_kind == "instrument":

        def unreadable() -> ThreadSchedMeter:
            raise OSError("no schedstat here")

        monkeypatch.setattr(ThreadSchedMeter, "of_this_thread", unreadable)

    @contextmanager
    def recorded() -> Iterator[BusyFractionSource]:
        with open_meter() as meter:
            made.append(meter)
            yield meter

    monkeypatch.setattr(loop_load, "open_load_meter", recorded)
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
    if meter_kind == "kernel" and isinstance(meter, ThreadSchedMeter):
        return  # (this kernel gives a schedstat)
    assert isinstance(meter, LoopLoadMeter)
    with pytest.raises(KeyError):
        trio.lowlevel.remove_instrument(meter)  # removed when the task ended
