"""The plain-TCP KV transport, and the KV transfer port every prefill instance serves.

A connection to the port opens with a mutual proof of the secret routers and
workers share (``pdtrio.security``), in which neither side sends anything the
other could reuse: the client sends one byte that names its session and a
fresh nonce; prefill answers with its own nonce and an HMAC over both (and its
instance id); the client checks it (a listener without the secret gets no
further: no grant, no request) and answers with its own HMAC, which prefill
checks before it reads anything else.  Without a secret the proofs are zeros
and go unchecked.  Sessions:

- ``B`` (blocks, the TCP transport): decode sends a ``TransferRequest``;
  prefill answers with a ``TransferAnswer`` (``TransferAnswerWithDigests`` when it
  recorded what it wrote in the blocks) and, when granted, the raw block
  bytes; decode acknowledges with ``TransferDone`` once the bytes are in its
  own blocks (prefill keeps them leased until the router releases them, once
  decode has produced a token).
- ``N`` (NIXL control, see ``pdtrio.kv.nixl_grants``): prefill sends its
  ``NixlAgentInfo`` first; an instance without NIXL says why not there.

Messages are length-prefixed msgpack (``pdtrio.protocol.link.wire``); block bytes
follow their answer unframed.
"""

from __future__ import annotations

import logging
import ssl
import struct
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final, TypeVar, final

import trio

from pdtrio.engine.api import EngineError
from pdtrio.kv.api import KvBlockSink, KvBlockSource, KvTransferError
from pdtrio.logs import LogBudget
from pdtrio.protocol.link import wire
from pdtrio.protocol.link.wire import (
    KvDigests,
    KvHandle,
    NixlAgentInfo,
    TransferAnswer,
    TransferAnswerWithDigests,
    TransferDone,
    TransferRequest,
    WireError,
)
from pdtrio.security import NONCE_SIZE, PeerCredentials, new_nonce

log = logging.getLogger("pdtrio.kv")

SESSION_BLOCKS: Final = b"B"
SESSION_NIXL: Final = b"N"
# connections a KV port serves at once (pulls, NIXL sessions); more are closed at once
MAX_KV_CONNECTIONS = 256
# connections yet to show the credential, and how long each may take to
MAX_KV_STRANGERS = 1024
KV_PREAMBLE_TIMEOUT_S = 5.0
# a pull that has not finished by then fails (the start is rejected, its blocks freed)
DEFAULT_TRANSFER_TIMEOUT_S: Final = 30.0

_LENGTH = struct.Struct("!I")
KV_PROOF_SIZE: Final = 32  # an HMAC-SHA256
_MAX_MESSAGE = 1 << 20
_T = TypeVar("_T")

# the KV port's messages (the NIXL session speaks them too)
request_decoder: wire.Decoder[TransferRequest] = wire.Decoder(TransferRequest)
# (a plain answer, without digests, reads as one too)
answer_decoder: wire.Decoder[TransferAnswerWithDigests] = wire.Decoder(TransferAnswerWithDigests)
done_decoder: wire.Decoder[TransferDone] = wire.Decoder(TransferDone)

# serves one NIXL control session on an accepted connection (its opening byte already read)
NixlSessionHandler = Callable[[trio.abc.Stream], Awaitable[None]]


async def receive_exactly(stream: trio.abc.ReceiveStream, size: int) -> bytearray:
    buffer = bytearray()
    while len(buffer) < size:
        chunk = await stream.receive_some(min(size - len(buffer), 1 << 20))
        if not chunk:
            raise KvTransferError(f"peer closed after {len(buffer)} of {size} bytes")
        buffer += chunk
    return buffer


async def send_message(stream: trio.abc.SendStream, message: Any) -> None:
    body = wire.encode(message)
    await stream.send_all(_LENGTH.pack(len(body)) + body)


