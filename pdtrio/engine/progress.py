"""What a model load is doing: its stages at INFO, and a bar while it reads the weights.

A 20 s load used to print its first line and its last; an operator watching it could
not tell a slow disk from a hang.  Each stage (resolving the name, reading the
weights, building the model, allocating the KV cache) is one INFO line, and while the
weights are read a bar redraws itself on stderr, only when stderr is a terminal (a log
file or a collector gets the lines alone).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar, final

log = logging.getLogger("pdtrio.engine.load")

T = TypeVar("T")

_BAR_WIDTH = 30
_REDRAW_S = 0.1  # at most ten redraws a second: a bar is for eyes, not for the log


@final
class LoadProgress:
    """One model load's progress: ``stage`` lines, and ``track`` over the weights."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = sys.stderr if stream is None else stream
        isatty = getattr(self._stream, "isatty", None)
        self.shows_bar = bool(isatty is not None and isatty())

    def stage(self, message: str, *args: object) -> None:
        log.info(message, *args)

    def track(self, items: Iterable[T], total: int, what: str) -> Iterator[T]:
        """``items`` as they come, counted: one INFO line at the end (how many, how long),
        and the bar on a terminal in between."""
        started = time.monotonic()
        drawn_at = 0.0
        count = 0
        try:
            for item in items:
                yield item
                count += 1
                now = time.monotonic()
                if self.shows_bar and (now - drawn_at >= _REDRAW_S or count == total):
                    self._draw(count, total, what, now - started)
                    drawn_at = now
        finally:
            if self.shows_bar and drawn_at:
                self._stream.write("\n")
                self._stream.flush()
        log.info("read %d %s in %.1f s", count, what, time.monotonic() - started)

    def _draw(self, count: int, total: int, what: str, elapsed: float) -> None:
        done = min(count, total) / total if total else 1.0
        filled = int(done * _BAR_WIDTH)
        bar = "#" * filled + "." * (_BAR_WIDTH - filled)
        self._stream.write(f"\rloading weights [{bar}] {count}/{total} {what} {elapsed:.1f} s")
        self._stream.flush()
