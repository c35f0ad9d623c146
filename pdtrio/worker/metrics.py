"""A worker's ``/metrics``: its engine's steps and KV cache, its KV transfers.

Steps are observed as they happen (the engine calls :meth:`WorkerMetrics.step`
once per step, from its thread for torch); everything else (KV blocks,
queue, transfers) is read from the engine and the transport at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import TYPE_CHECKING, Any, Final, Protocol, final

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdtrio.engine.api import Engine
from pdtrio.kv.api import KvTransport
from pdtrio.kv.digest import KvDigestCounts
from pdtrio.worker.http_listener import HttpConnections

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric


class WorkerState(Protocol):
    """What the metrics read of the worker (``pdtrio.worker.server.Worker``)."""

    @property
    def engine(self) -> Engine: ...

    @property
    def transport(self) -> KvTransport: ...

    @property
    def leases(self) -> Sized: ...

    @property
    def kv_digest_counts(self) -> KvDigestCounts: ...

    @property
    def http_connections(self) -> HttpConnections: ...


STEP_BUCKETS_S: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
BATCH_SIZE_BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@final
class WorkerMetrics:
    """One worker's metrics, in a registry of its own (tests run several per process)."""

    def __init__(self, worker: WorkerState) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.step_seconds = Histogram(
            "pdtrio_engine_step_seconds",
            "Time of one engine step that computed something.",
            registry=registry,
            buckets=STEP_BUCKETS_S,
        )
        self.batch_size = Histogram(
            "pdtrio_engine_batch_size",
            "Requests one engine step ran (prefills and decodes).",
            registry=registry,
            buckets=BATCH_SIZE_BUCKETS,
        )
        self.tokens = Counter(
            "pdtrio_engine_generated_tokens",
            "Tokens the engine's steps produced (rate: tokens per second).",
            registry=registry,
        )
        registry.register(WorkerStateCollector(worker))

    def step(self, seconds: float, batch_size: int, tokens: int) -> None:
        """An engine step ran (an ``engine.api.StepObserver``)."""
        self.step_seconds.observe(seconds)
        self.batch_size.observe(batch_size)
        if tokens:
            self.tokens.inc(tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@final
class WorkerStateCollector(Collector):
    """The engine's KV cache and queue, the transport's totals: read at scrape time."""

    def __init__(self, worker: WorkerState) -> None:
        self._worker = worker

    def describe(self) -> Iterator[Metric]:
        return iter(())  # nothing to check at registration; collect reads the worker

    def collect(self) -> Iterator[Metric]:
        worker = self._worker
        engine = worker.engine.statistics()
        yield GaugeMetricFamily(
            "pdtrio_engine_kv_blocks_used",
            "KV cache blocks held by requests.",
            value=engine.kv_blocks_in_use,
        )
        yield GaugeMetricFamily(
            "pdtrio_engine_kv_blocks_free",
            "KV cache blocks free.",
            value=engine.kv_blocks_total - engine.kv_blocks_in_use,
        )
        yield GaugeMetricFamily(
            "pdtrio_engine_running_requests",
            "Requests the engine holds (prefilling or decoding).",
            value=engine.running_requests,
        )
        yield GaugeMetricFamily(
            "pdtrio_engine_queue_length",
            "Requests waiting for an engine step (prefills queued, decodes past the batch).",
            value=engine.waiting_requests,
        )
        yield CounterMetricFamily(
            "pdtrio_engine_prefix_cache_hit_tokens",
            "Prompt tokens whose KV the prefix cache had (reused, not computed).",
            value=engine.prefix_cache_hit_tokens,
        )
        yield CounterMetricFamily(
            "pdtrio_engine_prefix_cache_miss_tokens",
            "Prompt tokens looked up in the prefix cache and computed.",
            value=engine.prefix_cache_miss_tokens,
        )
        yield CounterMetricFamily(
            "pdtrio_engine_prefix_cache_evicted_blocks",
            "Cached KV blocks no request held, evicted to make room.",
            value=engine.prefix_cache_evicted_blocks,
        )
        yield GaugeMetricFamily(
            "pdtrio_engine_prefix_cache_blocks",
            "KV blocks in the prefix cache (held by requests or reclaimable).",
            value=engine.prefix_cache_blocks,
        )
        yield CounterMetricFamily(
            "pdtrio_engine_prefix_cache_decode_reused_blocks",
            "Prompt KV blocks decode found in its prefix cache instead of pulling them.",
            value=engine.prefix_cache_decode_reused_blocks,
        )
        yield CounterMetricFamily(
            "pdtrio_engine_prefix_cache_decode_pulled_blocks",
            "Prompt KV blocks decode pulled from prefill with its prefix cache on.",
            value=engine.prefix_cache_decode_pulled_blocks,
        )
        yield GaugeMetricFamily(
            "pdtrio_worker_kv_leases",
            "Prefilled requests whose KV waits for decode to pull it.",
            value=len(worker.leases),
        )
        connections = worker.http_connections
        open_connections = GaugeMetricFamily(
            "pdtrio_worker_http_connections",
            "Open connections to the HTTP port, by whether a request on them showed the secret.",
            labels=["authenticated"],
        )
        open_connections.add_metric(["false"], connections.strangers)
        open_connections.add_metric(["true"], connections.peers)
        yield open_connections
        digests = worker.kv_digest_counts
        yield CounterMetricFamily(
            "pdtrio_worker_kv_digest_checks",
            "KV handoffs whose pulled blocks decode checked against what prefill wrote.",
            value=digests.checked,
        )
        yield CounterMetricFamily(
            "pdtrio_worker_kv_digest_mismatches",
            "KV handoffs refused: pulled blocks not what prefill wrote (stale, reused, damaged).",
            value=digests.mismatched,
        )
        yield CounterMetricFamily(
            "pdtrio_worker_http_connections_evicted",
            "Connections without the secret closed to make room for a new connection.",
            value=connections.evicted,
        )
        info: dict[str, Any] = worker.transport.info()
        pulls = CounterMetricFamily(
            "pdtrio_kv_transfers",
            "KV pulls this (decode) worker completed, by transport.",
            labels=["transport"],
        )
        seconds = CounterMetricFamily(
            "pdtrio_kv_transfer_seconds",
            "Time spent in completed KV pulls, by transport.",
            labels=["transport"],
        )
        nbytes = CounterMetricFamily(
            "pdtrio_kv_transfer_bytes",
            "KV bytes pulled, by transport.",
            labels=["transport"],
        )
        for family, key in ((pulls, "pulls"), (seconds, "pull_seconds"), (nbytes, "pull_bytes")):
            for transport, total in sorted(info.get(key, {}).items()):
                family.add_metric([transport], float(total))
            yield family
