"""The plain-TCP KV transport.

Decode connects to prefill's transfer endpoint and asks for a request's
blocks; prefill answers with a header and the raw block bytes.  Headers are
length-prefixed msgpack; the body is the engine's block bytes, unframed.
"""

from __future__ import annotations

import struct
from typing import Any, final

import trio

from pdtrio import codec
from pdtrio.engine.api import Engine
from pdtrio.kv.api import KvBlockSource, KvTransferError
from pdtrio.protocol.wire import KvHandle, WireError

_LENGTH = struct.Struct("!I")
_MAX_HEADER = 1 << 20


async def _receive_exactly(stream: trio.abc.ReceiveStream, size: int) -> bytearray:
    buffer = bytearray()
    while len(buffer) < size:
        chunk = await stream.receive_some(min(size - len(buffer), 1 << 20))
        if not chunk:
            raise KvTransferError(f"peer closed after {len(buffer)} of {size} bytes")
        buffer += chunk
    return buffer


async def _send_header(stream: trio.abc.SendStream, header: Any) -> None:
    body = codec.pack(header)
    await stream.send_all(_LENGTH.pack(len(body)) + body)


async def _receive_header(stream: trio.abc.ReceiveStream) -> Any:
    (size,) = _LENGTH.unpack(await _receive_exactly(stream, _LENGTH.size))
    if size > _MAX_HEADER:
        raise KvTransferError(f"header of {size} bytes is too large")
    return codec.unpack(bytes(await _receive_exactly(stream, size)))


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
                    request = await _receive_header(stream)
                    request_id, block_ids = str(request[0]), tuple(int(b) for b in request[1])
                except (KvTransferError, WireError, TypeError, ValueError, IndexError):
                    return
                except trio.BrokenResourceError:
                    return
                if not source.holds(request_id, block_ids):
                    await _send_header(stream, [False, f"no lease held for {request_id}"])
                    return
                data = await source.read_blocks(block_ids)
                try:
                    await _send_header(stream, [True, len(data)])
                    await stream.send_all(data)
                    # decode acknowledges once the bytes are its own: free them here
                    ack = await _receive_header(stream)
                except (trio.BrokenResourceError, KvTransferError, WireError):
                    return  # no ack: the lease, or the router's release, frees them
                if ack == ["done"]:
                    source.release(request_id)

        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, handle, listeners)
            task_status.started((host, int(bound[1])))

    async def pull(
        self, handle: KvHandle, engine: Engine, dest_block_ids: tuple[int, ...]
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
                await _send_header(stream, [handle.request_id, list(handle.block_ids)])
                header = await _receive_header(stream)
                if not header[0]:
                    raise KvTransferError(f"prefill refused the transfer: {header[1]}")
                expected = len(handle.block_ids) * handle.layout.block_nbytes
                size = int(header[1])
                if size != expected:
                    raise KvTransferError(f"prefill sent {size} bytes, expected {expected}")
                data = await _receive_exactly(stream, size)
                await engine.write_blocks(dest_block_ids, bytes(data))
                await _send_header(stream, ["done"])
            except (trio.BrokenResourceError, WireError) as exc:
                raise KvTransferError(f"KV transfer broke: {exc}") from exc
