"""An OTLP/HTTP trace receiver for tests: what a Collector would get, decoded with the
official protobuf messages (opentelemetry-proto)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import attrs
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@attrs.frozen
class ReceivedSpan:
    service: str
    instance: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    events: tuple[tuple[str, dict[str, Any]], ...]
    error: str | None  # the status message when its status is ERROR
    start_ns: int
    end_ns: int


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


@attrs.define
class TraceReceiver:
    url: str = ""
    spans: list[ReceivedSpan] = attrs.Factory(list)
    _lock: threading.Lock = attrs.Factory(threading.Lock)

    def add(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = _attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        error = span.status.message if span.status.code == 2 else None
                        self.spans.append(
                            ReceivedSpan(
                                service=resource.get("service.name", ""),
                                instance=resource.get("service.instance.id", ""),
                                name=span.name,
                                trace_id=span.trace_id.hex(),
                                span_id=span.span_id.hex(),
                                parent_id=span.parent_span_id.hex(),
                                attributes=_attributes(span.attributes),
                                events=tuple(
                                    (event.name, _attributes(event.attributes))
                                    for event in span.events
                                ),
                                error=error,
                                start_ns=span.start_time_unix_nano,
                                end_ns=span.end_time_unix_nano,
                            )
                        )

    def received(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)


@contextmanager
def trace_receiver() -> Iterator[TraceReceiver]:
    """A receiver on loopback, serving on a thread of its own (as a Collector would)."""
    receiver = TraceReceiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                import gzip

                body = gzip.decompress(body)
            receiver.add(body)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
