"""The paged KV cache: preallocated blocks, stored block-major for transfer.

Storage is one tensor of shape
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (2 is K then
V), so block ``b`` is the contiguous byte range
``[b * block_nbytes, (b + 1) * block_nbytes)`` of the tensor: a block moves
between instances as one memcpy / one RDMA region, all layers together.
The tensor is allocated once and never replaced, so its memory can be
registered with a transport (``region``).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from typing import final

import attrs
import numpy as np
import torch

from pdtrio.engine.api import KvRegion, kv_buffer
from pdtrio.engine.blocks import BlockAllocator
from pdtrio.engine.config import ModelConfig
from pdtrio.protocol.kv_layout import KvLayout

__all__ = ["BlockAllocator", "KvCacheStatistics", "PagedKvCache", "dtype_name"]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, the spelling KvLayout uses."""
    return str(dtype).removeprefix("torch.")


@final
@attrs.frozen
class KvCacheStatistics:
    num_blocks: int
    num_used: int
    num_free: int
    block_size: int
    block_nbytes: int


@final
class PagedKvCache:
    """K and V of every layer for ``num_blocks`` blocks of ``block_size`` positions."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self._buffer: mmap.mmap | None = None
        if torch.device(device).type == "cpu" and nbytes > 0:
            # zeroed, in huge pages where the kernel allows: faster to copy between processes
            self._buffer = kv_buffer(nbytes)
            self.kv = torch.frombuffer(self._buffer, dtype=torch.uint8).view(dtype).view(shape)
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.device = self.kv.device  # "cuda" becomes "cuda:0", as the model's tensors say
        self.allocator = BlockAllocator(num_blocks)

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> PagedKvCache:
        return cls(
            num_blocks=num_blocks,
            block_size=block_size,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=dtype,
            device=device,
        )

    @property
    def block_nbytes(self) -> int:
        return self.kv[0].numel() * self.kv.element_size() if self.num_blocks else 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def layout(self, model_fingerprint: str) -> KvLayout:
        return KvLayout(
            model_fingerprint=model_fingerprint,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=dtype_name(self.dtype),
        )

    def region(self) -> KvRegion:
        """The storage tensor's memory: block ``b`` at ``address + b * block_nbytes``."""
        return KvRegion(
            address=self.kv.data_ptr(),
            num_blocks=self.num_blocks,
            block_nbytes=self.block_nbytes,
            device=self.device.type,
            device_id=self.device.index or 0,
        )

    def statistics(self) -> KvCacheStatistics:
        return KvCacheStatistics(
            num_blocks=self.num_blocks,
            num_used=self.allocator.num_used,
            num_free=self.allocator.num_free,
            block_size=self.block_size,
            block_nbytes=self.block_nbytes,
        )

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = list(block_ids)
        for block_id in ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id {block_id} out of range 0..{self.num_blocks - 1}")
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def read_blocks(self, block_ids: Sequence[int]) -> bytes:
        """The raw bytes of these blocks, block after block, in the cache's layout."""
        blocks = self.kv.index_select(0, self._index(block_ids)).cpu()
        return blocks.view(torch.uint8).numpy().tobytes()

    @torch.inference_mode()
    def write_blocks(self, block_ids: Sequence[int], data: bytes | bytearray | memoryview) -> None:
        """Fill blocks from bytes made by ``read_blocks`` on a cache of the same layout."""
        index = self._index(block_ids)
        source = np.frombuffer(data, dtype=np.uint8)
        expected = len(index) * self.block_nbytes
        if source.size != expected:
            raise ValueError(
                f"KV data for {len(index)} blocks must be {expected} bytes, got {source.size}"
            )
        staging = torch.empty(expected, dtype=torch.uint8)
        staging.numpy()[:] = source
        blocks = staging.view(self.dtype).view(len(index), *self.kv.shape[1:])
        self.kv.index_copy_(0, index, blocks.to(self.device))

    @torch.inference_mode()
    def copy_blocks(self, sources: Sequence[int], destinations: Sequence[int]) -> None:
        """Copy each source block's K and V, every layer, into the destination block of the
        same index (a choice's own copy of a shared prompt's partial last block)."""
        if len(sources) != len(destinations):
            raise ValueError(f"{len(sources)} source blocks for {len(destinations)} destinations")
        if not sources:
            return
        self.kv.index_copy_(
            0, self._index(destinations), self.kv.index_select(0, self._index(sources))
        )
