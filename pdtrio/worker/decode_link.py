"""Decode side of the router <-> decode websocket.

One link per connected router.  A reader takes ``start``/``abort`` frames; a
single sender writes every frame, so writes never interleave.  Engine outputs
reach the sender through a bounded channel and leave in coalesced token
frames under the ``FlushPolicy`` (pdtrio.protocol.flush).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, final

import attrs
import trio

from pdtrio import codec
from pdtrio.asgi import Receive, Scope, Send
from pdtrio.engine.api import EngineError, NoRoom, StepOutputs
from pdtrio.kv.api import KvTransferError
from pdtrio.protocol.flush import FlushNow, FlushPolicy, WaitUntil
from pdtrio.protocol.kv_layout import layout_mismatch
from pdtrio.protocol.wire import (
    DecodeAbort,
    DecodeAccepted,
    DecodeFailed,
    DecodeRejected,
    DecodeStart,
    RejectReason,
    WireError,
    decode_message,
    token_frame_wire,
)

if TYPE_CHECKING:
    from pdtrio.worker.server import Worker

log = logging.getLogger("pdtrio.worker.decode")


@attrs.frozen
class _Control:
    """A non-token message, sent in order with the token frames."""

    wire: list[Any]


_WRITE_DONE: Any = object()


@final
class _Link:
    def __init__(self, server: DecodeLinkServer, send: Send) -> None:
        self.server = server
        self.worker = server.worker
        self._send = send
        self.outbox_send, self.outbox_receive = trio.open_memory_channel[
            Any
        ](256)
        self.requests: dict[str, trio.CancelScope] = {}
        self.frames_sent = 0
        self._in_flight = 0  # frames handed to the writer and not yet written

    async def send_control(self, message: Any) -> None:
        await self.outbox_send.send(_Control(message.to_wire()))

    async def run_sender(self) -> None:
        """Collect engine outputs under the flush policy; a writer task sends frames.

        The writer counts its finished writes in ``_in_flight`` and pokes the
        outbox (never blocking on it), so the policy knows when a frame is in
        flight: tokens that arrive meanwhile merge into the next frame instead
        of queueing as frames.
        """
        policy = FlushPolicy(self.worker.config.flush)
        receive = self.outbox_receive
        frames_send, frames_receive = trio.open_memory_channel[list[Any]](4)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._run_writer, frames_receive)
            while True:
                decision = policy.decide(trio.current_time(), in_flight=self._in_flight > 0)
                if isinstance(decision, FlushNow):
                    self._in_flight += 1
                    await frames_send.send(token_frame_wire(policy.take()))
                    continue
                deadline = decision.deadline if isinstance(decision, WaitUntil) else math.inf
                item: Any = None
                # only the wait is bounded: a hand-over cut by the deadline would lose a frame
                with trio.move_on_at(deadline):
                    item = await receive.receive()
                if item is None or item is _WRITE_DONE:
                    continue
                if isinstance(item, _Control):
                    # control messages keep their order relative to tokens
                    while policy.has_pending:
                        self._in_flight += 1
                        await frames_send.send(token_frame_wire(policy.take()))
                    self._in_flight += 1
                    await frames_send.send(item.wire)
                else:
                    policy.add(item, trio.current_time())

    async def _run_writer(self, frames: trio.MemoryReceiveChannel[list[Any]]) -> None:
        poke = self.outbox_send.clone()
        async for message in frames:
            await self._send({"type": "websocket.send", "bytes": codec.pack(message)})
            self.frames_sent += 1
            self._in_flight -= 1
            try:
                # wake the collector; a full outbox wakes it anyway, so never wait here
                poke.send_nowait(_WRITE_DONE)
            except trio.WouldBlock:
                pass

    async def run_reader(self, receive: Receive, nursery: trio.Nursery) -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("bytes")
            if data is None:
                continue
            try:
                parsed = decode_message(codec.unpack(data))
            except WireError as exc:
                log.warning("dropping a bad frame from the router: %s", exc)
                continue
            if isinstance(parsed, DecodeStart):
                scope = trio.CancelScope()
                if parsed.request_id in self.server.owner:
                    await self.send_control(
                        DecodeRejected(
                            parsed.request_id,
                            RejectReason.BAD_REQUEST,
                            f"request {parsed.request_id} is already running here",
                        )
                    )
                    continue
                self.requests[parsed.request_id] = scope
                self.server.owner[parsed.request_id] = self
                nursery.start_soon(self._start_request, parsed, scope)
            elif isinstance(parsed, DecodeAbort):
                self.abort(parsed.request_id)

    def abort(self, request_id: str) -> None:
        scope = self.requests.pop(request_id, None)
        if scope is not None:
            scope.cancel()
        self.server.owner.pop(request_id, None)
        self.worker.engine.abort(request_id)

    def finished(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.server.owner.pop(request_id, None)

    async def _start_request(self, start: DecodeStart, scope: trio.CancelScope) -> None:
        worker = self.worker
        engine = worker.engine
        request_id = start.request_id
        handle = start.kv_handle
        started = False
        accepted = False
        rejection: DecodeRejected | None = None
        with scope:
            try:
                mismatch = layout_mismatch(handle.layout, engine.layout)
                if mismatch is not None:
                    raise _Reject(RejectReason.LAYOUT_MISMATCH, mismatch)
                total_tokens = len(start.prompt_token_ids) + start.remaining_tokens + 1
                if handle.instance_id == worker.instance_id:
                    # colocated: the prefill blocks are already ours, no copy
                    if not worker.leases.hand_over(request_id):
                        raise _Reject(RejectReason.TRANSFER_FAILED, "the KV lease has expired")
                    engine.allocate_blocks(request_id, total_tokens)
                else:
                    blocks = engine.allocate_blocks(request_id, total_tokens)
                    await worker.transport.pull(handle, engine, blocks[: len(handle.block_ids)])
                await self.send_control(DecodeAccepted(request_id))
                accepted = True
                await engine.start_decode(
                    request_id,
                    list(start.prompt_token_ids),
                    start.first_token_id,
                    start.sampling,
                    start.remaining_tokens,
                    start.cached_tokens,
                )
                started = True
            except _Reject as exc:
                rejection = DecodeRejected(request_id, exc.reason, exc.message)
            except NoRoom as exc:
                rejection = DecodeRejected(request_id, RejectReason.NO_ROOM, str(exc))
            except KvTransferError as exc:
                rejection = DecodeRejected(request_id, RejectReason.TRANSFER_FAILED, str(exc))
            except EngineError as exc:
                rejection = DecodeRejected(request_id, RejectReason.BAD_REQUEST, str(exc))
            finally:
                if not started:
                    engine.free_request(request_id)
                    self.finished(request_id)
        if rejection is not None and accepted:
            await self.send_control(DecodeFailed(request_id, rejection.message))
        elif rejection is not None:
            await self.send_control(rejection)
        elif not started and not scope.cancelled_caught:
            await self.send_control(DecodeFailed(request_id, "decode start did not complete"))


class _Reject(Exception):
    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@final
class DecodeLinkServer:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.owner: dict[str, _Link] = {}
        self._links: set[_Link] = set()

    @property
    def link_count(self) -> int:
        return len(self._links)

    @property
    def request_count(self) -> int:
        return len(self.owner)

    async def dispatch_outputs(self, outputs: trio.MemoryReceiveChannel[StepOutputs]) -> None:
        """Route each engine step's entries to the link that started each request."""
        async with outputs:
            async for step in outputs:
                owner = self.owner
                if len(self._links) == 1:
                    (link,) = self._links
                    entries = [e for e in step if owner.get(e[0]) is link]
                    await self._deliver(link, entries)
                    continue
                per_link: dict[_Link, StepOutputs] = {}
                for entry in step:
                    target = owner.get(entry[0])
                    if target is not None:
                        per_link.setdefault(target, []).append(entry)
                for target, entries in per_link.items():
                    await self._deliver(target, entries)

    async def _deliver(self, link: _Link, entries: StepOutputs) -> None:
        if not entries:
            return
        for entry in entries:
            if entry[3] is not None:
                link.finished(entry[0])
        try:
            await link.outbox_send.send(entries)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the link is gone; its requests were aborted

    async def serve_websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        await send({"type": "websocket.accept"})
        link = _Link(self, send)
        self._links.add(link)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(link.run_sender)
                await link.run_reader(receive, nursery)
                nursery.cancel_scope.cancel()
        finally:
            self._links.discard(link)
            link.outbox_send.close()
            # the router went away: every request it started here ends now
            for request_id in [rid for rid, owner in self.owner.items() if owner is link]:
                link.abort(request_id)
