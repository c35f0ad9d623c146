"""Prometheus plumbing shared by the router and the workers (``prometheus_client``).

Each router and worker object owns one ``CollectorRegistry`` (tests run several
in one process: the default global registry would register names twice).
State that already lives in an object (an instance's link, the engine's KV
blocks) is read at scrape time by a custom collector, never pushed per event.

Multiprocess mode: under ``hypercorn -w N`` each process runs its own router.
With ``PROMETHEUS_MULTIPROC_DIR`` set (before the processes start, to an empty
directory), ``prometheus_client`` keeps every counter, gauge and histogram
value in per-process files there, and :func:`exposition` answers with all
processes' values summed (``MultiProcessCollector``).  What a custom
collector reports comes from the answering process only (see docs/metrics.md).

Per-token paths do not call ``prometheus_client``: :class:`LocalHistogram`
counts observations in a plain list and merges them into a ``Histogram`` in
bulk, a handful of calls per merge whatever the number of observations.

Exemplars (a traced request's ``trace_id`` on the bucket it fell in) are shown only
to a scrape that asks for OpenMetrics (``Accept: application/openmetrics-text``);
under multiprocess mode ``prometheus_client`` keeps none.
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Final, final

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.openmetrics.exposition import (
    CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE_TEXT,
)
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar

MULTIPROC_DIR_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE: Final = b"text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE: Final = OPENMETRICS_CONTENT_TYPE_TEXT.encode()
_OPENMETRICS_MEDIA_TYPE: Final = "application/openmetrics-text"

# latencies from a millisecond (a token gap) to minutes (a long completion)
LATENCY_BUCKETS_S: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


def multiprocess_dir() -> str | None:
    """The directory multiprocess mode shares values through, or None (one process)."""
    return os.environ.get(MULTIPROC_DIR_ENV) or None


def wants_openmetrics(accept: str | None) -> bool:
    """Whether a scrape's ``Accept`` header asks for OpenMetrics (the format with exemplars)."""
    return accept is not None and _OPENMETRICS_MEDIA_TYPE in accept.lower()


def exposition(
    registry: CollectorRegistry,
    live: Iterable[Collector] = (),
    *,
    multiprocess: str | None = None,
    openmetrics: bool = False,
) -> bytes:
    """The text format for ``/metrics`` (``openmetrics``: OpenMetrics, with exemplars).

    ``multiprocess``: the shared directory (every process's values, summed) instead
    of ``registry``; the ``live`` collectors (this process's state) are added either way.
    """
    generate = generate_openmetrics if openmetrics else generate_latest
    if multiprocess is None:
        return generate(registry)
    scrape = CollectorRegistry(auto_describe=False)
    MultiProcessCollector(scrape, path=multiprocess)  # type: ignore[no-untyped-call]
    for collector in live:
        scrape.register(collector)
    return generate(scrape)


@final
class LocalHistogram:
    """Observations counted in a plain list, merged into a Histogram child in bulk.

    ``observe`` costs a bisect and two additions; ``merge_into`` a few calls per
    non-empty bucket, then starts over.  The bounds must be the histogram's.
    ``observe_traced`` also keeps, per bucket, the latest traced observation as its
    exemplar (only traced requests pay for it).
    """

    __slots__ = ("_bounds", "_counts", "_exemplars", "_total", "count")

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = tuple(bounds)
        self._counts = [0] * (len(self._bounds) + 1)  # the last: +Inf
        self._total = 0.0
        self.count = 0
        # bucket index -> the latest traced observation there, not merged yet
        self._exemplars: dict[int, Exemplar] = {}

    def observe(self, value: float) -> None:
        # bisect_left: the first bound >= value, as Histogram.observe's `value <= bound`
        self._counts[bisect_left(self._bounds, value)] += 1
        self._total += value
        self.count += 1

    def observe_traced(self, value: float, trace_id: str) -> None:
        """``observe``, the observation then its bucket's exemplar (``trace_id``'s)."""
        index = bisect_left(self._bounds, value)
        self._counts[index] += 1
        self._total += value
        self.count += 1
        self._exemplars[index] = Exemplar({"trace_id": trace_id}, value, time.time())

    def merge_into(self, histogram: Histogram) -> None:
        """Add what was observed to ``histogram`` (a child, its labels chosen); reset."""
        if not self.count:
            return
        # prometheus_client keeps per-bucket (not cumulative) counts and a sum: the same
        # values observe() would have added, one inc per bucket instead of per observation
        buckets = histogram._buckets  # noqa: SLF001 - no public bulk observe
        counts = self._counts
        for index, count in enumerate(counts):
            if count:
                buckets[index].inc(count)
                counts[index] = 0
        histogram._sum.inc(self._total)  # noqa: SLF001
        self._total = 0.0
        self.count = 0
        exemplars = self._exemplars
        if exemplars:
            for index, exemplar in exemplars.items():
                buckets[index].set_exemplar(exemplar)
            exemplars.clear()
