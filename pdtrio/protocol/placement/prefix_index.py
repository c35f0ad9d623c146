"""Which prefix of a prompt an instance has cached: block hashes, and the router's index.

A worker's prefix cache (``pdtrio.engine.prefix_cache``) keys each full KV block by a
hash chain over the prompt's token ids, salted with the KV layout
(:func:`block_hashes`).  With its cache on, the worker reports the hashes it stores
and evicts to each router on the link (``wire.KvEvents``, a snapshot of the whole set
first on every connection), and the router keeps them per instance
(:class:`CachedBlocks`, owned by the link: dropped when it drops, rebuilt from the
next connection's snapshot, never stale).

The router holds no tokenizer, so it cannot hash a chat or text prompt itself.  It
learns instead: a prefill reply carries the prompt's token ids, so the router hashes
them and remembers the chain under a key of the prompt's messages
(:class:`PromptChains`, bounded, least recently used out first).  A later request whose
messages begin with an earlier prompt's (a conversation's next turn, the same system
prompt and history) looks up the longest such earlier prompt (:func:`prompt_keys`)
and asks each instance's :class:`CachedBlocks` how much of its chain it holds.  This
is approximate only in the step from messages to tokens (the earlier prompt's last
block may differ once the conversation goes on); which blocks each instance holds is
exact, as reported.  A token-id prompt is hashed directly.

Sans-IO: the standard library and attrs, no clock.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final, final

import attrs

from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.link.wire import (
    ChatPrompt,
    ChatPromptWithTools,
    KvEvents,
    Prompt,
    TextPrompt,
    TokenPrompt,
)

_HASH_BYTES: Final = 16


def layout_salt(layout: KvLayout) -> str:
    """What besides the tokens decides a block's KV: the model (its fingerprint names the
    weights), the dtype and the shape of a block."""
    return (
        f"pdtrio-prefix-v1|{layout.model_fingerprint}|{layout.dtype}|{layout.block_size}|"
        f"{layout.num_layers}|{layout.num_kv_heads}|{layout.head_dim}"
    )


def chain_root(salt: str) -> bytes:
    """The hash a prompt's chain starts from: every block hash depends on ``salt``."""
    return hashlib.blake2b(salt.encode("utf-8"), digest_size=_HASH_BYTES).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, root: bytes) -> list[bytes]:
    """The hash of each full block of ``token_ids`` (a partial last block has none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    hashes: list[bytes] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = array("q", token_ids[start : start + block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=_HASH_BYTES).digest()
        hashes.append(parent)
    return hashes


def layout_block_hashes(token_ids: Sequence[int], layout: KvLayout) -> list[bytes]:
    """:func:`block_hashes` as an engine of ``layout`` computes them."""
    return block_hashes(token_ids, layout.block_size, chain_root(layout_salt(layout)))


@final
class CachedBlocks:
    """The block hashes one instance reported it holds, as its KV events say.

    ``reporting`` is False until the first snapshot of a connection: an instance whose
    cache is off (or a worker from before KV events) never reports, and counts as
    holding nothing.
    """

    __slots__ = ("_hashes", "reporting")

    def __init__(self) -> None:
        self._hashes: set[bytes] = set()
        self.reporting = False

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._hashes

    def apply(self, events: KvEvents) -> None:
        """A report: a snapshot replaces the set, a change removes and then stores."""
        if events.snapshot:
            self._hashes = set(events.stored)
            self.reporting = True
            return
        if not self.reporting:
            return  # changes before any snapshot on this connection: nothing to apply them to
        self._hashes.difference_update(events.removed)
        self._hashes.update(events.stored)

    def clear(self) -> None:
        """The connection is gone: what it reported may be stale from now on."""
        self._hashes = set()
        self.reporting = False

    def prefix_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes`` (a prompt's chain) it holds from the start, without a gap:
        a lookup on the instance stops at the first block it lacks."""
        held = self._hashes
        count = 0
        for block_hash in hashes:
            if block_hash not in held:
                break
            count += 1
        return count


