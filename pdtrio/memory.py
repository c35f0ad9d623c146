"""Giving the memory of big requests back to the operating system (glibc only).

A request body of megabytes, and the millions of objects parsed from it, are
freed when the request ends, but glibc keeps much of it for reuse, so the
process's resident memory stays at its high-water mark (the router went from
88 to 204 MB after three huge requests, and stayed there):

- freeing a big mmap-ed buffer (the body) raises glibc's mmap threshold to its
  size, and its trim threshold to twice that: from then on buffers of up to
  15 MB come from the heaps, and up to 30 MB free at the top of a thread's
  heap is never given back, not even by ``malloc_trim``.
  :func:`limit_heap_retention` fixes both thresholds once at start-up;
- what is freed in the middle of a heap (the main one, or the arena of the
  thread that parsed) stays there: ``malloc_trim(0)`` gives those pages back.
  It needs no GIL (ctypes releases it), so :class:`HeapTrimmer` runs it on a
  thread, a moment after a big request's last references are gone;
- a request's objects caught in a reference cycle (an exception kept in a
  local of a frame in its own traceback; an httpx response and its stream)
  live on until a full garbage collection, and with them whatever they hold
  (a 15 MB prompt, its encoded copy): the trimmer collects first.  A full
  collection walks every object, so :func:`freeze_startup_objects` takes what
  start-up made, which lives as long as the process, out of its way.

Elsewhere than on glibc (macOS, musl) there is no ``mallopt``/``malloc_trim``
and this does nothing.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import sys
from collections.abc import Callable
from typing import Any, Final, final

import trio

log = logging.getLogger("pdtrio.memory")

# How long after a big request the trim waits: its response is written and its
# objects freed by then, and a burst of big requests is trimmed once.
TRIM_DELAY_S: Final = 0.05
# Buffers from this size up are mmap-ed, and munmap-ed (given back) when freed;
# glibc's own starting value is 128 KiB, which it then raises as it sees fit.
MMAP_THRESHOLD_BYTES: Final = 1024 * 1024
_M_TRIM_THRESHOLD: Final = -1  # <malloc.h>
_M_MMAP_THRESHOLD: Final = -3
_DEFAULT_TRIM_THRESHOLD_BYTES: Final = 128 * 1024
# A worker's engine allocates and frees buffers of megabytes every step (a SmolLM2 decode
# step of 8 sequences: about 55 of 1-25 MB): with the router's thresholds each one was
# mmap-ed, faulted in page by page and unmapped again, 39,000 page faults a step, and the
# step took 1.9x as long (131 against 68 ms).  So a worker keeps buffers up to glibc's
# largest mmap threshold (32 MiB on 64-bit) in its heaps, and up to twice that free at a
# heap's top; a huge prompt's memory still goes back through the trim after it.
WORKER_MMAP_THRESHOLD_BYTES: Final = 32 * 1024 * 1024
WORKER_TRIM_THRESHOLD_BYTES: Final = 64 * 1024 * 1024


def _glibc_function(name: str, *argtypes: Any) -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the symbols already in the process, libc's among them
        function = getattr(libc, name)
    except (OSError, AttributeError):  # not glibc
        return None
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    found: Callable[..., int] = function
    return found


_malloc_trim: Final = _glibc_function("malloc_trim", ctypes.c_size_t)
_mallopt: Final = _glibc_function("mallopt", ctypes.c_int, ctypes.c_int)


def limit_heap_retention(
    mmap_threshold: int = MMAP_THRESHOLD_BYTES,
    trim_threshold: int = _DEFAULT_TRIM_THRESHOLD_BYTES,
) -> bool:
    """Fix glibc's mmap and trim thresholds, process-wide: big buffers go back when freed.

    Idempotent; call it once at start-up, before any big request.  Returns
    whether the thresholds were set (False where this is not glibc).
    """
    if _mallopt is None:
        return False
    # setting either turns glibc's adjustment of both off
    return bool(_mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        _mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )


def freeze_startup_objects() -> None:
    """Collect, then move every object there is out of the garbage collector's sight.

    For a process that has just started (the router once its lifespan is up):
    what exists then lives as long as the process, and every full collection
    would walk it again.  Not for a process that runs several apps in turn (a
    test run): what they leave behind would never be collected.
    """
    gc.collect()
    gc.freeze()


# young objects the router may gain, net, before the collector walks them: its request
# path leaves no cycles (its young collections free nothing), while each walks every
# object of the requests in flight, so Python's default of 700 runs them far too often
# (benchmarks.router_cost measures the setting)
ROUTER_YOUNG_COLLECTION_THRESHOLD: Final = 10_000


def collect_young_less_often(threshold: int) -> None:
    """Raise the garbage collector's threshold for its youngest generation only.

    For a process whose objects are freed by their reference counts (no cycles
    made per request): what a young collection would walk is alive anyway.
    """
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(threshold, older, oldest)


def can_trim() -> bool:
    """Whether this process can hand freed heap memory back (Linux with glibc)."""
    return _malloc_trim is not None


def trim_heap() -> bool:
    """``malloc_trim(0)``: True if memory went back to the OS. Blocking: call it on a thread."""
    if _malloc_trim is None:
        return False
    return bool(_malloc_trim(0))


@final
class HeapTrimmer:
    """Trims the heap on a thread a moment after big requests: one trim for a burst of them.

    ``trim_soon()`` is cheap and never waits; call it from a trio task once a
    big request is done with (after its response is sent is best).  The trim
    runs in a trio system task, so it holds up no request.
    """

    def __init__(self, delay_s: float = TRIM_DELAY_S, *, collect_cycles: bool = True) -> None:
        self.delay_s = delay_s
        self.collect_cycles = collect_cycles
        self.trims = 0  # trims done (tests and metrics)
        self._wanted = False
        self._running = False

    def trim_soon(self) -> None:
        if _malloc_trim is None:
            return
        self._wanted = True
        if not self._running:
            self._running = True
            trio.lowlevel.spawn_system_task(self._run, name="pdtrio.memory.HeapTrimmer")

    async def _run(self) -> None:
        try:
            while self._wanted:
                self._wanted = False
                await trio.sleep(self.delay_s)
                if self.collect_cycles:
                    gc.collect()  # on the loop: it holds the GIL wherever it runs
                await trio.to_thread.run_sync(trim_heap)
                self.trims += 1
        except Exception:  # a system task that raises takes the whole run down
            log.exception("trimming the heap failed")
        finally:
            self._running = False
