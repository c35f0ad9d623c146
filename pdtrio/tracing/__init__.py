"""OpenTelemetry traces of requests, across the router, its workers and the engines.

The one place tracing lives.  Off by default: on when ``[tracing] endpoint`` or
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` names a
collector; ``OTEL_TRACES_SAMPLER`` / ``_ARG`` and ``OTEL_SERVICE_NAME`` are honoured
where the configuration leaves them.  With it off, :func:`start_tracing` answers None
and nothing of OpenTelemetry is imported: the request path checks one attribute.
Without the SDK (the ``pdtrio[otel]`` extra), or with a collector that does not take
spans, requests are served as untraced ones are and one WARNING says so.

What each process traces: the router, a span per request and its legs
(``pdtrio.tracing._request``, fed by the request shell); a worker, its part of a leg
(prefill compute, the KV pull, decode admission and run), under the ``traceparent`` the
router's message carries; the HTTP legs to vLLM and SGLang send it as a header.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pdtrio.config import TracingConfig
from pdtrio.tracing._context import (
    TRACEPARENT_HEADER,
    RemoteParent,
    format_traceparent,
    parse_traceparent,
)

if TYPE_CHECKING:  # (OpenTelemetry is imported only once tracing is on)
    from pdtrio.tracing._otel import Tracing as Tracing
    from pdtrio.tracing._otel import WorkSpan as WorkSpan
    from pdtrio.tracing._request import RequestTrace as RequestTrace

log = logging.getLogger("pdtrio.tracing")

_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def tracing_endpoint(config: TracingConfig, environ: Mapping[str, str]) -> str:
    """Where spans would go ("" : tracing is off)."""
    if config.endpoint:
        return config.endpoint
    for variable in _ENDPOINT_VARIABLES:
        value = environ.get(variable, "").strip()
        if value:
            return value
    return ""


def start_tracing(
    config: TracingConfig, role: str, environ: Mapping[str, str] | None = None
) -> Tracing | None:
    """This process's tracer for ``role`` (router, worker), or None when tracing is off."""
    environ = os.environ if environ is None else environ
    endpoint = tracing_endpoint(config, environ)
    if not endpoint:
        return None
    try:
        from pdtrio.tracing._otel import Tracing
    except ImportError as exc:
        log.warning(
            "tracing is off: spans are asked for (%s) but the OpenTelemetry SDK is not "
            "installed (pip install 'pdtrio[otel]'): %s",
            endpoint,
            exc,
        )
        return None
    return Tracing.start(config, endpoint, role, environ)


def request_trace(
    tracing: Tracing, incoming: str, *, request_id: str, model: str, endpoint: str, key_id: str
) -> RequestTrace:
    """A request's spans on the router (``incoming``: the client's ``traceparent``)."""
    from pdtrio.tracing._request import RequestTrace

    return RequestTrace(
        tracing, incoming, request_id=request_id, model=model, endpoint=endpoint, key_id=key_id
    )


__all__ = [
    "TRACEPARENT_HEADER",
    "RemoteParent",
    "format_traceparent",
    "parse_traceparent",
    "request_trace",
    "start_tracing",
    "tracing_endpoint",
]
