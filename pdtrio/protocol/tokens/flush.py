"""When the decode side sends a token frame: the coalescing flush policy.

The decode sender drains the engine's step outputs (each a list of
:class:`~pdtrio.protocol.link.wire.TokenEntry`, at most one per running request)
into a :class:`FlushPolicy`, and asks it what to do with
:meth:`FlushPolicy.decide`, telling it whether a frame is being written.

The rule
--------
* **Link free, batch never queued: send now.**  When no frame is being written
  (``in_flight=False``), entries that arrived while the link was free go out at
  once: a lone stream pays no wait, ever.
* **Frame in flight: accumulate.**  The sender never writes two frames at once,
  so while one is in flight the answer is :class:`WaitForWrite`.  Entries of
  the same request merge into one new entry (token ids and text concatenated,
  ``finish_reason`` and ``usage`` from the later step that has them; an entry
  nothing merged into goes out as it came), so under load frames grow with the
  time the previous one took to write.
* **Write done, batch queued: hold up to the window.**  A batch that had to
  queue behind a frame (``decide(..., in_flight=True)`` saw it) is sent when
  the link is free *and* one of: its oldest entry has waited ``window_s``; it
  is full (``max_entries`` entries or ``max_bytes_hint`` characters of text);
  or any request in it finishes.  Otherwise the answer is :class:`WaitUntil`
  at the oldest entry's time plus ``window_s``.

So the policy adds latency only when the link was already busy, and never more
than ``window_s``; a shell that writes inline and never reports
``in_flight=True`` gets pure send-when-free, which is never slower.  With
``coalesce=False`` every step is its own frame, sent as soon as the link is
free, without merging or holding (for comparisons).

:meth:`FlushPolicy.take` returns all pending entries, or a prefix that fits the
caps (a single entry larger than ``max_bytes_hint`` goes alone); what is left
keeps its own add times, so its window runs from its own oldest entry.  A
request is in at most one place at a time, so per-request order is kept across
frames.  ``now`` must not go backwards (pass ``trio.current_time()``).  When
the step channel closes, the shell sends what is left with ``take()`` until
:attr:`FlushPolicy.has_pending` is false, whatever ``decide`` says.
"""

from __future__ import annotations

from collections import deque
from typing import final

import attrs

from pdtrio.protocol.link.wire import TokenEntry, Usage


@final
@attrs.frozen
class FlushConfig:
    window_s: float = attrs.field(default=0.002, validator=attrs.validators.ge(0.0))
    """Longest a queued entry is held, once the link is free, to let others join (and a
    decode's notices, its accepts and capacity reports, for a frame to ride with)."""
    max_entries: int = attrs.field(default=1024, validator=attrs.validators.ge(1))
    """Most entries in one frame."""
    max_bytes_hint: int = attrs.field(default=256 * 1024, validator=attrs.validators.ge(1))
    """Most characters of text in one frame (a single larger entry goes alone)."""
    coalesce: bool = True
    """False: one frame per step, sent as soon as the link is free."""


@final
@attrs.frozen
class FlushNow:
    """Call ``take()`` and write the frame now."""


@final
@attrs.frozen
class WaitUntil:
    """Wait for new entries or ``deadline``, whichever is first, then decide again."""

    deadline: float


@final
@attrs.frozen
class WaitForWrite:
    """Entries are pending behind the in-flight frame: decide again when it is
    written (or when new entries arrive). No timer is needed."""


@final
@attrs.frozen
class Idle:
    """Nothing pending: wait for the next step."""


FlushDecision = FlushNow | WaitUntil | WaitForWrite | Idle

_FLUSH_NOW = FlushNow()
_WAIT_FOR_WRITE = WaitForWrite()
_IDLE = Idle()


@final
@attrs.frozen
class FlushStatistics:
    pending_entries: int
    pending_text_chars: int
    frames_taken: int
    entries_taken: int
    entries_merged: int
    """Entries that were folded into a pending entry of the same request."""