# the router hashes at most this many of a prompt's tokens (a few ms): beyond, a prefix
# this long decides the instance as well
MAX_HASHED_TOKENS: Final = 1 << 14

# Prompts longer than this (characters) get no keys: hashing them would hold the event loop.
MAX_KEYED_PROMPT_CHARS: Final = 1 << 20


def prompt_keys(prompt: Prompt) -> list[bytes]:
    """A key for each prefix of ``prompt`` an earlier prompt may have been, shortest first.

    A chat's key after each of its messages (the tools first, when it has any); a
    text's one key, of the whole text.  None for a token-id prompt (the router hashes
    its ids directly) or one past :data:`MAX_KEYED_PROMPT_CHARS`.
    """
    if type(prompt) is TextPrompt:
        if len(prompt.text) > MAX_KEYED_PROMPT_CHARS:
            return []
        return [key_digest(b"text", prompt.text.encode("utf-8", "surrogatepass"))]
    if not isinstance(prompt, ChatPrompt):
        return []
    if sum(len(text) for _, text in prompt.messages) > MAX_KEYED_PROMPT_CHARS:
        return []
    tools = prompt.tools_json if type(prompt) is ChatPromptWithTools else ""
    extras = prompt.message_extras if type(prompt) is ChatPromptWithTools else ()
    key = key_digest(b"chat", tools.encode("utf-8", "surrogatepass"))
    keys: list[bytes] = []
    for index, (role, text) in enumerate(prompt.messages):
        extra = extras[index] if index < len(extras) else ""
        key = key_digest(key, role.encode(), text.encode("utf-8", "surrogatepass"), extra.encode())
        keys.append(key)
    return keys


def key_digest(*parts: bytes) -> bytes:
    """A 16-byte key over ``parts``, each length-prefixed (no two splits collide): a prompt
    prefix's key is the digest of the key before it and what follows it."""
    hasher = hashlib.blake2b(digest_size=_HASH_BYTES)
    for part in parts:
        # each part length-prefixed: no two splits give the same bytes
        hasher.update(len(part).to_bytes(8, "little"))
        hasher.update(part)
    return hasher.digest()


@final
@attrs.frozen
class LearnedPrompt:
    """What prefill told of an earlier prompt: its block hash chain, and how many tokens
    and characters (:func:`prompt_chars`) it had (the new part of a later prompt is
    estimated at its tokens per character)."""

    hashes: tuple[bytes, ...]
    num_tokens: int = 0
    num_chars: int = 0


@final
class PromptChains:
    """Block hash chains of earlier prompts, by :func:`prompt_keys` key: what the router
    learned from prefill replies (their token ids), at most ``max_hashes`` hashes in all,
    the least recently used prompts forgotten first."""

    __slots__ = ("_chains", "_held", "max_hashes")

    def __init__(self, max_hashes: int = 1 << 18) -> None:
        if max_hashes < 0:
            raise ValueError(f"max_hashes must be >= 0, got {max_hashes}")
        self.max_hashes = max_hashes
        self._chains: OrderedDict[bytes, LearnedPrompt] = OrderedDict()
        self._held = 0

    def __len__(self) -> int:
        return len(self._chains)

    @property
    def hashes_held(self) -> int:
        return self._held

    def learn(
        self, key: bytes, hashes: Sequence[bytes], num_tokens: int = 0, num_chars: int = 0
    ) -> None:
        """Remember ``hashes`` as the chain of the prompt ``key`` names (of ``num_tokens``
        tokens, ``num_chars`` characters)."""
        chain = tuple(hashes)
        if len(chain) > self.max_hashes:
            return
        old = self._chains.pop(key, None)
        if old is not None:
            self._held -= len(old.hashes)
        self._chains[key] = LearnedPrompt(chain, num_tokens, num_chars)
        self._held += len(chain)
        while self._held > self.max_hashes:
            _, dropped = self._chains.popitem(last=False)
            self._held -= len(dropped.hashes)

    def knows(self, key: bytes) -> bool:
        return key in self._chains

    def longest_learned(self, keys: Sequence[bytes]) -> LearnedPrompt | None:
        """The longest prefix among ``keys`` (shortest first) learned, if any."""
        for key in reversed(keys):
            learned = self._chains.get(key)
            if learned is not None:
                self._chains.move_to_end(key)
                return learned
        return None

    def longest(self, keys: Sequence[bytes]) -> tuple[bytes, ...]:
        """The chain of the longest prefix among ``keys`` (shortest first) learned; ()."""
        learned = self.longest_learned(keys)
        return () if learned is None else learned.hashes


