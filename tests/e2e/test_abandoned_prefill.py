"""Prefills the router gives up on hold nothing: not the leases of clients that left during
prefill (while the link to prefill works, and while it stalls past its timeout), nor those
of a prefill worker whose link timed out while it was stopped.

Real processes (``benchmarks.abandoned_prefill``'s cluster: the synthetic engine with a
prefill of about a second, ``kv_lease_s`` 60 s, the router's link to prefill through a
fault proxy).  What is checked is what a user sees in
the workers' ``/pd/stats``: both idle (no lease, no block, nothing running) within a bound
far below the lease, which a lease left to expire would pass.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from benchmarks.abandoned_prefill import KV_LEASE_S, Cluster, Plan, sigstop, start_cluster, storm
from pdtrio.testing import Processes, Service
from tests.cluster import eventually

# generous: a bound on liveness (a lease nobody releases waits KV_LEASE_S), not a measure
IDLE_WITHIN_S = 15.0
assert IDLE_WITHIN_S < KV_LEASE_S / 2

PLAN = Plan(clients=60, stopped_clients=10, stop_s=3.0)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with Processes(stop_grace_s=30) as procs:
        yield start_cluster(procs, tmp_path, PLAN)


def test_clients_that_leave_during_prefill_leave_both_workers_idle(cluster: Cluster) -> None:
    report = trio.run(storm, cluster, PLAN, IDLE_WITHIN_S)
    assert report["idle_after_s"] is not None, report["stats"]
    # the same storm, its link to prefill stalled past the link timeout halfway through the
    # prefills (as a swamped prefill's link does): prefill answers into the stall calls the
    # router has given up on, and nobody is left to release their leases but the router
    report = trio.run(partial(storm, cluster, PLAN, IDLE_WITHIN_S, stall=True))
    assert report["idle_after_s"] is not None, report["stats"]
    assert report["leases_expired"] == 0


def test_a_link_timeout_while_prefill_is_stopped_leaves_no_lease(cluster: Cluster) -> None:
    report = trio.run(sigstop, cluster, PLAN, IDLE_WITHIN_S)
    # the link timed out: each of the stopped prefills' clients got an answer (503)
    assert sum(report["answers"].values()) == PLAN.stopped_clients, report["answers"]
    assert report["idle_after_s"] is not None, report["stats"]
    assert report["leases_expired"] == 0


def _answer_while_stopped(cluster: Cluster, stopped: Service) -> httpx.Response:
    """A request's answer while ``stopped`` is SIGSTOPped and out of rotation."""
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        assert eventually(
            lambda: httpx.get(f"{cluster.router.url}/health", timeout=10).status_code == 503,
            IDLE_WITHIN_S,
        )
        return httpx.post(
            f"{cluster.router.url}/v1/completions",
            json={"model": "synthetic", "prompt": "hi", "max_tokens": 4},
            timeout=10,
        )
    finally:
        os.kill(stopped.pid, signal.SIGCONT)


def test_the_503_names_the_role_that_is_missing(cluster: Cluster) -> None:
    # decode is out (a restart, say) while prefill is up
    answer = _answer_while_stopped(cluster, cluster.decode)
    assert answer.status_code == 503
    assert answer.json()["error"]["message"] == "no decode instance is available"

    assert eventually(
        lambda: httpx.get(f"{cluster.router.url}/health", timeout=10).status_code == 200,
        IDLE_WITHIN_S,
    )
    answer = _answer_while_stopped(cluster, cluster.prefill)
    assert answer.status_code == 503
    assert answer.json()["error"]["message"] == "no prefill instance is available"
