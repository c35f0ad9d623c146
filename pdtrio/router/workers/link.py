"""Router side of the router <-> worker link: one websocket per worker instance.

Everything per request rides it, whatever the worker's role: the prefill call
and its answer, the release, the decode start, its answer and tokens, the
abort.  No HTTP exchange per request: one connection, request ids, one reader
task, one writer task draining a bounded outbox.

The router asks each worker for batches (``?batch=1``): what queued on the
worker during a write comes as one message (``wire.is_batch``); a single
message is read too.  The reader decodes each frame and hands each token
entry to its stream's bounded buffer without ever awaiting the stream's
consumer, so a slow client cannot stall the others; the stream's own task
drains its buffer.  A message posted to an idle link (nothing queued, no
write under way) is written at once from the poster's task, a frame whole in
one ``os.write`` that never waits (``WebSocketClient.send_now``): waking the
writer for it was a task step more per message.  Otherwise the writer sends
whatever is queued in one write, so a burst shares a syscall; what the kernel
left of a message written at once goes first.  Either way no await falls
inside a frame, so a request cancelled mid-way can never tear one.

Cancellation: a prefill call whose request is cancelled sends a release,
which stops the prefill on the worker (or frees the blocks it leased); a
reply that comes for a call nobody waits for any more is released at once.
A release shows the request's release token (:func:`release_token`, sent
with the call), so the worker honours it over any link, whether its reply
was sent or not.  Releases made while the link is down, those sent in the
last two link timeouts before it was lost (they may be lost with it), and
one for each prefill call the link's loss cut off (its reply may be lost
with it, the KV leased) are sent when it comes back: nothing stays pinned
until its lease ends.  The
link owns aborts: whoever ends a decode here (its pipeline's cleanup, or the
reader cutting off a client that fell too far behind) calls
:meth:`WorkerLink.abort`, which never blocks.  A stream the link ended is
marked failed, so its consumer ends with an error as soon as it looks.

The link keeps decode's last ``DecodeCapacity`` report and the blocks it has
promised to starts decode has not answered yet (decode reports an accept's
blocks before the accept), so :attr:`WorkerLink.available_blocks` never counts
the same free blocks twice.  Every change calls ``on_capacity``.

The link asks for the worker's prefix cache changes (``?kv_events=1``) and keeps
them in :attr:`WorkerLink.cached_blocks`: emptied when the link drops, rebuilt from
the snapshot the worker sends first on every connection (a worker with its cache off
sends none; the link then reports nothing cached).

Liveness: the worker sends a ``Heartbeat`` after each ``heartbeat_s`` of
silence (the router asks for that interval in the link's URL); any frame
counts.  The reader stamps the time of each read, and a watchdog sleeping
until that stamp plus ``link_timeout_s`` drops a link that brought nothing for
that long (a stopped or wedged worker: its TCP stays up), as if it broke.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import final

import attrs
import httpx
import trio

from pdtrio.protocol.link.wire import (
    DECODE_ERRORS,
    DecodeAbort,
    DecodeAccepted,
    DecodeCapacity,
    DecodeRejected,
    DecodeStart,
    DecodeStartChoices,
    Heartbeat,
    KvEvents,
    PrefillFailed,
    PrefillReply,
    PrefillReplyWithChoices,
    PrefillReplyWithLogprob,
    PrefillRequest,
    RejectReason,
    ReleaseRequest,
    TokenEntry,
    TokenFrame,
    TokenLogprobs,
    choice_request_id,
    encode,
    encode_in_pieces,
    from_worker_batch_decoder,
    from_worker_decoder,
    is_batch,
    prompt_is_long,
)
from pdtrio.protocol.placement.prefix_index import CachedBlocks
from pdtrio.protocol.tokens.stream_buffer import PushResult
from pdtrio.router.backend import BackendLost, BackendUnreachable
from pdtrio.router.stream_outcome import CUT_OFF_MESSAGE, DecodeLoss
from pdtrio.router.workers.kv_leases import LeaseClock
from pdtrio.router.workers.stream import DecodeStream
from pdtrio.router.workers.ws_client import (
    ConnectionClosed,
    HandshakeError,
    WebSocketClient,
    connect_websocket,
)
from pdtrio.security import PeerAuthenticationError

log = logging.getLogger("pdtrio.router.worker_link")

_OVERFLOW = PushResult.OVERFLOW
_MAX_MESSAGE_SIZE = 64 * 1024 * 1024
# one read of the link takes up to this much; every frame in it is dispatched
# before the reader yields, so a stream's consumer wakes once per read, not per frame
_RECEIVE_SIZE = 64 * 1024


# a long prompt goes to the writer in pieces of this size, each encoded just before it is sent
_PROMPT_PIECE_BYTES = 256 * 1024

# messages waiting for the writer; a caller that finds it full waits for room
_OUTBOX_LIMIT = 4096
# releases kept for when a link that is down comes back (past this, the oldest are dropped:
# their leases expire)
_RELEASES_DUE_LIMIT = 65536

# the key of this router process's release tokens: no other peer can make one
_RELEASE_KEY = secrets.token_bytes(32)


def release_token(request_id: str) -> str:
    """This router's proof that it asked for the request's prefill (sent with the call):
    a release showing it frees the KV on any link.  Derived, not stored (no state per
    request, no system call)."""
    return hashlib.blake2b(request_id.encode(), key=_RELEASE_KEY, digest_size=16).hexdigest()


class WorkerLinkError(Exception):
    """Base of the worker link's errors."""