# tokens per character assumed for a prompt whose conversation the router has not seen
# (English text and code run at about 3 to 4.5 characters a token)
DEFAULT_TOKENS_PER_CHAR: Final = 0.3


def prompt_chars(prompt: Prompt) -> int:
    """The characters of a chat's or text's prompt (the tools' JSON too): what an
    estimate of its token count goes by; 0 for a token-id prompt."""
    if type(prompt) is TextPrompt:
        return len(prompt.text)
    if isinstance(prompt, ChatPrompt):
        tools = len(prompt.tools_json) if type(prompt) is ChatPromptWithTools else 0
        return tools + sum(len(text) for _, text in prompt.messages)
    return 0


@final
class PromptBlocks:
    """One request's prompt as the prefix index sees it: its block hashes for a layout,
    hashed from its token ids, or the chain learned for the longest earlier prompt its
    messages begin with (``keys``, shortest first, to learn its own under the last)."""

    __slots__ = ("_by_layout", "_learned", "_num_chars", "_token_ids", "keys")

    def __init__(self, prompt: Prompt, chains: PromptChains) -> None:
        self._token_ids = prompt.token_ids if type(prompt) is TokenPrompt else None
        self.keys = prompt_keys(prompt)
        self._learned = chains.longest_learned(self.keys) if self.keys else None
        self._num_chars = prompt_chars(prompt)
        self._by_layout: dict[KvLayout, list[bytes]] = {}

    @property
    def num_chars(self) -> int:
        return self._num_chars

    def hashes_for(self, layout: KvLayout) -> Sequence[bytes]:
        """The hash chain an engine of ``layout`` would find the prompt's blocks by (as far
        as the router knows it: a chain learned under another layout matches nothing)."""
        if self._token_ids is None:
            return () if self._learned is None else self._learned.hashes
        hashes = self._by_layout.get(layout)
        if hashes is None:
            hashes = self._by_layout[layout] = layout_block_hashes(
                self._token_ids[:MAX_HASHED_TOKENS], layout
            )
        return hashes

    def estimated_tokens(self) -> int:
        """The prompt's token count: exact for token ids; for a chat or text, the earlier
        prompt's count it begins with plus its new characters at that prompt's tokens per
        character (:data:`DEFAULT_TOKENS_PER_CHAR` when none was learned)."""
        if self._token_ids is not None:
            return len(self._token_ids)
        learned = self._learned
        if learned is None or learned.num_chars <= 0 or learned.num_tokens <= 0:
            return math.ceil(self._num_chars * DEFAULT_TOKENS_PER_CHAR)
        new_chars = max(self._num_chars - learned.num_chars, 0)
        return learned.num_tokens + math.ceil(new_chars * learned.num_tokens / learned.num_chars)


__all__ = [
    "MAX_HASHED_TOKENS",
    "MAX_KEYED_PROMPT_CHARS",
    "DEFAULT_TOKENS_PER_CHAR",
    "CachedBlocks",
    "LearnedPrompt",
    "PromptBlocks",
    "PromptChains",
    "block_hashes",
    "chain_root",
    "layout_block_hashes",
    "key_digest",
    "layout_salt",
    "prompt_chars",
    "prompt_keys",
]
