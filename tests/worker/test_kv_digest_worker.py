"""The verified handoff in a cluster: what prefill wrote is checked by decode, a mismatch is
a failed handoff the router places elsewhere, counted and logged, never a wrong answer.

In-process clusters of synthetic workers (TCP KV); the torch engine's, over NIXL and TCP,
are in test_torch_pd.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import trio

from pdtrio.config import KvDigestCoverage, RouterConfig, WorkerFaultsConfig
from pdtrio.worker.fault_hooks import FaultyKvTransport
from pdtrio.worker.server import Worker
from tests.cluster import Cluster, client, running_cluster, synthetic_worker, wait_until_idle
from tests.metrics import value

LIVENESS_S = 15.0
# one decode, refused: the router's wait for another decode to connect is cut short
_NO_OTHER_DECODE = RouterConfig(decode_reconnect_wait_s=0.2)
_CORRUPT = WorkerFaultsConfig(kv_transfer_corrupt=True)


def _body(index: int) -> dict[str, Any]:
    prompt = f"the verified handoff, request {index}: " + "block " * (5 + 7 * index)
    return {"model": "synthetic", "prompt": prompt, "max_tokens": 6, "seed": index}


def _workers(
    *, digest: KvDigestCoverage = "sampled", corrupt: tuple[str, ...] = ()
) -> Callable[[str], Worker]:
    """Workers in start order; ``corrupt`` names, by "role#n" (1-based), those whose pulls
    land damaged."""
    made: dict[str, int] = {}

    def make(role: str) -> Worker:
        made[role] = made.get(role, 0) + 1
        faults = _CORRUPT if f"{role}#{made[role]}" in corrupt else None
        return synthetic_worker(role, faults=faults, worker_overrides={"kv_digest": digest})

    return make


async def _answers(cluster: Cluster, count: int) -> list[str]:
    texts = []
    async with client(cluster) as http:
        for index in range(count):
            with trio.fail_after(LIVENESS_S):
                response = await http.post("/v1/completions", json=_body(index))
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
    return texts


def _digest_metrics(worker: Worker) -> tuple[float, float]:
    text = worker.metrics.render().decode()
    return (
        value(text, "pdtrio_worker_kv_digest_checks_total"),
        value(text, "pdtrio_worker_kv_digest_mismatches_total"),
    )


async def _idle(cluster: Cluster) -> None:
    await wait_until_idle(cluster, LIVENESS_S)
    for stats in cluster.stats():
        assert stats["kv_blocks_in_use"] == 0, stats


async def test_checked_handoffs_answer_as_unchecked_ones_and_are_counted() -> None:
    answers: dict[str, list[str]] = {}
    for digest in ("off", "sampled", "full"):
        async with running_cluster(make_worker=_workers(digest=digest)) as cluster:  # type: ignore[arg-type]
            answers[digest] = await _answers(cluster, 4)
            decode = cluster.workers[1]
            checks, mismatches = _digest_metrics(decode)
            assert (checks, mismatches) == ((0.0 if digest == "off" else 4.0), 0.0)
            await _idle(cluster)
    assert answers["sampled"] == answers["off"] == answers["full"]


async def test_a_corrupted_handoff_is_refused_and_retried_on_the_other_decode(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with running_cluster(make_worker=_workers()) as cluster:
        undisturbed = await _answers(cluster, 4)
    with caplog.at_level(logging.WARNING, logger="pdtrio.worker"):
        async with running_cluster(
            roles=("prefill", "decode", "decode"), make_worker=_workers(corrupt=("decode#1",))
        ) as cluster:
            assert await _answers(cluster, 4) == undisturbed
            _, faulty, healthy = cluster.workers
            transport = faulty.transport
            assert isinstance(transport, FaultyKvTransport) and transport.corrupted_pulls > 0
            checks, mismatches = _digest_metrics(faulty)
            assert mismatches == checks == transport.corrupted_pulls
            assert _digest_metrics(healthy)[1] == 0
            # (whichever decode the router tried first, each request ended on the healthy one)
            assert _digest_metrics(healthy)[0] == 4
            await _idle(cluster)
    warnings = [r for r in caplog.records if "KV digest mismatch" in r.getMessage()]
    assert len(warnings) == transport.corrupted_pulls
    assert all(r.levelno == logging.WARNING for r in warnings)
    assert "prompt blocks 0," in warnings[0].getMessage()


async def test_a_corrupted_handoff_with_one_decode_is_a_503_naming_the_mismatch() -> None:
    async with running_cluster(
        make_worker=_workers(corrupt=("decode#1",)), router=_NO_OTHER_DECODE
    ) as cluster:
        async with client(cluster) as http:
            with trio.fail_after(LIVENESS_S):
                response = await http.post("/v1/completions", json=_body(0))
        assert response.status_code == 503, response.text
        message = response.json()["error"]["message"]
        assert "is not what prefill wrote (digest mismatch in prompt blocks 0," in message
        # each of the handoff's rounds (a new prefill each) was refused as damaged
        rounds = float(_NO_OTHER_DECODE.handoff_attempts)
        assert _digest_metrics(cluster.workers[1]) == (rounds, rounds)
        await _idle(cluster)
