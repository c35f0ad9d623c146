"""The worker's thread settings: the OpenMP wait policy goes into the environment before
torch is imported (unless the environment has one), the affinity onto every thread."""

from __future__ import annotations

import os

import pytest

from pdtrio.config import EngineConfig
from pdtrio.engine.threads import (
    BRIEF_SPIN_COUNT,
    SPIN_COUNT_ENV,
    WAIT_POLICY_ENV,
    prepare_process,
)


def test_the_wait_policy_is_set_unless_the_environment_has_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(WAIT_POLICY_ENV, raising=False)
    monkeypatch.delenv(SPIN_COUNT_ENV, raising=False)
    prepare_process(EngineConfig(omp_wait_policy=""))
    assert WAIT_POLICY_ENV not in os.environ and SPIN_COUNT_ENV not in os.environ
    prepare_process(EngineConfig())  # the default: brief, a short spin
    assert os.environ[SPIN_COUNT_ENV] == str(BRIEF_SPIN_COUNT)
    assert WAIT_POLICY_ENV not in os.environ
    monkeypatch.delenv(SPIN_COUNT_ENV)
    prepare_process(EngineConfig(omp_wait_policy="passive"))
    assert os.environ[WAIT_POLICY_ENV] == "PASSIVE"
    assert SPIN_COUNT_ENV not in os.environ
    monkeypatch.setenv(WAIT_POLICY_ENV, "ACTIVE")
    prepare_process(EngineConfig(omp_wait_policy="passive"))
    assert os.environ[WAIT_POLICY_ENV] == "ACTIVE"
    monkeypatch.delenv(WAIT_POLICY_ENV)
    monkeypatch.setenv(SPIN_COUNT_ENV, "5")
    prepare_process(EngineConfig(omp_wait_policy="passive"))  # GOMP_SPINCOUNT is kept too
    assert WAIT_POLICY_ENV not in os.environ and os.environ[SPIN_COUNT_ENV] == "5"


def test_the_affinity_is_set_on_every_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WAIT_POLICY_ENV, "PASSIVE")
    allowed = os.sched_getaffinity(0)
    tasks = [int(task) for task in os.listdir("/proc/self/task")]
    before = {task: os.sched_getaffinity(task) for task in tasks}
    one = min(allowed)
    try:
        prepare_process(EngineConfig(cpu_affinity=(one,)))
        for task in tasks:
            try:
                assert os.sched_getaffinity(task) == {one}
            except ProcessLookupError:
                pass  # a thread that ended meanwhile
    finally:
        for task, cpus in before.items():
            try:
                os.sched_setaffinity(task, cpus)
            except ProcessLookupError:
                pass


def test_cpu_numbers_are_checked() -> None:
    with pytest.raises(ValueError, match="cpu_affinity"):
        EngineConfig(cpu_affinity=(-1,))
