"""The link supervisor retires a deregistered instance's link once nothing runs on it,
woken by what ends there (no polling): a stream finishing, its lease coming back."""

from __future__ import annotations

import attrs
import httpx
import pytest
import trio
import trio.testing

from tests.cluster import running_cluster, wait_for_stats, wait_until_idle, worker_backend

LIVENESS_S = 20.0


async def test_a_deregistered_decode_keeps_its_link_until_its_stream_ends_then_goes() -> None:
    async with (
        running_cluster(decode_step_s=0.02) as cluster,
        httpx.AsyncClient(base_url=cluster.url, timeout=LIVENESS_S) as http,
    ):
        router = cluster.router_app.router
        assert router is not None
        workers = worker_backend(router)
        (decode,) = [i for i in workers.instances.values() if i.serves_decode]
        link_scope = decode.link_scope
        assert link_scope is not None
        body = {"model": router.models[0], "prompt": "hi", "max_tokens": 60, "stream": True}
        chunks = 0
        with trio.fail_after(LIVENESS_S):
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunks += 1
                    if chunks == 3:
                        # mid-stream: the registry says it left
                        workers.links.instance_deregistered(decode.instance_id)
                        await trio.testing.wait_all_tasks_blocked()
                        assert not decode.usable
                        assert not link_scope.cancel_called  # its stream still runs on it
                        assert workers.instances.get(decode.instance_id) is decode
            assert chunks > 3  # the stream ran to its end on the deregistered instance
            # nothing polls: once every task waits, the link has gone (a poll would
            # still be asleep)
            await wait_for_stats(lambda: not router.requests, LIVENESS_S)
            await trio.testing.wait_all_tasks_blocked(cushion=0.01)
            assert link_scope.cancel_called
        assert decode.instance_id not in workers.instances
        stats = workers.links.statistics()
        assert stats.links == 1  # prefill's
        await wait_until_idle(cluster)


async def test_the_instance_table_and_the_links_report_frozen_snapshots() -> None:
    async with running_cluster() as cluster:
        router = cluster.router_app.router
        assert router is not None
        workers = worker_backend(router)
        table = workers.instances.statistics()
        links = workers.links.statistics()
        assert (table.instances, table.prefill_usable, table.decode_usable) == (2, 1, 1)
        assert (table.suspended, table.draining, table.active_prefills, table.leases_out) == (
            0,
            0,
            0,
            0,
        )
        assert (links.links, links.connected, links.reconnects, links.hangs) == (2, 2, 0, 0)
        (decode,) = [i for i in workers.instances.values() if i.serves_decode]
        workers.instances.instance_failed(decode, trio.current_time())
        assert workers.instances.statistics().suspended == 1
        assert table.suspended == 0  # a snapshot: what it said then
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            table.suspended = 1  # type: ignore[misc]
