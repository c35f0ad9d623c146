"""The router's metrics and its access log: one place records each request's figures.

A :class:`RequestFigures` rides along with each completion request (the pipeline fills
it: prefill, queue, handoff, each delivered event); when the request ends
:meth:`RouterMetrics.request_ended` counts it, observes its latencies and writes its
one access line (``pdtrio.access``, INFO).

Per delivered event: a clock read and a local bucket count (no ``prometheus_client``
call); the inter-token gaps, tokens and the per-request figures go to Prometheus when
``/metrics`` is scraped (under multiprocess mode: when the request ends, and at most
once a second while it streams).  What already lives in the router (instances, links,
egress) is read at scrape time by :class:`RouterStateCollector`.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol, final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdtrio.logs import ACCESS_LOGGER, log_access
from pdtrio.metrics import LATENCY_BUCKETS_S, LocalHistogram, exposition, multiprocess_dir
from pdtrio.protocol.link.registration import REJECTION_REASONS
from pdtrio.protocol.request import MigrationReason

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

access_log = logging.getLogger(ACCESS_LOGGER)

# a streaming request's gaps and tokens reach Prometheus at least this often
FLUSH_INTERVAL_S: Final = 1.0
# gaps between two events of a stream: the decode step (ms) to a stall (s)
ITL_BUCKETS_S: Final = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
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
# where a prompt was prefilled (pdtrio_prefill_placements, the access line's prefill_at)
PREFILL_PLACES = ("remote", "local")
# the status an access line gives a request whose client went away (nginx's convention)
CLIENT_CLOSED_STATUS: Final = 499


class Outcome(enum.Enum):
    """How a completion request ended, as /metrics counts it."""

    OK = "ok"
    DISCONNECTED = "disconnected"
    """The client went away before the response was complete."""
    REJECTED = "rejected"
    """Refused before any byte of the response went out (with its status)."""
    FAILED = "failed"
    """Ended by an error event after the stream had started (with the error's status)."""


class RouterState(Protocol):
    """What the collector reads of the router (``pdtrio.router.core.Router``)."""

    @property
    def instances(self) -> Mapping[str, Any]: ...

    @property
    def workers(self) -> Sequence[Any]: ...

    @property
    def tokens_delivered(self) -> int: ...

    @property
    def egress(self) -> Any: ...


@final
class _ModelSeries:
    """One model's children, resolved once (``labels()`` costs as much as an observe)."""

    __slots__ = (
        "completion_tokens",
        "e2e",
        "handoff",
        "itl",
        "multiprocess",
        "pending",
        "prefill",
        "prompt_tokens",
        "queued",
        "ttft",
    )

    def __init__(self, metrics: RouterMetrics, model: str) -> None:
        self.ttft = metrics.ttft.labels(model)
        self.itl = metrics.itl.labels(model)
        self.e2e = metrics.e2e.labels(model)
        self.queued = metrics.queued.labels(model)
        self.prefill = metrics.prefill.labels(model)
        self.handoff = metrics.handoff.labels(model)
        self.prompt_tokens = metrics.prompt_tokens.labels(model)
        self.completion_tokens = metrics.completion_tokens.labels(model)
        # ended requests' figures, not in the children yet (see RouterMetrics.request_ended)
        self.pending = _PendingFigures()
        # other processes' scrapes read only what is merged: merged as it comes
        self.multiprocess = metrics.multiprocess is not None

    def merge_pending(self) -> None:
        pending = self.pending
        pending.e2e.merge_into(self.e2e)
        pending.ttft.merge_into(self.ttft)
        pending.prefill.merge_into(self.prefill)
        pending.queued.merge_into(self.queued)
        pending.handoff.merge_into(self.handoff)
        if pending.prompt_tokens:
            self.prompt_tokens.inc(pending.prompt_tokens)
            pending.prompt_tokens = 0
        pending.itl.merge_into(self.itl)
        if pending.completion_tokens:
            self.completion_tokens.inc(pending.completion_tokens)
            pending.completion_tokens = 0


@final
class _PendingFigures:
    """Per-request observations of one model, counted locally until the next scrape."""

    __slots__ = (
        "completion_tokens",
        "e2e",
        "handoff",
        "itl",
        "prefill",
        "prompt_tokens",
        "queued",
        "ttft",
    )

    def __init__(self) -> None:
        # every running request's gaps, as they come (not merged per request at its end)
        self.itl = LocalHistogram(ITL_BUCKETS_S)
        self.completion_tokens = 0
        self.e2e = LocalHistogram(LATENCY_BUCKETS_S)
        self.ttft = LocalHistogram(LATENCY_BUCKETS_S)
        self.prefill = LocalHistogram(LATENCY_BUCKETS_S)
        self.queued = LocalHistogram(LATENCY_BUCKETS_S)
        self.handoff = LocalHistogram(LATENCY_BUCKETS_S)
        self.prompt_tokens = 0


@final
class RequestFigures:
    """One request's timings and token counts, as the pipeline learns them.

    Times are ``time.perf_counter()`` readings; a phase that never ran stays None.
    """

    __slots__ = (
        "_flushed_tokens",
        "_itl",
        "_last_event_at",
        "_next_flush",
        "_series",
        "completion_tokens",
        "first_token_at",
        "handoff_s",
        "migrations",
        "prefill_at",
        "prefill_s",
        "prompt_tokens",
        "queued_s",
        "started",
    )

    def __init__(self, series: _ModelSeries | None, started: float) -> None:
        self._series = series
        self.started = started
        self.first_token_at: float | None = None
        self._last_event_at = started
        self._next_flush = started + FLUSH_INTERVAL_S
        # the gaps go straight to the model's pending ones (a histogram a request, merged
        # at its end, was a dozen calls a request)
        self._itl = LocalHistogram(ITL_BUCKETS_S) if series is None else series.pending.itl
        self.completion_tokens = 0
        self._flushed_tokens = 0
        self.prompt_tokens: int | None = None
        self.prefill_s: float | None = None
        self.queued_s: float | None = None
        self.handoff_s: float | None = None
        self.migrations: list[str] = []  # why each migration happened, in order
        # where its prompt was prefilled: "remote" (a prefill instance), "local" (on its
        # decode: conditional disaggregation); None before any prefill
        self.prefill_at: str | None = None

    def delivered(self, num_tokens: int) -> None:
        """An event with ``num_tokens`` tokens went to the client (or was gathered)."""
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            self._itl.observe(now - self._last_event_at)
        self._last_event_at = now
        self.completion_tokens += num_tokens
        if now >= self._next_flush:
            self._next_flush = now + FLUSH_INTERVAL_S
            self.flush()
            series = self._series
            if series is not None and series.multiprocess:
                series.merge_pending()

    def flush(self) -> None:
        """The tokens counted since the last flush go to the model's pending figures (its
        gaps went there as they came): the next scrape gives them to Prometheus."""
        series = self._series
        if series is None:
            return
        tokens = self.completion_tokens - self._flushed_tokens
        if tokens:
            series.pending.completion_tokens += tokens
            self._flushed_tokens = self.completion_tokens


@final
class RouterMetrics:
    """The router's Prometheus metrics, in a registry of their own."""

    def __init__(self, router: RouterState) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.state = RouterStateCollector(router)
        registry.register(self.state)
        self.requests = Counter(
            "pdtrio_requests",
            "Completion requests ended, by endpoint, model and outcome "
            "(status: the error's status class for rejected and failed).",
            ["endpoint", "model", "outcome", "status"],
            registry=registry,
        )
        # each label set's child, looked up once: labels() is dear on the hot path
        self._requests_by_labels: dict[tuple[str, str, str, str], Any] = {}
        # ended requests not counted in their child yet, by label set (see request_ended)
        self._requests_pending: dict[tuple[str, str, str, str], int] = {}
        self.requests_active = Gauge(
            "pdtrio_requests_active",
            "Completion requests running now.",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.streams_active = Gauge(
            "pdtrio_streams_active",
            "Requests decoding now (decode accepted them, they have not ended).",
            registry=registry,
            multiprocess_mode="livesum",
        )
        latency = ["model"]
        self.ttft = Histogram(
            "pdtrio_time_to_first_token_seconds",
            "From the request's start to its first token going out.",
            latency,
            registry=registry,
            buckets=LATENCY_BUCKETS_S,
        )
        self.itl = Histogram(
            "pdtrio_inter_token_latency_seconds",
            "Gaps between two events of a response (an event may carry several tokens).",
            latency,
            registry=registry,
            buckets=ITL_BUCKETS_S,
        )
        self.e2e = Histogram(
            "pdtrio_e2e_request_latency_seconds",
            "From the request's start to its end, whatever the outcome.",
            latency,
            registry=registry,
            buckets=LATENCY_BUCKETS_S,
        )
        self.queued = Histogram(
            "pdtrio_queue_wait_seconds",
            "Time a prefilled request waited for decode KV room.",
            latency,
            registry=registry,
            buckets=LATENCY_BUCKETS_S,
        )
        self.prefill = Histogram(
            "pdtrio_prefill_seconds",
            "From the first prefill call to prefill's answer (retries on other instances included).",
            latency,
            registry=registry,
            buckets=LATENCY_BUCKETS_S,
        )
        self.handoff = Histogram(
            "pdtrio_kv_handoff_seconds",
            "From the decode start sent to decode accepting it (its KV pull included).",
            latency,
            registry=registry,
            buckets=LATENCY_BUCKETS_S,
        )
        self.prompt_tokens = Counter(
            "pdtrio_prompt_tokens",
            "Prompt tokens of prefilled requests.",
            ["model"],
            registry=registry,
        )
        self.completion_tokens = Counter(
            "pdtrio_completion_tokens",
            "Generated tokens delivered to clients.",
            ["model"],
            registry=registry,
        )
        self.retries = Counter(
            "pdtrio_retries",
            "A request tried again: on another prefill instance, or for decode room or "
            "another decode instance.",
            ["phase"],
            registry=registry,
        )
        for phase in ("prefill", "decode"):
            self.retries.labels(phase)  # shown at 0 from the start
        self.migrations = Counter(
            "pdtrio_migrations",
            "Requests continued on another decode after their decode was lost mid-stream, "
            "by reason: link_lost, link_timeout, decode_failed, stalled.",
            ["reason"],
            registry=registry,
        )
        for migration_reason in MigrationReason:
            self.migrations.labels(migration_reason.value)  # shown at 0 from the start
        prefill_placements = Counter(
            "pdtrio_prefill_placements",
            "Prefill calls by where they ran: remote (a prefill instance, the KV handed to "
            "decode) or local (on the decode instance itself: little of the prompt was "
            "missing from its prefix cache, router.local_prefill_max_tokens).",
            ["where"],
            registry=registry,
        )
        # by where (shown at 0 from the start; resolved once: labels() costs as an inc())
        self.prefill_placed = {w: prefill_placements.labels(w) for w in PREFILL_PLACES}
        ttft_by_placement = Summary(
            "pdtrio_ttft_by_prefill_placement_seconds",
            "Time to first token by where the request's prompt was prefilled (remote, local): "
            "what conditional disaggregation does to TTFT (sum / count: the mean).",
            ["where"],
            registry=registry,
        )
        # (resolved once: labels() costs as much as an observe)
        self._ttft_by_placement = {w: ttft_by_placement.labels(w) for w in PREFILL_PLACES}
        # [sum, count] of the TTFTs not observed in those children yet (see request_ended)
        self._ttft_by_placement_pending: dict[str, list[float]] = {
            w: [0.0, 0] for w in PREFILL_PLACES
        }
        self.queue_full = Counter(
            "pdtrio_queue_full_rejections",
            "Requests refused with 429 because the decode queue was full.",
            registry=registry,
        )
        self.registry_rejected = Counter(
            "pdtrio_registry_rejected_entries",
            "Registry (etcd) entries ignored, once per change of the entry, by reason: "
            "malformed, invalid, unsigned, bad_signature, wrong_key, router_url, internal.",
            ["reason"],
            registry=registry,
        )
        for reason in REJECTION_REASONS:
            self.registry_rejected.labels(reason)  # shown at 0 from the start
        self._series: dict[str, _ModelSeries] = {}
        self.multiprocess = multiprocess_dir()

    def figures(self, model: str) -> RequestFigures:
        """A new request's figures, started now."""
        series = self._series.get(model)
        if series is None:
            series = self._series[model] = _ModelSeries(self, model)
        return RequestFigures(series, time.perf_counter())

    def request_ended(
        self,
        *,
        endpoint: str,
        model: str,
        outcome: Outcome,
        status: int | None,
        figures: RequestFigures | None = None,
        request_id: str = "-",
        prefill: str = "-",
        decode: str = "-",
    ) -> None:
        """Count a completion request by how it ended, observe its figures, log its line.

        ``status``: the error's HTTP status (None for ok and disconnected).
        """
        status_class = "" if status is None else f"{status // 100}xx"
        labels = (endpoint, model, outcome.value, status_class)
        # counted at the next scrape, as the figures below (not a locked call each)
        requests_pending = self._requests_pending
        requests_pending[labels] = requests_pending.get(labels, 0) + 1
        if status == 429:
            self.queue_full.inc()
        now = time.perf_counter()
        ttft_ms = total_ms = None
        if figures is not None:
            figures.flush()
            series = figures._series  # noqa: SLF001 - the same module
            total_s = now - figures.started
            total_ms = total_s * 1000
            if figures.first_token_at is not None:
                ttft_ms = (figures.first_token_at - figures.started) * 1000
            if series is not None:
                # counted here, given to Prometheus at the next scrape (a few calls per
                # bucket, not a locked call per figure); other processes' scrapes read
                # what this one wrote, so under multiprocess mode it is given at once
                pending = series.pending
                pending.e2e.observe(total_s)
                if ttft_ms is not None:
                    pending.ttft.observe(ttft_ms / 1000)
                    if figures.prefill_at is not None:
                        placed = self._ttft_by_placement_pending[figures.prefill_at]
                        placed[0] += ttft_ms / 1000
                        placed[1] += 1
                if figures.prompt_tokens is not None:
                    pending.prompt_tokens += figures.prompt_tokens
                if figures.prefill_s is not None:
                    pending.prefill.observe(figures.prefill_s)
                if figures.queued_s is not None:
                    pending.queued.observe(figures.queued_s)
                if figures.handoff_s is not None:
                    pending.handoff.observe(figures.handoff_s)
                if self.multiprocess:
                    series.merge_pending()
        if self.multiprocess:
            self._merge_pending()
        if access_log.isEnabledFor(logging.INFO):
            if status is None:
                status = 200 if outcome is Outcome.OK else CLIENT_CLOSED_STATUS
            fields = {
                "request_id": request_id,
                "model": model or "-",
                "status": status,
                "outcome": outcome.value,
                "prompt_tokens": "-"
                if figures is None or figures.prompt_tokens is None
                else figures.prompt_tokens,
                "completion_tokens": 0 if figures is None else figures.completion_tokens,
                "ttft_ms": "-" if ttft_ms is None else round(ttft_ms, 1),
                "total_ms": "-" if total_ms is None else round(total_ms, 1),
                "prefill": prefill,
                "decode": decode,
                "migrations": "-"
                if figures is None or not figures.migrations
                else ",".join(figures.migrations),
                "prefill_at": "-"
                if figures is None or figures.prefill_at is None
                else figures.prefill_at,
            }
            log_access(" ".join([f"{key}={value}" for key, value in fields.items()]), fields)

    def _merge_pending(self) -> None:
        """The ended requests' counts and TTFTs by placement, into their children."""
        by_labels = self._requests_by_labels
        for labels, count in self._requests_pending.items():
            counter = by_labels.get(labels)
            if counter is None:
                counter = by_labels[labels] = self.requests.labels(*labels)
            counter.inc(count)
        self._requests_pending.clear()
        for where, placed in self._ttft_by_placement_pending.items():
            if placed[1]:
                # a Summary's observe is these two additions; no public bulk one
                summary = self._ttft_by_placement[where]
                summary._count.inc(placed[1])  # noqa: SLF001
                summary._sum.inc(placed[0])  # noqa: SLF001
                placed[0] = placed[1] = 0

    def render(self) -> bytes:
        """``/metrics``: this router's, or with multiprocess mode every process's."""
        self._merge_pending()
        for series in self._series.values():
            series.merge_pending()
        return exposition(self.registry, (self.state,), multiprocess=self.multiprocess)


@final
class RouterStateCollector(Collector):
    """What the router already holds, read at scrape time: instances, links, egress.

    Under multiprocess mode these come from the process that answers the scrape.
    """

    def __init__(self, router: RouterState) -> None:
        self._router = router

    def describe(self) -> Iterator[Metric]:
        return iter(())  # nothing to check at registration; collect reads the router

    def collect(self) -> Iterator[Metric]:
        router = self._router
        labels = ["instance", "role", "model"]
        up = GaugeMetricFamily(
            "pdtrio_instance_up",
            "1 while the instance takes new work (healthy, registered, linked, not draining).",
            labels=labels,
        )
        active = GaugeMetricFamily(
            "pdtrio_instance_active_requests",
            "Requests on the instance now: prefill calls waiting and decode streams.",
            labels=labels,
        )
        free = GaugeMetricFamily(
            "pdtrio_instance_kv_free_blocks",
            "Free KV blocks the decode instance last reported.",
            labels=labels,
        )
        reconnects = CounterMetricFamily(
            "pdtrio_link_reconnects",
            "Times the router's link to the instance connected again after a break.",
            labels=["instance"],
        )
        misses = CounterMetricFamily(
            "pdtrio_link_heartbeat_misses",
            "Links dropped because the instance sent nothing (heartbeats included) in time.",
            labels=["instance"],
        )
        cached = GaugeMetricFamily(
            "pdtrio_instance_cached_blocks",
            "KV blocks the instance's prefix cache holds, as its KV events told this router "
            "(the prefix index cache-aware routing reads; absent while it reports none).",
            labels=labels,
        )
        frames = CounterMetricFamily(
            "pdtrio_decode_frames_received",
            "Frames the router read from the instance's link.",
            labels=["instance"],
        )
        cut_off = 0
        for instance in router.instances.values():
            values = [instance.instance_id, instance.role, instance.model]
            link = instance.link
            up.add_metric(values, 1.0 if instance.usable else 0.0)
            streams = 0 if link is None else link.active_requests
            active.add_metric(values, float(streams + instance.active_prefills))
            if link is None:
                continue
            if link.capacity is not None:
                free.add_metric(values, float(link.capacity.free_blocks))
            if link.cached_blocks.reporting:
                cached.add_metric(values, float(len(link.cached_blocks)))
            counts = link.statistics()
            reconnects.add_metric([instance.instance_id], float(max(0, counts.connects - 1)))
            misses.add_metric([instance.instance_id], float(counts.hangs))
            frames.add_metric([instance.instance_id], float(counts.frames_received))
            cut_off += counts.clients_cut_off
        yield from (up, active, free, cached, reconnects, misses, frames)
        yield GaugeMetricFamily(
            "pdtrio_local_prefill_max_tokens",
            "Conditional disaggregation's threshold: a request missing no more of its prompt "
            "from its decode's prefix cache is prefilled there (0: never).",
            value=float(getattr(router.instances, "local_prefill_max_tokens", 0)),
        )
        yield CounterMetricFamily(
            "pdtrio_slow_clients_cut_off",
            "Streams ended because their client read too slowly.",
            value=float(cut_off),
        )
        yield CounterMetricFamily(
            "pdtrio_tokens_delivered",
            "Tokens delivered by this process (all models; counted per event).",
            value=float(router.tokens_delivered),
        )
        yield GaugeMetricFamily(
            "pdtrio_egress_spacing_seconds",
            "How far apart each stream's sends go now (adaptive egress; 0: at once).",
            value=router.egress.spacing_s,
        )
        yield GaugeMetricFamily(
            "pdtrio_event_loop_busy_ratio",
            "How busy the router's event loop was lately (0 to 1).",
            value=router.egress.busy_fraction,
        )
        restarts = CounterMetricFamily(
            "pdtrio_worker_restarts",
            "Restarts of each embedded worker.",
            labels=["worker"],
        )
        for worker in router.workers:
            restarts.add_metric([worker.name], float(worker.restarts))
        yield restarts
