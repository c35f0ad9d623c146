"""The worker's thread settings: the OpenMP wait policy goes into the environment before
torch is imported (unless the environment has one), the affinity onto every thread."""

from __future__ import annotations

import os
import subprocess
import sys

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


_COUNT_THREADS = """
import os, sys, time, trio
os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
from pdtrio.config import EngineConfig
from pdtrio.engine.torch.engine import TorchEngine
from pdtrio.engine.torch.threads import apply_num_threads

def threads(at_most):
    # an ended thread's OpenMP helpers end soon after it, not at once
    for _ in range(100):
        if len(os.listdir("/proc/self/task")) <= at_most:
            break
        time.sleep(0.05)
    return len(os.listdir("/proc/self/task"))

config = EngineConfig(model="tiny-random", num_threads=int(sys.argv[1]), num_kv_blocks=512)
apply_num_threads(config)  # (setting 2 starts a thread of torch's: not one of a team)
before = threads(1000)
engine = TorchEngine.from_config(config)
loaded = threads(before)
blocks = tuple(range(512))

async def read_and_write():
    data = await engine.read_blocks(blocks)
    await engine.write_blocks(blocks, data)

trio.run(read_and_write)
print(loaded - before, threads(loaded + 1) - loaded)
"""


@pytest.mark.slow
def test_only_the_engine_thread_starts_openmp_threads() -> None:
    """The model loads in a thread that ends after it, and the KV cache's reads and writes
    in trio's worker threads start no OpenMP team: a second team in a process makes libgomp
    cut every thread's spin (pdtrio/engine/torch/threads.py).  The threads an engine on two
    OpenMP threads leaves are those one on a single thread (no team at all) leaves."""

    def threads_left(intra_op_threads: int) -> list[int]:
        found = subprocess.run(
            [sys.executable, "-c", _COUNT_THREADS, str(intra_op_threads)],
            capture_output=True,
            text=True,
            check=True,
        )
        return [int(count) for count in found.stdout.split()]

    assert threads_left(2) == threads_left(1)
