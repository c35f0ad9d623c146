"""The router's approximate prefix index for engine instances (no KV events): a request's
prefix keys, what each instance was sent and when, eviction by room and by age."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdtrio.protocol.link.wire import ChatPrompt, ChatPromptWithTools, TextPrompt, TokenPrompt
from pdtrio.protocol.placement.approx_prefix import (
    MAX_KEYS_PER_PROMPT,
    TEXT_CHUNK_CHARS,
    TOKEN_CHUNK,
    ApproxPrefixIndex,
    approx_prompt_keys,
)


def chat(*texts: str) -> ChatPrompt:
    """A system prompt, then the user and the assistant in turn."""
    roles = ["system"] + ["user" if i % 2 else "assistant" for i in range(1, len(texts))]
    return ChatPrompt(tuple(zip(roles, texts, strict=True)))


def index(max_entries: int = 1000, ttl_s: float = 60.0) -> ApproxPrefixIndex:
    return ApproxPrefixIndex(max_entries=max_entries, ttl_s=ttl_s)


# --- the keys ------------------------------------------------------------------------------


def test_a_chats_keys_are_one_per_message_and_a_next_turn_begins_with_them() -> None:
    first = approx_prompt_keys(chat("be brief", "hi"))
    second = approx_prompt_keys(chat("be brief", "hi", "hello", "how are you"))
    assert len(first) == 2 and len(second) == 4
    assert second[:2] == first
    assert approx_prompt_keys(chat("be terse", "hi"))[0] != first[0]
    # tools change every key: the template shows them first
    tools = ChatPromptWithTools((("system", "be brief"), ("user", "hi")), '[{"f": 1}]', ("", ""))
    assert not set(approx_prompt_keys(tools)) & set(first)


def test_texts_sharing_a_long_beginning_share_its_whole_chunks() -> None:
    shared = "x" * (3 * TEXT_CHUNK_CHARS)
    one = approx_prompt_keys(TextPrompt(shared + "the first question"))
    other = approx_prompt_keys(TextPrompt(shared + "another question, longer" * 20))
    assert one[:3] == other[:3]
    assert one[3] != other[3]  # (a partial last chunk has its own key)
    assert len(one) == 4
    # a text differing at its start shares nothing, however alike the rest
    assert not set(approx_prompt_keys(TextPrompt("y" + shared[1:]))) & set(one)


def test_token_prompts_are_keyed_per_chunk_of_ids_and_never_like_a_text() -> None:
    ids = tuple(range(5 * TOKEN_CHUNK))
    keys = approx_prompt_keys(TokenPrompt(ids))
    assert len(keys) == 5
    assert approx_prompt_keys(TokenPrompt((*ids[: 2 * TOKEN_CHUNK], 7, 7)))[:2] == keys[:2]
    assert approx_prompt_keys(TokenPrompt((1, *ids[1:])))[0] != keys[0]
    assert not set(keys) & set(approx_prompt_keys(TextPrompt("0 1 2 3")))


def test_a_long_prompt_stops_at_the_most_keys_and_bad_chunks_are_refused() -> None:
    keys = approx_prompt_keys(TextPrompt("z" * (TEXT_CHUNK_CHARS * (MAX_KEYS_PER_PROMPT + 5))))
    assert len(keys) == MAX_KEYS_PER_PROMPT
    assert len(approx_prompt_keys(TextPrompt("abcdef"), text_chunk_chars=2)) == 3
    with pytest.raises(ValueError, match="chunk sizes"):
        approx_prompt_keys(TextPrompt("a"), text_chunk_chars=0)


# --- the index -------------------------------------------------------------------------------


def test_the_instance_sent_a_prefix_holds_it_and_another_holds_nothing() -> None:
    prefixes = index()
    first = approx_prompt_keys(chat("be brief", "hi"))
    prefixes.record("p0", first, now=0.0)
    second = approx_prompt_keys(chat("be brief", "hi", "hello", "more"))
    assert prefixes.cached_prefix("p0", second, now=1.0) == 2
    assert prefixes.cached_prefix("p1", second, now=1.0) == 0
    # deterministic: the same lookup, the same answer; a lookup changes nothing
    assert prefixes.cached_prefix("p0", second, now=1.0) == 2
    assert prefixes.statistics().recorded == 1


def test_a_text_diverging_sooner_matches_a_shorter_prefix() -> None:
    prefixes = index()
    base = "".join(chr(ord("a") + i % 26) for i in range(4 * TEXT_CHUNK_CHARS))
    prefixes.record("p0", approx_prompt_keys(TextPrompt(base + "end")), now=0.0)
    late = approx_prompt_keys(TextPrompt(base[: 3 * TEXT_CHUNK_CHARS] + "!" * 300))
    early = approx_prompt_keys(TextPrompt(base[:TEXT_CHUNK_CHARS] + "!" * 300))
    assert prefixes.cached_prefix("p0", late, now=0.0) == 3
    assert prefixes.cached_prefix("p0", early, now=0.0) == 1


def test_entries_older_than_the_ttl_count_as_evicted_and_a_new_record_renews() -> None:
    prefixes = index(ttl_s=10.0)
    keys = approx_prompt_keys(chat("a", "b"))
    prefixes.record("p0", keys, now=0.0)
    assert prefixes.cached_prefix("p0", keys, now=10.0) == 2
    assert prefixes.cached_prefix("p0", keys, now=10.5) == 0
    prefixes.record("p1", approx_prompt_keys(chat("c")), now=20.0)  # drops the old ones
    stats = prefixes.statistics()
    assert (stats.entries, stats.expired, stats.instances) == (1, 2, 1)
    prefixes.record("p0", keys, now=21.0)
    assert prefixes.cached_prefix("p0", keys, now=30.0) == 2


def test_the_cap_drops_the_least_recently_recorded_and_a_prompts_tail_before_its_start() -> None:
    prefixes = index(max_entries=4)
    old = approx_prompt_keys(chat("old", "x"))
    prefixes.record("p0", old, now=0.0)
    new = approx_prompt_keys(chat("new", "y", "z"))
    prefixes.record("p1", new, now=1.0)
    assert prefixes.cached_prefix("p0", old, now=1.0) == 1  # its tail went first
    assert prefixes.cached_prefix("p1", new, now=1.0) == 3
    prefixes.record("p1", approx_prompt_keys(chat("other", "w")), now=2.0)
    assert prefixes.cached_prefix("p0", old, now=2.0) == 0
    assert prefixes.cached_prefix("p1", new, now=2.0) == 2
    assert len(prefixes) == 4 and prefixes.statistics().evicted == 3
    # a prompt longer than the cap keeps its beginning
    long = approx_prompt_keys(TextPrompt("q" * 10 * TEXT_CHUNK_CHARS))
    prefixes.record("p2", long, now=3.0)
    assert prefixes.cached_prefix("p2", long, now=3.0) == 4


def test_a_forgotten_instance_holds_nothing_and_the_others_keep_theirs() -> None:
    prefixes = index()
    keys = approx_prompt_keys(chat("a", "b"))
    prefixes.record("p0", keys, now=0.0)
    prefixes.record("p1", keys, now=0.0)
    prefixes.forget("p0")
    prefixes.forget("gone")  # (unknown: nothing to do)
    assert prefixes.cached_prefix("p0", keys, now=0.0) == 0
    assert prefixes.cached_prefix("p1", keys, now=0.0) == 2
    stats = prefixes.statistics()
    assert (stats.entries, stats.instances, stats.forgotten) == (2, 1, 2)


def test_no_room_records_nothing_and_bad_settings_are_refused() -> None:
    prefixes = index(max_entries=0)
    keys = approx_prompt_keys(chat("a"))
    prefixes.record("p0", keys, now=0.0)
    assert prefixes.cached_prefix("p0", keys, now=0.0) == 0 and len(prefixes) == 0
    with pytest.raises(ValueError, match="max_entries"):
        index(max_entries=-1)
    with pytest.raises(ValueError, match="ttl_s"):
        index(ttl_s=0.0)


@given(st.text("ab", max_size=20), st.text("ab", max_size=20))
def test_a_text_matches_as_many_chunks_as_it_shares_with_the_one_recorded(
    recorded: str, asked: str
) -> None:
    chunk = 3
    prefixes = index()
    prefixes.record("p0", approx_prompt_keys(TextPrompt(recorded), text_chunk_chars=chunk), 0.0)
    keys = approx_prompt_keys(TextPrompt(asked), text_chunk_chars=chunk)
    shared = 0  # chunks of ``asked`` whose whole prefix, to the chunk's end, ``recorded`` has
    while shared < len(keys) and recorded[: (shared + 1) * chunk] == asked[: (shared + 1) * chunk]:
        shared += 1
    assert prefixes.cached_prefix("p0", keys, 0.0) == shared
