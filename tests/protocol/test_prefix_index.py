"""The router's prefix index: KV events on the wire, each instance's cached block hashes,
and how a chat prompt finds the chain of the earlier prompt its messages begin with."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.link import wire
from pdtrio.protocol.placement.prefix_index import (
    DEFAULT_TOKENS_PER_CHAR,
    MAX_KEYED_PROMPT_CHARS,
    CachedBlocks,
    PromptBlocks,
    PromptChains,
    layout_block_hashes,
    prompt_chars,
    prompt_keys,
)

LAYOUT = KvLayout(
    model_fingerprint="m", num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="f32"
)
H = [bytes([i]) * 16 for i in range(8)]


# --- the wire -------------------------------------------------------------------------


def test_kv_events_cross_the_link_alone_and_in_a_batch() -> None:
    events = wire.KvEvents(snapshot=False, stored=(H[0], H[1]), removed=(H[2],))
    assert wire.from_worker_decoder.decode(wire.encode(events)) == events
    batch = [events, wire.Heartbeat()]
    assert wire.is_batch(wire.encode(batch))
    assert wire.from_worker_batch_decoder.decode(wire.encode(batch)) == batch


def test_a_snapshot_is_one_message_of_many_hashes() -> None:
    snapshot = wire.KvEvents(snapshot=True, stored=tuple(H))
    data = wire.encode(snapshot)
    assert len(data) < len(H) * 18 + 8  # the hashes and little else: no per-block message
    assert wire.from_worker_decoder.decode(data) == snapshot


# --- one instance's cached blocks --------------------------------------------------------


def test_changes_before_a_snapshot_are_ignored_and_a_snapshot_replaces_everything() -> None:
    cached = CachedBlocks()
    cached.apply(wire.KvEvents(snapshot=False, stored=(H[0],)))
    assert not cached.reporting and len(cached) == 0
    cached.apply(wire.KvEvents(snapshot=True, stored=(H[0], H[1], H[2])))
    cached.apply(wire.KvEvents(snapshot=False, stored=(H[3],), removed=(H[1],)))
    assert cached.reporting and {h for h in H if h in cached} == {H[0], H[2], H[3]}
    cached.apply(wire.KvEvents(snapshot=True, stored=(H[5],)))
    assert {h for h in H if h in cached} == {H[5]}


def test_a_dropped_link_forgets_what_it_reported() -> None:
    cached = CachedBlocks()
    cached.apply(wire.KvEvents(snapshot=True, stored=(H[0],)))
    cached.clear()
    assert not cached.reporting and H[0] not in cached
    assert cached.prefix_blocks([H[0]]) == 0


def test_the_cached_prefix_stops_at_the_first_block_missing() -> None:
    cached = CachedBlocks()
    cached.apply(wire.KvEvents(snapshot=True, stored=(H[0], H[1], H[3])))
    assert cached.prefix_blocks([H[0], H[1], H[2], H[3]]) == 2
    assert cached.prefix_blocks([H[1], H[0]]) == 2
    assert cached.prefix_blocks([H[2], H[0]]) == 0
    assert cached.prefix_blocks([]) == 0


# --- prompts ---------------------------------------------------------------------------

messages = st.lists(
    st.tuples(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=20)),
    min_size=1,
    max_size=6,
)


@given(messages, messages)
def test_an_earlier_prompt_is_found_by_a_prompt_that_begins_with_its_messages(
    earlier: list[tuple[str, str]], more: list[tuple[str, str]]
) -> None:
    earlier_key = prompt_keys(wire.ChatPrompt(tuple(earlier)))[-1]
    later_keys = prompt_keys(wire.ChatPrompt((*earlier, *more)))
    assert later_keys[len(earlier) - 1] == earlier_key
    # keys are per message prefix, all distinct
    assert len(set(later_keys)) == len(later_keys)


@pytest.mark.parametrize(
    "other",
    [
        wire.ChatPrompt((("user", "hello!"), ("assistant", ""))),
        wire.ChatPrompt((("system", "hello"),)),
        wire.ChatPrompt((("user", "hell"), ("user", "o"))),
        wire.ChatPromptWithTools((("user", "hello"),), '[{"type": "function"}]', ("",)),
        wire.TextPrompt("hello"),
    ],
)
def test_a_prompt_that_differs_in_any_way_has_other_keys(other: wire.Prompt) -> None:
    keys = prompt_keys(wire.ChatPrompt((("user", "hello"),)))
    assert not set(keys) & set(prompt_keys(other))


def test_token_prompts_and_huge_prompts_have_no_keys() -> None:
    assert prompt_keys(wire.TokenPrompt((1, 2, 3))) == []
    assert prompt_keys(wire.TextPrompt("x" * (MAX_KEYED_PROMPT_CHARS + 1))) == []
    huge = wire.ChatPrompt((("user", "x" * (MAX_KEYED_PROMPT_CHARS + 1)),))
    assert prompt_keys(huge) == []


def test_the_longest_earlier_prompt_learned_wins_and_the_least_recent_goes_first() -> None:
    chains = PromptChains(max_hashes=4)
    keys = prompt_keys(wire.ChatPrompt((("system", "s"), ("user", "a"), ("user", "b"))))
    chains.learn(keys[0], [H[0]])
    chains.learn(keys[1], [H[0], H[1]])
    assert chains.longest(keys) == (H[0], H[1])
    assert chains.longest(keys[:1]) == (H[0],)  # (now the most recently used)
    chains.learn(b"another prompt", [H[5], H[6]])  # 5 hashes > 4: the least recent goes
    assert chains.longest(keys) == (H[0],) and chains.hashes_held == 3
    chains.learn(b"too long", H[:5])  # longer than the whole bound: not kept
    assert not chains.knows(b"too long")


def test_a_token_prompt_is_hashed_as_its_engine_would() -> None:
    ids = tuple(range(11))
    blocks = PromptBlocks(wire.TokenPrompt(ids), PromptChains())
    assert blocks.keys == []
    assert list(blocks.hashes_for(LAYOUT)) == layout_block_hashes(ids, LAYOUT)
    assert len(blocks.hashes_for(LAYOUT)) == 2  # two full blocks of 4, and 3 over


def test_a_chat_prompt_takes_the_chain_learned_for_its_earlier_turn() -> None:
    chains = PromptChains()
    first = wire.ChatPrompt((("user", "hi"),))
    chains.learn(prompt_keys(first)[-1], [H[1], H[2]])
    second = PromptBlocks(wire.ChatPrompt((("user", "hi"), ("assistant", "yo"))), chains)
    assert tuple(second.hashes_for(LAYOUT)) == (H[1], H[2])
    unknown = PromptBlocks(wire.ChatPrompt((("user", "bye"),)), chains)
    assert tuple(unknown.hashes_for(LAYOUT)) == ()


def test_a_prompts_token_count_is_estimated_from_its_conversations_earlier_turn() -> None:
    chains = PromptChains()
    # a token-id prompt's count is exact
    assert PromptBlocks(wire.TokenPrompt(tuple(range(11))), chains).estimated_tokens() == 11
    # nothing learned: the default tokens per character
    first = wire.ChatPrompt((("system", "x" * 90), ("user", "y" * 10)))
    assert PromptBlocks(first, chains).estimated_tokens() == math.ceil(
        100 * DEFAULT_TOKENS_PER_CHAR
    )
    # the earlier turn had 50 tokens in 100 characters: the 40 new ones count 20 more
    chains.learn(prompt_keys(first)[-1], [H[1]], num_tokens=50, num_chars=100)
    second = wire.ChatPrompt((*first.messages, ("assistant", "z" * 20), ("user", "w" * 20)))
    assert PromptBlocks(second, chains).estimated_tokens() == 70
    tools = wire.ChatPromptWithTools((("user", "hi"),), "[" + "t" * 9, ("",))
    assert prompt_chars(tools) == 12 and prompt_chars(wire.TextPrompt("abc")) == 3
