"""The router's metrics and its access log: one place records each request's figures.

A :class:`RequestFigures` rides along with each completion request (the pipeline fills
it: prefill, queue, handoff, each delivered event); when the request ends
:meth:`RouterMetrics.request_ended` counts it, observes its latencies and writes its
one access line (``pdtrio.access``, INFO).

Per delivered event: a clock read and a local bucket count (no ``prometheus_client``
call); the inter-token gaps, tokens and the per-request figures go to Prometheus when
``/metrics`` is scraped (under multiprocess mode: when the request ends, and at most
once a second while it streams).  What already lives in the router (instances, links,
egress) is read at scrape time by
:class:`~pdtrio.router.state_metrics.RouterStateCollector`.
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Any, Final, final

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary

from pdtrio.logs import ACCESS_LOGGER, log_access
from pdtrio.metrics import LATENCY_BUCKETS_S, LocalHistogram, exposition, multiprocess_dir
from pdtrio.protocol.link.registration import REJECTION_REASONS
from pdtrio.protocol.request import MigrationReason
from pdtrio.router.state_metrics import RouterState, RouterStateCollector

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


@attrs.frozen
class MetricSpec:
    """One metric of the router's registry: the attribute :class:`RouterMetrics` keeps it
    in, and what Prometheus shows of it."""

    attribute: str
    kind: type[Counter | Gauge | Histogram | Summary]
    name: str
    documentation: str
    labels: tuple[str, ...] = ()
    # label values shown at 0 from the start
    at_zero: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    # a gauge's, under multiprocess mode: how the processes' values make one
    multiprocess_mode: str | None = None

    def declare(self, registry: CollectorRegistry) -> Counter | Gauge | Histogram | Summary:
        options: dict[str, Any] = {}
        if self.buckets is not None:
            options["buckets"] = self.buckets
        if self.multiprocess_mode is not None:
            options["multiprocess_mode"] = self.multiprocess_mode
        metric = self.kind(self.name, self.documentation, self.labels, registry=registry, **options)
        for value in self.at_zero:
            metric.labels(value)
        return metric


# every metric RouterMetrics declares, in the order /metrics lists them
DECLARED_METRICS: Final = (
    MetricSpec(
        "requests",
        Counter,
        "pdtrio_requests",
        "Completion requests ended, by endpoint, model and outcome "
        "(status: the error's status class for rejected and failed).",
        ("endpoint", "model", "outcome", "status"),
    ),
    MetricSpec(
        "requests_active",
        Gauge,
        "pdtrio_requests_active",
        "Completion requests running now.",
        multiprocess_mode="livesum",
    ),
    MetricSpec(
        "streams_active",
        Gauge,
        "pdtrio_streams_active",
        "Requests decoding now (decode accepted them, they have not ended).",
        multiprocess_mode="livesum",
    ),
    MetricSpec(
        "ttft",
        Histogram,
        "pdtrio_time_to_first_token_seconds",
        "From the request's start to its first token going out.",
        ("model",),
        buckets=LATENCY_BUCKETS_S,
    ),
    MetricSpec(
        "itl",
        Histogram,
        "pdtrio_inter_token_latency_seconds",
        "Gaps between two events of a response (an event may carry several tokens).",
        ("model",),
        buckets=ITL_BUCKETS_S,
    ),
    MetricSpec(
        "e2e",
        Histogram,
        "pdtrio_e2e_request_latency_seconds",
        "From the request's start to its end, whatever the outcome.",
        ("model",),
        buckets=LATENCY_BUCKETS_S,
    ),
    MetricSpec(
        "queued",
        Histogram,
        "pdtrio_queue_wait_seconds",
        "Time a prefilled request waited for decode KV room.",
        ("model",),
        buckets=LATENCY_BUCKETS_S,
    ),
    MetricSpec(
        "prefill",
        Histogram,
        "pdtrio_prefill_seconds",
        "From the first prefill call to prefill's answer (retries on other instances included).",
        ("model",),
        buckets=LATENCY_BUCKETS_S,
    ),
    MetricSpec(
        "handoff",
        Histogram,
        "pdtrio_kv_handoff_seconds",
        "From the decode start sent to decode accepting it (its KV pull included).",
        ("model",),
        buckets=LATENCY_BUCKETS_S,
    ),
    MetricSpec(
        "prompt_tokens",
        Counter,
        "pdtrio_prompt_tokens",
        "Prompt tokens of prefilled requests.",
        ("model",),
    ),
    MetricSpec(
        "completion_tokens",
        Counter,
        "pdtrio_completion_tokens",
        "Generated tokens delivered to clients.",
        ("model",),
    ),
    MetricSpec(
        "retries",
        Counter,
        "pdtrio_retries",
        "A request tried again: on another prefill instance, or for decode room or "
        "another decode instance.",
        ("phase",),
        at_zero=("prefill", "decode"),
    ),
    MetricSpec(
        "migrations",
        Counter,
        "pdtrio_migrations",
        "Requests continued on another decode after their decode was lost mid-stream, "
        "by reason: link_lost, link_timeout, decode_failed, stalled.",
        ("reason",),
        at_zero=tuple(reason.value for reason in MigrationReason),
    ),
    MetricSpec(
        "prefill_placements",
        Counter,
        "pdtrio_prefill_placements",
        "Prefill calls by where they ran: remote (a prefill instance, the KV handed to "
        "decode) or local (on the decode instance itself: little of the prompt was "
        "missing from its prefix cache, router.local_prefill_max_tokens).",
        ("where",),
        at_zero=PREFILL_PLACES,
    ),
    MetricSpec(
        "ttft_by_placement",
        Summary,
        "pdtrio_ttft_by_prefill_placement_seconds",
        "Time to first token by where the request's prompt was prefilled (remote, local): "
        "what conditional disaggregation does to TTFT (sum / count: the mean).",
        ("where",),
        at_zero=PREFILL_PLACES,
    ),
    MetricSpec(
        "queue_full",
        Counter,
        "pdtrio_queue_full_rejections",
        "Requests refused with 429 because the decode queue was full.",
    ),
    MetricSpec(
        "registry_rejected",
        Counter,
        "pdtrio_registry_rejected_entries",
        "Registry (etcd) entries ignored, once per change of the entry, by reason: "
        "malformed, invalid, unsigned, bad_signature, wrong_key, router_url, internal.",
        ("reason",),
        at_zero=REJECTION_REASONS,
    ),
)


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

    # each metric of DECLARED_METRICS, in the attribute it names (the constructor sets it)
    requests: Counter
    requests_active: Gauge
    streams_active: Gauge
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queued: Histogram
    prefill: Histogram
    handoff: Histogram
    prompt_tokens: Counter
    completion_tokens: Counter
    retries: Counter
    migrations: Counter
    prefill_placements: Counter
    ttft_by_placement: Summary
    queue_full: Counter
    registry_rejected: Counter

    def __init__(self, router: RouterState) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.state = RouterStateCollector(router)
        self.registry.register(self.state)
        for spec in DECLARED_METRICS:
            setattr(self, spec.attribute, spec.declare(self.registry))
        # each label set's child, looked up once: labels() is dear on the hot path
        self._requests_by_labels: dict[tuple[str, str, str, str], Any] = {}
        # ended requests not counted in their child yet, by label set (see request_ended)
        self._requests_pending: dict[tuple[str, str, str, str], int] = {}
        # the placements' children by where, resolved once: labels() costs as much as an
        # inc() or an observe()
        self.prefill_placed = {w: self.prefill_placements.labels(w) for w in PREFILL_PLACES}
        self._ttft_by_placement = {w: self.ttft_by_placement.labels(w) for w in PREFILL_PLACES}
        # [sum, count] of the TTFTs not observed in those children yet (see request_ended)
        self._ttft_by_placement_pending: dict[str, list[float]] = {
            w: [0.0, 0] for w in PREFILL_PLACES
        }
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
        trace_id: str = "",
        sampled: bool = False,
    ) -> None:
        """Count a completion request by how it ended, observe its figures, log its line.

        ``status``: the error's HTTP status (None for ok and disconnected); ``trace_id``:
        its trace's, if traced (the access line's; ``sampled``: the TTFT's and e2e's exemplar).
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
                if sampled:
                    pending.e2e.observe_traced(total_s, trace_id)
                else:
                    pending.e2e.observe(total_s)
                if ttft_ms is not None:
                    if sampled:
                        pending.ttft.observe_traced(ttft_ms / 1000, trace_id)
                    else:
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
            _log_access_line(
                request_id=request_id,
                model=model,
                status=status,
                outcome=outcome,
                figures=figures,
                ttft_ms=ttft_ms,
                total_ms=total_ms,
                prefill=prefill,
                decode=decode,
                trace_id=trace_id,
            )

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

    def render(self, *, openmetrics: bool = False) -> bytes:
        """``/metrics``: this router's, or with multiprocess mode every process's
        (``openmetrics``: in OpenMetrics, with the exemplars)."""
        self._merge_pending()
        for series in self._series.values():
            series.merge_pending()
        return exposition(
            self.registry, (self.state,), multiprocess=self.multiprocess, openmetrics=openmetrics
        )


def _log_access_line(
    *,
    request_id: str,
    model: str,
    status: int,
    outcome: Outcome,
    figures: RequestFigures | None,
    ttft_ms: float | None,
    total_ms: float | None,
    prefill: str,
    decode: str,
    trace_id: str,
) -> None:
    """A request's one access line: its figures, none of its content."""
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
        "prefill_at": "-" if figures is None or figures.prefill_at is None else figures.prefill_at,
    }
    if trace_id:
        fields["trace_id"] = trace_id
    log_access(" ".join([f"{key}={value}" for key, value in fields.items()]), fields)
