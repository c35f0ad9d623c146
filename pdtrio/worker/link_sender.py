"""The sending half of a router's link (``/pd/link``): one sender writes every frame.

Writes never interleave: control messages (decode accepts, rejections and
failures, prefill replies and failures) and engine outputs reach the sender
through one bounded outbox, and a single writer task sends the frames.  Tokens
leave in coalesced token frames under the ``FlushPolicy``
(pdtrio.protocol.flush); control messages keep their order relative to them.

A decoding worker's link also reports the engine's free KV blocks
(``DecodeCapacity``) when it opens and whenever the count may have changed (an
accept, a finish, an abort, and an abort's blocks freed later by the engine:
``BlocksFreed``): a dirty flag and a poke of the outbox, so reports
coalesce to the latest value and nothing polls.  The report a control message
may change goes out just before it, so the router never sees an accept its
report lacks.

A router that asks for it (``?batch=1``) gets the frames that queued during
a write in one message, a batch (``wire.is_batch``): one send through the
websocket, and one wake-up of the router, for all of them.

A router that asks for them (``?kv_events=1``) gets the prefix cache's changes
(``KvEvents``): the whole set when the link opens, then what changed, checked before
each frame goes out (a control message, a token frame, a heartbeat): many hashes in
one message, riding the link's own rhythm; nothing when the cache is off.  A prefill's
stored blocks go out just ahead of its reply.

Liveness: after ``heartbeat_s`` without a frame, the sender writes a
``Heartbeat``, so the router can tell a silent link from a hung worker.
The sender waits for the earlier of the flush deadline and the heartbeat's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final, final

import trio

from pdtrio.asgi import Send
from pdtrio.engine.api import Engine, StepLogprobs, StepOutputs
from pdtrio.protocol import wire
from pdtrio.protocol.flush import FlushConfig, FlushNow, FlushPolicy, WaitUntil
from pdtrio.protocol.wire import (
    DecodeAccepted,
    DecodeCapacity,
    DecodeFailed,
    DecodeRejected,
    Heartbeat,
    KvEvents,
    PrefillFailed,
    PrefillReply,
    TokenFrame,
    TokenLogprob,
    TokenLogprobs,
)
from pdtrio.worker.fault_hooks import FaultHooks

# the heartbeat interval of a router that names none
DEFAULT_HEARTBEAT_S: Final = 0.5
_HEARTBEAT: Final = Heartbeat()

Control = DecodeAccepted | DecodeRejected | DecodeFailed | PrefillReply | PrefillFailed
# What reaches the sender: a step's entries (after their logprobs, for requests that asked),
# a control message, or None: a write finished.
Outgoing = StepOutputs | StepLogprobs | Control | None
_Frame = TokenFrame | TokenLogprobs | Control | DecodeCapacity | Heartbeat | KvEvents


@final
class LinkSender:
    """Every frame one link sends, in order: tokens under the flush policy, control
    messages, capacity reports, heartbeats.

    ``reports_capacity``: a decoding worker's link (it reports its KV room);
    ``is_draining``: whether the worker takes nothing new (it reports no room then);
    ``reply_written``: called with a prefill reply's request id once it is written;
    ``kv_events``: the router reads the prefix cache's changes.
    """

    def __init__(
        self,
        send: Send,
        engine: Engine,
        flush: FlushConfig,
        *,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        batches: bool = False,
        kv_events: bool = False,
        reports_capacity: bool,
        is_draining: Callable[[], bool],
        reply_written: Callable[[str], None],
        faults: FaultHooks | None = None,
    ) -> None:
        self._send = send
        self._engine = engine
        self._flush = flush
        self._heartbeat_s = heartbeat_s
        # the router reads batches (?batch=1): what is ready goes out in one message
        self._batches = batches
        self._is_draining = is_draining
        self._reply_written = reply_written
        self._last_write = trio.current_time()  # when the writer last finished a frame
        self.outbox_send, self._outbox_receive = trio.open_memory_channel[Outgoing](256)
        self._in_flight = 0  # frames handed to the writer and not yet written
        # only a decoding worker reports its KV room; the first report goes out at once
        self._reports_capacity = reports_capacity
        self._capacity_dirty = reports_capacity
        self._last_capacity: DecodeCapacity | None = None
        self._faults = faults
        # logprobs of tokens not sent yet, per request: they go out just ahead of the
        # first token frame after them (a request's, merged as its tokens are)
        self._logprobs: dict[str, list[TokenLogprob]] = {}
        # a fault hook (testing only) may turn heartbeats off
        self._heartbeats = faults is None or not faults.heartbeats_off
        self._kv_events = kv_events
        self._kv_cursor: int | None = None  # the prefix cache's changes reported (None: none)

    def mark_capacity(self) -> None:
        """The engine's free blocks may have changed: report it soon (never blocks)."""
        if not self._reports_capacity:
            return
        self._capacity_dirty = True
        try:
            self.outbox_send.send_nowait(None)  # wake the collector; a full outbox wakes it anyway
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def _capacity_report(self) -> DecodeCapacity | None:
        """The current report, or None when it says what the last one said."""
        self._capacity_dirty = False
        stats = self._engine.statistics()
        # a draining worker takes nothing new: it says it has no room
        free_blocks = 0 if self._is_draining() else stats.kv_blocks_total - stats.kv_blocks_in_use
        report = DecodeCapacity(
            free_blocks=free_blocks,
            total_blocks=stats.kv_blocks_total,
            block_size=self._engine.layout.block_size,
        )
        if report == self._last_capacity:
            return None
        self._last_capacity = report
        return report

    async def send_control(self, message: Control) -> None:
        await self.outbox_send.send(message)

    async def _send_kv_events(self, frames_send: trio.MemorySendChannel[_Frame]) -> bool:
        """The prefix cache's changes since the last report, if the router reads them and
        there are any (the first time: the whole set); whether a frame went."""
        if not self._kv_events:
            return False
        self._kv_cursor, events = self._engine.kv_events(self._kv_cursor)
        if events is None:
            return False
        self._in_flight += 1
        await frames_send.send(events)
        return True

    async def run(self) -> None:
        """Collect engine outputs under the flush policy; a writer task sends frames.

        The writer counts its finished writes in ``_in_flight`` and pokes the
        outbox (never blocking on it), so the policy knows when a frame is in
        flight: tokens that arrive meanwhile merge into the next frame instead
        of queueing as frames.
        """
        policy = FlushPolicy(self._flush)
        receive = self._outbox_receive
        frames_send, frames_receive = trio.open_memory_channel[_Frame](4)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._run_writer, frames_receive)
            await self._send_kv_events(frames_send)  # the snapshot: the router's view anew
            while True:
                if self._capacity_dirty:
                    report = self._capacity_report()
                    if report is not None:
                        self._in_flight += 1
                        await frames_send.send(report)
                decision = policy.decide(trio.current_time(), in_flight=self._in_flight > 0)
                if isinstance(decision, FlushNow):
                    await self._send_tokens(frames_send, policy)
                    continue
                deadline = decision.deadline if isinstance(decision, WaitUntil) else math.inf
                # a frame in flight is proof of life; its write's poke re-arms the heartbeat
                beat_at = (
                    self._last_write + self._heartbeat_s
                    if self._heartbeats and not self._in_flight
                    else math.inf
                )
                item: Outgoing = None
                # only the wait is bounded: a hand-over cut by the deadline would lose a frame
                with trio.move_on_at(min(deadline, beat_at)):
                    item = await receive.receive()
                if item is None:
                    if not self._in_flight and trio.current_time() >= beat_at:
                        # a report proves liveness as well as a heartbeat
                        if not await self._send_kv_events(frames_send):
                            self._in_flight += 1
                            await frames_send.send(_HEARTBEAT)
                    continue
                if isinstance(item, list):
                    policy.add(item, trio.current_time())
                    continue
                if type(item) is StepLogprobs:
                    held = self._logprobs
                    for entry in item.entries:
                        held.setdefault(entry.request_id, []).extend(entry.items)
                    continue
                # control messages keep their order relative to tokens
                while policy.has_pending:
                    await self._send_tokens(frames_send, policy)
                # a prefill's stored blocks go ahead of its reply: the router that has the
                # reply knows them
                await self._send_kv_events(frames_send)
                # what an accept allocated is in the report ahead of it
                report = self._capacity_report() if self._reports_capacity else None
                if report is not None:
                    self._in_flight += 1
                    await frames_send.send(report)
                self._in_flight += 1
                await frames_send.send(item)

    async def _send_tokens(
        self, frames_send: trio.MemorySendChannel[_Frame], policy: FlushPolicy
    ) -> None:
        """The next token frame, after the logprobs of its tokens (and of any later)."""
        await self._send_kv_events(frames_send)
        if self._logprobs:
            held, self._logprobs = self._logprobs, {}
            for request_id, items in held.items():
                self._in_flight += 1
                await frames_send.send(TokenLogprobs(request_id, items))
        self._in_flight += 1
        await frames_send.send(TokenFrame(policy.take()))

    async def _run_writer(self, frames: trio.MemoryReceiveChannel[_Frame]) -> None:
        poke = self.outbox_send.clone()
        faults = self._faults
        async for frame in frames:
            batch = [frame]
            if self._batches:
                # the frames that queued during the last write go out with this one: one
                # send (and one wake-up of the router) for all of them; the channel's
                # bound bounds a batch
                while True:
                    try:
                        batch.append(frames.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
            if faults is not None:
                for queued in batch:
                    await faults.before_frame(queued)  # a stall (testing only)
            data = wire.encode(batch if self._batches else frame)
            await self._send({"type": "websocket.send", "bytes": data})
            self._last_write = trio.current_time()
            for sent in batch:
                if isinstance(sent, PrefillReply):  # (a reply with a logprob too)
                    # written: the router holds its handle now (it releases it, or decode)
                    self._reply_written(sent.request_id)
            self._in_flight -= len(batch)
            try:
                # wake the collector; a full outbox wakes it anyway, so never wait here
                poke.send_nowait(None)
            except trio.WouldBlock:
                pass
