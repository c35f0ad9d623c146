"""A worker's glibc thresholds keep its engine's step buffers in the heap (pdtrio.memory)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdtrio import memory

# a step's buffers: allocated, written and freed again and again (like an engine step's)
_STEPS = """
import resource, sys
import torch
from pdtrio import memory
assert memory.limit_heap_retention(int(sys.argv[1]), int(sys.argv[2]))
def step():
    for size in (4 << 20, 6 << 20, 12 << 20):
        torch.empty(size, dtype=torch.uint8).fill_(1)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults_of_ten_steps(mmap_threshold: int, trim_threshold: int) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _STEPS, str(mmap_threshold), str(trim_threshold)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.slow
@pytest.mark.skipif(not memory.can_trim(), reason="glibc only (mallopt)")
def test_a_workers_step_buffers_are_reused_not_faulted_in_again() -> None:
    # 10 steps of 22 MiB: faulted in each time, that is 56,320 pages of 4 KiB
    one_step = (22 << 20) // 4096
    router = _page_faults_of_ten_steps(memory.MMAP_THRESHOLD_BYTES, 128 * 1024)
    worker = _page_faults_of_ten_steps(
        memory.WORKER_MMAP_THRESHOLD_BYTES, memory.WORKER_TRIM_THRESHOLD_BYTES
    )
    assert router > 5 * one_step  # what the worker's engine paid with the router's thresholds
    # (the heap may still grow once as it settles)
    assert worker < one_step, f"{worker} page faults: the step's buffers went back to the OS"
