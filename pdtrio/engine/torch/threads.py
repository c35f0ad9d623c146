"""The torch engine's intra-op threads (the process's OpenMP wait policy and CPU affinity
are set before torch is imported: :mod:`pdtrio.engine.threads`).

One thread of the process does the engine's parallel torch work (the engine thread).
libgomp gives each thread that starts parallel regions a team of its own, and once a
process has more OpenMP threads than CPUs it cuts every thread's spin before sleeping to
a thousand turns (``GOMP_SPINCOUNT`` cannot raise it), so each of a step's thousand
parallel regions wakes its helpers from sleep.  A SmolLM2 bfloat16 decode step on 2 cores
(Sapphire Rapids) took 47 ms on the engine thread while the thread that loaded the model
kept its team, against 26 ms without.  So the model loads in a thread that ends after
it (its team ends with it), and the worker threads that touch the KV cache
(``single_threaded``) multiply on one thread, starting no team.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from pdtrio.config import EngineConfig
from pdtrio.engine.threads import SPIN_COUNT_ENV, WAIT_POLICY_ENV

log = logging.getLogger("pdtrio.engine")

T = TypeVar("T")
_OPENMP_RUNTIMES = ("libgomp", "libiomp", "libomp")


def apply_num_threads(config: EngineConfig) -> None:
    """torch's intra-op threads: ``engine.num_threads``, or torch's default for 0."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    log.info(
        "torch threads: %d intra-op, %s=%s, %s=%s, CPUs %s",
        torch.get_num_threads(),
        WAIT_POLICY_ENV,
        os.environ.get(WAIT_POLICY_ENV, "(unset)"),
        SPIN_COUNT_ENV,
        os.environ.get(SPIN_COUNT_ENV, "(unset)"),
        ",".join(str(c) for c in sorted(os.sched_getaffinity(0))),
    )


def in_passing_thread(work: Callable[[], T]) -> T:
    """``work()`` in a new thread that ends with it: the OpenMP team its parallel torch
    work starts ends too, and leaves the engine thread's the only one."""
    results: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(work())
        except BaseException as exc:  # re-raised in the caller's thread below
            errors.append(exc)

    # (a daemon: an interrupted caller's process need not wait for a load to finish)
    thread = threading.Thread(target=run, name="pdtrio-engine-load", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return results[0]


def single_threaded(work: Callable[..., T], *args: object) -> T:
    """``work(*args)`` in a worker thread (``trio.to_thread``), its torch work on that
    thread alone: it starts no OpenMP team beside the engine thread's (see the module's
    docstring).  Only the calling thread's OpenMP setting changes (``torch.set_num_threads``
    would change MKL's for every thread too)."""
    set_threads = _omp_set_num_threads()
    if set_threads is not None:
        torch.get_num_threads()  # torch sets a new thread's count once, at its first use
        set_threads(1)
    return work(*args)


@functools.cache
def _omp_set_num_threads() -> Callable[[int], object] | None:
    """The OpenMP runtime's ``omp_set_num_threads`` (the calling thread's setting), from the
    runtime torch loaded; None where none is found (then a side thread's torch work may
    start a team)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if any(name in os.path.basename(path) for name in _OPENMP_RUNTIMES):
            try:
                function: Callable[[int], object] = ctypes.CDLL(path).omp_set_num_threads
            except (OSError, AttributeError):
                continue
            return function
    return None
