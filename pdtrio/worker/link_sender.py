"""The sending half of a router's link (``/pd/link``): one sender writes every frame.

Writes never interleave: control messages (decode accepts, rejections and
failures, prefill replies and failures) and engine outputs reach the sender
through one bounded outbox, and a single writer task sends the frames.  Tokens
leave in coalesced token frames under the ``FlushPolicy``
(pdtrio.protocol.tokens.flush); control messages keep their order relative to them.

A decoding worker's link also reports the engine's free KV blocks
(``DecodeCapacity``) when it opens and whenever the count may have changed (an
accept, a finish, an abort, and an abort's blocks freed later by the engine:
``BlocksFreed``): a dirty flag and a poke of the outbox, so reports
coalesce to the latest value and nothing polls.  The report a control message
may change goes out just before it, so the router never sees an accept its
report lacks.

Notices: what the router reads only for its books and never waits on (a
decode's accepts, and its capacity reports after the first) are held up to the
flush window, to go out in the write of the next frame that goes anyway (its
tokens, a reply, a rejection, a heartbeat), ahead of it: a write, and a wake-up
of the router, of their own cost it more than everything else a short request
does on its decode link.  A report goes out at once while the worker drains
(no new work may be placed on it); the first one on a link, too.

A router that asks for it (``?batch=1``) gets the frames that queued during
a write in one message, a batch (``wire.is_batch``): one send through the
websocket, and one wake-up of the router, for all of them.  A frame and the
notices ahead of it always share a write.

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
from pdtrio.protocol.link import wire
from pdtrio.protocol.link.wire import (
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
from pdtrio.protocol.tokens.flush import FlushConfig, FlushNow, FlushPolicy, WaitUntil
from pdtrio.worker.fault_hooks import FaultHooks

# the heartbeat interval of a router that names none
DEFAULT_HEARTBEAT_S: Final = 0.5
_HEARTBEAT: Final = Heartbeat()

Control = DecodeAccepted | DecodeRejected | DecodeFailed | PrefillReply | PrefillFailed
# What reaches the sender: a step's entries (after their logprobs, for requests that asked),
# a control message, or None: a write finished.
Outgoing = StepOutputs | StepLogprobs | Control | None
_Frame = TokenFrame | TokenLogprobs | Control | DecodeCapacity | Heartbeat | KvEvents
# the frames one write carries (in order; the writer may batch several groups)
_Group = list[_Frame]


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
        # notices held for the next write (accepts; a dirty capacity is one too), and
        # when they go on their own at the latest (inf: none held)
        self._accepts_held: list[DecodeAccepted] = []
        self._notices_due = math.inf

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

    def _kv_events_frame(self) -> KvEvents | None:
        """The prefix cache's changes since the last report, if the router reads them and
        there are any (the first time: the whole set)."""
        if not self._kv_events:
            return None
        self._kv_cursor, events = self._engine.kv_events(self._kv_cursor)
        return events

    def _hold_notices(self, now: float) -> None:
        if self._notices_due == math.inf:
            self._notices_due = now + self._flush.window_s

    async def _send_group(
        self, frames_send: trio.MemorySendChannel[_Group], frames: list[_Frame]
    ) -> None:
        """``frames`` in one write, after the notices held (the capacity report ahead of
        the accepts: what an accept allocated is in the report ahead of it)."""
        group: list[_Frame] = []
        if self._capacity_dirty:
            report = self._capacity_report()
            if report is not None:
                group.append(report)
        if self._accepts_held:
            group += self._accepts_held
            self._accepts_held = []
        self._notices_due = math.inf
        group += frames
        if group:
            self._in_flight += len(group)
            await frames_send.send(group)

    async def run(self) -> None:
        """Collect engine outputs under the flush policy; a writer task sends frames.

        The writer counts its finished writes in ``_in_flight`` and pokes the
        outbox (never blocking on it), so the policy knows when a frame is in
        flight: tokens that arrive meanwhile merge into the next frame instead
        of queueing as frames.
        """
        policy = FlushPolicy(self._flush)
        receive = self._outbox_receive
        frames_send, frames_receive = trio.open_memory_channel[_Group](4)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._run_writer, frames_receive)
            # the snapshot (the router's view anew), and the first capacity report
            snapshot = self._kv_events_frame()
            await self._send_group(frames_send, [snapshot] if snapshot is not None else [])
            while True:
                if self._capacity_dirty:
                    if self._is_draining():
                        await self._send_group(frames_send, [])  # placed nowhere from now
                    else:
                        self._hold_notices(trio.current_time())
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
                with trio.move_on_at(min(deadline, beat_at, self._notices_due)):
                    item = await receive.receive()
                if item is None:
                    now = trio.current_time()
                    if now >= self._notices_due:
                        # nothing else went within the window: the notices on their own
                        await self._send_group(frames_send, [])
                    elif not self._in_flight and now >= beat_at:
                        # a report proves liveness as well as a heartbeat
                        events = self._kv_events_frame()
                        await self._send_group(frames_send, [events or _HEARTBEAT])
                    continue
                if isinstance(item, list):
                    policy.add(item, trio.current_time())
                    continue
                if type(item) is StepLogprobs:
                    held = self._logprobs
                    for entry in item.entries:
                        held.setdefault(entry.request_id, []).extend(entry.items)
                    continue
                if type(item) is DecodeAccepted:
                    self._accepts_held.append(item)
                    self._hold_notices(trio.current_time())
                    continue
                # control messages keep their order relative to tokens
                while policy.has_pending:
                    await self._send_tokens(frames_send, policy)
                # a prefill's stored blocks go ahead of its reply: the router that has the
                # reply knows them
                events = self._kv_events_frame()
                await self._send_group(frames_send, [item] if events is None else [events, item])

    async def _send_tokens(
        self, frames_send: trio.MemorySendChannel[_Group], policy: FlushPolicy
    ) -> None:
        """The next token frame, after the logprobs of its tokens (and of any later)."""
        frames: list[_Frame] = []
        events = self._kv_events_frame()
        if events is not None:
            frames.append(events)
        if self._logprobs:
            held, self._logprobs = self._logprobs, {}
            frames += [TokenLogprobs(request_id, items) for request_id, items in held.items()]
        frames.append(TokenFrame(policy.take()))
        await self._send_group(frames_send, frames)

    async def _run_writer(self, groups: trio.MemoryReceiveChannel[_Group]) -> None:
        poke = self.outbox_send.clone()
        faults = self._faults
        async for group in groups:
            batch = group
            if self._batches:
                # the groups that queued during the last write go out with this one: one
                # send (and one wake-up of the router) for all of them; the channel's
                # bound bounds a batch
                while True:
                    try:
                        batch += groups.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
            if faults is not None:
                for queued in batch:
                    await faults.before_frame(queued)  # a stall (testing only)
            if self._batches:
                await self._send({"type": "websocket.send", "bytes": wire.encode(batch)})
            else:
                for frame in batch:
                    await self._send({"type": "websocket.send", "bytes": wire.encode(frame)})
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
