"""OpenTelemetry traces (issue 54): one trace per request across the router and its
workers, as an OTLP/HTTP receiver gets it; off, broken or absent, requests are served."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

import httpx
import pytest
import trio

from pdtrio.config import (
    InstanceConfig,
    PdtrioConfig,
    RouterConfig,
    SecurityConfig,
    TracingConfig,
    WorkerFaultsConfig,
)
from pdtrio.engine.api import Engine
from pdtrio.engine.synthetic import SyntheticEngine
from pdtrio.router.app import RouterApp
from pdtrio.tracing import parse_traceparent, start_tracing
from pdtrio.worker.server import Worker
from tests.cluster import serve_app, synthetic_worker
from tests.router.test_migration import FailsAStep
from tests.tracing_receiver import ReceivedSpan, trace_receiver

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
REQUEST_SPAN = "POST /v1/chat/completions"
ROUTER, WORKER = "pdtrio-router", "pdtrio-worker"


@asynccontextmanager
async def traced_cluster(
    endpoint: str,
    decodes: tuple[WorkerFaultsConfig, ...] = (WorkerFaultsConfig(),),
    *,
    first_fails_step: int = 0,
    security: SecurityConfig | None = None,
) -> AsyncIterator[str]:
    """A router, a prefill and decodes, all sending spans to ``endpoint``; on exit every
    process part has flushed its spans (``first_fails_step``: the first decode's engine
    fails that step, as in test_migration)."""
    tracing = TracingConfig(endpoint=endpoint)
    workers = [synthetic_worker("prefill", worker_overrides={"tracing": tracing})]
    workers += [
        synthetic_worker("decode", faults=faults, worker_overrides={"tracing": tracing})
        for faults in decodes
    ]
    if first_fails_step:
        first = workers[1]
        assert isinstance(first.engine, SyntheticEngine)
        workers[1] = Worker(first.config, cast(Engine, FailsAStep(first.engine, first_fails_step)))
    async with trio.open_nursery() as nursery:
        instances = []
        for worker in workers:
            ready = await nursery.start(worker.run)
            instances.append(InstanceConfig(role=worker.config.role, url=ready["url"]))
        config = PdtrioConfig(
            router=RouterConfig(decode_policy="round_robin"),
            instances=tuple(instances),
            tracing=tracing,
            security=security or SecurityConfig(),
        )
        yield await serve_app(RouterApp(config), nursery)
        nursery.cancel_scope.cancel()


async def stream_chat(url: str, headers: dict[str, str] | None = None) -> str:
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8,
        "stream": True,
    }
    text = ""
    async with httpx.AsyncClient(base_url=url, timeout=20) as http:
        async with http.stream(
            "POST", "/v1/chat/completions", json=body, headers=headers or {}
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    for choice in chunk["choices"]:
                        text += choice["delta"].get("content") or ""
    return text


def one(spans: list[ReceivedSpan], name: str, service: str = "pdtrio-router") -> ReceivedSpan:
    found = [s for s in spans if s.name == name and s.service == service]
    assert len(found) == 1, (name, service, [(s.service, s.name) for s in spans])
    return found[0]


async def test_a_streamed_request_is_one_trace_across_router_prefill_and_decode(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pdtrio.access")
    with trace_receiver() as receiver:
        async with traced_cluster(receiver.url) as url:
            assert await stream_chat(url, {"traceparent": CLIENT_TRACEPARENT})
        spans = receiver.received()
    assert {s.trace_id for s in spans} == {CLIENT_TRACE}
    request = one(spans, REQUEST_SPAN)
    assert request.parent_id == CLIENT_SPAN  # the client's span is its parent
    assert request.attributes["gen_ai.request.model"] == "synthetic"
    assert request.attributes["http.route"] == "/v1/chat/completions"
    assert request.attributes["pdtrio.outcome"] == "ok"
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["gen_ai.usage.input_tokens"] > 0
    assert request.attributes["gen_ai.usage.output_tokens"] == 8
    assert "first_token" in [name for name, _ in request.events]
    assert request.error is None
    prefill = one(spans, "prefill")
    decode = one(spans, "decode")
    for leg in (prefill, decode):
        assert leg.parent_id == request.span_id
        assert leg.error is None
        assert request.start_ns <= leg.start_ns <= leg.end_ns <= request.end_ns
    assert prefill.end_ns <= decode.start_ns
    # from its placement: placed on an instance, then its KV pulled
    assert [name for name, _ in decode.events][:2] == ["placed", "accepted"]
    assert decode.attributes["pdtrio.instance"]
    # the workers' spans are children of the router's legs
    worker_prefill = one(spans, "prefill", "pdtrio-worker")
    admission = one(spans, "decode admission", "pdtrio-worker")
    assert worker_prefill.parent_id == prefill.span_id
    assert worker_prefill.attributes["gen_ai.usage.input_tokens"] > 0
    assert admission.parent_id == decode.span_id
    # prefill wrote the KV decode pulls; decode ran from admission to the last token
    [(_, written)] = [(n, a) for n, a in worker_prefill.events if n == "kv_written"]
    assert written["pdtrio.kv_blocks"] > 0
    worker_decode = one(spans, "decode", "pdtrio-worker")
    assert worker_decode.parent_id == decode.span_id
    assert worker_decode.start_ns <= admission.start_ns <= admission.end_ns <= worker_decode.end_ns
    assert worker_decode.attributes["pdtrio.finish"] == "length"
    assert worker_decode.attributes["gen_ai.usage.output_tokens"] == 8
    # prefill made the first token; decode the rest
    assert worker_decode.attributes["pdtrio.tokens_generated"] == 7
    assert worker_decode.error is None and not worker_decode.events  # no span/event a token
    # the access line names the trace
    [access] = [r for r in caplog.records if r.name == "pdtrio.access"]
    assert f"trace_id={CLIENT_TRACE}" in access.getMessage()
    assert access.trace_id == CLIENT_TRACE  # (a JSON log's key)
    # each process its own instance id
    assert len({request.instance, worker_prefill.instance, admission.instance}) == 3


async def test_a_decode_retry_appears_in_the_trace_with_its_reason() -> None:
    # the first decode's KV pulls fail: a request placed there is placed again
    failing, healthy = WorkerFaultsConfig(kv_transfer_fail=True), WorkerFaultsConfig()
    with trace_receiver() as receiver:
        async with traced_cluster(receiver.url, decodes=(failing, healthy)) as url:
            for _ in range(2):  # (round robin: one of them meets the failing decode first)
                assert await stream_chat(url)
        spans = receiver.received()
    retried = [
        s for s in spans if s.name == REQUEST_SPAN and any(n == "retry" for n, _ in s.events)
    ]
    assert retried
    request = retried[0]
    retry = next(attributes for name, attributes in request.events if name == "retry")
    assert retry["pdtrio.leg"] == "decode"
    assert retry["pdtrio.reason"]
    decodes = sorted(
        (
            s
            for s in spans
            if s.trace_id == request.trace_id and s.name == "decode" and s.service == ROUTER
        ),
        key=lambda s: s.start_ns,
    )
    assert [d.attributes["pdtrio.attempt"] for d in decodes] == [1, 2]
    assert decodes[0].error is not None and "rejected" in decodes[0].error
    assert decodes[1].error is None
    assert request.attributes["pdtrio.outcome"] == "ok"


async def test_a_decode_lost_mid_stream_shows_its_migration_and_both_decodes_in_one_trace() -> None:
    healthy = WorkerFaultsConfig()
    with trace_receiver() as receiver:
        async with traced_cluster(
            receiver.url, decodes=(healthy, healthy), first_fails_step=5
        ) as url:
            for _ in range(2):  # (round robin: one of them meets the failing decode)
                assert await stream_chat(url)
        spans = receiver.received()
    [request] = [
        s for s in spans if s.name == REQUEST_SPAN and any(n == "migration" for n, _ in s.events)
    ]
    migration = next(attributes for name, attributes in request.events if name == "migration")
    assert migration["pdtrio.reason"] == "decode_failed"
    assert migration["pdtrio.lost_on"]
    assert request.attributes["pdtrio.outcome"] == "ok"
    assert request.attributes["gen_ai.usage.output_tokens"] == 8
    traced = [s for s in spans if s.trace_id == request.trace_id]
    assert {s.trace_id for s in traced} == {request.trace_id}  # one trace, both decodes in it
    decodes = sorted(
        (s for s in traced if s.name == "decode" and s.service == ROUTER),
        key=lambda s: s.start_ns,
    )
    assert [d.attributes["pdtrio.attempt"] for d in decodes] == [1, 2]
    assert all(d.parent_id == request.span_id for d in decodes)
    assert decodes[0].attributes["pdtrio.instance"] != decodes[1].attributes["pdtrio.instance"]
    assert decodes[0].error is not None and decodes[1].error is None
    assert decodes[0].end_ns <= decodes[1].start_ns
    # each decode worker's run under its own attempt: the lost one failed, the next finished
    runs = {s.parent_id: s for s in traced if s.name == "decode" and s.service == WORKER}
    lost, finished = runs[decodes[0].span_id], runs[decodes[1].span_id]
    assert lost.attributes["pdtrio.finish"] == "error" and lost.error
    assert finished.attributes["pdtrio.finish"] == "length"
    assert finished.attributes["pdtrio.tokens_before"] > 1  # it went on from the lost one
    assert finished.attributes["gen_ai.usage.output_tokens"] == 8


async def test_requests_refused_before_the_pipeline_get_a_span_with_their_status(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pdtrio.access")
    security = SecurityConfig(api_keys=("the-key",))
    with trace_receiver() as receiver:
        async with traced_cluster(receiver.url, security=security) as url:
            async with httpx.AsyncClient(base_url=url, timeout=20) as http:
                chat = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}]}
                # no key (the client's trace), then a body that fails validation (a new one)
                unauthorized = await http.post(
                    "/v1/chat/completions", json=chat, headers={"traceparent": CLIENT_TRACEPARENT}
                )
                invalid = await http.post(
                    "/v1/chat/completions",
                    json={**chat, "max_tokens": -1},
                    headers={"authorization": "Bearer the-key"},
                )
        spans = receiver.received()
    assert (unauthorized.status_code, invalid.status_code) == (401, 400)
    refused = sorted(
        (s for s in spans if s.name == REQUEST_SPAN and s.service == ROUTER),
        key=lambda s: s.start_ns,
    )
    assert [s.attributes["http.response.status_code"] for s in refused] == [401, 400]
    assert all(s.attributes["pdtrio.outcome"] == "rejected" and s.error for s in refused)
    assert (refused[0].trace_id, refused[0].parent_id) == (CLIENT_TRACE, CLIENT_SPAN)
    assert refused[1].trace_id != CLIENT_TRACE and refused[1].parent_id == ""
    assert len(spans) == 2  # nothing else was asked of anyone
    # each refusal's access line names its trace
    access = [r.getMessage() for r in caplog.records if r.name == "pdtrio.access"]
    assert [f"trace_id={s.trace_id}" in line for s, line in zip(refused, access, strict=True)] == [
        True,
        True,
    ]


async def test_a_traced_requests_trace_id_is_an_exemplar_in_an_openmetrics_scrape() -> None:
    with trace_receiver() as receiver:
        async with traced_cluster(receiver.url) as url:
            assert await stream_chat(url, {"traceparent": CLIENT_TRACEPARENT})
            async with httpx.AsyncClient(base_url=url, timeout=20) as http:
                openmetrics = await http.get(
                    "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}
                )
                plain = await http.get("/metrics")
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.endswith("# EOF\n")
    exemplar = f'# {{trace_id="{CLIENT_TRACE}"}}'
    for histogram in ("pdtrio_time_to_first_token_seconds", "pdtrio_e2e_request_latency_seconds"):
        buckets = [
            line
            for line in openmetrics.text.splitlines()
            if line.startswith(f"{histogram}_bucket{{") and 'model="synthetic"' in line
        ]
        assert [line for line in buckets if exemplar in line], buckets
    # a plain scrape is the text format as before: no exemplars
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "pdtrio_e2e_request_latency_seconds_bucket{" in plain.text
    assert "trace_id" not in plain.text and "# EOF" not in plain.text


async def test_a_malformed_traceparent_is_ignored_and_the_request_starts_a_trace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    with trace_receiver() as receiver:
        async with traced_cluster(receiver.url) as url:
            assert await stream_chat(url, {"traceparent": "00-not-a-trace-01"})
        spans = receiver.received()
    request = one(spans, REQUEST_SPAN)
    assert request.parent_id == ""
    assert request.trace_id != CLIENT_TRACE
    assert not [r for r in caplog.records if r.name.startswith("pdtrio.tracing")]


async def test_an_unreachable_collector_is_said_once_and_requests_are_served(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    caplog.set_level(logging.WARNING)
    with trace_receiver() as receiver:
        closed = receiver.url  # (closed below: nothing listens there any more)
    async with traced_cluster(closed) as url:
        for _ in range(2):
            assert await stream_chat(url)
    warnings = [
        r for r in caplog.records if r.name == "pdtrio.tracing" and r.levelno == logging.WARNING
    ]
    # one per process part that had spans to send (the router, the prefill, the decode)
    assert 1 <= len(warnings) <= 3
    assert all("could not be sent" in r.getMessage() for r in warnings)


def test_without_the_sdk_tracing_is_off_with_one_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pdtrio.tracing._otel", None)  # (import fails)
    caplog.set_level(logging.WARNING)
    assert start_tracing(TracingConfig(endpoint="http://127.0.0.1:9"), "router") is None
    [warning] = [r for r in caplog.records if r.name == "pdtrio.tracing"]
    assert "pdtrio[otel]" in warning.getMessage()


def test_tracing_is_off_unless_an_endpoint_is_named() -> None:
    assert start_tracing(TracingConfig(), "router", environ={}) is None


async def test_without_tracing_a_request_is_served_as_before() -> None:
    from tests.cluster import running_cluster

    async with running_cluster() as cluster:
        assert cluster.router_app.router is not None
        assert cluster.router_app.router.tracing is None
        assert await stream_chat(cluster.url, {"traceparent": CLIENT_TRACEPARENT})


@pytest.mark.parametrize(
    "value",
    [
        "",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
    ],
)
def test_a_malformed_traceparent_names_no_parent(value: str) -> None:
    assert parse_traceparent(value) is None


def test_a_later_versions_traceparent_is_read_by_its_prefix() -> None:
    parent = parse_traceparent(f"01-{CLIENT_TRACE}-{CLIENT_SPAN}-01-more")
    assert parent is not None and parent.sampled
    assert parent.trace_id == int(CLIENT_TRACE, 16)