class WorkerLinkClosed(WorkerLinkError, BackendUnreachable):
    """The link to the worker is down: the message was not sent."""


class WorkerLinkLost(WorkerLinkError, BackendLost):
    """The link went down while a call was pending: the worker may have seen it."""


class WorkerLinkHung(WorkerLinkError):
    """The worker sent nothing, not even a heartbeat, for the link timeout."""


# what a broken, refused or silent websocket raises out of WorkerLink.run
class PeerRefused(HandshakeError):
    """The instance did not prove it holds the worker secret: no link, nothing sent."""


LINK_ERRORS = (OSError, trio.BrokenResourceError, HandshakeError, ConnectionClosed, WorkerLinkHung)


@final
class _PendingPrefill:
    """A prefill call waiting for its answer (or for the link to go down)."""

    __slots__ = ("answer", "lost", "_done")

    def __init__(self) -> None:
        self.answer: PrefillReply | PrefillFailed | None = None
        self.lost: str | None = None
        self._done = trio.Event()

    def settle(self, answer: PrefillReply | PrefillFailed | None, lost: str | None = None) -> None:
        self.answer = answer
        self.lost = lost
        self._done.set()

    async def wait(self) -> None:
        await self._done.wait()


@final
@attrs.frozen
class WorkerLinkStatistics:
    connects: int  # connections made (the ones after the first: reconnects)
    hangs: int  # connections dropped for silence
    frames_received: int
    entries_received: int  # token entries, over every frame
    clients_cut_off: int  # streams ended for a client too far behind


