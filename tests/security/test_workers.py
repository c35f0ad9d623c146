"""Between router and workers: a proof of the shared secret on every worker endpoint (both
ways, never the secret itself), a grant per request.

An unauthenticated peer that reaches a worker can do nothing but be refused; a listener
that poses as a worker learns nothing it can use.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

import httpx
import msgspec
import pytest
import trio

from pdtrio.config import SecurityConfig
from pdtrio.kv.api import KvTransferError
from pdtrio.kv.tcp import (
    SESSION_BLOCKS,
    answer_decoder,
    connect_kv_port,
    receive_exactly,
    receive_message,
    send_message,
)
from pdtrio.peer_auth import WorkerAuth, link_authorization
from pdtrio.protocol.link import wire
from pdtrio.protocol.link.wire import (
    PrefillReply,
    PrefillRequest,
    ReleaseReply,
    ReleaseRequest,
    TextPrompt,
    TransferRequest,
)
from pdtrio.protocol.sampling import SamplingParams
from pdtrio.router.workers.ws_client import HandshakeError, connect_websocket
from pdtrio.security import (
    PeerAuthenticationError,
    PeerCredentials,
    decode_nonce,
    encode_nonce,
    format_auth_params,
    new_nonce,
    opening_authorization,
    parse_auth_params,
)
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
            # the secret itself opens nothing: it is never what a peer sends
            bearer = await peer.get("/pd/info", headers={"authorization": f"Bearer {SECRET}"})
            assert bearer.status_code == 401
            # a peer with another secret: it refuses the worker's proof, and the worker
            # refuses its answer
            with pytest.raises(PeerAuthenticationError, match="proof is wrong"):
                await peer.get("/pd/info", auth=WorkerAuth(PeerCredentials("another")))
            nonce = new_nonce()
            challenge = await peer.get(
                "/pd/info", headers={"authorization": opening_authorization(nonce)}
            )
            params = parse_auth_params(challenge.headers["www-authenticate"])
            assert params is not None and params["instance"] == prefill.instance_id
            worker_nonce = decode_nonce(params["nonce"])
            assert worker_nonce is not None
            forged = PeerCredentials("another").router_proof(
                nonce, worker_nonce, params["instance"]
            )
            wrong = await peer.get(
                "/pd/info",
                headers={
                    "authorization": format_auth_params(
                        {
                            "nonce": params["nonce"],
                            "client-nonce": encode_nonce(nonce),
                            "proof": encode_nonce(forged),
                        }
                    )
                },
            )
            assert wrong.status_code == 401
            right = await peer.get("/pd/info", auth=WorkerAuth(PeerCredentials(SECRET)))
            assert right.status_code == 200
            assert right.json()["instance_id"] == prefill.instance_id
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


async def _kv_port_answer(worker: Worker, proof: bytes, request: TransferRequest) -> bytes:
    """What the KV port says to a peer that answers its challenge with ``proof``, then
    sends ``request``."""
    stream = await trio.open_tcp_stream("127.0.0.1", worker.transfer_endpoint[1])
    received = b""
    async with stream:
        try:
            await stream.send_all(SESSION_BLOCKS + new_nonce())
            await receive_exactly(stream, 64)  # its nonce and proof
            await stream.send_all(proof)
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
    answer = await worker.prefill.prefill_call(
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
        # no proof: dropped before anything is read or answered
        silent = await _kv_port_answer(
            prefill, bytes(32), TransferRequest("victim", handle.block_ids, handle.access_token)
        )
        assert silent == b""
        # proven, the request id and the blocks, but not the grant: refused
        stream = await connect_kv_port(
            "127.0.0.1", prefill.transfer_endpoint[1], SESSION_BLOCKS, secret, prefill.instance_id
        )
        async with stream:
            await send_message(stream, TransferRequest("victim", handle.block_ids, "guessed"))
            answer = await receive_message(stream, answer_decoder)
        assert not answer.granted and "no lease" in answer.reason
        assert prefill.stats()["kv_leases"] == 1
        # nor may a peer with the secret free it without the grant
        async with httpx.AsyncClient(
            base_url=worker_url(prefill), headers=MSGPACK, auth=WorkerAuth(secret)
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
            # the link reads its messages in order: once a prefill sent after them is
            # answered, the release and the abort have been dealt with
            barrier = PrefillRequest("barrier", TextPrompt("after them"), SamplingParams(), 8)
            await ws.send_messages([wire.encode(barrier)])
            with trio.fail_after(10):
                while not any(
                    isinstance(message, PrefillReply) and message.request_id == "barrier"
                    for message in map(wire.from_worker_decoder.decode, await ws.receive_messages())
                ):
                    pass
        finally:
            await ws.aclose()
        assert prefill.prefill.release("barrier")
        assert prefill.stats()["kv_leases"] == 1  # untouched
        assert prefill.prefill.release("someone-elses")


async def test_a_kv_handle_naming_an_unregistered_source_never_reaches_decode() -> None:
    async with running_cluster() as cluster:
        prefill, decode = cluster.workers
        # the prefill hands out handles naming another address than it registered (and
        # than its /pd/info says)
        prefill_once = prefill.prefill._prefill

        async def lying_prefill(request: PrefillRequest) -> PrefillReply:
            reply = await prefill_once(request)
            assert reply.kv_handle is not None
            elsewhere = msgspec.structs.replace(reply.kv_handle, transfer_port=1)
            return msgspec.structs.replace(reply, kv_handle=elsewhere)

        prefill.prefill._prefill = lying_prefill  # type: ignore[method-assign]
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


class _PosingListener:
    """A listener a registry could name as a worker: it records every request and
    answers as told (``answer`` returns the response's status line and headers)."""

    def __init__(self, answer: Callable[[bytes], Awaitable[bytes]]) -> None:
        self.answer = answer
        self.requests: list[bytes] = []

    async def serve(self, stream: trio.SocketStream) -> None:
        buffered = b""
        async with stream:
            try:
                while True:
                    while b"\r\n\r\n" not in buffered:
                        chunk = await stream.receive_some(65536)
                        if not chunk:
                            return
                        buffered += chunk
                    head, _, buffered = buffered.partition(b"\r\n\r\n")
                    self.requests.append(head)
                    await stream.send_all(await self.answer(head))
            except trio.BrokenResourceError:
                pass


def _response(status: str, headers: dict[str, str], body: bytes = b"{}") -> bytes:
    lines = [f"HTTP/1.1 {status}", f"content-length: {len(body)}", *headers_lines(headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def headers_lines(headers: dict[str, str]) -> list[str]:
    return [f"{name}: {value}" for name, value in headers.items()]


def _authorization_of(head: bytes) -> str:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"authorization":
            return value.strip().decode()
    return ""


async def test_a_listener_posing_as_a_worker_learns_nothing_and_gets_no_link() -> None:
    """What the registry can make the router dial gets a nonce to answer and nothing else:
    whether it lets everything through, forges a challenge, or relays a real worker's."""
    async with running_cluster(security=SecurityConfig(worker_secret=SECRET)) as cluster:
        real = cluster.workers[1]
        credentials = PeerCredentials(SECRET)
        async with httpx.AsyncClient() as relay_http:

            async def lets_everything_through(head: bytes) -> bytes:
                return _response("200 OK", {"content-type": "application/json"})

            async def forges_a_challenge(head: bytes) -> bytes:
                forged = (
                    'PDTRIO-HMAC nonce="AAAA", client-nonce="'
                    + _authorization_of(head).partition('client-nonce="')[2].rstrip('"')
                    + '", proof="'
                    + "A" * 43
                    + '", instance="decode-evil"'
                )
                return _response("401 Unauthorized", {"www-authenticate": forged})

            async def relays_a_real_worker(head: bytes) -> bytes:
                answer = await relay_http.get(
                    worker_url(real) + "/pd/auth",
                    headers={"authorization": _authorization_of(head)},
                )
                challenge = answer.headers.get("www-authenticate", "")
                return _response(f"{answer.status_code} X", {"www-authenticate": challenge})

            for behaviour in (lets_everything_through, forges_a_challenge, relays_a_real_worker):
                listener = _PosingListener(behaviour)
                async with trio.open_nursery() as nursery:
                    listeners = await nursery.start(
                        functools.partial(trio.serve_tcp, host="127.0.0.1"), listener.serve, 0
                    )
                    port = listeners[0].socket.getsockname()[1]
                    async with httpx.AsyncClient() as http:
                        with pytest.raises(PeerAuthenticationError):
                            await link_authorization(
                                http, f"http://127.0.0.1:{port}", credentials, "decode-evil"
                            )
                        with pytest.raises(PeerAuthenticationError):
                            await http.get(
                                f"http://127.0.0.1:{port}/pd/info",
                                auth=WorkerAuth(credentials, "decode-evil"),
                            )
                    nursery.cancel_scope.cancel()
                assert len(listener.requests) == 2, behaviour.__name__
                for head in listener.requests:
                    # one fresh nonce of ours each time, no proof, no secret, no upgrade
                    authorization = _authorization_of(head)
                    assert authorization.startswith("PDTRIO-HMAC client-nonce="), authorization
                    assert "proof" not in authorization
                    assert SECRET.encode() not in head
                    assert b"upgrade" not in head.lower()
                nonces = {_authorization_of(head) for head in listener.requests}
                assert len(nonces) == 2
        # the real worker took no link from any of them
        assert real.stats()["router_links"] == 1


async def test_an_answer_seen_on_the_wire_opens_nothing_a_second_time() -> None:
    async with running_cluster(security=SecurityConfig(worker_secret=SECRET)) as cluster:
        prefill, decode = cluster.workers
        credentials = PeerCredentials(SECRET)
        seen: list[str] = []

        async def record(request: httpx.Request) -> None:
            seen.append(request.headers.get("authorization", ""))

        async with httpx.AsyncClient(
            base_url=worker_url(prefill), event_hooks={"request": [record]}
        ) as peer:
            first = await peer.get("/pd/stats", auth=WorkerAuth(credentials))
            assert first.status_code == 200
            assert "proof" in seen[-1]
            replayed = await peer.get("/pd/stats", headers={"authorization": seen[-1]})
            assert replayed.status_code == 401
        # the link's handshake answer, likewise: good once
        async with httpx.AsyncClient() as http:
            headers = await link_authorization(
                http, worker_url(decode), credentials, decode.instance_id
            )
        link_url = worker_url(decode).replace("http", "ws") + "/pd/link"
        ws = await connect_websocket(link_url, max_message_size=1 << 20, headers=headers)
        await ws.aclose()
        with pytest.raises(HandshakeError, match="403"):
            await connect_websocket(link_url, max_message_size=1 << 20, headers=headers)
        # and a worker proves who it is: an answer for another instance id is refused
        async with httpx.AsyncClient() as http:
            with pytest.raises(PeerAuthenticationError, match="not 'prefill-0'"):
                await link_authorization(http, worker_url(decode), credentials, "prefill-0")


async def test_a_router_with_a_secret_refuses_a_worker_that_asks_for_none() -> None:
    async with running_cluster(roles=("prefill",)) as cluster:
        url = worker_url(cluster.workers[0])
        async with httpx.AsyncClient() as http:
            with pytest.raises(PeerAuthenticationError, match="without proving"):
                await link_authorization(http, url, PeerCredentials(SECRET), None)
            with pytest.raises(PeerAuthenticationError, match="without proving"):
                await http.get(url + "/pd/info", auth=WorkerAuth(PeerCredentials(SECRET)))
            # a router without one links as before
            assert await link_authorization(http, url, PeerCredentials(""), None) == []


async def test_a_kv_port_that_cannot_prove_itself_gets_no_request() -> None:
    received = bytearray()

    async def poser(stream: trio.SocketStream) -> None:
        async with stream:
            received.extend(await receive_exactly(stream, 33))
            await stream.send_all(new_nonce() + new_nonce())  # a nonce and a made-up proof
            with trio.move_on_after(1):
                while chunk := await stream.receive_some(65536):
                    received.extend(chunk)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, host="127.0.0.1"), poser, 0
        )
        port = listeners[0].socket.getsockname()[1]
        with pytest.raises(KvTransferError, match="did not prove"):
            await connect_kv_port(
                "127.0.0.1", port, SESSION_BLOCKS, PeerCredentials(SECRET), "prefill-0"
            )
        nursery.cancel_scope.cancel()
    # the session byte and our nonce: no proof of ours, no request, no grant
    assert len(received) == 33 and received[:1] == SESSION_BLOCKS


async def test_a_metrics_token_opens_the_metrics_and_nothing_else() -> None:
    token = "scraper-token"
    async with running_cluster(
        roles=("prefill",),
        security=SecurityConfig(worker_secret=SECRET),
        make_worker=lambda role: synthetic_worker(
            role, secret=SECRET, worker_overrides={"metrics_token": token}
        ),
    ) as cluster:
        bearer = {"authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=worker_url(cluster.workers[0])) as scraper:
            metrics = await scraper.get("/metrics", headers=bearer)
            assert metrics.status_code == 200 and "pdtrio_worker" in metrics.text
            assert (await scraper.get("/metrics")).status_code == 401
            wrong = await scraper.get("/metrics", headers={"authorization": "Bearer nope"})
            assert wrong.status_code == 401
            for path in ("/pd/info", "/pd/stats"):
                assert (await scraper.get(path, headers=bearer)).status_code == 401
