"""Two routers in one process share nothing: each its own lease clock, limits, backend and
metrics (tests, and programs that embed the app, build several)."""

from __future__ import annotations

import sys

import attrs
import httpx
import trio

from pdtrio.config import PdtrioConfig
from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.link.wire import KvHandle
from pdtrio.router.core import Router
from pdtrio.router.gil_handoff import GilHandoff
from tests.cluster import worker_backend


def _handle(token: str) -> KvHandle:
    layout = KvLayout("model", 2, 2, 8, 4, "float32")
    return KvHandle("r", "prefill-0", "10.0.0.5", 9000, (0,), 4, layout, 30.0, token)


async def test_two_routers_in_one_process_keep_their_own_state() -> None:
    first_config = PdtrioConfig()
    second_config = attrs.evolve(
        first_config, router=attrs.evolve(first_config.router, request_timeout_s=7.0)
    )
    async with httpx.AsyncClient() as http, trio.open_nursery() as nursery:
        first = Router(first_config, nursery, http)
        second = Router(second_config, nursery, http)
        assert worker_backend(first).leases is not worker_backend(second).leases
        assert first.backend is not second.backend
        assert first.metrics is not second.metrics
        # a lease one router counts is not the other's
        now = trio.current_time()
        worker_backend(first).leases.received(_handle("grant"), now)
        assert len(worker_backend(first).leases) == 1 and len(worker_backend(second).leases) == 0
        # each router's machines are held to its own settings
        assert first.request_limits.request_timeout_s == first_config.router.request_timeout_s
        assert second.request_limits.request_timeout_s == 7.0
        nursery.cancel_scope.cancel()


def test_a_gil_handoff_lowers_the_switch_interval_while_used_and_restores_it() -> None:
    before = sys.getswitchinterval()
    first, second = GilHandoff(before / 10), GilHandoff(before / 10)
    with first.prompt():
        assert sys.getswitchinterval() == before / 10
        with second.prompt():  # another router's, at the same time
            assert sys.getswitchinterval() == before / 10
        assert sys.getswitchinterval() == before / 10
    assert sys.getswitchinterval() == before
