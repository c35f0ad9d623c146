"""Which prefix of a prompt an engine instance has probably cached, as the router guesses it.

A vLLM or SGLang instance publishes no KV events to the router, so the router cannot know
what its prefix cache holds.  It remembers instead what it sent where: for each request
an instance served, the request's prefix keys (:func:`approx_prompt_keys`) and when.  A
later request that shares a beginning with it shares its first keys, and the instance it
went to has probably cached that much of it (SGLang's router does this with a radix tree
over text, llm-d's approximate prefix-cache scorer with hashed blocks of text).

Approximate in three ways: the keys are over messages, characters or token ids, not the
engine's KV blocks; the engine evicts as it needs room, unseen (an entry older than
``ttl_s`` counts as evicted: the engine's cache will have moved on); and a restart empties
its cache (an instance that leaves the pool, fails or goes down is forgotten).

Sans-IO: stdlib only, no clock (``now`` is passed in, any monotonic clock).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final, final

import attrs

from pdtrio.protocol.link.wire import ChatPrompt, Prompt, TextPrompt, TokenPrompt
from pdtrio.protocol.placement.prefix_index import key_digest, prompt_keys

# a text prompt's keys: one per this many characters (a few tokens' worth, so that a
# shared beginning is found to within a short chunk, and a long prompt makes few keys)
TEXT_CHUNK_CHARS: Final = 128
# a token-id prompt's keys: one per this many ids (a couple of an engine's KV blocks)
TOKEN_CHUNK: Final = 32
# a prompt's keys stop here: a prefix this long already decides where it is cached
MAX_KEYS_PER_PROMPT: Final = 1024


def approx_prompt_keys(
    prompt: Prompt,
    *,
    text_chunk_chars: int = TEXT_CHUNK_CHARS,
    token_chunk: int = TOKEN_CHUNK,
) -> list[bytes]:
    """A key for each prefix of ``prompt`` another prompt may share, shortest first; each
    key names the whole prefix up to it (two prompts share a key only when they share
    everything before it too).

    A chat's key after each of its messages (:func:`~pdtrio.protocol.placement.prefix_index.prompt_keys`);
    a text's after each ``text_chunk_chars`` characters, and after its last partial chunk;
    a token-id prompt's likewise per ``token_chunk`` ids.  At most
    :data:`MAX_KEYS_PER_PROMPT`.
    """
    if text_chunk_chars <= 0 or token_chunk <= 0:
        raise ValueError(
            f"chunk sizes must be > 0, got {text_chunk_chars} characters, {token_chunk} tokens"
        )
    if isinstance(prompt, ChatPrompt):
        return prompt_keys(prompt)[:MAX_KEYS_PER_PROMPT]
    if type(prompt) is TextPrompt:
        text = prompt.text
        stop = min(len(text), MAX_KEYS_PER_PROMPT * text_chunk_chars)
        chunks = [
            text[start : start + text_chunk_chars].encode("utf-8", "surrogatepass")
            for start in range(0, stop, text_chunk_chars)
        ]
        return _chain(b"approx-text", chunks)
    assert type(prompt) is TokenPrompt
    ids = prompt.token_ids
    stop = min(len(ids), MAX_KEYS_PER_PROMPT * token_chunk)
    return _chain(
        b"approx-tokens",
        [
            array("q", ids[start : start + token_chunk]).tobytes()
            for start in range(0, stop, token_chunk)
        ],
    )


def _chain(root: bytes, chunks: Sequence[bytes]) -> list[bytes]:
    """Each key digests the one before it with its chunk: a key names its whole prefix."""
    keys: list[bytes] = []
    key = key_digest(root)
    for chunk in chunks:
        key = key_digest(key, chunk)
        keys.append(key)
    return keys


@final
@attrs.frozen
class ApproxPrefixStatistics:
    entries: int
    """(instance, key) pairs held now."""
    instances: int
    """Instances with an entry."""
    recorded: int
    """Requests recorded as served."""
    evicted: int
    """Entries dropped for room (``max_entries``), least recently recorded first."""
    expired: int
    """Entries dropped for age (``ttl_s``)."""
    forgotten: int
    """Entries dropped with their instance (it left, failed or went down)."""


@final
class ApproxPrefixIndex:
    """Which request prefixes the router sent to which instance, and when.

    At most ``max_entries`` (instance, key) pairs, the least recently recorded out first
    (0: nothing is recorded, every lookup finds nothing); an entry older than ``ttl_s``
    counts as gone.
    """

    __slots__ = (
        "_entries",
        "_evicted",
        "_expired",
        "_forgotten",
        "_per_instance",
        "_recorded",
        "max_entries",
        "ttl_s",
    )

    def __init__(self, *, max_entries: int, ttl_s: float) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        # (instance id, key) -> when it was last recorded; oldest first
        self._entries: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self._per_instance: dict[str, int] = {}  # entries held, by instance
        self._recorded = 0
        self._evicted = 0
        self._expired = 0
        self._forgotten = 0

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, instance_id: str, keys: Sequence[bytes], now: float) -> None:
        """``instance_id`` served a request of these prefix ``keys`` (shortest first)."""
        if not keys or self.max_entries == 0:
            return
        self._recorded += 1
        self._expire(now)
        entries = self._entries
        # longest first, so a prompt's shorter keys are the more recent: room is made
        # from its long tail, never by cutting its beginning (a lookup stops at a gap)
        for key in reversed(keys):
            entry = (instance_id, key)
            if entry in entries:
                entries.move_to_end(entry)
            else:
                self._per_instance[instance_id] = self._per_instance.get(instance_id, 0) + 1
            entries[entry] = now
        while len(entries) > self.max_entries:
            self._drop_oldest()
            self._evicted += 1

    def cached_prefix(self, instance_id: str, keys: Sequence[bytes], now: float) -> int:
        """How many of ``keys`` (a request's, shortest first) ``instance_id`` probably holds
        from the start: each instance's count for one request compares with another's."""
        if instance_id not in self._per_instance:
            return 0
        entries = self._entries
        oldest = now - self.ttl_s
        count = 0
        for key in keys:
            recorded_at = entries.get((instance_id, key))
            if recorded_at is None or recorded_at < oldest:
                break
            count += 1
        return count

    def forget(self, instance_id: str) -> None:
        """The instance's cache is gone or unknown (it left, restarted, failed): drop its
        entries.  (A scan of every entry: rare, at an instance's change of state.)"""
        held = self._per_instance.pop(instance_id, 0)
        if not held:
            return
        self._forgotten += held
        for entry in [e for e in self._entries if e[0] == instance_id]:
            del self._entries[entry]

    def statistics(self) -> ApproxPrefixStatistics:
        return ApproxPrefixStatistics(
            entries=len(self._entries),
            instances=len(self._per_instance),
            recorded=self._recorded,
            evicted=self._evicted,
            expired=self._expired,
            forgotten=self._forgotten,
        )

    def _expire(self, now: float) -> None:
        # every record moves its entries to the end: the oldest are first
        oldest = now - self.ttl_s
        entries = self._entries
        while entries:
            recorded_at = next(iter(entries.values()))
            if recorded_at >= oldest:
                return
            self._drop_oldest()
            self._expired += 1

    def _drop_oldest(self) -> None:
        (instance_id, _), _ = self._entries.popitem(last=False)
        left = self._per_instance[instance_id] - 1
        if left:
            self._per_instance[instance_id] = left
        else:
            del self._per_instance[instance_id]


__all__ = [
    "MAX_KEYS_PER_PROMPT",
    "TEXT_CHUNK_CHARS",
    "TOKEN_CHUNK",
    "ApproxPrefixIndex",
    "ApproxPrefixStatistics",
    "approx_prompt_keys",
]