async def receive_message(stream: trio.abc.ReceiveStream, decoder: wire.Decoder[_T]) -> _T:
    """The next message; KvTransferError if the peer left, WireError if it is not one."""
    (size,) = _LENGTH.unpack(await receive_exactly(stream, _LENGTH.size))
    if size > _MAX_MESSAGE:
        raise WireError(f"a message of {size} bytes is too large")
    return decoder.decode(await receive_exactly(stream, size))


async def connect(handle: KvHandle, session: bytes, secret: PeerCredentials) -> trio.abc.Stream:
    """A connection to the handle's KV transfer port (over TLS when the credentials say),
    its session named, and the port's owner and we proven to each other."""
    return await connect_kv_port(
        handle.transfer_host, handle.transfer_port, session, secret, handle.instance_id
    )


async def connect_kv_port(
    host: str, port: int, session: bytes, secret: PeerCredentials, instance_id: str
) -> trio.abc.Stream:
    """A connection to ``instance_id``'s KV transfer port at ``host:port``, proven both ways;
    KvTransferError when it cannot be reached or does not prove it holds the secret."""
    try:
        tcp = await trio.open_tcp_stream(host, port)
    except OSError as exc:
        raise KvTransferError(f"cannot reach KV endpoint {host}:{port}: {exc}") from exc
    stream: trio.abc.Stream = tcp
    try:
        if secret.client_tls is not None:
            tls = trio.SSLStream(tcp, secret.client_tls, server_hostname=host)
            await tls.do_handshake()
            stream = tls
        client_nonce = new_nonce()
        await stream.send_all(session + client_nonce)
        hello = await receive_exactly(stream, NONCE_SIZE + KV_PROOF_SIZE)
        server_nonce, server_proof = bytes(hello[:NONCE_SIZE]), bytes(hello[NONCE_SIZE:])
        expected = secret.kv_proof(b"server", session, client_nonce, server_nonce, instance_id)
        if not secret.proof_matches(server_proof, expected):
            raise KvTransferError(
                f"the KV endpoint {host}:{port} did not prove it is {instance_id!r} holding "
                "the worker secret"
            )
        await stream.send_all(
            secret.kv_proof(b"client", session, client_nonce, server_nonce, instance_id)
        )
    except (trio.BrokenResourceError, ssl.SSLError) as exc:
        await trio.aclose_forcefully(stream)
        raise KvTransferError(f"KV endpoint closed the connection: {exc}") from exc
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return stream


