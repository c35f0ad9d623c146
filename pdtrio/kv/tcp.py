"""The plain-TCP KV transport.

Decode connects to prefill's transfer endpoint and sends a
``TransferRequest``; prefill answers with a ``TransferAnswer`` and, when
granted, the raw block bytes; decode acknowledges with ``TransferDone`` once
the bytes are in its own blocks, and prefill frees them.  Messages are
length-prefixed msgpack (``pdtrio.protocol.wire``); the body is the engine's
block bytes, unframed.
"""

from __future__ import annotations

import logging
import struct
from typing import Any, TypeVar, final

import trio

from pdtrio.engine.api import EngineError
from pdtrio.kv.api import KvBlockSink, KvBlockSource, KvTransferError
from pdtrio.protocol import wire
from pdtrio.protocol.wire import KvHandle, TransferAnswer, TransferDone, TransferRequest, WireError

log = logging.getLogger("pdtrio.kv")

_LENGTH = struct.Struct("!I")
_MAX_MESSAGE = 1 << 20
_T = TypeVar("_T")

_request_decoder: wire.Decoder[TransferRequest] = wire.Decoder(TransferRequest)
_answer_decoder: wire.Decoder[TransferAnswer] = wire.Decoder(TransferAnswer)
_done_decoder: wire.Decoder[TransferDone] = wire.Decoder(TransferDone)


async def _receive_exactly(stream: trio.abc.ReceiveStream, size: int) -> bytearray:
    buffer = bytearray()
    while len(buffer) < size:
        chunk = await stream.receive_some(min(size - len(buffer), 1 << 20))
        if not chunk:
            raise KvTransferError(f"peer closed after {len(buffer)} of {size} bytes")
        buffer += chunk
    return buffer


async def _send_message(stream: trio.abc.SendStream, message: Any) -> None:
    body = wire.encode(message)
    await stream.send_all(_LENGTH.pack(len(body)) + body)


async def _receive_message(stream: trio.abc.ReceiveStream, decoder: wire.Decoder[_T]) -> _T:
    """The next message; KvTransferError if the peer left, WireError if it is not one."""
    (size,) = _LENGTH.unpack(await _receive_exactly(stream, _LENGTH.size))
    if size > _MAX_MESSAGE:
        raise WireError(f"a message of {size} bytes is too large")
    return decoder.decode(await _receive_exactly(stream, size))


@final
class TcpKvTransport:
    async def serve(
        self,
        source: KvBlockSource,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async def handle(stream: trio.SocketStream) -> None:
            async with stream:
                try:
                    await _serve_one(source, stream)
                except (KvTransferError, WireError, trio.BrokenResourceError) as exc:
                    # no ack: the lease, or the router's release, frees the blocks
                    log.warning("KV transfer to a decode instance failed: %s", exc)

        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, handle, listeners)
            task_status.started((host, int(bound[1])))

    async def pull(
        self, handle: KvHandle, sink: KvBlockSink, dest_block_ids: tuple[int, ...]
    ) -> None:
        if len(dest_block_ids) != len(handle.block_ids):
            raise KvTransferError(
                f"{len(handle.block_ids)} source blocks but {len(dest_block_ids)} destinations"
            )
        try:
            stream = await trio.open_tcp_stream(handle.transfer_host, handle.transfer_port)
        except OSError as exc:
            raise KvTransferError(
                f"cannot reach KV endpoint {handle.transfer_host}:{handle.transfer_port}: {exc}"
            ) from exc
        async with stream:
            try:
                await _send_message(stream, TransferRequest(handle.request_id, handle.block_ids))
                answer = await _receive_message(stream, _answer_decoder)
                if not answer.granted:
                    raise KvTransferError(f"prefill refused the transfer: {answer.reason}")
                expected = len(handle.block_ids) * handle.layout.block_nbytes
                if answer.nbytes != expected:
                    raise KvTransferError(
                        f"prefill offers {answer.nbytes} bytes, expected {expected}"
                    )
                data = await _receive_exactly(stream, expected)
                try:
                    await sink.write_blocks(dest_block_ids, bytes(data))
                except EngineError as exc:
                    raise KvTransferError(f"the received KV does not fit: {exc}") from exc
                await _send_message(stream, TransferDone(handle.request_id))
            except (trio.BrokenResourceError, WireError) as exc:
                raise KvTransferError(f"KV transfer broke: {exc}") from exc


async def _serve_one(source: KvBlockSource, stream: trio.SocketStream) -> None:
    request = await _receive_message(stream, _request_decoder)
    request_id = request.request_id
    if not source.holds(request_id, request.block_ids):
        answer = TransferAnswer(False, reason=f"no lease held for {request_id}")
        await _send_message(stream, answer)
        return
    data = await source.read_blocks(request.block_ids)
    await _send_message(stream, TransferAnswer(True, nbytes=len(data)))
    await stream.send_all(data)
    done = await _receive_message(stream, _done_decoder)
    if done.request_id != request_id:
        raise WireError(f"acknowledged {done.request_id!r}, not {request_id!r}")
    source.release(request_id)