@attrs.define(eq=False)
class _Slot:
    """One pending entry; once a later one merges in, the parts of a new entry."""

    entry: TokenEntry
    added_at: float
    step: int
    text_len: int
    finish_reason: str | None
    # set once merged: our own token list and text pieces (the inputs are never mutated)
    token_ids: list[int] | None = None
    text_parts: list[str] | None = None
    usage: Usage | None = None

    def merge(self, later: TokenEntry) -> None:
        if self.token_ids is None or self.text_parts is None:
            first = self.entry
            self.token_ids = list(first.token_ids)
            self.text_parts = [first.text]
            self.usage = first.usage
        self.token_ids.extend(later.token_ids)
        self.text_parts.append(later.text)
        self.text_len += len(later.text)
        if later.finish_reason is not None:
            self.finish_reason = later.finish_reason
        if later.usage is not None:
            self.usage = later.usage

    def take(self) -> TokenEntry:
        if self.token_ids is None or self.text_parts is None:
            return self.entry
        return TokenEntry(
            self.entry.request_id,
            self.token_ids,
            "".join(self.text_parts),
            self.finish_reason,
            self.usage,
        )


@final
class FlushPolicy:
    """Pending token entries and the rule for when they become a frame."""

    def __init__(self, config: FlushConfig) -> None:
        self._config = config
        self._slots: deque[_Slot] = deque()
        self._by_request: dict[str, _Slot] = {}
        self._text_chars = 0
        self._finishing = 0  # pending slots that carry a finish_reason
        self._queued = False  # the pending batch waited behind an in-flight frame
        self._step = 0
        self._frames_taken = 0
        self._entries_taken = 0
        self._entries_merged = 0

    @property
    def config(self) -> FlushConfig:
        return self._config

    @property
    def pending_entries(self) -> int:
        return len(self._slots)

    @property
    def has_pending(self) -> bool:
        return bool(self._slots)

    def add(self, entries: list[TokenEntry], now: float) -> None:
        """Queue one engine step's entries. Neither they nor their token lists are mutated."""
        if not entries:
            return
        self._step += 1
        coalesce = self._config.coalesce
        for entry in entries:
            text_len = len(entry.text)
            self._text_chars += text_len
            slot = self._by_request.get(entry.request_id) if coalesce else None
            if slot is not None:
                finished_before = slot.finish_reason is not None
                slot.merge(entry)
                if not finished_before and slot.finish_reason is not None:
                    self._finishing += 1
                self._entries_merged += 1
                continue
            slot = _Slot(entry, now, self._step, text_len, entry.finish_reason)
            self._slots.append(slot)
            if coalesce:
                self._by_request[entry.request_id] = slot
            if entry.finish_reason is not None:
                self._finishing += 1

    def decide(self, now: float, *, in_flight: bool) -> FlushDecision:
        """What the sender does next; ``in_flight``: a frame is being written."""
        if not self._slots:
            return _IDLE
        if in_flight:
            if self._config.coalesce:
                self._queued = True
            return _WAIT_FOR_WRITE
        if not self._queued:
            return _FLUSH_NOW
        config = self._config
        deadline = self._slots[0].added_at + config.window_s
        if (
            now >= deadline
            or self._finishing
            or len(self._slots) >= config.max_entries
            or self._text_chars >= config.max_bytes_hint
        ):
            return _FLUSH_NOW
        return WaitUntil(deadline)

    def take(self) -> list[TokenEntry]:
        """The entries of the frame to send now: all pending, or the prefix
        that fits the caps (one step at most without coalescing). Empty when
        nothing is pending."""
        slots = self._slots
        if not slots:
            return []
        config = self._config
        if (
            config.coalesce
            and len(slots) <= config.max_entries
            and self._text_chars <= config.max_bytes_hint
        ):
            frame = [slot.take() for slot in slots]
            slots.clear()
            self._by_request.clear()
            self._text_chars = 0
            self._finishing = 0
        else:
            frame = self._take_prefix()
        if not slots:
            self._queued = False
        self._frames_taken += 1
        self._entries_taken += len(frame)
        return frame

    def _take_prefix(self) -> list[TokenEntry]:
        config = self._config
        slots = self._slots
        step = slots[0].step
        frame: list[TokenEntry] = []
        chars = 0
        while slots and len(frame) < config.max_entries:
            slot = slots[0]
            if not config.coalesce and slot.step != step:
                break
            if frame and chars + slot.text_len > config.max_bytes_hint:
                break
            slots.popleft()
            chars += slot.text_len
            if config.coalesce:
                del self._by_request[slot.entry.request_id]
            if slot.finish_reason is not None:
                self._finishing -= 1
            frame.append(slot.take())
        self._text_chars -= chars
        return frame

    def statistics(self) -> FlushStatistics:
        return FlushStatistics(
            pending_entries=len(self._slots),
            pending_text_chars=self._text_chars,
            frames_taken=self._frames_taken,
            entries_taken=self._entries_taken,
            entries_merged=self._entries_merged,
        )
