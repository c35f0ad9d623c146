"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) in plain torch, paged.

Parameter names follow the HF ``*ForCausalLM`` checkpoints (``model.layers.N.
self_attn.q_proj.weight`` ...), so a HF state dict loads as it is.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import final

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from pdtrio.engine.config import ModelConfig, RopeScaling
from pdtrio.engine.torch.kv_cache import PagedKvCache


class StepAbandoned(Exception):
    """A step's ``should_stop`` said nobody waits for its result any more."""


@final
@attrs.frozen
class SeqInput:
    """New tokens of one sequence at positions ``start_pos ..``; KV goes to ``block_table``.

    One token is a decode step unless ``prompt`` says it is (the last of a prompt whose
    start was cached, a one-token chunk): a prompt's tokens are computed as one, so its KV
    is the same however it was split."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    prompt: bool = False


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim // 2], float32 on the CPU, with the checkpoint's
    scaling (computed on the CPU even inside ``torch.device("meta")``, where arange goes
    through Python decompositions that import torch._dynamo: seconds of a model load)."""
    dim = config.head_dim
    with torch.device("cpu"):
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        scaling = config.rope_scaling
        if scaling is not None:
            inv_freq = _scale_inv_freq(inv_freq, scaling)
        return inv_freq.to(torch.float32)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "freq_factors":
        factors = torch.tensor(scaling.freq_factors, dtype=torch.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(
                f"rope freq_factors has {factors.numel()} entries, expected {inv_freq.numel()}"
            )
        return inv_freq / factors
    # llama3: keep high frequencies, divide low ones by factor, interpolate between
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, D]; cos/sin [T, 1, D]
    return x * cos + _rotate_half(x) * sin


_REDUCED = frozenset({torch.bfloat16, torch.float16})


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; on a CPU without fast kernels for a reduced dtype
    (AVX2) a bfloat16/float16 model attends in float32 (and gets its dtype back): torch's
    CPU flash attention in bfloat16 took four times as long as in float32 there (a quarter
    of a SmolLM2 decode step against 5 %), and its inputs here are gathered copies anyway,
    so widening them costs little.  With AMX, bfloat16 attention is the faster (a SmolLM2
    256-token prefill 91 against 106 ms).

    A prompt's queries come without a batch dimension ([heads, tokens, D]); torch's CPU
    flash kernel takes only 4-D inputs, so they get one: in 3-D every prompt took the
    generic path (bmm, softmax, masks), 4.3 ms a layer for a 256-token SmolLM2 prompt
    against 1.3 ms in 4-D, 2.3 against 0.8 ms for a second 128-token chunk (2 threads,
    AVX2 EPYC), and in 4-D flash takes grouped key heads as they are (``enable_gqa``)."""
    if q.dim() == 3:
        batched = (q[None], k[None], v[None])
        return _attention(
            *batched, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa
        )[0]
    dtype = q.dtype
    if q.device.type == "cpu" and dtype in _REDUCED and _slow_reduced_matmul(dtype):
        out = F.scaled_dot_product_attention(
            q.float(),
            k.float(),
            v.float(),
            attn_mask=attn_mask,
            is_causal=is_causal,
            enable_gqa=enable_gqa,
        )
        return out.to(dtype)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa
    )


def _decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] over keys and values [B, W, Hkv, D];
    ``mask`` [B, 1, 1, W] True where a key is real; [B, Hq, D].

    A row's result is the same bits whatever the other rows and the width W (its blocks
    padded to the longest row's): a sequence's tokens must not depend on what shares its
    step.  torch's CPU flash attention takes another path when a batch has fewer rows than
    threads (last-bit differences, which a 4-bit step's bfloat16 inputs grow into other
    tokens), so a smaller batch comes padded with copies of its first row up to the
    thread count (``_PagedPlan.decode_extra``); the keys are always padded and masked,
    never cut to a lone row's length."""
    return _attention(
        q[:, :, None, :],  # [B, Hq, 1, D]
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        enable_gqa=True,
    )[:, :, 0, :]


# A matrix product of at least this many rows, in a reduced dtype on a CPU whose torch has
# no fast kernel for it, is computed in float32 (see _linear).
_WIDEN_ROWS = 16


