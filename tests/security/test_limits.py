"""Workers bound what a peer can hold: bodies in flight, router links, KV and HTTP connections."""

from __future__ import annotations

import httpx
import pytest
import trio

from pdtrio.config import SecurityConfig
from pdtrio.kv import tcp
from pdtrio.peer_auth import WorkerAuth
from pdtrio.protocol.link.wire import TransferRequest
from pdtrio.router.workers.ws_client import HandshakeError, connect_websocket
from pdtrio.security import PeerCredentials
from pdtrio.worker import router_link
from tests.cluster import running_cluster, synthetic_worker, wait_for_stats


async def _start_a_body(port: int) -> trio.SocketStream:
    """A prefill POST whose body never finishes arriving."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(
        b"POST /pd/prefill HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n" + b"\x00" * 1000
    )
    return stream


async def test_prefill_bodies_in_flight_are_bounded() -> None:
    async with running_cluster(roles=("prefill",)) as cluster:
        prefill = cluster.workers[0]
        held = [await _start_a_body(prefill.http_port) for _ in range(4)]
        try:
            await wait_for_stats(lambda: prefill.stats()["prefill_bodies_receiving"] == 4)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{prefill.http_port}") as http:
                refused = await http.post("/pd/prefill", content=b"x" * 10)
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            assert "retry shortly" in refused.json()["error"]["message"]
        finally:
            for stream in held:
                await stream.aclose()
        await wait_for_stats(lambda: prefill.stats()["prefill_bodies_receiving"] == 0)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{prefill.http_port}") as http:
            malformed = await http.post("/pd/prefill", content=b"x" * 10)
        assert malformed.status_code == 400  # room again: read, then refused as malformed


async def test_router_links_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_link, "MAX_LINKS", 2)
    async with running_cluster(roles=("decode",)) as cluster:
        decode = cluster.workers[0]
        url = f"ws://127.0.0.1:{decode.http_port}/pd/link"
        # the router holds one already
        extra = await connect_websocket(url, max_message_size=1 << 20)
        try:
            with pytest.raises(HandshakeError):
                await connect_websocket(url, max_message_size=1 << 20)
        finally:
            await extra.aclose()


async def test_kv_port_strangers_are_bounded_and_cannot_crowd_out_peers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tcp, "MAX_KV_STRANGERS", 4)
    monkeypatch.setattr(tcp, "MAX_KV_CONNECTIONS", 1)
    monkeypatch.setattr(tcp, "KV_PREAMBLE_TIMEOUT_S", 0.5)
    async with running_cluster(roles=("prefill",)) as cluster:
        prefill = cluster.workers[0]
        port = prefill.transfer_endpoint[1]
        silent = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(4)]
        try:
            # a fifth stranger is closed at once
            fifth = await trio.open_tcp_stream("127.0.0.1", port)
            async with fifth:
                with trio.fail_after(10):
                    assert await fifth.receive_some(1) == b""
            # the silent ones go when their time to authenticate is up
            with trio.fail_after(10):
                for stream in silent:
                    assert await stream.receive_some(1) == b""
        finally:
            for stream in silent:
                await stream.aclose()
        # a peer that shows the credential is served while strangers wait
        strangers = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(3)]
        try:
            peer = await tcp.connect_kv_port(
                "127.0.0.1", port, tcp.SESSION_BLOCKS, prefill.secret, prefill.instance_id
            )
            async with peer:
                await tcp.send_message(peer, TransferRequest("nobody", (0,), ""))
                with trio.fail_after(10):
                    answer = await tcp.receive_message(peer, tcp.answer_decoder)
            assert not answer.granted and "no lease" in answer.reason
        finally:
            for stream in strangers:
                await stream.aclose()


async def test_an_idle_connection_to_a_worker_is_closed_soon() -> None:
    async with running_cluster(roles=("prefill",)) as cluster:
        prefill = cluster.workers[0]
        idle = await trio.open_tcp_stream("127.0.0.1", prefill.http_port)
        async with idle:
            with trio.fail_after(15):  # (5 s of keep-alive, with room on a slow machine)
                assert await idle.receive_some(1) == b""
        # the router's link (a websocket) is not idle-timed: still there.  It is older than
        # the idle connection, so had it been timed it would be closed by now; a moment for
        # such a close to reach the statistics (proving an absence: nothing to wait on)
        await trio.sleep(0.1)
        assert prefill.stats()["router_links"] == 1


async def test_http_connections_without_the_secret_are_bounded_and_never_keep_the_router_out() -> (
    None
):
    limits = {"max_unauthenticated_connections": 4, "max_authenticated_connections": 8}
    security = SecurityConfig(worker_secret="s3cret")
    async with running_cluster(
        roles=("prefill", "decode"),
        security=security,
        make_worker=lambda role: synthetic_worker(role, secret="s3cret", worker_overrides=limits),
    ) as cluster:
        prefill = cluster.workers[0]
        connections = prefill.http_connections
        await wait_for_stats(lambda: connections.peers >= 1)  # the router's link showed the secret
        silent = [await trio.open_tcp_stream("127.0.0.1", prefill.http_port) for _ in range(4)]
        try:
            await wait_for_stats(lambda: connections.strangers == 4)
            # a fifth takes the place of the oldest, which is closed
            fifth = await trio.open_tcp_stream("127.0.0.1", prefill.http_port)
            async with fifth:
                with trio.fail_after(10):
                    assert await silent[0].receive_some(1) == b""
                await wait_for_stats(lambda: connections.strangers == 4)
                assert connections.evicted == 1
                # a peer with the secret gets in while strangers are at their bound, and
                # leaves their count: a new router probe is served
                auth = WorkerAuth(PeerCredentials("s3cret"))
                async with httpx.AsyncClient(
                    base_url=f"http://127.0.0.1:{prefill.http_port}", auth=auth
                ) as http:
                    info = await http.get("/pd/info")
                    assert info.status_code == 200
                    # it took the oldest stranger's place, then left the strangers
                    assert (connections.strangers, connections.evicted) == (3, 2)
                    assert connections.peers >= 2
                # and routed requests go on
                async with httpx.AsyncClient(base_url=cluster.url) as client:
                    answer = await client.post(
                        "/v1/completions",
                        json={"model": "synthetic", "prompt": "hi", "max_tokens": 3},
                    )
                assert answer.status_code == 200, answer.text
        finally:
            for stream in silent:
                await stream.aclose()
        metrics = prefill.metrics.render().decode()
        assert "pdtrio_worker_http_connections_evicted_total 2.0" in metrics
        assert 'pdtrio_worker_http_connections{authenticated="true"}' in metrics
