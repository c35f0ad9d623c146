"""A torch worker's CPU threads: how many, on which CPUs, and whether idle ones spin.

torch's CPU wheels run their intra-op parallelism on libgomp, which reads
``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` once, when torch is imported:
:func:`prepare_process` must run before that (``pdtrio worker`` imports torch only to
build its engine). Without either, libgomp's threads spin after each parallel region
(300,000 turns, ~5 ms here) before they sleep: a decode step runs about a thousand of
them, so a worker's helper threads spin through its idle gaps too, taking the cores
another process (the router, the other worker of a PD pair) is waiting for.  Sleeping at
once (``PASSIVE``) costs every region a wake-up instead: a SmolLM2 bfloat16 decode step
took 47 against 26 ms (2 threads, Sapphire Rapids).  So by default a thread spins
10,000 turns (~0.25 ms: the gaps between a step's regions) and then sleeps.
"""

from __future__ import annotations

import logging
import os
import sys

from pdtrio.config import EngineConfig

log = logging.getLogger("pdtrio.engine")

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
SPIN_COUNT_ENV = "GOMP_SPINCOUNT"
# turns an idle thread spins under the "brief" policy (~24 ns each here)
BRIEF_SPIN_COUNT = 10_000


def prepare_process(config: EngineConfig) -> None:
    """Before torch is imported: the OpenMP wait policy and the process's CPU affinity."""
    policy = config.omp_wait_policy
    chosen = WAIT_POLICY_ENV in os.environ or SPIN_COUNT_ENV in os.environ
    if policy and not chosen:
        if "torch" in sys.modules:
            log.warning(
                "engine.omp_wait_policy = %r has no effect: torch was imported before it was set",
                policy,
            )
        if policy == "brief":
            os.environ[SPIN_COUNT_ENV] = str(BRIEF_SPIN_COUNT)
        else:
            os.environ[WAIT_POLICY_ENV] = policy.upper()
    if config.cpu_affinity:
        cpus = set(config.cpu_affinity)
        # every thread there is now (new ones inherit it from the thread that starts them)
        for task in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(task), cpus)
