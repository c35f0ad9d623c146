"""The plain-TCP KV transport, and the KV transfer port every prefill instance serves.

A connection to the port opens with one byte that names its session:

- ``B`` (blocks, the TCP transport): decode sends a ``TransferRequest``;
  prefill answers with a ``TransferAnswer`` and, when granted, the raw block
  bytes; decode acknowledges with ``TransferDone`` once the bytes are in its
  own blocks, and prefill frees them.
- ``N`` (NIXL control, see ``pdtrio.kv.nixl``): prefill sends its
  ``NixlAgentInfo`` first; an instance without NIXL says why not there.

Messages are length-prefixed msgpack (``pdtrio.protocol.wire``); block bytes
follow their answer unframed.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar, final

import trio

from pdtrio.engine.api import EngineError
from pdtrio.kv.api import KvBlockSink, KvBlockSource, KvTransferError
from pdtrio.protocol import wire
from pdtrio.protocol.wire import (
    KvHandle,
    NixlAgentInfo,
    TransferAnswer,
    TransferDone,
    TransferRequest,
    WireError,
)

log = logging.getLogger("pdtrio.kv")

SESSION_BLOCKS: Final = b"B"
SESSION_NIXL: Final = b"N"
# a pull that has not finished by then fails (the start is rejected, its blocks freed)
DEFAULT_TRANSFER_TIMEOUT_S: Final = 30.0

_LENGTH = struct.Struct("!I")
_MAX_MESSAGE = 1 << 20
_T = TypeVar("_T")

# the KV port's messages (the NIXL session speaks them too)
request_decoder: wire.Decoder[TransferRequest] = wire.Decoder(TransferRequest)
answer_decoder: wire.Decoder[TransferAnswer] = wire.Decoder(TransferAnswer)
done_decoder: wire.Decoder[TransferDone] = wire.Decoder(TransferDone)

# serves one NIXL control session on an accepted connection (its opening byte already read)
NixlSessionHandler = Callable[[trio.SocketStream], Awaitable[None]]


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


async def connect(handle: KvHandle, session: bytes) -> trio.SocketStream:
    """A connection to the handle's KV transfer port, its session named."""
    try:
        stream = await trio.open_tcp_stream(handle.transfer_host, handle.transfer_port)
    except OSError as exc:
        raise KvTransferError(
            f"cannot reach KV endpoint {handle.transfer_host}:{handle.transfer_port}: {exc}"
        ) from exc
    try:
        await stream.send_all(session)
    except trio.BrokenResourceError as exc:
        await stream.aclose()
        raise KvTransferError(f"KV endpoint closed the connection: {exc}") from exc
    return stream


async def serve_kv_port(
    source: KvBlockSource,
    host: str,
    port: int,
    *,
    nixl_sessions: NixlSessionHandler | None,
    nixl_unavailable: str,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the KV transfer port until cancelled; reports the bound (host, port).

    Without ``nixl_sessions``, a NIXL session gets ``nixl_unavailable`` as its answer.
    """

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                # a peer that connects and says nothing (or stalls mid-transfer) holds
                # neither a task nor blocks past the transfer deadline
                session = b""
                with trio.move_on_after(DEFAULT_TRANSFER_TIMEOUT_S):
                    session = await stream.receive_some(1)
                if session == SESSION_BLOCKS:
                    with trio.move_on_after(DEFAULT_TRANSFER_TIMEOUT_S) as transfer:
                        await _serve_blocks(source, stream)
                    if transfer.cancelled_caught:
                        log.warning("a KV transfer stalled past its deadline; dropped")
                elif session == SESSION_NIXL and nixl_sessions is not None:
                    await nixl_sessions(stream)
                elif session == SESSION_NIXL:
                    await send_message(stream, NixlAgentInfo(unavailable=nixl_unavailable))
                    await _wait_closed(stream)
            except (KvTransferError, WireError, trio.BrokenResourceError) as exc:
                # no ack: the lease, or the router's release, frees the blocks
                log.warning("KV transfer to a decode instance failed: %s", exc)

    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started((host, int(bound[1])))


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
        self.nixl_unavailable = nixl_unavailable  # why not NIXL: said at start, to peers, in info
        self.pulls = 0
        self.pull_seconds = 0.0

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
            task_status=task_status,
        )

    def info(self) -> dict[str, Any]:
        return {
            "transport": "tcp",
            "nixl": {"unavailable": self.nixl_unavailable},
            "pulls": {"tcp": self.pulls},
            "pull_seconds": {"tcp": self.pull_seconds},
        }

    async def pull(
        self, handle: KvHandle, sink: KvBlockSink, dest_block_ids: tuple[int, ...]
    ) -> None:
        check_destination(handle, dest_block_ids)
        started = time.perf_counter()
        with trio.move_on_after(self.timeout_s) as deadline:
            await pull_over_tcp(handle, sink, dest_block_ids)
            self.pulls += 1
            self.pull_seconds += time.perf_counter() - started
        if deadline.cancelled_caught:
            raise KvTransferError(
                f"the KV transfer stalled past its deadline ({self.timeout_s:g} s)"
            )


def check_destination(handle: KvHandle, dest_block_ids: tuple[int, ...]) -> None:
    if len(dest_block_ids) != len(handle.block_ids):
        raise KvTransferError(
            f"{len(handle.block_ids)} source blocks but {len(dest_block_ids)} destinations"
        )


async def pull_over_tcp(
    handle: KvHandle, sink: KvBlockSink, dest_block_ids: tuple[int, ...]
) -> None:
    """One blocks session: the bytes through a TCP stream into ``sink``. Raises KvTransferError."""
    stream = await connect(handle, SESSION_BLOCKS)
    async with stream:
        try:
            await send_message(stream, TransferRequest(handle.request_id, handle.block_ids))
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
            await send_message(stream, TransferDone(handle.request_id))
        except (trio.BrokenResourceError, WireError) as exc:
            raise KvTransferError(f"KV transfer broke: {exc}") from exc


async def _serve_blocks(source: KvBlockSource, stream: trio.SocketStream) -> None:
    request = await receive_message(stream, request_decoder)
    request_id = request.request_id
    if not source.holds(request_id, request.block_ids):
        answer = TransferAnswer(False, reason=f"no lease held for {request_id}")
        await send_message(stream, answer)
        return
    data = await source.read_blocks(request.block_ids)
    await send_message(stream, TransferAnswer(True, nbytes=len(data)))
    await stream.send_all(data)
    done = await receive_message(stream, done_decoder)
    if done.request_id != request_id:
        raise WireError(f"acknowledged {done.request_id!r}, not {request_id!r}")
    source.release(request_id)
