"""The etcd registry against a real etcd: listing, watching, bad entries, compaction, outages."""

from __future__ import annotations

import httpx
import msgspec
import pytest
import trio

from pdtrio.config import DiscoveryConfig
from pdtrio.discovery.etcd import EtcdClient
from pdtrio.discovery.registry import DiscoveryState, EtcdRegistry
from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.link.registration import (
    Registration,
    RegistrationError,
    decode_registration,
    encode_registration,
    instance_id_from_key,
    registration_key,
)
from pdtrio.testing.etcd import EtcdServer
from tests.cluster import wait_for_stats

PREFIX = "/test/instances/"
WAIT_S = 15.0
LAYOUT = KvLayout("synthetic", 1, 1, 1, 16, "synthetic")


def registration(name: str, role: str = "decode", url: str = "") -> Registration:
    return Registration(
        instance_id=name,
        role=role,  # type: ignore[arg-type]
        url=url or f"http://127.0.0.1:9{len(name)}00",
        transfer_host="127.0.0.1",
        transfer_port=0,
        model="synthetic",
        max_model_len=8192,
        layout=LAYOUT,
        kv_blocks_total=64,
        kv_transport="tcp",
    )


class Recorder:
    """A listener that keeps what it is told and wakes whoever waits."""

    def __init__(self) -> None:
        self.registered: dict[str, Registration] = {}
        self.calls: list[tuple[str, str]] = []
        self.ignored: dict[str, str] = {}
        self.rejected: list[tuple[str, str]] = []  # (key, reason) as counted
        self._changed = trio.Event()

    def instance_registered(self, registration: Registration) -> None:
        self.registered[registration.instance_id] = registration
        self._note("put", registration.instance_id)

    def instance_deregistered(self, instance_id: str) -> None:
        self.registered.pop(instance_id, None)
        self._note("delete", instance_id)

    def registration_ignored(self, key: str, reason: str | None) -> None:
        if reason is None:
            self.ignored.pop(key, None)
        else:
            self.ignored[key] = reason
            self._note("ignored", key)

    def registration_rejected(self, key: str, reason: str) -> None:
        self.rejected.append((key, reason))

    def _note(self, kind: str, name: str) -> None:
        self.calls.append((kind, name))
        self._changed.set()
        self._changed = trio.Event()

    async def until(self, names: set[str]) -> None:
        with trio.fail_after(WAIT_S):
            while set(self.registered) != names:
                await self._changed.wait()


async def put(client: EtcdClient, value: Registration) -> None:
    await client.put(registration_key(PREFIX, value.instance_id), encode_registration(value))


async def test_lists_then_watches_every_change(etcd: EtcdServer) -> None:
    recorder = Recorder()
    state = DiscoveryState("etcd")
    config = DiscoveryConfig(etcd_endpoints=(etcd.endpoint,), prefix=PREFIX)
    async with EtcdClient([etcd.endpoint]) as client, trio.open_nursery() as nursery:
        await put(client, registration("a"))
        await client.put("/test/other/x", b"not ours")  # outside the prefix
        await nursery.start(EtcdRegistry(config, recorder, state).run)
        assert set(recorder.registered) == {"a"}  # listed before it reported started
        await put(client, registration("b"))
        await recorder.until({"a", "b"})
        await put(client, registration("b", url="http://127.0.0.1:7777"))  # moved
        with trio.fail_after(WAIT_S):
            while recorder.registered["b"].url != "http://127.0.0.1:7777":
                await recorder._changed.wait()
        await client.delete(registration_key(PREFIX, "a"))
        await recorder.until({"b"})
        # a bad entry is reported, and an entry that turns bad leaves routing
        await client.put(registration_key(PREFIX, "junk"), b"{not json")
        await client.put(registration_key(PREFIX, "b"), b"[]")
        await recorder.until(set())
        assert set(recorder.ignored) == {PREFIX + "junk", PREFIX + "b"}
        await client.put(registration_key(PREFIX, "c"), encode_registration(registration("d")))
        with trio.fail_after(WAIT_S):
            while PREFIX + "c" not in recorder.ignored:
                await recorder._changed.wait()
        assert "says it is 'd'" in recorder.ignored[PREFIX + "c"]
        assert state.connected and state.revision > 0
        nursery.cancel_scope.cancel()


