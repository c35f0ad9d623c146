"""While a thread parses a big body, the GIL comes back to the event loop sooner.

CPython's switch interval (5 ms by default) is paid on each of the several system
calls an answer makes (every one releases the GIL), so during a big parse on a
thread even ``/health`` would wait.  The interval is the interpreter's, so it is
lowered only while some body is being parsed, and put back after.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import final


@final
class GilHandoff:
    """One router's users of the lowered switch interval (on the loop thread only, so a
    plain counter does)."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._users = 0
        # the interval found before this router lowered it (None: it did not)
        self._restore: float | None = None

    @contextmanager
    def prompt(self) -> Iterator[None]:
        """Make the thread holding the GIL hand it over within the interval, meanwhile."""
        if self._users == 0:
            current = sys.getswitchinterval()
            if current > self._interval_s:
                self._restore = current
                sys.setswitchinterval(self._interval_s)
        self._users += 1
        try:
            yield
        finally:
            self._users -= 1
            if self._users == 0 and self._restore is not None:
                # (another router in the process may have put it back already)
                if sys.getswitchinterval() == self._interval_s:
                    sys.setswitchinterval(self._restore)
                self._restore = None
