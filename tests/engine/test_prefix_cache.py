"""The prefix cache's bookkeeping: the hash chain, reference counts, and eviction that
never touches a block a request holds."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdtrio.engine import prefix_cache
from pdtrio.engine.api import NoRoom
from pdtrio.engine.blocks import BlockAllocator, BlockOwnership
from pdtrio.engine.prefix_cache import PrefixCache, block_hashes, chain_root, layout_salt
from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.placement.prefix_index import CachedBlocks

BLOCK = 4
ROOT = chain_root("a model|float32")


def owning(num_blocks: int, *, enabled: bool = True, max_cached_blocks: int = 0) -> BlockOwnership:
    allocator = BlockAllocator(num_blocks)
    cache = PrefixCache(allocator, enabled=enabled, max_cached_blocks=max_cached_blocks)
    return BlockOwnership(allocator, BLOCK, cache)


# --- the hash chain -----------------------------------------------------------------------


def test_the_same_prefix_gives_the_same_block_hashes_and_a_partial_block_none() -> None:
    prompt = list(range(10, 24))  # 14 tokens: 3 full blocks and 2 tokens over
    hashes = block_hashes(prompt, BLOCK, ROOT)
    assert len(hashes) == 3 and len(set(hashes)) == 3
    # a longer prompt with the same first 12 tokens shares their three blocks
    assert block_hashes([*prompt[:12], 99, 98, 97, 96], BLOCK, ROOT)[:3] == hashes
    assert block_hashes(prompt[:11], BLOCK, ROOT) == hashes[:2]
    assert block_hashes(prompt[:3], BLOCK, ROOT) == []


@pytest.mark.parametrize("changed", [0, 3, 4, 9, 11])
def test_changing_a_token_changes_its_block_hash_and_every_later_one(changed: int) -> None:
    prompt = list(range(100, 116))
    other = list(prompt)
    other[changed] += 1
    before, after = block_hashes(prompt, BLOCK, ROOT), block_hashes(other, BLOCK, ROOT)
    first = changed // BLOCK
    assert after[:first] == before[:first]
    assert all(a != b for a, b in zip(after[first:], before[first:], strict=True))


def test_the_same_block_after_a_different_prefix_hashes_differently() -> None:
    # the chain: a block stands for its whole prefix, not for its own tokens
    tail = [7, 7, 7, 7]
    assert (
        block_hashes([1, 2, 3, 4, *tail], BLOCK, ROOT)[1]
        != block_hashes([5, 6, 7, 8, *tail], BLOCK, ROOT)[1]
    )


def test_the_salt_names_what_else_changes_the_kv() -> None:
    layout = KvLayout("model-a", 2, 1, 8, BLOCK, "float32")
    prompt = list(range(8))
    salts = {
        layout_salt(layout),
        layout_salt(KvLayout("model-b", 2, 1, 8, BLOCK, "float32")),
        layout_salt(KvLayout("model-a", 2, 1, 8, BLOCK, "bfloat16")),
    }
    assert len(salts) == 3
    chains = {tuple(block_hashes(prompt, BLOCK, chain_root(salt))) for salt in salts}
    assert len(chains) == 3


@pytest.mark.slow
def test_block_hashes_are_the_same_in_another_process() -> None:
    # Python's hash() of str/bytes is salted per process; the chain must not be
    code = (
        "from pdtrio.engine.prefix_cache import block_hashes, chain_root;"
        "print(block_hashes(list(range(12)), 4, chain_root('s'))[-1].hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == block_hashes(list(range(12)), 4, chain_root("s"))[-1].hex()


# --- reference counts ----------------------------------------------------------------------


def test_two_requests_share_a_cached_prefix_and_one_leaving_keeps_it_for_the_other() -> None:
    blocks = owning(16)
    prompt = list(range(1, 15))  # 3 full blocks + 2 tokens
    table_a, cached_a = blocks.ensure_prompt("a", prompt, ROOT)
    assert cached_a == 0 and len(table_a) == 4
    blocks.cache_prompt("a")
    table_b, cached_b = blocks.ensure_prompt("b", [*prompt[:12], 50, 51, 52], ROOT)
    assert cached_b == 12
    assert table_b[:3] == table_a[:3] and table_b[3] != table_a[3]
    cache = blocks.prefix_cache
    assert [cache.refs(b) for b in table_a[:3]] == [2, 2, 2]
    assert blocks.num_used == 5  # 3 shared + a's partial block + b's own last block
    blocks.release("a")
    # b still holds the shared blocks: nothing of them freed, nothing reclaimable
    assert [cache.refs(b) for b in table_b] == [1, 1, 1, 1]
    assert cache.num_reclaimable == 0 and blocks.num_used == 4
    blocks.release("b")
    # nobody holds anything; the three cached blocks are kept, reclaimable
    assert blocks.num_used == 0 and cache.num_reclaimable == 3
    assert cache.statistics().cached_blocks == 3
    assert blocks.allocator.num_free == 13
    assert (cache.statistics().hit_tokens, cache.statistics().miss_tokens) == (12, 14 + 3)


def test_a_prompt_cached_whole_still_computes_its_last_block() -> None:
    blocks = owning(8)
    prompt = list(range(1, 13))  # exactly 3 blocks
    first, _ = blocks.ensure_prompt("a", prompt, ROOT)
    blocks.cache_prompt("a")
    blocks.release("a")
    again, cached = blocks.ensure_prompt("b", prompt, ROOT)
    # the last token's logits are needed: its block is computed again, in a block of b's own
    assert cached == 8 and again[:2] == first[:2] and again[2] != first[2]
    blocks.cache_prompt("b")  # the hash of block 3 is cached already: a's block keeps it
    assert blocks.prefix_cache.statistics().cached_blocks == 3
    blocks.release("b")
    assert blocks.prefix_cache.num_reclaimable == 3 and blocks.allocator.num_free == 5


def test_an_allocation_evicts_reclaimable_blocks_least_recently_released_first() -> None:
    blocks = owning(6)
    for name, base in (("old", 100), ("new", 200)):
        blocks.ensure_prompt(name, list(range(base, base + 9)), ROOT)  # 2 full + 1 partial
        blocks.cache_prompt(name)
        blocks.release(name)
    cache = blocks.prefix_cache
    assert cache.num_reclaimable == 4 and blocks.allocator.num_free == 2
    blocks.ensure("big", 4 * BLOCK)  # needs 2 of the cached blocks
    assert cache.statistics().evicted_blocks == 2
    blocks.release("big")
    # the old prompt's blocks went; the newer prompt is still found whole
    assert blocks.ensure_prompt("again", list(range(200, 209)), ROOT)[1] == 8
    blocks.release("again")
    assert blocks.ensure_prompt("gone", list(range(100, 109)), ROOT)[1] == 0


def test_no_room_when_every_block_is_held_and_nothing_changes() -> None:
    blocks = owning(4)
    blocks.ensure_prompt("a", list(range(1, 10)), ROOT)  # 2 full blocks + 1 partial
    blocks.cache_prompt("a")
    table_b, cached = blocks.ensure_prompt("b", list(range(1, 10)), ROOT)  # shares 2, takes 1
    assert cached == 8 and blocks.num_used == 4
    with pytest.raises(NoRoom):
        blocks.ensure_prompt("c", [1, 2, 3, 4, 9, 9], ROOT)  # would share 1, needs 1 more
    with pytest.raises(NoRoom):
        blocks.ensure("b", 13)
    # nothing evicted, no reference lost or left behind by the failed calls
    assert blocks.owned("c") == [] and blocks.owned("b") == list(table_b)
    assert [blocks.prefix_cache.refs(b) for b in table_b] == [2, 2, 1]
    assert blocks.prefix_cache.statistics().evicted_blocks == 0


def test_the_cap_keeps_at_most_that_many_blocks_cached() -> None:
    blocks = owning(16, max_cached_blocks=2)
    blocks.ensure_prompt("a", list(range(1, 14)), ROOT)  # 3 full blocks
    blocks.cache_prompt("a")
    # a holds them all: the cap left the third uncached, as it could evict none
    assert blocks.prefix_cache.statistics().cached_blocks == 2
    blocks.release("a")
    blocks.ensure_prompt("b", list(range(30, 43)), ROOT)
    blocks.cache_prompt("b")
    statistics = blocks.prefix_cache.statistics()
    assert statistics.cached_blocks == 2 and statistics.evicted_blocks == 2


def test_with_the_cache_off_a_released_block_is_free_at_once() -> None:
    blocks = owning(8, enabled=False)
    blocks.ensure_prompt("a", list(range(1, 14)), ROOT)
    blocks.cache_prompt("a")
    blocks.release("a")
    assert blocks.allocator.num_free == 8
    assert blocks.ensure_prompt("b", list(range(1, 14)), ROOT)[1] == 0
    assert blocks.prefix_cache.statistics().hit_tokens == 0


def test_decode_reuses_every_cached_full_block_of_a_received_prompt() -> None:
    blocks = owning(16)
    prompt = list(range(1, 13))  # exactly 3 blocks
    first, reused = blocks.ensure_received("a", prompt, ROOT, len(prompt) + 5)
    assert reused == 0 and len(first) == 5  # the prompt's 3 blocks and 2 for the budget
    blocks.cache_prompt("a")  # pulled: cached now
    blocks.release("a")
    # the next turn: the whole earlier prompt (all of it: decode computes none), and more
    turn, reused = blocks.ensure_received("b", [*prompt, 20, 21], ROOT, len(prompt) + 6)
    assert reused == 3 and turn[:3] == first[:3] and len(turn) == 5
    assert [blocks.prefix_cache.refs(b) for b in turn] == [1] * 5
    blocks.cache_prompt("b")
    # the same prompt again, cached whole: every block reused, nothing to pull
    again, reused = blocks.ensure_received("c", prompt, ROOT, len(prompt) + 1)
    assert reused == 3 and again[:3] == first[:3]
    blocks.cache_prompt("c")
    statistics = blocks.prefix_cache.statistics()
    assert (statistics.decode_reused_blocks, statistics.decode_pulled_blocks) == (6, 3 + 1)
    # the prefill counters are left alone: decode looked nothing up for a computation
    assert (statistics.hit_tokens, statistics.miss_tokens) == (0, 0)
    assert [blocks.prefix_cache.refs(b) for b in first[:3]] == [2, 2, 2]
    blocks.release("b")
    blocks.release("c")
    assert blocks.num_used == 0 and blocks.prefix_cache.num_reclaimable == 3


def test_a_received_prompt_freed_before_its_pull_ends_caches_and_counts_nothing() -> None:
    blocks = owning(16)
    prompt = list(range(1, 10))
    blocks.ensure_received("a", prompt, ROOT, len(prompt))
    blocks.cache_prompt("a")
    blocks.release("a")
    table, reused = blocks.ensure_received("b", [*prompt, 30, 31, 32, 33], ROOT, 20)
    assert reused == 2
    blocks.release("b")  # the pull failed, or the router aborted it
    blocks.cache_prompt("b")  # (too late: nothing of b is left)
    statistics = blocks.prefix_cache.statistics()
    assert statistics.cached_blocks == 2 and statistics.decode_reused_blocks == 0
    assert blocks.num_used == 0 and blocks.prefix_cache.num_reclaimable == 2
    assert blocks.allocator.num_free == 14


def test_no_room_for_a_received_prompt_takes_nothing_and_evicts_no_held_block() -> None:
    blocks = owning(4)
    prompt = list(range(1, 9))  # 2 blocks
    held, _ = blocks.ensure_received("a", prompt, ROOT, len(prompt))
    blocks.cache_prompt("a")
    with pytest.raises(NoRoom):
        # reuses a's 2 blocks, needs 3 more of the 2 free
        blocks.ensure_received("b", [*prompt, 5], ROOT, 19)
    assert blocks.owned("b") == [] and [blocks.prefix_cache.refs(b) for b in held] == [1, 1]
    assert blocks.prefix_cache.statistics().evicted_blocks == 0


def test_with_the_cache_off_a_received_prompt_reuses_nothing() -> None:
    blocks = owning(8, enabled=False)
    prompt = list(range(1, 9))
    blocks.ensure_received("a", prompt, ROOT, len(prompt))
    blocks.cache_prompt("a")
    blocks.release("a")
    table, reused = blocks.ensure_received("b", prompt, ROOT, len(prompt))
    blocks.cache_prompt("b")
    statistics = blocks.prefix_cache.statistics()
    assert reused == 0 and len(table) == 2 and statistics.cached_blocks == 0
    assert (statistics.decode_reused_blocks, statistics.decode_pulled_blocks) == (0, 0)


# --- KV events -----------------------------------------------------------------------------


def test_a_reader_reports_what_was_stored_and_evicted_since_its_cursor() -> None:
    blocks = owning(4)
    cursor, snapshot = blocks.prefix_cache.events_since(None)
    assert snapshot is not None and snapshot.snapshot and snapshot.stored == ()
    first = list(range(1, 10))  # two full blocks
    blocks.ensure_prompt("a", first, ROOT)
    blocks.cache_prompt("a")
    blocks.release("a")
    cursor, events = blocks.prefix_cache.events_since(cursor)
    assert events is not None and not events.snapshot
    assert set(events.stored) == set(block_hashes(first, BLOCK, ROOT)) and events.removed == ()
    assert blocks.prefix_cache.events_since(cursor) == (cursor, None)
    # four blocks for another prompt: both cached ones are evicted
    blocks.ensure_prompt("b", list(range(50, 66)), ROOT)
    cursor, events = blocks.prefix_cache.events_since(cursor)
    assert events is not None and set(events.removed) == set(block_hashes(first, BLOCK, ROOT))
    assert events.stored == ()


def test_a_reader_the_journal_no_longer_reaches_gets_the_whole_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prefix_cache, "JOURNAL_LIMIT", 2)
    blocks = owning(8)
    cursor, _ = blocks.prefix_cache.events_since(None)
    prompt = list(range(1, 14))  # three full blocks: three changes, one past the journal
    blocks.ensure_prompt("a", prompt, ROOT)
    blocks.cache_prompt("a")
    _, events = blocks.prefix_cache.events_since(cursor)
    assert events is not None and events.snapshot
    assert set(events.stored) == set(block_hashes(prompt, BLOCK, ROOT))


def test_with_the_cache_off_there_is_nothing_to_report() -> None:
    blocks = owning(8, enabled=False)
    blocks.ensure_prompt("a", list(range(1, 14)), ROOT)
    blocks.cache_prompt("a")
    assert blocks.prefix_cache.events_since(None)[1] is None


# --- eviction under pressure, as a state machine ------------------------------------------

NUM_BLOCKS = 12


class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests come (a prompt over a small alphabet, so prefixes are shared), compute, grow,
    and leave, in any order; an allocation that must evict does.  A model of each block's
    content (the token prefix it holds KV for) checks every reuse and every eviction."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = owning(NUM_BLOCKS)
        self.cache = self.blocks.prefix_cache
        self.live: dict[str, list[int]] = {}  # request -> its prompt
        self.computed: set[str] = set()
        # block -> the prompt prefix it holds KV for (written when a request computes it)
        self.content: dict[int, tuple[int, ...]] = {}
        self.count = 0
        # a router's view, told every change; another told only now and then
        self.view, self.cursor = CachedBlocks(), None
        self.late_view, self.late_cursor = CachedBlocks(), None

    @rule(
        stem=st.sampled_from([(), (0,) * 8, (1, 2) * 6]),
        tail=st.lists(st.integers(0, 2), max_size=10),
        received=st.booleans(),
        budget=st.integers(1, 6),
    )
    def arrive(self, stem: tuple[int, ...], tail: list[int], received: bool, budget: int) -> None:
        """A prefill, or (``received``) a decode taking a prompt whose KV it pulls."""
        prompt = [*stem, *tail] or [0]
        self.count += 1
        name = f"r{self.count}"
        held_before = {b: self.cache.refs(b) for t in self.live for b in self.blocks.owned(t)}
        try:
            if received:
                table, reused = self.blocks.ensure_received(
                    name, prompt, ROOT, len(prompt) + budget
                )
                cached = reused * BLOCK
            else:
                table, cached = self.blocks.ensure_prompt(name, prompt, ROOT)
        except NoRoom:
            assert self.blocks.owned(name) == []
            return
        finally:
            # whatever happened, no block some request held lost a reference
            for block_id, refs in held_before.items():
                assert self.cache.refs(block_id) >= refs
        # decode computes none of the prompt: it may reuse every full block
        assert cached % BLOCK == 0 and (cached <= len(prompt) if received else cached < len(prompt))
        for index in range(cached // BLOCK):
            # a reused block holds exactly this prompt's prefix up to the block's end
            assert self.content[table[index]] == tuple(prompt[: (index + 1) * BLOCK])
        for index in range(cached // BLOCK, len(table)):
            self.content.pop(table[index], None)  # fresh: whatever it held is gone
        self.live[name] = prompt

    @precondition(lambda self: set(self.live) - self.computed)
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(set(self.live) - self.computed)))
        prompt = self.live[name]
        table = self.blocks.owned(name)
        for index in range(len(prompt) // BLOCK):
            if not self.cache.is_cached(table[index]):
                self.content[table[index]] = tuple(prompt[: (index + 1) * BLOCK])
        self.blocks.cache_prompt(name)
        self.computed.add(name)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), more=st.integers(1, 12))
    def grow(self, data: st.DataObject, more: int) -> None:
        name = data.draw(st.sampled_from(sorted(self.live)))
        table = self.blocks.owned(name)
        try:
            grown = self.blocks.ensure(name, len(table) * BLOCK + more)
        except NoRoom:
            assert self.blocks.owned(name) == table
            return
        for block_id in grown[len(table) :]:
            self.content.pop(block_id, None)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.live)))
        self.blocks.release(name)
        del self.live[name]
        self.computed.discard(name)

    @rule()
    def late_report(self) -> None:
        self.late_cursor, events = self.cache.events_since(self.late_cursor)
        if events is not None:
            self.late_view.apply(events)
        self._same_as_the_cache(self.late_view)

    @invariant()
    def the_reported_view_is_what_the_cache_holds(self) -> None:
        self.cursor, events = self.cache.events_since(self.cursor)
        if events is not None:
            assert events.snapshot == (not self.view.reporting)  # only the first report
            self.view.apply(events)
        self._same_as_the_cache(self.view)

    def _same_as_the_cache(self, view: CachedBlocks) -> None:
        _, snapshot = self.cache.events_since(None)
        assert snapshot is not None and snapshot.snapshot
        assert len(view) == len(snapshot.stored) == self.cache.statistics().cached_blocks
        assert all(h in view for h in snapshot.stored)

    @invariant()
    def every_block_is_held_reclaimable_or_free_and_only_one_of_them(self) -> None:
        holders: dict[int, int] = {}
        for name in self.live:
            table = self.blocks.owned(name)
            assert len(set(table)) == len(table)
            for block_id in table:
                holders[block_id] = holders.get(block_id, 0) + 1
        assert {b: self.cache.refs(b) for b in holders} == holders
        assert self.blocks.num_used == len(holders)
        free = set(self.blocks.allocator._free)
        reclaimable = set(self.cache._reclaimable)
        assert not (free & set(holders)) and not (reclaimable & set(holders))
        assert not (free & reclaimable)
        assert len(free) + len(reclaimable) + len(holders) == NUM_BLOCKS
        assert all(self.cache.is_cached(b) for b in reclaimable)


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
