"""The OpenTelemetry SDK behind ``pdtrio.tracing``: imported only once tracing is asked for.

Spans are exported by the SDK's ``BatchSpanProcessor`` on its own thread, over OTLP/HTTP:
nothing on the trio loop waits for the collector.  A process keeps its own provider (never
the global one), so two routers in one process, or a router beside a test's receiver,
never share or replace each other's.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, final

import trio
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from pdtrio.config import TracingConfig
from pdtrio.tracing._context import RemoteParent, format_traceparent, parse_traceparent

log = logging.getLogger("pdtrio.tracing")

_TRACES_PATH = "/v1/traces"
# what the exporter's client says of each failed batch: pdtrio.tracing says it once instead
_EXPORTER_LOGGER = "opentelemetry.exporter.otlp"
# the most a router or worker waits, at exit, for its last spans to reach the collector
SHUTDOWN_GRACE_S = 5.0


def _traces_url(endpoint: str) -> str:
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(_TRACES_PATH) else endpoint + _TRACES_PATH


@final
class _ReportingExporter(SpanExporter):
    """The OTLP exporter, saying once (one WARNING) that the collector does not take spans."""

    def __init__(self, inner: SpanExporter, where: str) -> None:
        self._inner = inner
        self._where = where
        self._warned = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        detail = "it refused them or did not answer"
        try:
            result = self._inner.export(spans)
        except Exception as exc:  # (the exporter's thread: nothing of the loop's here)
            result, detail = SpanExportResult.FAILURE, repr(exc)
        if result is not SpanExportResult.SUCCESS and not self._warned:
            self._warned = True
            log.warning(
                "tracing: spans could not be sent to %s (%s); requests are served as "
                "before, and later failures to send are not logged",
                self._where,
                detail,
            )
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


def _parent_context(parent: RemoteParent) -> Any:
    remote = SpanContext(
        trace_id=parent.trace_id,
        span_id=parent.span_id,
        is_remote=True,
        trace_flags=TraceFlags(parent.flags),
    )
    return trace.set_span_in_context(NonRecordingSpan(remote))


def traceparent_of(span: Span) -> str:
    context = span.get_span_context()
    return format_traceparent(context.trace_id, context.span_id, int(context.trace_flags))


@final
class WorkSpan:
    """One span of a worker's (or a leg's) work, as the code that does it sees it."""

    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    def set(self, key: str, value: str | int | float | bool) -> None:
        self.span.set_attribute(key, value)

    def event(self, name: str, attributes: Mapping[str, str | int | float | bool] = {}) -> None:  # noqa: B006
        self.span.add_event(name, dict(attributes))

    def fail(self, message: str) -> None:
        self.span.set_status(Status(StatusCode.ERROR, message))

    def end(self) -> None:
        self.span.end()


@final
class Tracing:
    """A process's tracer: its provider, exporter and sampler (the lifespan owns it)."""

    def __init__(self, provider: TracerProvider, service_name: str, where: str) -> None:
        self._provider = provider
        self.tracer = provider.get_tracer("pdtrio")
        self.service_name = service_name
        self.where = where

    @classmethod
    def start(
        cls, config: TracingConfig, endpoint: str, role: str, environ: Mapping[str, str]
    ) -> Tracing:
        service_name = config.service_name or environ.get("OTEL_SERVICE_NAME") or f"pdtrio-{role}"
        resource = Resource.create(
            {
                "service.name": service_name,
                # each process its own: routers under -w N, each embedded worker
                "service.instance.id": f"{uuid.uuid4()}",
                "process.pid": os.getpid(),
            }
        )
        # None: OTEL_TRACES_SAMPLER / _ARG, else the SDK's parent-based always-on
        sampler = None
        if config.sampler_ratio is not None:
            sampler = ParentBased(TraceIdRatioBased(config.sampler_ratio))
        provider = TracerProvider(sampler=sampler, resource=resource, shutdown_on_exit=False)
        url = _traces_url(config.endpoint) if config.endpoint else None
        # (None: the exporter reads OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT itself)
        where = url or endpoint
        logging.getLogger(_EXPORTER_LOGGER).setLevel(logging.CRITICAL)
        exporter = _ReportingExporter(OTLPSpanExporter(endpoint=url), where)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        log.info("tracing: spans of %s go to %s over OTLP/HTTP", service_name, where)
        return cls(provider, service_name, where)

    def request_span(self, name: str, incoming: str, attributes: Mapping[str, str | int]) -> Span:
        """A request's span: a child of the client's ``traceparent`` when it is valid."""
        context = None
        if incoming:
            parent = parse_traceparent(incoming)
            if parent is None:
                log.debug("ignoring a malformed traceparent header: %.80r", incoming)
            else:
                context = _parent_context(parent)
        return self.tracer.start_span(
            name, context=context, kind=SpanKind.SERVER, attributes=dict(attributes)
        )

    def refused_request(
        self, incoming: str, *, method: str, endpoint: str, status: int, message: str
    ) -> str:
        """The span of a request refused before its pipeline ran (a 401, a body that
        fails validation, an up-front 429); its trace id (hex) for the access line."""
        span = self.request_span(
            f"{method} {endpoint}",
            incoming,
            {
                "http.route": endpoint,
                "http.response.status_code": status,
                "pdtrio.outcome": "rejected",
            },
        )
        span.set_status(Status(StatusCode.ERROR, f"{status}: {message}"))
        span.end()
        return f"{span.get_span_context().trace_id:032x}"

    def child_span(
        self,
        name: str,
        parent: Span,
        attributes: Mapping[str, str | int | bool] = {},  # noqa: B006
    ) -> Span:
        return self.tracer.start_span(
            name, context=trace.set_span_in_context(parent), attributes=dict(attributes)
        )

    @contextmanager
    def work(
        self, name: str, traceparent: str, attributes: Mapping[str, str | int | bool]
    ) -> Iterator[WorkSpan | None]:
        """A span of this process's work for a request a router traces (``traceparent``:
        the router's leg); None without one (a router that does not trace)."""
        work = self.start_work(name, traceparent, attributes)
        if work is None:
            yield None
            return
        span = work.span
        try:
            yield work
        except BaseException as exc:
            if not isinstance(exc, trio.Cancelled):
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            else:
                span.add_event("cancelled")
            raise
        finally:
            span.end()

    def start_work(
        self, name: str, traceparent: str, attributes: Mapping[str, str | int | bool]
    ) -> WorkSpan | None:
        """``work``'s span for work that outlives one block: its owner ends it."""
        parent = parse_traceparent(traceparent) if traceparent else None
        if parent is None:
            return None
        span = self.tracer.start_span(
            name,
            context=_parent_context(parent),
            kind=SpanKind.SERVER,
            attributes=dict(attributes),
        )
        return WorkSpan(span)

    async def aclose(self) -> None:
        """Send what is left, off the loop, for at most ``SHUTDOWN_GRACE_S``."""
        with trio.move_on_after(SHUTDOWN_GRACE_S, shield=True) as waited:
            await trio.to_thread.run_sync(self._provider.shutdown, abandon_on_cancel=True)
        if waited.cancelled_caught:
            log.warning("tracing: the last spans did not reach %s before exit", self.where)
