from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdtrio.protocol.tokens.egress import (
    EgressConfig,
    EgressController,
    next_spacing,
    send_deadline,
)

CONFIG = EgressConfig()
busy = st.floats(0.0, 1.0)
light = st.floats(0.0, CONFIG.busy_high)
heavy = st.floats(CONFIG.busy_high, 1.0, exclude_min=True)
idle = st.floats(0.0, CONFIG.busy_low, exclude_max=True)
caps = st.floats(0.0, 1.0)


def run(controller: EgressController, measurements: list[float]) -> list[float]:
    return [controller.update(b) for b in measurements]


# --- examples ------------------------------------------------------------------


def test_light_load_never_delays() -> None:
    controller = EgressController(CONFIG)
    assert run(controller, [0.0, 0.3, 0.69, 0.84, 0.85, 0.5]) == [0.0] * 6


def test_sustained_load_ramps_to_the_cap_and_idle_brings_it_back() -> None:
    controller = EgressController(CONFIG)
    up = run(controller, [1.0] * 20)
    assert up[0] > 0.0
    assert up == sorted(up)
    assert up[-1] == CONFIG.max_delay_s
    down = run(controller, [0.0] * 20)
    assert down == sorted(down, reverse=True)
    assert down[-1] == 0.0


def test_inside_the_band_the_spacing_holds() -> None:
    controller = EgressController(CONFIG)
    held = run(controller, [0.95] * 3)[-1]
    assert run(controller, [0.7, 0.65, 0.85, 0.75]) == [held] * 4


def test_off_means_no_spacing_whatever_the_load() -> None:
    controller = EgressController(EgressConfig(max_delay_s=0.0))
    assert run(controller, [1.0] * 10) == [0.0] * 10


def test_a_nan_measurement_changes_nothing() -> None:
    controller = EgressController(CONFIG)
    held = run(controller, [1.0, 1.0])[-1]
    assert controller.update(math.nan) == held


def test_the_band_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="busy_low"):
        EgressConfig(busy_low=0.8, busy_high=0.6)
    with pytest.raises(ValueError, match="busy_high"):
        EgressConfig(busy_high=1.5)


def test_send_deadline() -> None:
    assert send_deadline(None, 0.05, 10.0) is None  # a stream's first send
    assert send_deadline(10.0, 0.0, 10.0) is None  # no spacing
    assert send_deadline(10.0, 0.05, 10.01) == pytest.approx(10.05)
    assert send_deadline(10.0, 0.05, 10.05) is None
    assert send_deadline(10.0, 0.05, 11.0) is None


# --- properties ----------------------------------------------------------------


@given(st.lists(busy, max_size=200), caps)
def test_never_negative_never_above_the_cap(measurements: list[float], cap: float) -> None:
    controller = EgressController(EgressConfig(max_delay_s=cap))
    for spacing in run(controller, measurements):
        assert 0.0 <= spacing <= cap


@given(st.lists(light, max_size=200))
def test_zero_while_the_load_stays_at_or_below_the_target(measurements: list[float]) -> None:
    assert set(run(EgressController(CONFIG), measurements)) <= {0.0}


@given(st.lists(busy, max_size=100), st.lists(heavy, min_size=1, max_size=100))
def test_sustained_load_never_shrinks_the_spacing(before: list[float], load: list[float]) -> None:
    controller = EgressController(CONFIG)
    run(controller, before)
    previous = controller.spacing_s
    for spacing in run(controller, load):
        assert spacing >= previous
        assert spacing > 0.0
        previous = spacing


@given(st.lists(busy, max_size=100), busy, busy, st.integers(1, 50))
def test_more_load_never_means_less_spacing(
    history: list[float], first: float, second: float, windows: int
) -> None:
    lighter, heavier = sorted((first, second))
    spacing = [EgressController(CONFIG), EgressController(CONFIG)]
    for controller, load in zip(spacing, (lighter, heavier), strict=True):
        run(controller, history + [load] * windows)
    assert spacing[0].spacing_s <= spacing[1].spacing_s


@given(st.lists(busy, max_size=100))
def test_a_saturated_loop_reaches_the_cap(history: list[float]) -> None:
    controller = EgressController(CONFIG)
    run(controller, history)
    # each window at full load moves the spacing up by gain * cap * (1 - busy_high)
    windows = math.ceil(1 / (CONFIG.gain * (1.0 - CONFIG.busy_high)))
    assert run(controller, [1.0] * windows)[-1] == CONFIG.max_delay_s


@given(st.lists(busy, max_size=100), st.lists(idle, min_size=1, max_size=100))
def test_returns_to_zero_once_the_load_goes_away(history: list[float], calm: list[float]) -> None:
    controller = EgressController(CONFIG)
    run(controller, history)
    previous = controller.spacing_s
    for spacing in run(controller, calm):
        assert spacing <= previous
        previous = spacing
    # a loop clearly below the band: back to exactly zero within a bounded number of windows
    margin = 0.1
    windows = math.ceil(1 / (CONFIG.gain * margin))
    assert run(controller, [CONFIG.busy_low - margin] * windows)[-1] == 0.0


@given(st.lists(busy, max_size=100), busy)
def test_next_spacing_is_what_the_controller_does(history: list[float], load: float) -> None:
    controller = EgressController(CONFIG)
    run(controller, history)
    assert next_spacing(CONFIG, controller.spacing_s, load) == controller.update(load)


@given(
    st.none() | st.floats(0.0, 1e6),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1e6),
)
def test_send_deadline_is_now_or_in_the_future(
    last_sent_at: float | None, spacing: float, now: float
) -> None:
    deadline = send_deadline(last_sent_at, spacing, now)
    if deadline is None:
        assert last_sent_at is None or spacing == 0.0 or now >= last_sent_at + spacing
    else:
        assert last_sent_at is not None
        assert now < deadline == last_sent_at + spacing
