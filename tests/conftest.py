"""Test tiers: ``-m "not slow"`` is the fast in-process tier; CI runs everything.

A test is ``slow`` when it starts a process (a worker, a router, hypercorn, etcd, a
benchmark, the CLI), loads a real model (SmolLM2's weights or tokenizer), or is long by
design (a real timeout waited out, a statistical run, the fuzzers).  Everything else runs
in this process on trio, the synthetic engine and loopback sockets:
``python -m pytest -m "not slow"``.

Whole modules are marked here (:data:`SLOW`), single tests with ``@pytest.mark.slow``.
The fast tier keeps the rule by itself: a test that is not marked slow and starts a
process fails, naming the rule, instead of quietly making the fast tier slow.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from tests.examples import PROFILE

# hypothesis's example counts: the fast tier's by default, CI's under HYPOTHESIS_PROFILE=ci
# (tests/examples.py)
settings.load_profile(PROFILE)
# torch's OpenMP threads in this process sleep at once when idle (a worker's spin briefly,
# pdtrio/engine/threads.py): spinning ones take the cores the trio tests wait for
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

TESTS = Path(__file__).resolve().parent

# folders, modules and single tests (``path::name``, parameters included) that start
# processes or load a real model, or are long by design
SLOW = (
    "e2e/",
    "discovery/test_etcd_discovery.py",
    "discovery/test_registry_security.py",
    "kv/test_nixl_listeners.py",
    "kv/test_nixl_processes.py",
    "kv/test_nixl_workers.py",
    "kv/test_selection.py::test_a_worker_that_needs_nixl_and_cannot_start_it_exits_with_one_line_of_ours",
    "faults/test_proxy.py::test_the_command_line_explains_itself",
    "faults/test_proxy.py::test_the_command_line_refuses_a_bad_address",
    "faults/test_proxy.py::test_the_command_line_proxy_adds_latency_and_stops_on_sigterm",
    "router/test_big_inputs.py::test_the_router_gives_the_memory_of_huge_requests_back",
    "router/test_router_metrics.py::test_multiprocess_mode_sums_every_process",
    "security/test_embedded_secret.py",
    "worker/test_smollm2_pd.py",
    "worker/test_decode_prefix_reuse.py",
    "worker/test_model_loading_errors.py",
    "worker/test_torch_pd.py",
    "worker/test_served_model_name.py",
    "worker/test_worker_cli.py",
    "test_processes_harness.py",
    "test_cli.py",
    "test_logs.py",
    # matplotlib runs fc-list to build its font cache on first use (no cache: every time,
    # since the refused process leaves it unbuilt)
    "test_benchmark_plots.py::test_latency_cdfs_and_throughput_are_written_as_a_png",
    "tools/test_export_hf.py",
    # in-process, but long by design (2 s or more each on a shared 2-core machine): real
    # link, client and transfer timeouts waited out, statistical runs, the fuzzers
    "fuzz/",
    "router/test_migration.py",
    "router/test_slow_client.py",
    "kv/test_transfer_port.py::test_a_peer_that_stalls_is_dropped_at_the_transfer_deadline",
    "security/test_limits.py::test_an_idle_connection_to_a_worker_is_closed_soon",
    "security/test_clients.py::test_concurrent_requests_are_limited_per_key_and_in_all",
    "worker/test_fault_hooks.py::test_a_decode_stalled_past_the_link_timeout_takes_its_stream_again_once_back",
    "worker/test_drain.py::test_a_draining_decode_finishes_its_streams_and_takes_no_new_ones",
    "faults/test_proxy.py::test_a_stalled_decode_link_fails_its_stream_and_the_instance_comes_back",
    "router/test_outcomes.py::test_each_outcome_is_counted_exactly",
    "protocol/test_openai_requests.py::test_near_valid_json_only_raises_openai_error",
    "protocol/test_openai_requests.py::test_arbitrary_json_only_raises_openai_error",
    "protocol/test_scheduling.py::test_over_many_picks_every_instance_gets_traffic",
    "protocol/test_scheduling.py::test_the_pick_is_always_usable",
    "protocol/test_flush.py::test_policy_preserves_streams_and_keeps_its_promises",
    "protocol/test_flush.py::test_a_simulated_sender_delivers_everything_by_itself",
    "protocol/test_flush.py::test_on_a_link_that_is_always_free_nothing_ever_waits",
    "engine/test_kv_cache.py::test_kv_handoff_between_two_caches_continues_identically",
    "engine/test_sampler.py::test_top_k_one_and_tiny_top_p_are_greedy",
    "engine/test_sampler.py::test_seeded_draw_ignores_batch_composition_and_order",
    "engine/test_sampler.py::test_ties_at_the_head_boundary_break_by_id",
    "engine/test_tokenizer.py::test_tiny_round_trips_any_unicode",
)
# a test that asks for one of these fixtures is slow wherever it is: a real etcd
# (tests/discovery/conftest.py), SmolLM2's weights or tokenizer (tests/engine/)
SLOW_FIXTURES = {"etcd", "smollm2"}


def _is_slow(item: pytest.Item) -> bool:
    where = Path(str(item.path)).resolve().relative_to(TESTS).as_posix()
    test = f"{where}::{item.name.split('[')[0]}"
    for slow in SLOW:
        if slow.endswith("/") and where.startswith(slow):
            return True
        if slow in (where, test):
            return True
    return bool(SLOW_FIXTURES & set(getattr(item, "fixturenames", ())))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
    # the tests against a real vLLM run only where nox -s vllm gave them one (its own
    # interpreter, minutes to install and start): out of the default suite, not skipped
    if not os.environ.get("PDTRIO_VLLM_PYTHON"):
        real_vllm = [item for item in items if item.get_closest_marker("vllm") is not None]
        if real_vllm:
            config.hook.pytest_deselected(items=real_vllm)
            items[:] = [item for item in items if item.get_closest_marker("vllm") is None]


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    if request.node.get_closest_marker("slow") is None:

        def refuse(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
            raise AssertionError(
                f"{request.node.nodeid} starts a process ({args!r}) but is not marked slow: "
                "mark it @pytest.mark.slow, or its module in tests/conftest.py's SLOW"
            )

        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield
