"""An engine's KV region is its blocks' memory: block b at address + b * block_nbytes."""

from __future__ import annotations

import ctypes
import random

import pytest

from tests.kv.blocks import synthetic


async def test_the_synthetic_engines_region_holds_its_blocks() -> None:
    engine = synthetic(num_blocks=16, block_size=4)
    region = engine.kv_region()
    assert (region.num_blocks, region.block_nbytes, region.device) == (16, 16, "cpu")
    assert region.block_nbytes == engine.layout.block_nbytes
    data = random.Random(1).randbytes(3 * region.block_nbytes)
    await engine.write_blocks((9, 2, 5), data)
    for index, block in enumerate((9, 2, 5)):
        held = ctypes.string_at(region.block_address(block), region.block_nbytes)
        assert held == data[index * region.block_nbytes : (index + 1) * region.block_nbytes]
    # and a write straight into the region is what read_blocks sees
    ctypes.memmove(region.block_address(7), b"\x42" * region.block_nbytes, region.block_nbytes)
    assert await engine.read_blocks((7,)) == b"\x42" * region.block_nbytes


def test_the_torch_caches_region_holds_its_blocks() -> None:
    torch = pytest.importorskip("torch")
    from pdtrio.engine.torch.kv_cache import PagedKvCache

    cache = PagedKvCache(
        num_blocks=8, block_size=4, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float64
    )
    region = cache.region()
    assert (region.num_blocks, region.device) == (8, "cpu")
    assert region.block_nbytes == cache.block_nbytes == cache.layout("m").block_nbytes
    assert not cache.kv.any()  # the cache starts zeroed
    cache.kv[3].fill_(1.5)
    held = ctypes.string_at(region.block_address(3), region.block_nbytes)
    assert held == cache.read_blocks([3])
    assert (
        held == torch.full((region.block_nbytes // 8,), 1.5, dtype=torch.float64).numpy().tobytes()
    )
