"""How many examples a property test draws: the fast tier's few, or CI's full count.

``HYPOTHESIS_PROFILE=ci`` (set by ``nox -s tests``, which CI runs) draws every test's
full count: hypothesis's 100 where a test names none, or the count it names through
:func:`examples`.  Without it (a developer's ``pytest -m "not slow"``) a fifth of that,
at least 10, so the in-process tier stays well under a minute; the properties checked
are the same, on fewer inputs.
"""

from __future__ import annotations

import os

from hypothesis import settings

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "dev")
_FULL = PROFILE == "ci"

# no deadline: hypothesis's default (200 ms an example) is a timing threshold, and a shared
# two-core machine misses it now and then (a scheduling property failed on it at 270 ms)
settings.register_profile("ci", max_examples=100, deadline=None)
settings.register_profile("dev", max_examples=20, deadline=None)


def examples(full: int) -> int:
    """``full`` under the ci profile; otherwise a fifth of it (10 at least)."""
    return full if _FULL else max(10, full // 5)