@functools.cache
def _slow_reduced_matmul(dtype: torch.dtype) -> bool:
    """Whether torch multiplies ``dtype`` matrices on this CPU without oneDNN's kernels (an
    AVX2-only CPU: no AVX-512 BF16/FP16, no AMX), i.e. through its generic loops."""
    if dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return not torch.ops.mkldnn._is_mkldnn_fp16_supported()


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [out, in] reordered once into oneDNN's layout for its matrix products, in
    its own dtype (a reduced dtype is widened to float32 where this CPU lacks kernels for
    it); None where oneDNN cannot take it (not a CPU tensor, no oneDNN in this torch).
    On AMX (Sapphire Rapids, 2 threads) a packed bfloat16 SmolLM2 gate_up product took 49 /
    80 / 293 µs for 1 / 32 / 256 rows against 110 / 135 / 419 µs through F.linear.

    Measured on an AVX2 EPYC, 2 threads, SmolLM2-135M's 120 layer weights, float32, each
    read once (rows = the tokens of a step): torch's F.linear (MKL) 46 / 96 / 152 / 611 ms
    for 1 / 8 / 32 / 256 rows, oneDNN on packed weights 40 / 56 / 90 / 456 ms; its
    [49152, 576] output layer 14.7 / 33 / 47 / 221 ms against 8.0 / 12.3 / 21.8 / 109 ms.
    """
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype not in (torch.float32, *_REDUCED):
        return None
    # a reduced dtype this CPU has kernels for (AMX, AVX-512 BF16) is packed as it is
    wide = weight.dtype in _REDUCED and _slow_reduced_matmul(weight.dtype)
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(
            weight.float() if wide else weight, None
        )
    except RuntimeError:
        return None  # a torch whose oneDNN refuses it: torch's own product then
    return packed


# 4-bit weights: groups of this many input features share a scale and a zero point
INT4_GROUP = 32
# Where the model has 4-bit copies (see quantize_int4) every decode row reads them, however
# many share its step, and a prompt's rows never do: a sequence's tokens must not depend on
# what else is in its step (a seeded choice equals the single request with its seed), and
# a prompt computes the same KV whether its start came from the prefix cache or not (in
# float32; in bfloat16 on AMX, oneDNN's products of over 32 rows may give a prompt's rows
# other last bits when its start was cached than when it is computed whole).  The
# kernel gives a row the same bits in any number of rows; it is faster than float32 only
# for a few.  Measured on an AVX2 EPYC, 2 threads, SmolLM2-135M's 120 layer weights each
# read once: packed float32 22.1 / 32.7 / 63.2 ms for 1 / 8 / 32 rows, 4-bit 8.6 / 22.3 /
# 85.6 ms.


@attrs.frozen(eq=False)
class Int4Weight:
    """A weight [out, in] as torch's CPU 4-bit layout: codes 0..15 packed two a byte, and per
    group of INT4_GROUP inputs a bfloat16 scale and zero point (w = (code - 8) * scale + zero)."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor  # [in / INT4_GROUP, out, 2] bfloat16


def int4_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as codes 0..15 [out, in] (int32) and per group of INT4_GROUP inputs
    a scale and a minimum [out, in / INT4_GROUP]: w = code * scale + minimum, the codes of
    each group spanning its minimum to its maximum (as GGUF's Q4_1 stores them)."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // INT4_GROUP, INT4_GROUP)
    low = groups.amin(dim=-1)
    scale = (groups.amax(dim=-1) - low) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: code 0
    codes = ((groups - low[..., None]) / scale[..., None]).round_().clamp_(0, 15)
    return codes.to(torch.int32).reshape(out_features, in_features), scale, low


def quantize_int4(weight: torch.Tensor) -> Int4Weight | None:
    """``weight`` in torch's CPU 4-bit layout (``int4_codes``: a weight dequantized from Q4_1
    gets its file's codes back; the kernel's scales and zero points are bfloat16, off by up
    to 2^-9 of theirs); None where torch has no CPU kernel for it (another device, inputs
    not a multiple of the group)."""
    out_features, in_features = weight.shape
    if weight.device.type != "cpu" or in_features % INT4_GROUP:
        return None
    codes, scale, low = int4_codes(weight)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    except (RuntimeError, AttributeError):
        return None  # a torch without the CPU 4-bit kernels
    zero = low + 8 * scale
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16)
    return Int4Weight(packed, scales_and_zeros.contiguous())


