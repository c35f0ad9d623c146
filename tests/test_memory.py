"""pdtrio.memory's garbage-collector settings (the heap's are tested with the processes
that use them: tests/worker/test_heap_thresholds.py, tests/router/test_big_inputs.py)."""

from __future__ import annotations

import gc

from pdtrio.memory import ROUTER_YOUNG_COLLECTION_THRESHOLD, collect_young_less_often


def test_only_the_youngest_generations_threshold_is_raised() -> None:
    before = gc.get_threshold()
    try:
        collect_young_less_often(ROUTER_YOUNG_COLLECTION_THRESHOLD)
        assert gc.get_threshold() == (ROUTER_YOUNG_COLLECTION_THRESHOLD, *before[1:])
    finally:
        gc.set_threshold(*before)
