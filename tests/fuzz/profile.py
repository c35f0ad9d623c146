"""The hypothesis settings every fuzz test runs under.

CI runs a bounded, derandomized count (reproducible, a few seconds); a longer,
random run is one command::

    PDTRIO_FUZZ_EXAMPLES=20000 python -m pytest tests/fuzz

(add ``--hypothesis-seed=N`` to repeat a random run; a failure prints its
``@reproduce_failure`` blob).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

DEFAULT_EXAMPLES = 120
_requested = os.environ.get("PDTRIO_FUZZ_EXAMPLES")

settings.register_profile(
    "pdtrio-fuzz",
    max_examples=int(_requested) if _requested else DEFAULT_EXAMPLES,
    deadline=None,
    # CI: the same examples every run; a long run explores new ones each time
    derandomize=not _requested,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# a decorator for each test; not loaded globally, so the other suites keep their settings
FUZZ = settings.get_profile("pdtrio-fuzz")