# Below this many rows a bfloat16/float16 product with a packed float32 weight still runs
# on the reduced weight: it is bound by reading the weight, half the bytes (see _linear).
_PACKED_ROWS_REDUCED = 4


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    int4: Int4Weight | None = None,
    decode_from: int | None = None,
) -> torch.Tensor:
    """``F.linear``; the rows from ``decode_from`` on (a step's decode rows: they come last;
    None: none) apart from the others, in pieces a row's bits do not depend on
    (``_decode_rows``), and in 4 bits where given the weight's 4-bit copy
    (``quantize_int4``; its kernel takes bfloat16 inputs: in float32 it was 5-10x slower);
    through oneDNN where the weight was packed for it (``pack_weight``),
    else torch's own product, where a bfloat16/float16 product of many rows (a prefill) on
    a CPU without fast kernels for that dtype is widened to float32 and rounded back.

    A reduced-dtype product of a few rows (a decode step at low concurrency) stays in its
    dtype: it is bound by reading the weights, which are half the bytes.  Measured on an
    AVX2 EPYC, 2 threads, SmolLM2-135M's layer weights: bfloat16 19 / 104 / 410 ms for 1 /
    8 / 32 rows against packed float32 40 / 56 / 90 ms; [256, 576] x [576, 1536] bfloat16
    26 ms, float32 3.4 ms."""
    if decode_from is not None and decode_from < x.shape[0]:
        decodes = _decode_rows(
            x[decode_from:], lambda rows: _product(rows, weight, bias, packed, int4)
        )
        if decode_from == 0:
            return decodes
        # a step with prompt rows too: they keep the weight's dtype
        return torch.cat((_product(x[:decode_from], weight, bias, packed), decodes))
    return _product(x, weight, bias, packed)


# A decode row's product is computed in pieces of 2 to this many rows, so that its bits do
# not depend on what shares its step (a seeded choice of n > 1 must equal its single
# request).  oneDNN's products on this kind of CPU (torch 2.13, 1 to 4 threads) give a row
# other last bits in 1 row (float32, [576, 1536] weights) and in more than 32 rows
# (bfloat16 on AMX); from 2 to 32 rows they agree to the bit.
_DECODE_PIECE_ROWS = 32


