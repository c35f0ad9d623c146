"""No bytes from a peer that has not authenticated stop, hang or leak a pdtrio process.

A router (API keys required) in front of a prefill and a decode worker (a worker
secret the peer does not hold), each its own process (``tests/fuzz/live.py``),
gets hostile bytes on every port a stranger can reach: the router's HTTP port, each
worker's HTTP port (its ``/pd/link`` websocket before the handshake included) and
the KV transfer port; and, as a peer holding the secret gone wrong, the link after
its handshake and a KV session after its opening.  First the known-hostile corpus
(``tests/fuzz/hostile.py``), then Hypothesis's cases.  After every case the target
still answers ``/health``; every few cases every process does and a completion
through the router (so both workers) succeeds; at the end of each test nothing is
held (KV blocks, leases, requests, descriptors, threads) and no process logged a
traceback.

CI runs a bounded, derandomized count (about three minutes in all).  Longer::

    PDTRIO_FUZZ_LIVE_EXAMPLES=2000 python -m pytest tests/fuzz/test_live_processes.py

(random cases, a new draw each run), or the long mode, which restarts a process
that died and goes on, printing the count per target and what it found::

    python -m tests.fuzz.live --minutes 60

Known tracebacks (``live.KNOWN_TRACEBACKS``) are printed, not failed on, unless
``PDTRIO_FUZZ_STRICT_LOGS=1``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.fuzz import hostile
from tests.fuzz.live import Fuzzer, LiveCluster, live_cluster

pytestmark = pytest.mark.slow

_requested = os.environ.get("PDTRIO_FUZZ_LIVE_EXAMPLES")
# random cases per target: CI's bounded count, the same cases every run
EXAMPLES = int(_requested) if _requested else 120
# every byte offset of the half-close cases only in a longer run (CI: every 7th)
EVERY_OFFSET = bool(_requested)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LiveCluster]:
    with live_cluster() as running:
        yield running


@pytest.fixture
def fuzzer(cluster: LiveCluster) -> Fuzzer:
    if cluster.check_serving():
        cluster.restart()  # a test before this one left it broken (and failed for it)
    cluster.new_log_findings()  # this test answers for what is logged from here on
    return Fuzzer(cluster, check_every=10)


def _assert_nothing_found(fuzzer: Fuzzer) -> None:
    for known in fuzzer.known:
        print(f"known traceback (PDTRIO_FUZZ_STRICT_LOGS=1 fails on it):\n{known}")
    assert not fuzzer.findings, "\n\n".join(finding.report() for finding in fuzzer.findings)


@pytest.mark.parametrize("target", hostile.TARGETS)
def test_no_known_hostile_bytes_stop_hang_or_leak_a_process(fuzzer: Fuzzer, target: str) -> None:
    fuzzer.corpus(target, every_offset=EVERY_OFFSET)
    fuzzer.finish(target)
    _assert_nothing_found(fuzzer)
    assert fuzzer.counts[target] == len(hostile.corpus(target, every_offset=EVERY_OFFSET))


@pytest.mark.parametrize("target", hostile.TARGETS)
def test_no_random_bytes_stop_hang_or_leak_a_process(fuzzer: Fuzzer, target: str) -> None:
    fuzzer.hypothesis(target, EXAMPLES, derandomize=not _requested)
    fuzzer.finish(target)
    _assert_nothing_found(fuzzer)
    assert fuzzer.counts[target] > 0
