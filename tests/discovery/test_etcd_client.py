"""The etcd client against a real etcd: KV, leases, watches, and etcd going away and coming back."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from functools import partial

import httpx
import pytest
import trio

from pdtrio.discovery.etcd import (
    EtcdClient,
    EtcdCompacted,
    EtcdLeaseLost,
    EtcdUnavailable,
    WatchEvent,
)
from pdtrio.testing.etcd import EtcdServer
from pdtrio.testing.processes import LOOPBACK, free_port

WAIT_S = 15.0  # a bound on waiting for etcd to act, never a performance threshold


@pytest.fixture
async def client(etcd: EtcdServer) -> AsyncIterator[EtcdClient]:
    async with EtcdClient([etcd.endpoint], timeout_s=2.0) as client:
        yield client


class Collected:
    """A watch's on_events: keeps every event, and wakes whoever waits for more."""

    def __init__(self) -> None:
        self.events: list[WatchEvent] = []
        self._more = trio.Event()

    def __call__(self, batch: list[WatchEvent]) -> None:
        self.events.extend(batch)
        self._more.set()
        self._more = trio.Event()

    async def wait_for(self, count: int) -> list[WatchEvent]:
        with trio.fail_after(WAIT_S):
            while len(self.events) < count:
                await self._more.wait()
        return self.events

    def summary(self) -> list[tuple[str, str, bytes]]:
        return [(e.kind, e.key, e.value) for e in self.events]


async def test_put_get_prefix_and_delete_round_trip_binary_values(client: EtcdClient) -> None:
    first = await client.put("svc/a", b"\x00\xff\x80binary")
    second = await client.put("svc/b", b"")
    outside = await client.put("svc0", b"not under svc/")
    assert 0 < first < second < outside

    a = await client.get("svc/a")
    assert a is not None
    assert (a.key, a.value, a.mod_revision, a.create_revision, a.lease) == (
        "svc/a",
        b"\x00\xff\x80binary",
        first,
        first,
        0,
    )
    assert await client.get("svc/missing") is None

    updated = await client.put("svc/a", b"\x01")
    assert updated > outside
    kvs, revision = await client.get_prefix("svc/")
    assert [(kv.key, kv.value) for kv in kvs] == [("svc/a", b"\x01"), ("svc/b", b"")]
    assert kvs[0].create_revision == first and kvs[0].mod_revision == updated
    assert revision == updated

    await client.delete("svc/a")
    await client.delete("svc/never-existed")
    assert await client.get("svc/a") is None
    kvs, revision = await client.get_prefix("svc/")
    assert [kv.key for kv in kvs] == ["svc/b"]
    assert revision > updated


async def test_a_lease_holds_its_key_until_it_expires(client: EtcdClient) -> None:
    lease = await client.grant_lease(1)
    revision = await client.put("svc/leased", b"x", lease=lease)
    assert await client.keep_alive_once(lease) > 0
    kv = await client.get("svc/leased")
    assert kv is not None and kv.lease == lease

    # stop refreshing: etcd deletes the key when the lease runs out, and says so on a watch
    collected = Collected()
    async with trio.open_nursery() as nursery:
        await nursery.start(
            partial(client.watch_prefix, "svc/", start_revision=revision + 1, on_events=collected)
        )
        await collected.wait_for(1)
        nursery.cancel_scope.cancel()
    assert collected.summary() == [("delete", "svc/leased", b"")]
    assert await client.get("svc/leased") is None

    with pytest.raises(EtcdLeaseLost):
        await client.keep_alive_once(lease)
    with pytest.raises(EtcdLeaseLost):
        await client.put("svc/leased", b"y", lease=lease)


async def test_revoking_a_lease_deletes_its_keys_and_twice_is_fine(client: EtcdClient) -> None:
    lease = await client.grant_lease(30)
    await client.put("svc/a", b"1", lease=lease)
    await client.put("svc/b", b"2", lease=lease)
    await client.put("svc/c", b"3")

    await client.revoke_lease(lease)
    kvs, _ = await client.get_prefix("svc/")
    assert [kv.key for kv in kvs] == ["svc/c"]

    await client.revoke_lease(lease)
    with pytest.raises(EtcdLeaseLost):
        await client.keep_alive_once(lease)


