"""Between router and workers: a shared secret on every worker endpoint, a grant per request.

An unauthenticated peer that reaches a worker can do nothing but be refused.
"""

from __future__ import annotations

import httpx
import msgspec
import pytest
import trio

from pdtrio.config import SecurityConfig
from pdtrio.kv.tcp import SESSION_BLOCKS, answer_decoder, receive_message, send_message
from pdtrio.protocol import wire
from pdtrio.protocol.sampling import SamplingParams
from pdtrio.protocol.wire import (
    PrefillReply,
    PrefillRequest,
    ReleaseReply,
    ReleaseRequest,
    TextPrompt,
    TransferRequest,
)
from pdtrio.router.ws_client import HandshakeError, connect_websocket
from pdtrio.security import KV_CREDENTIAL_SIZE, PeerCredentials
from pdtrio.worker.server import Worker
from tests.cluster import client, running_cluster, synthetic_worker, wait_until_idle

SECRET = "worker-secret-for-tests"
BODY = {"model": "synthetic", "prompt": "hello there", "max_tokens": 8}
MSGPACK = {"content-type": wire.MSGPACK_CONTENT_TYPE}


def worker_url(worker: Worker) -> str:
    return f"http://127.0.0.1:{worker.http_port}"


async def test_the_whole_path_works_with_the_secret_and_every_endpoint_refuses_without() -> None:
    async with running_cluster(security=SecurityConfig(worker_secret=SECRET)) as cluster:
        prefill, decode = cluster.workers
        async with client(cluster) as http:
            response = await http.post("/v1/completions", json=BODY)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 8
        async with httpx.AsyncClient(base_url=worker_url(prefill)) as peer:
            assert (await peer.get("/health")).status_code == 200  # liveness stays open
            for method, path in (
                ("GET", "/pd/info"),
                ("GET", "/pd/stats"),
                ("POST", "/pd/release"),
            ):
                refused = await peer.request(method, path)
                assert refused.status_code == 401, (path, refused.text)
                assert refused.json()["error"]["type"] == "authentication_error"
            wrong = await peer.get("/pd/info", headers={"authorization": "Bearer nope"})
            assert wrong.status_code == 401
            right = await peer.get("/pd/info", headers={"authorization": f"Bearer {SECRET}"})
            assert right.status_code == 200
        # the link: refused at the handshake
        with pytest.raises(HandshakeError, match="403"):
            await connect_websocket(
                worker_url(decode).replace("http", "ws") + "/pd/link", max_message_size=1 << 20
            )
        await wait_until_idle(cluster)


async def test_a_prefill_body_is_refused_before_it_is_read() -> None:
    async with running_cluster(security=SecurityConfig(worker_secret=SECRET)) as cluster:
        prefill = cluster.workers[0]
        stream = await trio.open_tcp_stream("127.0.0.1", prefill.http_port)
        async with stream:
            await stream.send_all(
                b"POST /pd/prefill HTTP/1.1\r\nhost: x\r\ncontent-length: 60000000\r\n\r\n"
            )
            with trio.fail_after(10):
                head = await stream.receive_some(4096)
        assert head.startswith(b"HTTP/1.1 401"), head


async def _kv_port_answer(worker: Worker, credential: bytes, request: TransferRequest) -> bytes:
    """What the KV port says to a peer that sends ``credential`` and ``request``."""
    stream = await trio.open_tcp_stream("127.0.0.1", worker.transfer_endpoint[1])
    received = b""
    async with stream:
        try:
            await stream.send_all(SESSION_BLOCKS + credential)
            await send_message(stream, request)
            with trio.fail_after(10):
                while chunk := await stream.receive_some(65536):
                    received += chunk
                    if len(received) >= 4:
                        break
        except trio.BrokenResourceError:
            pass  # dropped (a reset, when our bytes were still unread)
        return received


async def _prefill_directly(worker: Worker, request_id: str) -> PrefillReply:
    answer = await worker.prefill_call(
        PrefillRequest(request_id, TextPrompt("a prompt of some length"), SamplingParams(), 8)
    )
    assert isinstance(answer, PrefillReply) and answer.kv_handle is not None
    return answer


