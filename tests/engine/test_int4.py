"""4-bit copies of the layer weights for decode steps (engine.int4_weights)."""

from __future__ import annotations

import pytest
import torch

from pdtrio.config import EngineConfig
from pdtrio.engine.torch.builtin import BuiltinModelUnavailable
from pdtrio.engine.torch.engine import load_model
from pdtrio.engine.torch.loaders import LoadedModel
from pdtrio.engine.torch.model import (
    INT4_GROUP,
    SeqInput,
    _slow_reduced_matmul,
    int4_codes,
    quantize_int4,
)


def _q4_1(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight as GGUF's Q4_1 dequantizes it, and its codes: per group of 32, a float16
    scale and minimum, and codes 0..15 that reach both ends (what llama.cpp's quantizer gives)."""
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // INT4_GROUP
    codes = torch.randint(0, 16, (out_features, groups, INT4_GROUP), generator=generator)
    codes[..., 0], codes[..., 1] = 0, 15
    scale = (torch.rand(out_features, groups, 1, generator=generator) * 0.01 + 1e-3).half()
    low = (torch.randn(out_features, groups, 1, generator=generator) * 0.05).half()
    weight = (scale.float() * codes + low.float()).reshape(out_features, in_features)
    return weight, codes.reshape(out_features, in_features)


def test_a_q4_1_weight_gets_its_own_codes_back() -> None:
    weight, codes = _q4_1(96, 128, seed=1)

    found, scale, low = int4_codes(weight)

    assert torch.equal(found, codes.to(torch.int32))
    groups = weight.reshape(96, -1, INT4_GROUP)
    assert torch.allclose(low, groups.amin(-1))
    assert torch.allclose(scale * 15, groups.amax(-1) - groups.amin(-1))


def test_the_kernel_multiplies_by_the_codes_with_bfloat16_scales() -> None:
    weight, _ = _q4_1(96, 128, seed=2)
    int4 = quantize_int4(weight)
    assert int4 is not None
    eye = torch.eye(128, dtype=torch.bfloat16)

    product = torch.ops.aten._weight_int4pack_mm_for_cpu(
        eye, int4.packed, INT4_GROUP, int4.scales_and_zeros
    )

    # bfloat16 scale, zero point and output: each off by at most 2^-9 of itself
    _, scale, low = int4_codes(weight)
    zero = (low + 8 * scale).abs().repeat_interleave(INT4_GROUP, dim=1)
    bound = 2**-8 * (zero + 8 * scale.repeat_interleave(INT4_GROUP, dim=1) + weight.abs())
    assert bool(((product.float().t() - weight).abs() <= bound).all())


def test_a_weight_the_groups_do_not_divide_is_left_as_it_is() -> None:
    assert quantize_int4(torch.randn(8, 48)) is None


def test_every_decode_row_reads_the_4_bit_copies_and_a_prompt_never() -> None:
    quantized = load_model(EngineConfig(model="tiny-random", int4_weights="on"))
    wide = load_model(EngineConfig(model="tiny-random", int4_weights="off"))
    prompt = list(range(10, 30))

    def logits(model: LoadedModel, rows: int) -> tuple[torch.Tensor, ...]:
        cache = model.new_kv_cache(num_blocks=4 * rows + 2, block_size=16)
        tables = [[4 * i + b for b in range(4)] for i in range(rows)]
        first = model.model.forward_paged([SeqInput(prompt, 0, t) for t in tables], cache)
        steps = [SeqInput([7], len(prompt), t) for t in tables]
        step = model.model.forward_paged(steps, cache)
        # a prompt of one token (or a last one after a cached start) is a prompt
        alone = [4 * rows, 4 * rows + 1]
        one = model.model.forward_paged([SeqInput([7], 0, alone, prompt=True)], cache)
        return first, step, one

    for rows in (1, 16, 17, 40):  # any number of rows: a row's tokens must not depend on it
        (prompt_int4, step_int4, one_int4), (prompt_wide, step_wide, one_wide) = (
            logits(quantized, rows),
            logits(wide, rows),
        )
        assert torch.equal(prompt_int4, prompt_wide)  # a prompt: never in 4 bits
        assert torch.equal(one_int4, one_wide)
        assert not torch.equal(step_int4, step_wide), rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("setting", ["on", "off"])
def test_a_sequence_decodes_the_same_bits_whatever_shares_its_step(
    setting: str, dtype: str
) -> None:
    """A decode row alone, beside other decodes (fewer or more than the threads, longer
    contexts, over 16 rows) and beside prompts: the same logits and KV to the bit.  With
    4-bit copies a step with a prompt, or of over 16 rows, once ran its decodes in float32,
    and torch's attention gave a lone row other last bits, which the 4-bit product's
    bfloat16 inputs grow: a seeded choice of n > 1 then drew other tokens than its single
    request."""
    loaded = load_model(EngineConfig(model="tiny-random", dtype=dtype, int4_weights=setting))
    lengths = [61, 5, 130, 17, 33, 64, 200, 90, 12, 45, 77, 3, 150, 60, 31, 99, 16, 120, 8, 70]
    _assert_decode_rows_keep_their_bits(
        loaded,
        lengths,
        [
            ([0, 1, 2], None),
            ([0, 6, 2, 12], None),
            (list(range(17)), None),
            (list(range(20)), None),
            ([0], list(range(40, 60))),
            ([0], [9]),
            ([0, 1, 2, 3], list(range(40, 60))),
            (list(range(20)), list(range(40, 47))),
        ],
    )


@pytest.mark.parametrize(
    ("dtype", "setting"),
    [("float32", "off"), ("float32", "auto"), ("bfloat16", "off"), ("bfloat16", "auto")],
)
def test_smollm2_decode_rows_keep_their_bits_in_any_step(dtype: str, setting: str) -> None:
    """The same at SmolLM2's sizes, where oneDNN's products switch kernels: on a Sapphire
    Rapids CPU a lone float32 row of the [576, 1536] weight, and a bfloat16 row among more
    than 32 (AMX), got other last bits than in 2 to 32 rows."""
    if dtype == "bfloat16" and setting == "off" and _slow_reduced_matmul(torch.bfloat16):
        pytest.skip("without bfloat16 kernels a product of under 4 rows stays in bfloat16")
    loaded = _smollm2(setting, dtype)
    lengths = [40, 7, 90, 20, 33, 64, 18, 5] * 6
    everyone = list(range(len(lengths)))
    _assert_decode_rows_keep_their_bits(
        loaded,
        lengths,
        [
            ([0, 1], None),
            (everyone[:32], None),
            (everyone[:33], None),
            (everyone, None),
            ([0], list(range(40, 60))),
            (everyone[:33], list(range(100, 140))),
        ],
    )


def _assert_decode_rows_keep_their_bits(
    loaded: LoadedModel, lengths: list[int], cases: list[tuple[list[int], list[int] | None]]
) -> None:
    """Row 0's logits and new KV alone, then in each case's step (its rows' next token,
    and a prompt as the step's second sequence where one is given)."""
    model = loaded.model
    tables: list[list[int]] = []
    for length in lengths:
        start = sum(len(t) for t in tables)
        tables.append(list(range(start, start + length // 16 + 2)))
    others_start = sum(len(t) for t in tables)
    others = list(range(others_start, others_start + 4))  # blocks of a prompt in the step
    cache = loaded.new_kv_cache(num_blocks=others_start + 4, block_size=16)
    generator = torch.Generator().manual_seed(3)
    vocab = loaded.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    model.forward_paged([SeqInput(p, 0, t) for p, t in zip(prompts, tables, strict=True)], cache)
    before = cache.kv.clone()

    def step(rows: list[int], prompt: list[int] | None = None) -> tuple[torch.Tensor, ...]:
        cache.kv.copy_(before)
        seqs = [SeqInput([5 + row], lengths[row], tables[row]) for row in rows]
        if prompt is not None:
            seqs.insert(1, SeqInput(prompt, 0, others, prompt=True))
        logits = model.forward_paged(seqs, cache)
        return logits[0], cache.kv[tables[0][-2]].clone()  # (row 0's new KV is in there)

    alone = step([0])
    for rows, prompt in cases:
        shared = step(rows, prompt)
        assert torch.equal(shared[0], alone[0]), (len(rows), prompt)
        assert torch.equal(shared[1], alone[1]), (len(rows), prompt)


def _greedy(loaded: LoadedModel, prompt: list[int], steps: int) -> list[int]:
    cache = loaded.new_kv_cache(num_blocks=8, block_size=16)
    table = cache.allocator.allocate(cache.blocks_needed(len(prompt) + steps))
    logits = loaded.model.forward_paged([SeqInput(prompt, 0, table)], cache)
    tokens = [int(logits[0].argmax())]
    for position in range(len(prompt), len(prompt) + steps - 1):
        logits = loaded.model.forward_paged([SeqInput([tokens[-1]], position, table)], cache)
        tokens.append(int(logits[0].argmax()))
    return tokens


def _smollm2(int4_weights: str, dtype: str = "float32") -> LoadedModel:
    try:
        config = EngineConfig(model="smollm2-135m-instruct", dtype=dtype, int4_weights=int4_weights)
        return load_model(config)
    except BuiltinModelUnavailable as exc:
        pytest.skip(str(exc))


def test_smollm2_decodes_in_4_bits_where_asked_with_the_same_greedy_answer() -> None:
    quantized, wide = _smollm2("auto"), _smollm2("off")
    assert quantized.int4_layers  # its GGUF stores the layers in Q4_1
    assert quantized.model.model.layers[0].mlp.down_int4 is not None
    assert wide.model.model.layers[0].mlp.down_int4 is None
    tokenizer = quantized.tokenizer
    assert tokenizer is not None
    prompt = tokenizer.encode_chat([("user", "What is the capital of France?")])

    answer = _greedy(quantized, prompt, 24)

    assert answer == _greedy(wide, prompt, 24)
    assert "Paris" in tokenizer.decode(answer)


@pytest.mark.parametrize(("setting", "quantized"), [("auto", False), ("on", True), ("off", False)])
def test_a_model_not_stored_in_4_bits_is_quantized_only_when_asked(
    setting: str, quantized: bool
) -> None:
    loaded = load_model(EngineConfig(model="tiny-random", int4_weights=setting))

    assert not loaded.int4_layers
    assert (loaded.model.model.layers[0].self_attn.qkv_int4 is not None) == quantized