async def test_a_watch_sees_changes_in_order_and_resumes_without_gaps(client: EtcdClient) -> None:
    _, revision = await client.get_prefix("svc/")
    collected = Collected()
    async with trio.open_nursery() as nursery:
        await nursery.start(
            partial(client.watch_prefix, "svc/", start_revision=revision + 1, on_events=collected)
        )
        await client.put("svc/a", b"1")
        await client.put("other/a", b"not watched")
        await client.put("svc/b", b"\x00")
        await client.delete("svc/a")
        await collected.wait_for(3)
        nursery.cancel_scope.cancel()
    assert collected.summary() == [
        ("put", "svc/a", b"1"),
        ("put", "svc/b", b"\x00"),
        ("delete", "svc/a", b""),
    ]
    revisions = [e.mod_revision for e in collected.events]
    assert revisions == sorted(revisions) and len(set(revisions)) == 3

    # written while nobody watches: a watch resumed from the last revision + 1 sees exactly these
    await client.put("svc/c", b"3")
    await client.delete("svc/b")
    resumed = Collected()
    async with trio.open_nursery() as nursery:
        await nursery.start(
            partial(
                client.watch_prefix,
                "svc/",
                start_revision=revisions[-1] + 1,
                on_events=resumed,
            )
        )
        await resumed.wait_for(2)
        await client.put("svc/d", b"4")
        await resumed.wait_for(3)
        nursery.cancel_scope.cancel()
    assert resumed.summary() == [
        ("put", "svc/c", b"3"),
        ("delete", "svc/b", b""),
        ("put", "svc/d", b"4"),
    ]


async def test_a_compacted_start_revision_raises_compacted(
    etcd: EtcdServer, client: EtcdClient
) -> None:
    for i in range(5):
        latest = await client.put("svc/a", str(i).encode())
    async with httpx.AsyncClient(trust_env=False) as http:
        response = await http.post(
            f"{etcd.endpoint}/v3/kv/compaction", json={"revision": latest, "physical": True}
        )
        response.raise_for_status()

    with trio.fail_after(WAIT_S), pytest.raises(EtcdCompacted) as caught:
        await client.watch_prefix("svc/", start_revision=1, on_events=Collected())
    assert caught.value.compact_revision == latest


async def test_calls_raise_unavailable_while_etcd_is_down(
    etcd: EtcdServer, client: EtcdClient
) -> None:
    await client.put("svc/a", b"1")
    await etcd.stop()
    for call in (
        partial(client.put, "svc/a", b"2"),
        partial(client.get, "svc/a"),
        partial(client.get_prefix, "svc/"),
        partial(client.delete, "svc/a"),
        partial(client.grant_lease, 5),
        partial(client.keep_alive_once, 1),
        partial(client.revoke_lease, 1),
    ):
        with pytest.raises(EtcdUnavailable, match=etcd.endpoint):
            await call()


async def test_an_active_watch_raises_unavailable_when_etcd_stops(
    etcd: EtcdServer, client: EtcdClient
) -> None:
    failure: list[BaseException] = []

    async def watch(task_status: trio.TaskStatus[None]) -> None:
        try:
            await client.watch_prefix(
                "svc/", start_revision=1, on_events=Collected(), task_status=task_status
            )
        except EtcdUnavailable as exc:
            failure.append(exc)

    with trio.fail_after(WAIT_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(watch)
            await etcd.stop()
    assert len(failure) == 1

    # and a new watch cannot start while etcd is down
    with pytest.raises(EtcdUnavailable, match=etcd.endpoint):
        await client.watch_prefix("svc/", start_revision=1, on_events=Collected())


async def test_after_a_restart_the_same_client_works_and_the_data_survived(
    etcd: EtcdServer, client: EtcdClient
) -> None:
    written = await client.put("svc/a", b"kept")
    await etcd.stop()
    with pytest.raises(EtcdUnavailable):
        await client.get("svc/a")

    await etcd.start()
    kv = await client.get("svc/a")
    assert kv is not None and (kv.value, kv.mod_revision) == (b"kept", written)
    assert await client.put("svc/b", b"new") > written


async def test_an_unreachable_first_endpoint_is_skipped(etcd: EtcdServer) -> None:
    dead = f"http://{LOOPBACK}:{free_port()}"
    async with EtcdClient([dead, etcd.endpoint], timeout_s=2.0) as client:
        revision = await client.put("svc/a", b"1")
        kv = await client.get("svc/a")
        assert kv is not None and kv.value == b"1"

        collected = Collected()
        async with trio.open_nursery() as nursery:
            await nursery.start(
                partial(client.watch_prefix, "svc/", start_revision=revision, on_events=collected)
            )
            await collected.wait_for(1)
            nursery.cancel_scope.cancel()
        assert collected.summary() == [("put", "svc/a", b"1")]

    async with EtcdClient([dead], timeout_s=2.0) as client:
        with pytest.raises(EtcdUnavailable, match=dead):
            await client.get("svc/a")


async def test_the_gateway_wire_is_base64(etcd: EtcdServer, client: EtcdClient) -> None:
    """A value written by another etcd client (here: by hand) reads back as the same bytes."""
    async with httpx.AsyncClient(trust_env=False) as http:
        response = await http.post(
            f"{etcd.endpoint}/v3/kv/put",
            json={
                "key": base64.b64encode("svc/é".encode()).decode(),
                "value": base64.b64encode(b"\xfe\x00").decode(),
            },
        )
        response.raise_for_status()
    kvs, _ = await client.get_prefix("svc/")
    assert [(kv.key, kv.value) for kv in kvs] == [("svc/é", b"\xfe\x00")]