async def test_an_outage_keeps_the_view_and_a_restart_resumes_without_missing_a_change(
    etcd: EtcdServer,
) -> None:
    recorder = Recorder()
    state = DiscoveryState("etcd")
    config = DiscoveryConfig(etcd_endpoints=(etcd.endpoint,), prefix=PREFIX, etcd_timeout_s=1)
    async with trio.open_nursery() as nursery:
        async with EtcdClient([etcd.endpoint]) as client:
            await put(client, registration("a"))
        await nursery.start(EtcdRegistry(config, recorder, state).run)
        await etcd.stop()
        await wait_for_stats(lambda: not state.connected, WAIT_S)
        assert set(recorder.registered) == {"a"} and state.problem
        assert state.report()["connected"] is False
        # it stays out of touch (retrying with a growing pause) until etcd answers again:
        # watched for a second (the thing tested: it never claims a contact it lacks)
        for _ in range(20):
            await trio.sleep(0.05)
            assert not state.connected
        await etcd.start()
        async with EtcdClient([etcd.endpoint]) as client:
            await put(client, registration("b"))
            await client.delete(registration_key(PREFIX, "a"))
        await recorder.until({"b"})
        # in touch again once the watch is live (just after the listing that found b)
        await wait_for_stats(lambda: state.connected, WAIT_S)
        nursery.cancel_scope.cancel()


async def test_a_compacted_history_is_listed_again(etcd: EtcdServer) -> None:
    recorder = Recorder()
    state = DiscoveryState("etcd")
    config = DiscoveryConfig(etcd_endpoints=(etcd.endpoint,), prefix=PREFIX, etcd_timeout_s=1)
    async with trio.open_nursery() as nursery, EtcdClient([etcd.endpoint]) as client:
        await put(client, registration("a"))
        await nursery.start(EtcdRegistry(config, recorder, state).run)
        await etcd.stop()
        # while the router cannot watch: changes, then the history compacted away
        await etcd.start()
        await put(client, registration("b"))
        await client.delete(registration_key(PREFIX, "a"))
        revision = await client.put("/test/unrelated", b"x")
        async with httpx.AsyncClient() as http:
            answer = await http.post(
                f"{etcd.endpoint}/v3/kv/compaction", json={"revision": str(revision)}
            )
            answer.raise_for_status()
        await recorder.until({"b"})
        nursery.cancel_scope.cancel()


def test_registrations_round_trip_and_bad_ones_are_refused() -> None:
    value = registration("a")
    assert decode_registration(encode_registration(value)) == value
    assert b'"url"' in encode_registration(value)  # readable with etcdctl
    for bad in (b"", b"{}", b"[1]", msgspec.json.encode({"instance_id": 1})):
        with pytest.raises(RegistrationError):
            decode_registration(bad)
    with pytest.raises(RegistrationError, match="version"):
        decode_registration(encode_registration(value.__replace__(version=99)))
    with pytest.raises(RegistrationError, match="url"):
        decode_registration(encode_registration(value.__replace__(url="ftp://x")))
    assert instance_id_from_key(PREFIX, PREFIX + "a/b") == "a/b"
    assert instance_id_from_key(PREFIX, PREFIX) is None
    assert instance_id_from_key(PREFIX, "/elsewhere/a") is None


async def test_a_frozen_etcd_is_noticed_though_the_watch_stays_open(etcd: EtcdServer) -> None:
    recorder = Recorder()
    state = DiscoveryState("etcd")
    config = DiscoveryConfig(etcd_endpoints=(etcd.endpoint,), prefix=PREFIX, etcd_timeout_s=1)
    async with trio.open_nursery() as nursery:
        async with EtcdClient([etcd.endpoint]) as client:
            await put(client, registration("a"))
        await nursery.start(EtcdRegistry(config, recorder, state).run)
        etcd.freeze()
        try:
            await wait_for_stats(lambda: not state.connected, WAIT_S)
            assert set(recorder.registered) == {"a"}  # the last view stands
        finally:
            etcd.thaw()
        await wait_for_stats(lambda: state.connected, WAIT_S)
        nursery.cancel_scope.cancel()