async def serve_kv_port(
    source: KvBlockSource,
    host: str,
    port: int,
    *,
    nixl_sessions: NixlSessionHandler | None,
    nixl_unavailable: str,
    secret: PeerCredentials,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the KV transfer port until cancelled; reports the bound (host, port).

    Without ``nixl_sessions``, a NIXL session gets ``nixl_unavailable`` as its answer.
    """

    # two bounds: connections still to show the credential (each for a few seconds at
    # most), and authenticated ones; silent strangers can never take a peer's place
    strangers = trio.CapacityLimiter(MAX_KV_STRANGERS)
    peers = trio.CapacityLimiter(MAX_KV_CONNECTIONS)
    # what peers cause is logged within a budget: strangers can cause it at will
    budget = LogBudget()

    async def handle(tcp: trio.SocketStream) -> None:
        try:
            await handle_connection(tcp)
        except* Exception as failures:
            # whatever else a peer's bytes cause ends its connection, not the port
            budget.log(
                log,
                logging.WARNING,
                "unexpected",
                "a KV transfer connection failed and was closed: %r",
                failures.exceptions[0],
            )
            await trio.aclose_forcefully(tcp)

    async def handle_connection(tcp: trio.SocketStream) -> None:
        stream: trio.abc.Stream = tcp
        if secret.server_tls is not None:
            stream = trio.SSLStream(tcp, secret.server_tls, server_side=True)
        async with stream:
            try:
                with _slot(strangers) as admitted:
                    if not admitted:
                        budget.log(
                            log,
                            logging.WARNING,
                            "strangers",
                            "refused a KV connection: %d are yet to authenticate",
                            MAX_KV_STRANGERS,
                        )
                        return
                    session, proven = b"", False
                    # a peer that connects and says nothing goes within seconds
                    with trio.move_on_after(KV_PREAMBLE_TIMEOUT_S):
                        if isinstance(stream, trio.SSLStream):
                            await stream.do_handshake()
                        session, proven = await _prove_peer(stream, secret)
                if not proven:
                    budget.log(
                        log,
                        logging.WARNING,
                        "unproven",
                        "refused a KV transfer connection without proof of the secret",
                    )
                    return
                with _slot(peers) as admitted:
                    if not admitted:
                        budget.log(
                            log,
                            logging.WARNING,
                            "peers",
                            "refused a KV connection: %d are open",
                            MAX_KV_CONNECTIONS,
                        )
                        return
                    await serve_session(stream, session)
            except (KvTransferError, WireError, trio.BrokenResourceError, ssl.SSLError) as exc:
                # no ack: the lease, or the router's release, frees the blocks
                budget.log(
                    log,
                    logging.WARNING,
                    "failed",
                    "KV transfer to a decode instance failed: %s",
                    exc,
                )

    async def serve_session(stream: trio.abc.Stream, session: bytes) -> None:
        if session == SESSION_BLOCKS:
            # a peer that stalls mid-transfer holds nothing past the transfer deadline
            with trio.move_on_after(DEFAULT_TRANSFER_TIMEOUT_S) as transfer:
                await _serve_blocks(source, stream)
            if transfer.cancelled_caught:
                log.warning("a KV transfer stalled past its deadline; dropped")
        elif session == SESSION_NIXL and nixl_sessions is not None:
            await nixl_sessions(stream)
        elif session == SESSION_NIXL:
            await send_message(stream, NixlAgentInfo(unavailable=nixl_unavailable))
            await _wait_closed(stream)

    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started((host, int(bound[1])))


async def _prove_peer(stream: trio.abc.Stream, secret: PeerCredentials) -> tuple[bytes, bool]:
    """The server's side of the opening: the session byte, and whether the client proved
    it holds the secret (having seen our proof first)."""
    opening = await receive_exactly(stream, 1 + NONCE_SIZE)
    session, client_nonce = bytes(opening[:1]), bytes(opening[1:])
    server_nonce = new_nonce()
    identity = secret.identity
    proof = secret.kv_proof(b"server", session, client_nonce, server_nonce, identity)
    await stream.send_all(server_nonce + proof)
    presented = bytes(await receive_exactly(stream, KV_PROOF_SIZE))
    expected = secret.kv_proof(b"client", session, client_nonce, server_nonce, identity)
    return session, secret.proof_matches(presented, expected)


@contextmanager
def _slot(limiter: trio.CapacityLimiter) -> Iterator[bool]:
    """A place under ``limiter`` for the block's duration, if one is free now."""
    try:
        limiter.acquire_nowait()
    except trio.WouldBlock:
        yield False
        return
    try:
        yield True
    finally:
        limiter.release()


async def _wait_closed(stream: trio.abc.ReceiveStream) -> None:
    while await stream.receive_some(4096):
        pass


@final
class TcpKvTransport:
    """Blocks copied through prefill's memory and a TCP stream: works between any two instances."""

    def __init__(
        self,
        *,
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        nixl_unavailable: str = "kv_transport = 'tcp'",
    ) -> None:
        self.timeout_s = timeout_s
        # what peers' KV ports ask for, and ours asks for (the worker sets it)
        self.secret = PeerCredentials("")
        self.nixl_unavailable = nixl_unavailable  # why not NIXL: said at start, to peers, in info
        self.pulls = 0
        self.pull_seconds = 0.0
        self.pull_bytes = 0

    @property
    def name(self) -> str:
        return "tcp"

    async def run(
        self,
        source: KvBlockSource | None,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[tuple[str, int] | None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        log.info("KV transport: tcp (%s)", self.nixl_unavailable)
        if source is None:
            task_status.started(None)
            await trio.sleep_forever()
        await serve_kv_port(
            source,
            host,
            port,
            nixl_sessions=None,
            nixl_unavailable=self.nixl_unavailable,
            secret=self.secret,
            task_status=task_status,
        )

    def info(self) -> dict[str, Any]:
        return {
            "transport": "tcp",
            "nixl": {"unavailable": self.nixl_unavailable},
            "pulls": {"tcp": self.pulls},
            "pull_seconds": {"tcp": self.pull_seconds},
            "pull_bytes": {"tcp": self.pull_bytes},
        }

    async def pull(
        self, handle: KvHandle, sink: KvBlockSink, dest_block_ids: tuple[int, ...]
    ) -> KvDigests | None:
        check_destination(handle, dest_block_ids)
        started = time.perf_counter()
        digests: KvDigests | None = None
        with trio.move_on_after(self.timeout_s) as deadline:
            digests = await pull_over_tcp(handle, sink, dest_block_ids, self.secret)
            self.pulls += 1
            self.pull_seconds += time.perf_counter() - started
            self.pull_bytes += len(handle.block_ids) * handle.layout.block_nbytes
        if deadline.cancelled_caught:
            raise KvTransferError(
                f"the KV transfer stalled past its deadline ({self.timeout_s:g} s)"
            )
        return digests


def granted(nbytes: int, digests: KvDigests | None) -> TransferAnswer:
    """A grant's answer: with what prefill wrote in the blocks, when it recorded that."""
    if digests is None:
        return TransferAnswer(True, nbytes=nbytes)
    return TransferAnswerWithDigests(True, nbytes=nbytes, digests=digests)


def check_destination(handle: KvHandle, dest_block_ids: tuple[int, ...]) -> None:
    if len(dest_block_ids) != len(handle.block_ids):
        raise KvTransferError(
            f"{len(handle.block_ids)} source blocks but {len(dest_block_ids)} destinations"
        )


async def pull_over_tcp(
    handle: KvHandle, sink: KvBlockSink, dest_block_ids: tuple[int, ...], secret: PeerCredentials
) -> KvDigests | None:
    """One blocks session: the bytes through a TCP stream into ``sink``, and what prefill
    says it wrote in them. Raises KvTransferError."""
    stream = await connect(handle, SESSION_BLOCKS, secret)
    async with stream:
        try:
            await send_message(
                stream, TransferRequest(handle.request_id, handle.block_ids, handle.access_token)
            )
            answer = await receive_message(stream, answer_decoder)
            if not answer.granted:
                raise KvTransferError(f"prefill refused the transfer: {answer.reason}")
            expected = len(handle.block_ids) * handle.layout.block_nbytes
            if answer.nbytes != expected:
                raise KvTransferError(f"prefill offers {answer.nbytes} bytes, expected {expected}")
            data = await receive_exactly(stream, expected)
            try:
                await sink.write_blocks(dest_block_ids, bytes(data))
            except EngineError as exc:
                raise KvTransferError(f"the received KV does not fit: {exc}") from exc
            await send_message(stream, TransferDone(handle.request_id, handle.access_token))
        except (trio.BrokenResourceError, WireError) as exc:
            raise KvTransferError(f"KV transfer broke: {exc}") from exc
    return answer.digests


async def _serve_blocks(source: KvBlockSource, stream: trio.abc.Stream) -> None:
    request = await receive_message(stream, request_decoder)
    request_id = request.request_id
    if not source.holds(request_id, request.block_ids, request.access_token):
        answer = TransferAnswer(False, reason=f"no lease held for {request_id}")
        await send_message(stream, answer)
        return
    data = await source.read_blocks(request.block_ids)
    # (the generations are read after the bytes: a reuse before or during the read shows)
    await send_message(stream, granted(len(data), source.kv_digests(request_id, request.block_ids)))
    await stream.send_all(data)
    done = await receive_message(stream, done_decoder)
    if done.request_id != request_id:
        raise WireError(f"acknowledged {done.request_id!r}, not {request_id!r}")
    # the blocks stay leased: the router releases them once decode has produced a token
    # (a decode that fails before that is replaced by another, which pulls them again)
