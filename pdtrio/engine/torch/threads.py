"""The torch engine's intra-op threads (the process's OpenMP wait policy and CPU affinity
are set before torch is imported: :mod:`pdtrio.engine.threads`)."""

from __future__ import annotations

import logging
import os

import torch

from pdtrio.config import EngineConfig
from pdtrio.engine.threads import WAIT_POLICY_ENV

log = logging.getLogger("pdtrio.engine")


def apply_num_threads(config: EngineConfig) -> None:
    """torch's intra-op threads: ``engine.num_threads``, or torch's default for 0."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    log.info(
        "torch threads: %d intra-op, %s=%s, CPUs %s",
        torch.get_num_threads(),
        WAIT_POLICY_ENV,
        os.environ.get(WAIT_POLICY_ENV, "(libgomp's default)"),
        ",".join(str(c) for c in sorted(os.sched_getaffinity(0))),
    )
