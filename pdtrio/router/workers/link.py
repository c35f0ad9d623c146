"""Router side of the router <-> worker link: one websocket per worker instance.

Everything per request rides it, whatever the worker's role: the prefill call
and its answer, the release, the decode start, its answer and tokens, the
abort.  No HTTP exchange per request: one connection, request ids, one reader
task, one writer task draining a bounded outbox (``link_outbox``).

The link's parts: the connection, its liveness and its reader (here); what it
sends (``link_outbox.LinkOutbox``); the decode streams running on it, which the
reader feeds (``link_streams.LinkStreams``); and the releases it owes
(``link_releases.OwedReleases``).

The router asks each worker for batches (``?batch=1``): what queued on the
worker during a write comes as one message (``wire.is_batch``); a single
message is read too.  The reader decodes each frame and hands each message to
its part; no message waits for a stream's consumer.

Cancellation: a prefill call whose request is cancelled sends a release,
which stops the prefill on the worker (or frees the blocks it leased); a
reply that comes for a call nobody waits for any more is released at once.
No release is lost with the link (``link_releases`` says how).  Whoever ends a
decode here calls :meth:`WorkerLink.abort`, which never blocks.

The link keeps decode's last ``DecodeCapacity`` report, less the blocks promised
to starts decode has not answered yet, as :attr:`WorkerLink.available_blocks`.
Every change calls ``on_capacity``.

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

import logging
import ssl
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import final

import attrs
import httpx
import trio

from pdtrio.protocol.link.wire import (
    DECODE_ERRORS,
    DecodeCapacity,
    DecodeRejected,
    DecodeStart,
    Heartbeat,
    KvEvents,
    PrefillFailed,
    PrefillReply,
    PrefillReplyWithChoices,
    PrefillReplyWithLogprob,
    PrefillRequest,
    RejectReason,
    ReleaseRequest,
    TokenFrame,
    TokenLogprobs,
    encode,
    encode_in_pieces,
    from_worker_batch_decoder,
    from_worker_decoder,
    is_batch,
    prompt_is_long,
)
from pdtrio.protocol.placement.prefix_index import CachedBlocks
from pdtrio.router.backend import BackendLost, BackendUnreachable
from pdtrio.router.stream_outcome import DecodeLoss
from pdtrio.router.workers.kv_leases import LeaseClock
from pdtrio.router.workers.link_outbox import LinkOutbox
from pdtrio.router.workers.link_releases import OwedReleases
from pdtrio.router.workers.link_streams import LinkStreams
from pdtrio.router.workers.stream import DecodeStream
from pdtrio.router.workers.ws_client import (
    ConnectionClosed,
    HandshakeError,
    WebSocketClient,
    connect_websocket,
)
from pdtrio.security import PeerAuthenticationError

log = logging.getLogger("pdtrio.router.worker_link")

_MAX_MESSAGE_SIZE = 64 * 1024 * 1024
# one read of the link takes up to this much; every frame in it is dispatched
# before the reader yields, so a stream's consumer wakes once per read, not per frame
_RECEIVE_SIZE = 64 * 1024


# a long prompt goes to the writer in pieces of this size, each encoded just before it is sent
_PROMPT_PIECE_BYTES = 256 * 1024


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
        self.url = url
        self.max_pending_tokens = max_pending_tokens
        self._ws: WebSocketClient | None = None
        self._outbox = LinkOutbox(on_quieter)
        self._streams = LinkStreams(
            instance_id,
            max_pending_tokens,
            post_nowait=self._outbox.post_nowait,
            on_capacity=on_capacity,
            on_quieter=on_quieter,
        )
        self._prefills: dict[str, _PendingPrefill] = {}
        self._releases = OwedReleases()
        self.ever_connected = False
        self._frames_received = 0

    def statistics(self) -> WorkerLinkStatistics:
        return WorkerLinkStatistics(
            connects=self._connects,
            hangs=self._hangs,
            frames_received=self._frames_received,
            entries_received=self._streams.entries_received,
            clients_cut_off=self._streams.clients_cut_off,
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
        return len(self._streams.running)

    @property
    def busy(self) -> bool:
        """Whether requests run on it, or messages wait to go: closing it would cut them."""
        return bool(self._streams.running or self._prefills or self._outbox.busy)

    @property
    def available_blocks(self) -> int:
        """Free blocks decode reported, less those promised since; 0 when it cannot take any."""
        if self.capacity is None or self._ws is None:
            return 0
        return self.capacity.free_blocks - self._streams.promised_blocks

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
        try:
            ws = await self._handshake()
            self._start_using(ws)
            task_status.started()
            self._hung = False
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._outbox.write, ws)
                nursery.start_soon(self._watch, nursery.cancel_scope)
                if self.stream_idle_timeout_s > 0:
                    nursery.start_soon(self._streams.end_idle, self.stream_idle_timeout_s)
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
            self._outbox.disconnected()
            self._releases.link_lost()
            self._fail_all(lost, DecodeLoss.LINK_TIMEOUT if self._hung else DecodeLoss.LINK_LOST)
            self._on_capacity()  # waiters look elsewhere (or time out)
            self._on_quieter()
            if ws is not None:
                await ws.aclose()

    async def _handshake(self) -> WebSocketClient:
        """A new connection to the worker, under the connect timeout."""
        # a stopped worker's kernel still accepts TCP: only the handshake tells; once
        # the link has worked, a reconnect gets no longer than silence would
        connect_timeout_s = self.link_timeout_s if self.ever_connected else self._connect_timeout_s
        ws: WebSocketClient | None = None
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
        return ws

    def _start_using(self, ws: WebSocketClient) -> None:
        """Everything goes over ``ws`` from now; the releases owed go first."""
        self._ws = ws
        self.ever_connected = True
        self._connects += 1
        # what was queued for the old connection is dropped: the worker ended those
        # requests itself, but not the KV its replies leased: those releases go first
        self._outbox.connected(ws)
        due = self._releases.take_due()
        if due:
            for request_id, token in due.items():
                self._post_release(request_id, token)
            log.info("worker %s: %d releases sent on reconnecting", self.instance_id, len(due))
        self._last_read = trio.current_time()
        self._on_capacity()  # connected: waiters for a link (a prefill's among them) look again

    def _fail_all(self, message: str, loss: DecodeLoss) -> None:
        """The link is down: every stream and prefill call on it fails with ``message``."""
        self._streams.link_lost(message, loss)
        prefills = list(self._prefills.items())
        self._prefills.clear()
        for request_id, pending in prefills:
            # its reply may be lost with the link, its KV leased: released once it is back
            self.release(request_id)
            pending.settle(None, lost=message)

    # --- reading --------------------------------------------------------------------

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
        dispatch_entries = streams.dispatch_entries
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
                    elif type(message) is DecodeCapacity:
                        self.capacity = message
                        self._on_capacity()
                    elif (
                        type(message) is PrefillReply
                        or type(message) is PrefillFailed
                        or type(message) is PrefillReplyWithLogprob
                        or type(message) is PrefillReplyWithChoices
                    ):
                        self._prefill_answered(message, clock())
                    elif type(message) is Heartbeat:
                        pass  # its arrival was all it had to say
                    elif type(message) is KvEvents:
                        self.cached_blocks.apply(message)
                    elif type(message) is TokenLogprobs:
                        streams.logprobs_ahead(message)
                    else:  # decode's answer to a start, or its failure of a request
                        streams.answered(message)

    def _prefill_answered(self, message: PrefillReply | PrefillFailed, now: float) -> None:
        handle = message.kv_handle if isinstance(message, PrefillReply) else None
        pending = self._prefills.pop(message.request_id, None)
        if pending is not None:
            if handle is not None:
                self._leases.received(handle, now)  # its lease's TTL counts from here
            pending.settle(message)
        elif handle is not None:
            # its caller gave up (and sent a release, which may have crossed this reply):
            # release again, harmless if it was
            self.release(message.request_id, handle.access_token)

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
            if not await self._outbox.post(data):
                raise WorkerLinkClosed(f"worker {self.instance_id} is not connected")
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
        token = access_token or self._leases.release_token(request_id)
        if self._ws is None:
            self._releases.later(request_id, token)
            return
        self._post_release(request_id, token)

    def _post_release(self, request_id: str, token: str) -> None:
        """Queue the release, and keep it (for two link timeouts) in case the link is lost."""
        self._releases.sent(request_id, token, self._now(), 2 * self.link_timeout_s)
        self._outbox.post_nowait(encode(ReleaseRequest(request_id, token)))

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
        if start.request_id in self._streams.running:
            raise WorkerLinkError(f"request {start.request_id} is already running on this link")
        stream = self._streams.open(start, blocks, keep_token_ids=keep_token_ids)
        try:
            # decode counts the lease from its receipt: it gets what is left of it now
            if not await self._outbox.post(encode(self._leases.to_send(start, self._now()))):
                raise WorkerLinkClosed(f"worker {self.instance_id} is not connected")
        except BaseException:
            # not queued (the link is down, or cancelled while waiting for room)
            self._streams.unsent(start.request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """End the request on decode if it is still running there; never blocks, idempotent."""
        self._streams.abort(request_id)


def rejection_is_retryable(rejection: DecodeRejected) -> bool:
    """Whether another decode instance may take a request this one rejected."""
    # a failed pull: prefill still holds the KV under its lease, another decode may pull it
    return rejection.reason in (
        RejectReason.NO_ROOM,
        RejectReason.SHUTTING_DOWN,
        RejectReason.TRANSFER_FAILED,
        RejectReason.ALREADY_RUNNING,
    )