@final
class WorkerLink:
    def __init__(
        self,
        instance_id: str,
        url: str,
        *,
        max_pending_tokens: int,
        on_capacity: Callable[[], None] = lambda: None,
        on_quieter: Callable[[], None] = lambda: None,
        link_timeout_s: float = 1.5,
        heartbeat_s: float = 0.5,
        connect_timeout_s: float = 10.0,
        stream_idle_timeout_s: float = 0.0,
        authorize: Callable[[], Awaitable[Sequence[tuple[bytes, bytes]]]] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        leases: LeaseClock | None = None,
    ) -> None:
        self.instance_id = instance_id
        # the router's clock of the KV leases prefill replies bring (its own when alone)
        self._leases = LeaseClock() if leases is None else leases
        # the handshake's headers: our answer to a fresh challenge of the worker's, each time
        self._authorize = authorize
        self._ssl_context = ssl_context  # for a wss:// worker
        # a stream that gets no answer or token for this long is ended (0: never)
        self.stream_idle_timeout_s = stream_idle_timeout_s
        self.link_timeout_s = link_timeout_s
        self.heartbeat_s = heartbeat_s
        self._connect_timeout_s = connect_timeout_s
        # batch=1: the worker may send several messages as one (see wire.is_batch);
        # kv_events=1: its prefix cache's changes (a worker with the cache off sends none)
        self._connect_url = f"{url}?heartbeat_s={heartbeat_s!r}&batch=1&kv_events=1"
        self._last_read = 0.0  # when the reader last got frames (trio clock)
        # the run's clock, read straight once run() knows it (trio.current_time() is two
        # calls more, paid by every start and release)
        self._now: Callable[[], float] = trio.current_time
        self._hung = False  # the watchdog dropped the current connection
        self._hangs = 0  # links dropped for silence
        self._connects = 0  # connections made (the ones after the first: reconnects)
        self._on_capacity = on_capacity
        # told when it does less: a request ends on it, its outbox empties, it drops
        self._on_quieter = on_quieter
        # decode's last report (None: none on this connection yet)
        self.capacity: DecodeCapacity | None = None
        # the block hashes its prefix cache holds, as this connection reported them
        self.cached_blocks = CachedBlocks()
        # blocks of starts sent and not yet answered: decode's report may not count them yet
        self._promised: dict[str, int] = {}
        self.url = url
        self.max_pending_tokens = max_pending_tokens
        self._ws: WebSocketClient | None = None
        self._streams: dict[str, DecodeStream] = {}
        self._prefills: dict[str, _PendingPrefill] = {}
        # request id -> token of the releases to send once the link is back up
        self._releases_due: dict[str, str] = {}
        # (when, request id, token) of the releases sent on this connection lately: a link
        # that is lost may have lost them (unsent, or unread by a worker that hung), so they
        # are sent again on the next (a release is idempotent)
        self._recent_releases: deque[tuple[float, str, str]] = deque()
        # encoded messages for the writer, in order; a list swapped out whole per write
        self._outbox: list[bytes | Iterator[bytes]] = []
        self._writer_waiting = trio.lowlevel.ParkingLot()
        self._room_waiting = trio.lowlevel.ParkingLot()
        self.ever_connected = False
        self._frames_received = 0
        self._entries_received = 0
        self._clients_cut_off = 0

    def statistics(self) -> WorkerLinkStatistics:
        return WorkerLinkStatistics(
            connects=self._connects,
            hangs=self._hangs,
            frames_received=self._frames_received,
            entries_received=self._entries_received,
            clients_cut_off=self._clients_cut_off,
        )

    @property
    def connects(self) -> int:
        """Which connection to the worker this is (1: the first): a request that failed on
        one may be tried again on a later one (the worker ended everything of the old)."""
        return self._connects

    @property
    def connected(self) -> bool:
        return self._ws is not None

    @property
    def active_requests(self) -> int:
        return len(self._streams)

    @property
    def busy(self) -> bool:
        """Whether requests run on it, or messages wait to go: closing it would cut them."""
        ws = self._ws
        return bool(
            self._streams or self._prefills or self._outbox or (ws is not None and ws.has_unsent)
        )

    @property
    def available_blocks(self) -> int:
        """Free blocks decode reported, less those promised since; 0 when it cannot take any."""
        if self.capacity is None or self._ws is None:
            return 0
        return self.capacity.free_blocks - sum(self._promised.values())

    def _settle(self, request_id: str) -> None:
        """Decode answered (or will never answer) a start: its promise is over."""
        if self._promised.pop(request_id, None) is not None:
            self._on_capacity()

    async def _authorization(self) -> Sequence[tuple[bytes, bytes]]:
        if self._authorize is None:
            return ()
        try:
            return await self._authorize()
        except PeerAuthenticationError as exc:
            raise PeerRefused(f"{self.url}: refused to link: {exc}") from exc
        except httpx.HTTPError as exc:
            raise HandshakeError(f"{self.url}: cannot ask for a challenge: {exc!r}") from exc

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect, then read and write frames until the link breaks (the caller reconnects)."""
        ws: WebSocketClient | None = None
        lost = "the connection to the worker was lost"
        self._now = trio.lowlevel.current_clock().current_time
        # a stopped worker's kernel still accepts TCP: only the handshake tells; once
        # the link has worked, a reconnect gets no longer than silence would
        connect_timeout_s = self.link_timeout_s if self.ever_connected else self._connect_timeout_s
        try:
            with trio.move_on_after(connect_timeout_s):
                headers = await self._authorization()
                ws = await connect_websocket(
                    self._connect_url,
                    max_message_size=_MAX_MESSAGE_SIZE,
                    receive_size=_RECEIVE_SIZE,
                    headers=headers,
                    ssl_context=self._ssl_context,
                )
            if ws is None:
                raise HandshakeError(f"{self.url}: no websocket within {connect_timeout_s:g}s")
            self._ws = ws
            self.ever_connected = True
            self._connects += 1
            # what was queued for the old connection: the worker ended those requests itself,
            # but not the KV its replies leased: those releases go first
            self._outbox.clear()
            if self._releases_due:
                due, self._releases_due = self._releases_due, {}
                for request_id, token in due.items():
                    self._post_release(request_id, token)
                log.info("worker %s: %d releases sent on reconnecting", self.instance_id, len(due))
            self._last_read = trio.current_time()
            task_status.started()
            self._hung = False
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write, ws)
                nursery.start_soon(self._watch, nursery.cancel_scope)
                if self.stream_idle_timeout_s > 0:
                    nursery.start_soon(self._end_idle_streams)
                await self._read(ws)
                nursery.cancel_scope.cancel()
            if self._hung:
                self._hangs += 1
                lost = f"the worker sent nothing for {self.link_timeout_s:g}s"
                raise WorkerLinkHung(f"{self.instance_id}: {lost}")
        finally:
            self._ws = None
            self.capacity = None
            self.cached_blocks.clear()  # the next connection's snapshot rebuilds it
            self._promised.clear()
            self._outbox.clear()
            self._room_waiting.unpark_all()
            for _, request_id, token in self._recent_releases:
                self._release_later(request_id, token)
            self._recent_releases.clear()
            self._fail_all(lost, DecodeLoss.LINK_TIMEOUT if self._hung else DecodeLoss.LINK_LOST)
            self._on_capacity()  # waiters look elsewhere (or time out)
            self._on_quieter()
            if ws is not None:
                await ws.aclose()

    # --- reading --------------------------------------------------------------------

    async def _end_idle_streams(self) -> None:
        """End streams that got no answer or token for ``stream_idle_timeout_s``.

        A live link (heartbeats) can still carry a request decode forgot: an
        engine fault.  A sweep a few times per timeout, reading each stream's
        count of tokens pushed: nothing on the hot path.
        """
        timeout = self.stream_idle_timeout_s
        # request id -> (tokens pushed when last seen to change, when)
        seen: dict[str, tuple[int, float]] = {}
        while True:
            await trio.sleep(timeout / 4)
            now = trio.current_time()
            for request_id, stream in list(self._streams.items()):
                pushed = stream.buffer.statistics().tokens_pushed
                mark = seen.get(request_id)
                if mark is None or mark[0] != pushed:
                    seen[request_id] = (pushed, now)
                elif now - mark[1] >= timeout:
                    log.warning(
                        "request %s got nothing from %s for %gs: ending it",
                        request_id,
                        self.instance_id,
                        timeout,
                    )
                    self._end(
                        stream,
                        f"decode sent nothing for it for {timeout:g}s",
                        DecodeLoss.STALLED,
                        abort=True,
                    )
            for request_id in [r for r in seen if r not in self._streams]:
                del seen[request_id]

    async def _watch(self, link_scope: trio.CancelScope) -> None:
        """Cancel ``link_scope`` once no frame came for the link timeout.

        Sleeps until the last read plus the timeout; wakes once per timeout
        while frames flow.  Waking late means this process stalled: the
        worker's frames may be sitting unread, so they get a heartbeat
        interval to be read before the worker is blamed.
        """
        timeout = self.link_timeout_s
        grace = self.heartbeat_s
        due = self._last_read + timeout
        while True:
            await trio.sleep_until(due)
            now = trio.current_time()
            last = self._last_read + timeout
            if last > now:
                due = last
            elif now - due > grace:
                due = now + grace
            else:
                log.warning(
                    "worker %s sent nothing for %.1fs: dropping its link",
                    self.instance_id,
                    now - self._last_read,
                )
                self._hung = True
                link_scope.cancel()
                return

    async def _read(self, ws: WebSocketClient) -> None:
        streams = self._streams
        decode = from_worker_decoder.decode_raw
        decode_batch = from_worker_batch_decoder.decode_raw
        dispatch_entries = self._dispatch_entries
        # the run's clock, read straight (trio.current_time() is two calls more)
        clock = trio.lowlevel.current_clock().current_time
        while True:
            try:
                frames = await ws.receive_messages()
            except ConnectionClosed:
                return
            self._last_read = clock()  # the watchdog's only input: once per read
            self._frames_received += len(frames)
            # every message of the read goes to its streams before anyone else runs
            for data in frames:
                if isinstance(data, str):
                    log.warning("worker %s sent a text frame", self.instance_id)
                    continue
                try:
                    messages = decode_batch(data) if is_batch(data) else (decode(data),)
                except DECODE_ERRORS as exc:
                    log.warning("bad frame from worker %s: %s", self.instance_id, exc)
                    continue
                for message in messages:
                    if type(message) is TokenFrame:
                        dispatch_entries(message.entries)
                        continue
                    if type(message) is DecodeCapacity:
                        self.capacity = message
                        self._on_capacity()
                        continue
                    if (
                        type(message) is PrefillReply
                        or type(message) is PrefillFailed
                        or type(message) is PrefillReplyWithLogprob
                        or type(message) is PrefillReplyWithChoices
                    ):
                        handle = message.kv_handle if isinstance(message, PrefillReply) else None
                        pending = self._prefills.pop(message.request_id, None)
                        if pending is not None:
                            if handle is not None:
                                # its lease's TTL counts from here, on our clock
                                self._leases.received(handle, clock())
                            pending.settle(message)
                        elif handle is not None:
                            # its caller gave up (and sent a release, which may have crossed
                            # this reply): release again, harmless if it was
                            self.release(message.request_id, handle.access_token)
                        continue
                    if type(message) is Heartbeat:
                        continue  # its arrival was all it had to say
                    if type(message) is KvEvents:
                        self.cached_blocks.apply(message)
                        continue
                    if type(message) is TokenLogprobs:
                        stream = streams.get(message.request_id)
                        if stream is not None and stream.logprobs is not None:
                            stream.logprobs += message.items  # (its tokens follow)
                        continue
                    self._settle(message.request_id)
                    stream = streams.get(message.request_id)
                    if stream is None:
                        continue  # already ended here
                    if type(message) is DecodeAccepted:
                        stream.accept()  # (a rejection or failure wakes the waiter at once)
                        if stream.choices is not None:
                            self._accept_choices(stream)
                        continue
                    if type(message) is DecodeRejected:
                        stream.reject(message)
                    else:  # DecodeFailed: decode holds nothing of it any more
                        stream.fail(message.message, DecodeLoss.DECODE_FAILED)
                    del streams[message.request_id]
                    self._on_quieter()

    def _accept_choices(self, stream: DecodeStream) -> None:
        """Decode runs the request's choices: their entries reach their streams from now.
        Without choice 0, the request's own id runs nothing more there."""
        assert stream.choices is not None
        for choice_stream in stream.choices.values():
            choice_stream.accept()
            self._streams[choice_stream.request_id] = choice_stream
        if 0 not in stream.choices:
            del self._streams[stream.request_id]

    def _dispatch_entries(self, entries: list[TokenEntry]) -> None:
        """Hand each entry to its stream; never waits (the hot path)."""
        streams = self._streams
        get = streams.get
        self._entries_received += len(entries)
        for entry in entries:
            stream = get(entry.request_id)
            if stream is None:
                continue  # aborted or already gone
            finish_reason = entry.finish_reason
            token_ids = stream.token_ids
            if token_ids is not None:
                token_ids += entry.token_ids
            result = stream.buffer.push(
                entry.text, len(entry.token_ids), finish_reason, entry.usage
            )
            if result is _OVERFLOW:
                self._clients_cut_off += 1
                self._end(stream, CUT_OFF_MESSAGE, DecodeLoss.CUT_OFF, abort=True)
            elif finish_reason is not None:
                del streams[entry.request_id]  # finished on decode: nothing to abort
                self._on_quieter()
            if not stream.updated and (finish_reason is not None or not stream.holding):
                stream.notify()

    def _end(self, stream: DecodeStream, failure: str, loss: DecodeLoss, *, abort: bool) -> None:
        self._settle(stream.request_id)
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            if abort:
                self._post_nowait(encode(DecodeAbort(stream.request_id)))
            self._on_quieter()
        stream.fail(failure, loss)

    def _fail_all(self, message: str, loss: DecodeLoss) -> None:
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            stream.fail(message, loss)
        prefills = list(self._prefills.items())
        self._prefills.clear()
        for request_id, pending in prefills:
            # its reply may be lost with the link, its KV leased: released once it is back
            self.release(request_id)
            pending.settle(None, lost=message)

    # --- writing --------------------------------------------------------------------

    def _post_nowait(self, data: bytes) -> None:
        """Queue a message past the outbox's limit (releases and aborts: never block)."""
        ws = self._ws
        if ws is None:
            return  # the worker ended the link's requests itself
        self._send_or_queue(ws, data)

    async def _post(self, data: bytes | Iterator[bytes]) -> None:
        """Queue a message for the writer, waiting while the outbox is full."""
        while len(self._outbox) >= _OUTBOX_LIMIT and self._ws is not None:
            await self._room_waiting.park()
        ws = self._ws
        if ws is None:
            raise WorkerLinkClosed(f"worker {self.instance_id} is not connected")
        self._send_or_queue(ws, data)

    def _send_or_queue(self, ws: WebSocketClient, data: bytes | Iterator[bytes]) -> None:
        """Write an idle link's message from the poster's task, else queue it for the
        writer: waking the writer would be a task step more per message, for a batch
        of one most of the time."""
        if not self._outbox and type(data) is bytes and ws.send_now(data):
            if not ws.has_unsent:
                return
            # the kernel took only its start: the writer sends the rest first
        else:
            self._outbox.append(data)
        if self._writer_waiting:
            self._writer_waiting.unpark()

    async def _write(self, ws: WebSocketClient) -> None:
        while True:
            if not self._outbox and not ws.has_unsent:
                await self._writer_waiting.park()
                continue
            batch = self._outbox
            self._outbox = []
            if self._room_waiting:
                self._room_waiting.unpark_all()
            try:
                await ws.send_messages(batch)
            except ConnectionClosed:
                return  # the reader sees the close; the worker ends a lost link's requests
            del batch  # a huge prefill call must not live on until the next write
            if not self._outbox:
                self._on_quieter()

    # --- the pipeline's side --------------------------------------------------------

    async def prefill(self, request: PrefillRequest) -> PrefillReply | PrefillFailed:
        """Call prefill on the worker and wait for its answer.

        Raises :class:`WorkerLinkClosed` when the call could not be sent (another
        worker may take it) and :class:`WorkerLinkLost` when the link went down
        while it was pending.  Cancelled, it releases the request on the worker,
        which stops the prefill or frees what it leased.
        """
        request_id = request.request_id
        if self._ws is None:
            raise WorkerLinkClosed(f"worker {self.instance_id} is not connected")
        if request_id in self._prefills:
            raise WorkerLinkError(f"request {request_id} is already prefilling on this link")
        # a long prompt is encoded a slice at a time by the writer, as it sends them
        data: bytes | Iterator[bytes] = (
            encode_in_pieces(request, _PROMPT_PIECE_BYTES)
            if prompt_is_long(request.prompt)
            else encode(request)
        )
        pending = _PendingPrefill()
        self._prefills[request_id] = pending
        try:
            await self._post(data)
            del data  # a huge prompt need not live on here
            await pending.wait()
        except BaseException:
            if self._prefills.pop(request_id, None) is pending or pending.answer is not None:
                # (answered just as it was cancelled: the answer is dropped, its KV freed)
                self.release(request_id)
            raise
        if pending.answer is None:
            raise WorkerLinkLost(f"worker {self.instance_id}: {pending.lost}")
        return pending.answer

    def release(self, request_id: str, access_token: str = "") -> None:
        """Free the request's KV on prefill (``access_token``: the grant in its handle; by
        default the request's release token), or stop its prefill; never blocks, idempotent.

        While the link is down the release waits for it to come back."""
        if access_token:
            self._leases.forget(access_token)
        token = access_token or release_token(request_id)
        if self._ws is None:
            self._release_later(request_id, token)
            return
        self._post_release(request_id, token)

    def _release_later(self, request_id: str, token: str) -> None:
        """Send the release once the link is back (bounded: past it, leases expire)."""
        due = self._releases_due
        due[request_id] = token
        if len(due) > _RELEASES_DUE_LIMIT:
            del due[next(iter(due))]

    def _post_release(self, request_id: str, token: str) -> None:
        """Queue the release, and keep it (for two link timeouts) in case the link is lost."""
        now = self._now()
        recent = self._recent_releases
        recent.append((now, request_id, token))
        kept_since = now - 2 * self.link_timeout_s
        while recent[0][0] < kept_since or len(recent) > _RELEASES_DUE_LIMIT:
            recent.popleft()
        self._post_nowait(encode(ReleaseRequest(request_id, token)))

    async def start(
        self, start: DecodeStart, blocks: int = 0, *, keep_token_ids: bool = False
    ) -> DecodeStream:
        """Queue the start; the stream then reports decode's answer and tokens.

        ``blocks`` (what decode will allocate) are promised before the first
        checkpoint, so a caller that picked this link by :attr:`available_blocks`
        holds them against every other caller.  Raises :class:`WorkerLinkClosed`
        when the start could not be queued.
        """
        if self._ws is None:
            raise WorkerLinkClosed(f"decode instance {self.instance_id} is not connected")
        if start.request_id in self._streams:
            raise WorkerLinkError(f"request {start.request_id} is already running on this link")
        stream = DecodeStream(start.request_id, self.max_pending_tokens)
        if keep_token_ids:
            stream.token_ids = []
        if start.sampling.wants_logprobs:
            stream.logprobs = []
        if type(start) is DecodeStartChoices:
            stream.choices = {}
            for choice, _ in start.choices:
                if choice == 0:
                    stream.choices[0] = stream
                    continue
                choice_stream = DecodeStream(
                    choice_request_id(start.request_id, choice), self.max_pending_tokens
                )
                if start.sampling.wants_logprobs:
                    choice_stream.logprobs = []
                stream.add_choice(choice, choice_stream)
        self._streams[start.request_id] = stream
        self._promised[start.request_id] = blocks
        try:
            # decode counts the lease from its receipt: it gets what is left of it now
            await self._post(encode(self._leases.to_send(start, self._now())))
        except BaseException:
            # not queued (the link is down, or cancelled while waiting for room)
            self._streams.pop(start.request_id, None)
            self._settle(start.request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """End the request on decode if it is still running there; never blocks, idempotent."""
        stream = self._streams.get(request_id)
        if stream is not None:
            self._end(stream, "the request was aborted", DecodeLoss.ABORTED, abort=True)


def rejection_is_retryable(rejection: DecodeRejected) -> bool:
    """Whether another decode instance may take a request this one rejected."""
    # a failed pull: prefill still holds the KV under its lease, another decode may pull it
    return rejection.reason in (
        RejectReason.NO_ROOM,
        RejectReason.SHUTTING_DOWN,
        RejectReason.TRANSFER_FAILED,
    )
