"""The router's latency and token metrics, its access line, and multiprocess mode."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, multiprocess

from pdtrio.metrics import LocalHistogram, exposition
from pdtrio.router.metrics import DECLARED_METRICS, ITL_BUCKETS_S, RouterMetrics
from tests.cluster import client, running_cluster, wait_until_idle
from tests.metrics import value

_REQUESTS = 3
_MAX_TOKENS = 6


async def test_latencies_tokens_and_instances_after_a_few_requests(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pdtrio.access")
    async with running_cluster(decode_step_s=0.002) as cluster:
        async with client(cluster) as http:
            for index in range(_REQUESTS):
                body = {
                    "model": "synthetic",
                    "prompt": "say something",
                    "max_tokens": _MAX_TOKENS,
                    "stream": index % 2 == 0,
                }
                response = await http.post("/v1/completions", json=body)
                assert response.status_code == 200
            await wait_until_idle(cluster)
            metrics = (await http.get("/metrics")).text
    model = {"model": "synthetic"}
    for histogram in (
        "pdtrio_time_to_first_token_seconds",
        "pdtrio_e2e_request_latency_seconds",
        "pdtrio_prefill_seconds",
        "pdtrio_queue_wait_seconds",
        "pdtrio_kv_handoff_seconds",
    ):
        assert value(metrics, f"{histogram}_count", **model) == _REQUESTS, histogram
        assert value(metrics, f"{histogram}_bucket", le="+Inf", **model) == _REQUESTS
    # one gap per event after the first: at least one per request, at most one per token
    gaps = value(metrics, "pdtrio_inter_token_latency_seconds_count", **model)
    assert _REQUESTS <= gaps <= _REQUESTS * (_MAX_TOKENS - 1)
    assert value(metrics, "pdtrio_completion_tokens_total", **model) == _REQUESTS * _MAX_TOKENS
    assert value(metrics, "pdtrio_prompt_tokens_total", **model) > 0
    assert value(metrics, "pdtrio_requests_active") == 0
    assert value(metrics, "pdtrio_streams_active") == 0
    assert value(metrics, "pdtrio_retries_total") == 0
    assert value(metrics, "pdtrio_queue_full_rejections_total") == 0
    # the instances, as the router sees them now
    assert value(metrics, "pdtrio_instance_up", role="prefill") == 1
    assert value(metrics, "pdtrio_instance_up", role="decode") == 1
    assert value(metrics, "pdtrio_instance_active_requests") == 0
    free = value(metrics, "pdtrio_instance_kv_free_blocks", role="decode")
    assert free == cluster.workers[1].engine.statistics().kv_blocks_total
    assert value(metrics, "pdtrio_link_reconnects_total") == 0
    assert value(metrics, "pdtrio_link_heartbeat_misses_total") == 0
    # one access line per request, with its figures and no content
    lines = [r for r in caplog.records if r.name == "pdtrio.access"]
    assert len(lines) == _REQUESTS
    for record in lines:
        fields = dict(part.split("=", 1) for part in record.getMessage().split(" "))
        assert set(fields) == {
            "request_id",
            "model",
            "status",
            "outcome",
            "prompt_tokens",
            "completion_tokens",
            "ttft_ms",
            "total_ms",
            "prefill",
            "decode",
            "migrations",
            "prefill_at",
        }
        assert fields["request_id"].startswith("cmpl-")
        assert (fields["model"], fields["status"], fields["outcome"]) == ("synthetic", "200", "ok")
        assert fields["completion_tokens"] == str(_MAX_TOKENS)
        assert int(fields["prompt_tokens"]) > 0
        assert 0 < float(fields["ttft_ms"]) <= float(fields["total_ms"])
        assert fields["prefill"].startswith("prefill@")
        assert fields["decode"].startswith("decode@")
        assert fields["migrations"] == "-"
        assert fields["prefill_at"] == "remote"
        assert "say something" not in record.getMessage()


def test_a_local_histogram_merges_as_observe_would() -> None:
    from prometheus_client import Histogram

    registry = CollectorRegistry()
    direct = Histogram("direct", "", registry=registry, buckets=ITL_BUCKETS_S)
    merged = Histogram("merged", "", registry=registry, buckets=ITL_BUCKETS_S)
    local = LocalHistogram(ITL_BUCKETS_S)
    for gap in (0.0, 0.001, 0.0011, 0.01, 0.5, 2.5, 3.0, 100.0):
        direct.observe(gap)
        local.observe(gap)
    local.merge_into(merged)
    local.merge_into(merged)  # nothing more: merging twice adds nothing
    text = exposition(registry).decode()
    for bound in [*(str(b) for b in ITL_BUCKETS_S), "+Inf"]:
        assert value(text, "direct_bucket", le=bound) == value(text, "merged_bucket", le=bound)
    assert value(text, "merged_count") == 8
    assert value(text, "merged_sum") == pytest.approx(value(text, "direct_sum"))


_ONE_ROUTER_PROCESS = textwrap.dedent(
    """
    import os
    from types import SimpleNamespace

    from pdtrio.router.state_metrics import BackendFigures
    from pdtrio.router.metrics import Outcome
    from pdtrio.router.metrics import RouterMetrics

    router = SimpleNamespace(
        backend=SimpleNamespace(figures=BackendFigures), tokens_delivered=3,
        egress=SimpleNamespace(spacing_s=0.0, busy_fraction=0.0),
    )
    metrics = RouterMetrics(router)
    metrics.requests_active.inc()
    figures = metrics.figures("m")
    figures.prompt_tokens = 5
    figures.delivered(1)
    figures.delivered(2)
    metrics.request_ended(
        endpoint="/v1/completions", model="m", outcome=Outcome.OK, status=None, figures=figures
    )
    print(os.getpid())
    print(metrics.render().decode())
    """
)


def test_multiprocess_mode_sums_every_process(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    pids = []
    text = ""
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", _ONE_ROUTER_PROCESS],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        pid, _, text = done.stdout.partition("\n")
        pids.append(int(pid))
    # the second process's /metrics: both processes' requests, and its own live state
    assert value(text, "pdtrio_requests_total", outcome="ok") == 2
    assert value(text, "pdtrio_completion_tokens_total", model="m") == 6
    assert value(text, "pdtrio_prompt_tokens_total", model="m") == 10
    assert value(text, "pdtrio_inter_token_latency_seconds_count", model="m") == 2
    assert value(text, "pdtrio_e2e_request_latency_seconds_count", model="m") == 2
    assert value(text, "pdtrio_requests_active") == 2  # livesum: both pids' files are there
    assert value(text, "pdtrio_tokens_delivered_total") == 3  # the answering process's
    # a process gone: its live gauges go with it (what a supervisor's cleanup does)
    for pid in pids:
        multiprocess.mark_process_dead(pid, str(tmp_path))
    after = exposition(CollectorRegistry(), multiprocess=str(tmp_path)).decode()
    assert value(after, "pdtrio_requests_active") == 0
    assert value(after, "pdtrio_requests_total", outcome="ok") == 2


def test_every_declared_metric_has_its_typed_attribute_and_no_other() -> None:
    # the constructor sets them by name: a typo or a forgotten annotation shows here
    declared = {spec.attribute: spec.kind for spec in DECLARED_METRICS}
    assert len(declared) == len(DECLARED_METRICS)
    assert typing.get_type_hints(RouterMetrics) == declared
    assert len({spec.name for spec in DECLARED_METRICS}) == len(DECLARED_METRICS)
