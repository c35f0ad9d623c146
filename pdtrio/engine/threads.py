"""A torch worker's CPU threads: how many, on which CPUs, and whether idle ones spin.

torch's CPU wheels run their intra-op parallelism on libgomp, which reads
``OMP_WAIT_POLICY`` once, when torch is imported: :func:`prepare_process` must run
before that (``pdtrio worker`` imports torch only to build its engine). Without a
policy, libgomp's threads spin after each parallel region (300,000 turns) before they
sleep: a decode step runs about a thousand of them, so a worker's helper threads spin
through the step's serial parts and its idle gaps, taking the cores another process
(the router, the other worker of a PD pair) is waiting for.
"""

from __future__ import annotations

import logging
import os
import sys

from pdtrio.config import EngineConfig

log = logging.getLogger("pdtrio.engine")

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"


def prepare_process(config: EngineConfig) -> None:
    """Before torch is imported: the OpenMP wait policy and the process's CPU affinity."""
    if config.omp_wait_policy and WAIT_POLICY_ENV not in os.environ:
        if "torch" in sys.modules:
            log.warning(
                "engine.omp_wait_policy = %r has no effect: torch was imported before it was set",
                config.omp_wait_policy,
            )
        os.environ[WAIT_POLICY_ENV] = config.omp_wait_policy.upper()
    if config.cpu_affinity:
        cpus = set(config.cpu_affinity)
        # every thread there is now (new ones inherit it from the thread that starts them)
        for task in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(task), cpus)