def _decode_rows(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``product(x)`` for decode rows, in pieces of 2 to _DECODE_PIECE_ROWS rows (a lone row
    gets a copy beside it).  The two usual cases go straight, without a split: each costs
    every product of the step a few µs (0.6 ms a c=1 SmolLM2 step)."""
    rows = x.shape[0]
    if rows == 1:
        return product(torch.cat((x, x)))[:1]  # (contiguous: the 4-bit kernel wants it so)
    if rows <= _DECODE_PIECE_ROWS:
        return product(x)
    pieces = list(x.split(_DECODE_PIECE_ROWS))
    if pieces[-1].shape[0] == 1:
        pieces[-1] = torch.cat((pieces[-1], pieces[-1]))
    return torch.cat([product(piece) for piece in pieces])[:rows]


def _product(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
    int4: Int4Weight | None = None,
) -> torch.Tensor:
    """One product of ``_linear``'s (see there)."""
    dtype = x.dtype
    if int4 is not None:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), int4.packed, INT4_GROUP, int4.scales_and_zeros
        ).to(dtype)
        return out if bias is None else out + bias
    if packed is not None and packed.dtype == dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    # (from here on a packed weight is float32 and x bfloat16/float16: widened, see pack_weight)
    if packed is not None and x.shape[0] >= _PACKED_ROWS_REDUCED:
        wide_bias = None if bias is None else bias.float()
        out = torch.ops.mkldnn._linear_pointwise(x.float(), packed, wide_bias, "none", [], "")
        return out.to(dtype)
    if (
        x.device.type == "cpu"
        and dtype in _REDUCED
        and x.shape[0] >= _WIDEN_ROWS
        and _slow_reduced_matmul(dtype)
    ):
        wide_bias = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), wide_bias).to(dtype)
    return F.linear(x, weight, bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalised in float32, rounded to the model's dtype, then scaled (as HF's Llama
        # does); torch's fused rms_norm is one op where the spelled-out one took seven
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    # set by fuse(), which CausalLM.build calls
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    # oneDNN's copies of qkv_weight and o_proj's weight, or None (see pack_weight)
    qkv_packed: torch.Tensor | None = None
    o_packed: torch.Tensor | None = None
    # their 4-bit copies for decode steps, or None (CausalLM.quantize_int4)
    qkv_int4: Int4Weight | None = None
    o_int4: Int4Weight | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def fuse(self) -> None:
        """One weight for q, k and v (their rows stacked): a step multiplies once, not three
        times.  The three projections' parameters become views into it (no second copy)."""
        self.qkv_weight, self.qkv_bias = _stack_linears((self.q_proj, self.k_proj, self.v_proj))
        self.qkv_packed = pack_weight(self.qkv_weight)
        self.o_packed = pack_weight(self.o_proj.weight)

    def output(self, x: torch.Tensor, decode_from: int | None = None) -> torch.Tensor:
        """The rows from ``decode_from`` on are decode rows (see ``_linear``)."""
        return _linear(
            x, self.o_proj.weight, packed=self.o_packed, int4=self.o_int4, decode_from=decode_from
        )

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, decode_from: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q [T, Hq, D], rotated k [T, Hkv, D] and v [T, Hkv, D]."""
        t = x.shape[0]
        heads = self.num_heads + 2 * self.num_kv_heads
        qkv = _linear(
            x, self.qkv_weight, self.qkv_bias, self.qkv_packed, self.qkv_int4, decode_from
        )
        qkv = qkv.view(t, heads, self.head_dim)
        rotated = self.num_heads + self.num_kv_heads
        qk = _apply_rope(qkv[:, :rotated], cos, sin)  # q and k in one go
        return qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, rotated:]


def _stack_linears(
    linears: Sequence[nn.Linear],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The linears' weights (and biases) stacked by rows; each linear's own parameters become
    views of the stacked tensors, so the model holds one copy."""
    weight = torch.cat([linear.weight for linear in linears])
    has_bias = [linear.bias is not None for linear in linears]
    bias = torch.cat([linear.bias for linear in linears]) if all(has_bias) else None
    if any(has_bias) and bias is None:
        raise ValueError("some of the projections to stack have a bias and some not")
    row = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(weight[row : row + rows], requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias[row : row + rows], requires_grad=False)
        row += rows
    return weight, bias


class MLP(nn.Module):
    gate_up_weight: torch.Tensor  # set by fuse()
    # oneDNN's copies of gate_up_weight and down_proj's weight, or None (see pack_weight)
    gate_up_packed: torch.Tensor | None = None
    down_packed: torch.Tensor | None = None
    gate_up_int4: Int4Weight | None = None  # (see Attention)
    down_int4: Int4Weight | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def fuse(self) -> None:
        """One weight for gate and up (see Attention.fuse)."""
        self.gate_up_weight, _ = _stack_linears((self.gate_proj, self.up_proj))
        self.gate_up_packed = pack_weight(self.gate_up_weight)
        self.down_packed = pack_weight(self.down_proj.weight)

    def forward(self, x: torch.Tensor, decode_from: int | None = None) -> torch.Tensor:
        """The rows from ``decode_from`` on are decode rows (see ``_linear``)."""
        gate_up = _linear(
            x,
            self.gate_up_weight,
            packed=self.gate_up_packed,
            int4=self.gate_up_int4,
            decode_from=decode_from,
        )
        gate, up = gate_up.chunk(2, dim=-1)
        return _linear(
            F.silu(gate) * up,
            self.down_proj.weight,
            packed=self.down_packed,
            int4=self.down_int4,
            decode_from=decode_from,
        )


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


class _Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # an explicit (uninitialised) weight: nn.Embedding's own init is a normal_(), which on
        # the meta device CausalLM.build uses goes through torch's Python decompositions and
        # imports torch._dynamo (2-3 s of a model load); build replaces every parameter anyway
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@attrs.frozen(eq=False)
class _PagedPlan:
    """Index tensors for one forward_paged call, shared by every layer."""

    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_base: torch.Tensor  # [T] row of layer 0's K slot in the flat cache view
    last_index: torch.Tensor  # [B] row of each sequence's last new token
    # the first row of the decode sequences (one token each): the prompts' rows come first
    decode_start: int
    # [Bd * Lblocks] the blocks of their contexts, row after row, a short one padded
    decode_blocks: torch.Tensor | None
    decode_width: int  # slots of a decode row's blocks (Lblocks * block_size)
    # [Bd + decode_extra, 1, 1, decode_width] True where a key is real
    decode_mask: torch.Tensor | None
    # rows after the decodes' that copy the first (see _decode_attention)
    decode_extra: int
    # (row0, n_new, start_pos, blocks of positions 0 .. start_pos + n_new)
    prefill: list[tuple[int, int, int, torch.Tensor]]


@final
class CausalLM(nn.Module):
    """The decoder plus its LM head; ``forward_paged`` is what the engine calls."""

    lm_head_packed: torch.Tensor | None = None  # oneDNN's copy of the output layer (build)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Backbone(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("rope_inv_freq", rope_inv_freq(config), persistent=False)

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> CausalLM:
        """A model with these weights (HF names), on ``device`` in ``dtype``.

        ``weights`` may be a generator, so a loader can stream tensors one by one;
        every parameter must be given, and no unknown tensor is accepted.
        """
        with torch.device("meta"):
            model = cls(config)
        model.rope_inv_freq = rope_inv_freq(config).to(device)
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        missing = {name for name, _ in model.named_parameters()}
        expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
        for name, tensor in pairs:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # some tied checkpoints store the copy anyway
            if name not in expected:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"model expects {expected[name]}"
                )
            owner_name, _, attr = name.rpartition(".")
            value = tensor.to(device=device, dtype=dtype).contiguous()
            setattr(model.get_submodule(owner_name), attr, nn.Parameter(value, requires_grad=False))
            missing.discard(name)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
        for layer in model.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        model.lm_head_packed = pack_weight(model._lm_head_weight())
        model.eval()
        return model

    def quantize_int4(self) -> bool:
        """Every layer's products of a few rows in 4 bits from now on (``quantize_int4``; the
        output layer stays as it is: the next token is picked from its logits); False where
        torch has no 4-bit kernel for these weights here (nothing changed then)."""
        linears = self._int4_linears()
        copies = [quantize_int4(weight) for _, _, weight in linears]
        if any(copy is None for copy in copies):
            return False
        for (owner, name, _), copy in zip(linears, copies, strict=True):
            setattr(owner, name, copy)
        return True

    def int4_weights(self) -> list[tuple[torch.Tensor, Int4Weight | None]]:
        """Each layer weight with its 4-bit copy (None: it has none)."""
        return [(weight, getattr(owner, name)) for owner, name, weight in self._int4_linears()]

    def _int4_linears(self) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """(module, the attribute of its 4-bit copy, the weight) of every layer product."""
        linears: list[tuple[nn.Module, str, torch.Tensor]] = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears += [
                (attn, "qkv_int4", attn.qkv_weight),
                (attn, "o_int4", attn.o_proj.weight),
                (mlp, "gate_up_int4", mlp.gate_up_weight),
                (mlp, "down_int4", mlp.down_proj.weight),
            ]
        return linears

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def _lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.model.norm(hidden)
        weight, packed = self._lm_head_weight(), self.lm_head_packed
        # each row is a sequence's last token: its logits must not depend on the others
        return _decode_rows(hidden, lambda rows: _linear(rows, weight, packed=packed)).float()

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.rope_inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    @torch.inference_mode()
    def forward_reference(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [len, vocab] (float32) of a plain full causal forward, no cache."""
        ids = self._token_tensor(token_ids)
        positions = torch.arange(len(token_ids), device=self.device)
        cos, sin = self._rope(positions)
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(h), cos, sin)
            out = _attention(
                q.transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                is_causal=True,
                enable_gqa=True,
            )
            h = h + attn.output(out.transpose(0, 1).reshape(len(token_ids), -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self._logits(h)

    def _token_tensor(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(token_ids, dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token id out of range 0..{self.config.vocab_size - 1}")
        return ids.to(self.device)

    def _plan(self, seqs: Sequence[SeqInput], cache: PagedKvCache) -> _PagedPlan:
        bs = cache.block_size
        block_stride = cache.num_layers * 2 * bs  # rows of the flat view between blocks
        all_ids: list[int] = []
        positions: list[int] = []
        write_base: list[int] = []
        last_index = [0] * len(seqs)
        decode_tables: list[list[int]] = []
        decode_ends: list[int] = []
        prefill: list[tuple[int, int, int, list[int]]] = []
        # the prompts' rows first, then the decodes': a contiguous run that the 4-bit
        # products take (forward_paged)
        decodes = [i for i, seq in enumerate(seqs) if len(seq.token_ids) == 1 and not seq.prompt]
        prompts = [i for i, seq in enumerate(seqs) if len(seq.token_ids) != 1 or seq.prompt]
        decode_start = sum(len(seqs[i].token_ids) for i in prompts)
        row = 0
        for index in prompts + decodes:
            seq = seqs[index]
            n = len(seq.token_ids)
            if n == 0:
                raise ValueError("a sequence needs at least one new token")
            if seq.start_pos < 0:
                raise ValueError(f"start_pos must be >= 0, got {seq.start_pos}")
            end = seq.start_pos + n
            needed = cache.blocks_needed(end)
            if len(seq.block_table) < needed:
                raise ValueError(
                    f"block table of {len(seq.block_table)} blocks cannot hold {end} positions "
                    f"with block_size {bs}"
                )
            table = seq.block_table[:needed]
            if min(table) < 0 or max(table) >= cache.num_blocks:
                raise ValueError(f"block id out of range 0..{cache.num_blocks - 1}")
            all_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, end))
            # layer 0's K row of each new position
            write_base.extend(
                table[pos // bs] * block_stride + pos % bs for pos in range(seq.start_pos, end)
            )
            last_index[index] = row + n - 1
            if row >= decode_start:
                decode_tables.append(table)
                decode_ends.append(end)
            else:
                prefill.append((row, n, seq.start_pos, table))
            row += n
        device = cache.device
        decode_blocks = decode_mask = None
        decode_width = decode_extra = 0
        if decode_tables:
            widest = max(len(t) for t in decode_tables)
            decode_width = widest * bs
            # a short table is padded with its own first block: read, then masked out (a lone
            # row too: its keys are not cut to length); fewer rows than threads get copies
            # of the first (see _decode_attention)
            decode_extra = max(0, torch.get_num_threads() - len(decode_tables))
            decode_tables += [decode_tables[0]] * decode_extra
            decode_ends += [decode_ends[0]] * decode_extra
            padded = [t + [t[0]] * (widest - len(t)) for t in decode_tables]
            decode_blocks = torch.tensor(padded, dtype=torch.long).view(-1).to(device)
            ends = torch.tensor(decode_ends)
            real = torch.arange(decode_width)[None, :] < ends[:, None]
            decode_mask = real[:, None, None, :].to(device)
        return _PagedPlan(
            token_ids=self._token_tensor(all_ids),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            write_base=torch.tensor(write_base, dtype=torch.long, device=device),
            last_index=torch.tensor(last_index, dtype=torch.long, device=device),
            decode_start=decode_start,
            decode_blocks=decode_blocks,
            decode_width=decode_width,
            decode_mask=decode_mask,
            decode_extra=decode_extra,
            prefill=[
                (row0, n, start, torch.tensor(table, dtype=torch.long, device=device))
                for row0, n, start, table in prefill
            ],
        )

    @torch.inference_mode()
    def forward_paged(
        self,
        seqs: Sequence[SeqInput],
        cache: PagedKvCache,
        should_stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """Write the new tokens' KV into the cache; logits [len(seqs), vocab] of each last token.

        ``should_stop`` is asked after each layer; when it says so, StepAbandoned is raised
        (the KV written so far is the caller's to drop).

        Linear layers run once over the tokens of all sequences (the decode rows, last,
        in 4 bits where the model has copies); one-token (decode)
        sequences share one attention call per layer over their blocks, gathered whole
        (a block's slots of one layer are contiguous) and padded to the longest; a
        prompt's first chunk attends over its own k and v, a later chunk over its
        blocks.
        """
        if not seqs:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        if cache.dtype != self.dtype or cache.device != self.device:
            raise ValueError(
                f"KV cache is {cache.dtype} on {cache.device}, model is {self.dtype} on {self.device}"
            )
        if (cache.num_layers, cache.num_kv_heads, cache.head_dim) != (
            self.config.num_layers,
            self.config.num_kv_heads,
            self.config.head_dim,
        ):
            raise ValueError("KV cache shape does not match the model")
        plan = self._plan(seqs, cache)
        bs = cache.block_size
        heads, kv_heads, head_dim = (
            self.config.num_heads,
            self.config.num_kv_heads,
            self.config.head_dim,
        )
        flat = cache.kv.view(-1, kv_heads, head_dim)  # row = ((block*L + layer)*2 + kv)*bs + slot
        num_blocks = cache.num_blocks
        cos, sin = self._rope(plan.positions)
        h = self.model.embed_tokens(plan.token_ids)
        total = h.shape[0]
        # the decode rows apart, in pieces their bits do not depend on (see _linear)
        decode_from = plan.decode_start
        for layer_idx, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(h), cos, sin, decode_from)
            k_off = layer_idx * 2 * bs
            flat.index_copy_(0, plan.write_base + k_off, k)
            flat.index_copy_(0, plan.write_base + k_off + bs, v)
            # this layer's K (V) slots of every block: [blocks, bs * Hkv * D], rows in place
            layer_keys = cache.kv[:, layer_idx, 0].view(num_blocks, -1)
            layer_values = cache.kv[:, layer_idx, 1].view(num_blocks, -1)
            out: torch.Tensor | None = None
            if plan.decode_blocks is not None and plan.decode_mask is not None:
                shape = (-1, plan.decode_width, kv_heads, head_dim)
                keys = layer_keys.index_select(0, plan.decode_blocks).view(shape)
                values = layer_values.index_select(0, plan.decode_blocks).view(shape)
                start = plan.decode_start
                dq = q[start:]
                extra = plan.decode_extra
                if extra:
                    dq = torch.cat((dq, dq[:1].expand(extra, -1, -1)))
                dout = _decode_attention(dq, keys, values, plan.decode_mask)
                if extra:
                    dout = dout[:-extra]
                if start == 0:
                    out = dout
                else:
                    out = torch.empty(total, heads, head_dim, dtype=h.dtype, device=h.device)
                    out[start:] = dout
            if out is None:
                out = torch.empty(total, heads, head_dim, dtype=h.dtype, device=h.device)
            for row0, n, start, blocks in plan.prefill:
                sq = q[row0 : row0 + n].transpose(0, 1)
                if start == 0:
                    # a first chunk: its keys are its own, just computed
                    keys = k[row0 : row0 + n].transpose(0, 1)
                    values = v[row0 : row0 + n].transpose(0, 1)
                    sout = _attention(sq, keys, values, is_causal=True, enable_gqa=True)
                else:
                    end = start + n
                    rows = (-1, kv_heads, head_dim)
                    keys = layer_keys.index_select(0, blocks).view(rows)[:end].transpose(0, 1)
                    values = layer_values.index_select(0, blocks).view(rows)[:end].transpose(0, 1)
                    # query i sits at position start + i and sees keys 0 ..= start + i
                    mask = torch.ones(n, end, dtype=torch.bool, device=h.device).tril(start)
                    sout = _attention(sq, keys, values, attn_mask=mask, enable_gqa=True)
                out[row0 : row0 + n] = sout.transpose(0, 1)
            h = h + attn.output(out.reshape(total, heads * head_dim), decode_from)
            h = h + layer.mlp(layer.post_attention_layernorm(h), decode_from)
            if should_stop is not None and should_stop():
                raise StepAbandoned
        return self._logits(h.index_select(0, plan.last_index))


def random_state_dict(config: ModelConfig, *, seed: int) -> dict[str, torch.Tensor]:
    """Seeded float32 weights for ``config``, scaled so logits are far from uniform."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in CausalLM(config).named_parameters()}
    weights: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            weights[name] = 0.1 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            weights[name] = torch.randn(shape, generator=gen)
        else:
            fan_in = shape[-1]
            weights[name] = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
    return weights
