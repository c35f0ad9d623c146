"""Block allocation, the block byte layout, and the KV handoff between two caches."""

from __future__ import annotations

import random

import pytest
import torch

from pdtrio.engine.api import NoRoom
from pdtrio.engine.config import ModelConfig
from pdtrio.engine.torch.kv_cache import BlockAllocator, PagedKvCache
from pdtrio.engine.torch.model import CausalLM, SeqInput, random_state_dict
from pdtrio.protocol.kv_layout import KvLayout

CONFIG = ModelConfig(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)


def test_allocator_counts_and_low_ids_first() -> None:
    allocator = BlockAllocator(8)
    assert (allocator.num_free, allocator.num_used) == (8, 0)
    assert allocator.allocate(3) == [0, 1, 2]
    assert allocator.allocate(0) == []
    assert (allocator.num_free, allocator.num_used) == (5, 3)
    allocator.free([1])
    assert (allocator.num_free, allocator.num_used) == (6, 2)
    assert sorted(allocator.allocate(6)) == [1, 3, 4, 5, 6, 7]
    assert allocator.num_free == 0


def test_allocator_is_all_or_nothing() -> None:
    allocator = BlockAllocator(4)
    allocator.allocate(3)
    with pytest.raises(NoRoom):
        allocator.allocate(2)
    assert allocator.num_free == 1
    assert allocator.allocate(1) == [3]


def test_double_free_and_foreign_ids_are_errors_that_free_nothing() -> None:
    allocator = BlockAllocator(4)
    ids = allocator.allocate(2)
    allocator.free(ids[:1])
    with pytest.raises(ValueError, match="double free"):
        allocator.free(ids)  # ids[1] is fine, ids[0] is not: nothing is freed
    assert allocator.num_used == 1
    with pytest.raises(ValueError, match="double free"):
        allocator.free([ids[1], ids[1]])
    assert allocator.num_used == 1
    with pytest.raises(ValueError, match="out of range"):
        allocator.free([4])
    with pytest.raises(ValueError, match="double free"):
        allocator.free([3])  # never allocated
    allocator.free([ids[1]])
    assert allocator.num_used == 0


def test_layout_describes_the_block_bytes() -> None:
    cache = PagedKvCache.for_model(CONFIG, num_blocks=5, block_size=8)
    layout = cache.layout("abc123")
    assert layout == KvLayout(
        model_fingerprint="abc123",
        num_layers=3,
        num_kv_heads=2,
        head_dim=16,
        block_size=8,
        dtype="float32",
    )
    assert layout.block_nbytes == cache.block_nbytes == 3 * 2 * 8 * 2 * 16 * 4
    assert cache.kv.shape == (5, 3, 2, 8, 2, 16)
    half = PagedKvCache.for_model(CONFIG, num_blocks=5, block_size=8, dtype=torch.bfloat16)
    assert half.layout("abc123").dtype == "bfloat16"
    assert half.layout("abc123").block_nbytes == half.block_nbytes == cache.block_nbytes // 2
    assert [cache.blocks_needed(n) for n in (0, 1, 8, 9, 16, 17)] == [0, 1, 1, 2, 2, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_write_round_trip_moves_exactly_the_named_blocks(dtype: torch.dtype) -> None:
    source = PagedKvCache.for_model(CONFIG, num_blocks=6, block_size=4, dtype=dtype)
    source.kv.copy_(torch.randn(source.kv.shape, generator=torch.Generator().manual_seed(0)))
    data = source.read_blocks([4, 1])
    assert isinstance(data, bytes)
    assert len(data) == 2 * source.block_nbytes
    # block-major: one block is one contiguous byte range of the storage
    whole = source.read_blocks(range(6))
    nbytes = source.block_nbytes
    assert data == whole[4 * nbytes : 5 * nbytes] + whole[1 * nbytes : 2 * nbytes]

    target = PagedKvCache.for_model(CONFIG, num_blocks=6, block_size=4, dtype=dtype)
    target.write_blocks([0, 5], data)

    assert torch.equal(target.kv[0], source.kv[4])
    assert torch.equal(target.kv[5], source.kv[1])
    assert not target.kv[1:5].any()
    assert target.read_blocks([0, 5]) == data


def test_write_blocks_refuses_the_wrong_length_or_ids() -> None:
    cache = PagedKvCache.for_model(CONFIG, num_blocks=4, block_size=4)
    data = cache.read_blocks([0, 1])
    with pytest.raises(ValueError, match="bytes"):
        cache.write_blocks([0], data)
    with pytest.raises(ValueError, match="bytes"):
        cache.write_blocks([0, 1], data[:-1])
    with pytest.raises(ValueError, match="out of range"):
        cache.write_blocks([0, 4], data)
    with pytest.raises(ValueError, match="out of range"):
        cache.read_blocks([-1])
    cache.write_blocks([2, 3], bytearray(data))  # any buffer will do


def test_kv_handoff_between_two_caches_continues_identically() -> None:
    model = CausalLM.build(CONFIG, random_state_dict(CONFIG, seed=3))
    rng = random.Random(3)
    prompt = [rng.randrange(CONFIG.vocab_size) for _ in range(19)]
    continuation = [rng.randrange(CONFIG.vocab_size) for _ in range(7)]
    reference = model.forward_reference(prompt + continuation)

    prefill = PagedKvCache.for_model(CONFIG, num_blocks=16, block_size=4)
    prefill.allocator.allocate(3)  # so the prompt's block ids differ between the sides
    prefill_table = prefill.allocator.allocate(prefill.blocks_needed(len(prompt)))
    first = model.forward_paged([SeqInput(prompt, 0, prefill_table)], prefill)
    payload = prefill.read_blocks(prefill_table)

    decode = PagedKvCache.for_model(CONFIG, num_blocks=12, block_size=4)
    decode_table = decode.allocator.allocate(decode.blocks_needed(len(prompt) + len(continuation)))
    decode_table.reverse()
    received = decode_table[: len(prefill_table)]
    assert prefill.layout("m") == decode.layout("m")
    decode.write_blocks(received, payload)

    assert_close = torch.testing.assert_close
    assert_close(first[0], reference[len(prompt) - 1], rtol=1e-4, atol=1e-4)
    # the prefill side keeps going on its own blocks: the decode side must match it exactly
    prefill_grown = prefill_table + prefill.allocator.allocate(2)
    for i, token in enumerate(continuation):
        pos = len(prompt) + i
        on_decode = model.forward_paged([SeqInput([token], pos, decode_table)], decode)
        on_prefill = model.forward_paged([SeqInput([token], pos, prefill_grown)], prefill)
        assert torch.equal(on_decode, on_prefill)
        assert_close(on_decode[0], reference[pos], rtol=1e-4, atol=1e-4)
    assert decode.statistics().num_used == len(decode_table)