async def test_the_kv_port_wants_the_credential_and_each_request_its_grant() -> None:
    async with running_cluster(
        roles=("prefill",), security=SecurityConfig(worker_secret=SECRET)
    ) as cluster:
        prefill = cluster.workers[0]
        reply = await _prefill_directly(prefill, "victim")
        handle = reply.kv_handle
        assert handle is not None and handle.access_token
        secret = PeerCredentials(SECRET)
        # no credential: dropped before anything is read or answered
        silent = await _kv_port_answer(
            prefill, bytes(KV_CREDENTIAL_SIZE), TransferRequest("victim", handle.block_ids)
        )
        assert silent == b""
        # the credential, the request id and the blocks, but not the grant: refused
        stream = await trio.open_tcp_stream("127.0.0.1", prefill.transfer_endpoint[1])
        async with stream:
            await stream.send_all(SESSION_BLOCKS + secret.kv_credential)
            await send_message(stream, TransferRequest("victim", handle.block_ids, "guessed"))
            answer = await receive_message(stream, answer_decoder)
        assert not answer.granted and "no lease" in answer.reason
        assert prefill.stats()["kv_leases"] == 1
        # nor may a peer with the secret free it without the grant
        async with httpx.AsyncClient(
            base_url=worker_url(prefill), headers={"authorization": f"Bearer {SECRET}", **MSGPACK}
        ) as peer:
            body = wire.encode(ReleaseRequest("victim"))
            refused = await peer.post("/pd/release", content=body)
            assert not wire.Decoder(ReleaseReply).decode(refused.content).released
            body = wire.encode(ReleaseRequest("victim", handle.access_token))
            granted = await peer.post("/pd/release", content=body)
            assert wire.Decoder(ReleaseReply).decode(granted.content).released
        assert prefill.stats()["kv_leases"] == 0


async def test_a_link_may_release_only_its_own_prefills_or_with_the_grant() -> None:
    async with running_cluster(roles=("prefill",)) as cluster:
        prefill = cluster.workers[0]
        await _prefill_directly(prefill, "someone-elses")
        ws = await connect_websocket(
            worker_url(prefill).replace("http", "ws") + "/pd/link", max_message_size=1 << 20
        )
        try:
            await ws.send_messages([wire.encode(ReleaseRequest("someone-elses"))])
            await ws.send_messages([wire.encode(wire.DecodeAbort("someone-elses"))])
            await trio.sleep(0.2)
        finally:
            await ws.aclose()
        assert prefill.stats()["kv_leases"] == 1  # untouched
        assert prefill.release("someone-elses")


async def test_a_kv_handle_naming_an_unregistered_source_never_reaches_decode() -> None:
    async with running_cluster() as cluster:
        prefill, decode = cluster.workers
        # the prefill hands out handles naming another address than it registered (and
        # than its /pd/info says)
        prefill_once = prefill._prefill

        async def lying_prefill(request: PrefillRequest) -> PrefillReply:
            reply = await prefill_once(request)
            assert reply.kv_handle is not None
            elsewhere = msgspec.structs.replace(reply.kv_handle, transfer_port=1)
            return msgspec.structs.replace(reply, kv_handle=elsewhere)

        prefill._prefill = lying_prefill  # type: ignore[method-assign]
        async with client(cluster) as http:
            response = await http.post("/v1/completions", json=BODY)
        assert response.status_code == 502, response.text
        assert response.json()["error"]["code"] == "bad_kv_handle"
        assert decode.stats()["decode_requests"] == 0
        await wait_until_idle(cluster)  # the lease was released, not left to expire
        assert prefill.stats()["kv_leases"] == 0


def test_a_worker_never_puts_the_secret_where_others_read() -> None:
    worker = synthetic_worker("prefill", secret=SECRET)
    assert SECRET not in repr(worker.config)
    assert worker.secret.required
