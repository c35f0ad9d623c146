"""The KV layout descriptor, the rule that says two sides may be paired, and how many
blocks a number of tokens takes (the router, the engines and decode admission alike)."""

from __future__ import annotations

import msgspec

KV_LAYOUT_VERSION = 1


class KvLayout(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What a KV block is, byte for byte.

    Two instances can hand KV blocks to each other only if every field matches:
    a block copied between different layouts would be silently wrong.
    """

    model_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    parallel: str = "tp1"
    version: int = KV_LAYOUT_VERSION

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return (
            2
            * self.num_layers
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * _DTYPE_SIZES.get(self.dtype, 1)
        )

    def describe(self) -> str:
        return (
            f"v{self.version} model={self.model_fingerprint} layers={self.num_layers} "
            f"kv_heads={self.num_kv_heads} head_dim={self.head_dim} "
            f"block_size={self.block_size} dtype={self.dtype} parallel={self.parallel}"
        )


_DTYPE_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "int8": 1,
    "synthetic": 1,
}


def layout_mismatch(prefill: KvLayout, decode: KvLayout) -> str | None:
    """Why these two layouts cannot be paired, naming both sides; None if they can."""
    if prefill == decode:
        return None
    differing = [
        name
        for name in KvLayout.__struct_fields__
        if getattr(prefill, name) != getattr(decode, name)
    ]
    return (
        f"KV layout mismatch in {', '.join(differing)}: "
        f"prefill has [{prefill.describe()}], decode has [{decode.describe()}]"
    )


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """How many blocks of ``block_size`` tokens hold ``num_tokens`` (a ceiling division)."""
    return -(-num_tokens // block_size)


def choice_blocks_needed(
    prompt_tokens: int, total_tokens: int, choices: int, block_size: int
) -> int:
    """Blocks for ``choices`` sequences of ``total_tokens`` each that share the first
    ``prompt_tokens`` (their KV): the prompt's full blocks once, the rest per choice."""
    own = blocks_needed(total_tokens, block_size)
    shared = min(prompt_tokens // block_size, own)
    return own + (choices - 1) * (own - shared)
