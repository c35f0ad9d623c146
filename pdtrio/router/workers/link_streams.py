"""The decode streams running on one worker link, by request id: decode's answers and
token entries into them, and their ends.

The link's reader hands each token entry to its stream's bounded buffer without ever
awaiting the stream's consumer, so a slow client cannot stall the others; the stream's
own task drains its buffer.  The link owns aborts: whoever ends a decode here (its
pipeline's cleanup, the reader cutting off a client that fell too far behind, the idle
sweep) ends it through :meth:`LinkStreams.end`, which never blocks.  A stream the link
ended is marked failed, so its consumer ends with an error as soon as it looks.

The blocks promised to starts decode has not answered yet are kept here (decode
reports an accept's blocks before the accept), so the link's free blocks never count
the same blocks twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import final

import trio

from pdtrio.protocol.link.wire import (
    DecodeAbort,
    DecodeAccepted,
    DecodeFailed,
    DecodeRejected,
    DecodeStart,
    DecodeStartChoices,
    TokenEntry,
    TokenLogprobs,
    choice_request_id,
    encode,
)
from pdtrio.protocol.tokens.stream_buffer import PushResult
from pdtrio.router.stream_outcome import CUT_OFF_MESSAGE, DecodeLoss
from pdtrio.router.workers.stream import DecodeStream

log = logging.getLogger("pdtrio.router.worker_link")

_OVERFLOW = PushResult.OVERFLOW


@final
class LinkStreams:
    """The decode streams running on a worker link, and the blocks promised to starts
    decode has not answered.

    ``post_nowait`` queues an abort on the link; ``on_capacity`` is told when a
    promise ends, ``on_quieter`` when a stream leaves the link.
    """

    def __init__(
        self,
        instance_id: str,
        max_pending_tokens: int,
        *,
        post_nowait: Callable[[bytes], None],
        on_capacity: Callable[[], None],
        on_quieter: Callable[[], None],
    ) -> None:
        self.instance_id = instance_id
        self.max_pending_tokens = max_pending_tokens
        self.running: dict[str, DecodeStream] = {}
        # blocks of starts sent and not yet answered: decode's report may not count them yet
        self._promised: dict[str, int] = {}
        self._post_nowait = post_nowait
        self._on_capacity = on_capacity
        self._on_quieter = on_quieter
        self.entries_received = 0  # token entries, over every frame
        self.clients_cut_off = 0  # streams ended for a client too far behind

    @property
    def promised_blocks(self) -> int:
        return sum(self._promised.values())

    def open(self, start: DecodeStart, blocks: int, *, keep_token_ids: bool) -> DecodeStream:
        """``start``'s stream (with its choices'), running from now, its ``blocks``
        promised until decode answers."""
        stream = DecodeStream(start.request_id, self.max_pending_tokens)
        if keep_token_ids:
            stream.token_ids = []
        if start.sampling.wants_logprobs:
            stream.logprobs = []
        if isinstance(start, DecodeStartChoices):
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
        self.running[start.request_id] = stream
        self._promised[start.request_id] = blocks
        return stream

    def unsent(self, request_id: str) -> None:
        """Its start was not queued: nothing of it runs, nothing is promised."""
        self.running.pop(request_id, None)
        self.settle(request_id)

    def settle(self, request_id: str) -> None:
        """Decode answered (or will never answer) a start: its promise is over."""
        if self._promised.pop(request_id, None) is not None:
            self._on_capacity()

    def answered(self, message: DecodeAccepted | DecodeRejected | DecodeFailed) -> None:
        """Decode's answer to a start, or its failure of a request it ran."""
        self.settle(message.request_id)
        streams = self.running
        stream = streams.get(message.request_id)
        if stream is None:
            return  # already ended here
        if isinstance(message, DecodeAccepted):
            stream.accept()  # (a rejection or failure wakes the waiter at once)
            if stream.choices is not None:
                self._accept_choices(stream)
            return
        if isinstance(message, DecodeRejected):
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
            self.running[choice_stream.request_id] = choice_stream
        if 0 not in stream.choices:
            del self.running[stream.request_id]

    def logprobs_ahead(self, message: TokenLogprobs) -> None:
        """The logprobs of tokens about to come, kept for them when the request asked."""
        stream = self.running.get(message.request_id)
        if stream is not None and stream.logprobs is not None:
            stream.logprobs += message.items  # (its tokens follow)

    def dispatch_entries(self, entries: list[TokenEntry]) -> None:
        """Hand each entry to its stream; never waits (the hot path)."""
        streams = self.running
        get = streams.get
        self.entries_received += len(entries)
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
                self.clients_cut_off += 1
                self.end(stream, CUT_OFF_MESSAGE, DecodeLoss.CUT_OFF, abort=True)
            elif finish_reason is not None:
                del streams[entry.request_id]  # finished on decode: nothing to abort
                self._on_quieter()
            if not stream.updated and (finish_reason is not None or not stream.holding):
                stream.notify()

    def end(self, stream: DecodeStream, failure: str, loss: DecodeLoss, *, abort: bool) -> None:
        """End ``stream`` with ``failure`` (``abort``: on decode too, if it runs there)."""
        self.settle(stream.request_id)
        if self.running.get(stream.request_id) is stream:
            del self.running[stream.request_id]
            if abort:
                self._post_nowait(encode(DecodeAbort(stream.request_id)))
            self._on_quieter()
        stream.fail(failure, loss)

    def abort(self, request_id: str) -> None:
        """End the request on decode if it is still running there; never blocks, idempotent."""
        stream = self.running.get(request_id)
        if stream is not None:
            self.end(stream, "the request was aborted", DecodeLoss.ABORTED, abort=True)

    def link_lost(self, message: str, loss: DecodeLoss) -> None:
        """The link is down: every stream fails with ``message``, nothing is promised."""
        self._promised.clear()
        streams = list(self.running.values())
        self.running.clear()
        for stream in streams:
            stream.fail(message, loss)

    async def end_idle(self, idle_s: float) -> None:
        """End streams that got no answer or token for ``idle_s``.

        A live link (heartbeats) can still carry a request decode forgot: an
        engine fault.  A sweep a few times per timeout, reading each stream's
        count of tokens pushed: nothing on the hot path.
        """
        # request id -> (tokens pushed when last seen to change, when)
        seen: dict[str, tuple[int, float]] = {}
        while True:
            await trio.sleep(idle_s / 4)
            now = trio.current_time()
            for request_id, stream in list(self.running.items()):
                pushed = stream.buffer.statistics().tokens_pushed
                mark = seen.get(request_id)
                if mark is None or mark[0] != pushed:
                    seen[request_id] = (pushed, now)
                elif now - mark[1] >= idle_s:
                    log.warning(
                        "request %s got nothing from %s for %gs: ending it",
                        request_id,
                        self.instance_id,
                        idle_s,
                    )
                    self.end(
                        stream,
                        f"decode sent nothing for it for {idle_s:g}s",
                        DecodeLoss.STALLED,
                        abort=True,
                    )
            for request_id in [r for r in seen if r not in self.running]:
                del seen[request_id]
