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
    INT4_ROWS,
    SeqInput,
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


def test_a_decode_step_of_few_sequences_reads_the_4_bit_copies_and_a_prompt_never() -> None:
    quantized = load_model(EngineConfig(model="tiny-random", int4_weights="on"))
    wide = load_model(EngineConfig(model="tiny-random", int4_weights="off"))
    prompt = list(range(10, 30))

    def logits(model: LoadedModel, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache = model.new_kv_cache(num_blocks=4 * rows, block_size=16)
        tables = [[4 * i + b for b in range(4)] for i in range(rows)]
        first = model.model.forward_paged([SeqInput(prompt, 0, t) for t in tables], cache)
        steps = [SeqInput([7], len(prompt), t) for t in tables]
        return first, model.model.forward_paged(steps, cache)

    for rows in (1, INT4_ROWS, INT4_ROWS + 1):
        (prompt_int4, step_int4), (prompt_wide, step_wide) = (
            logits(quantized, rows),
            logits(wide, rows),
        )
        assert torch.equal(prompt_int4, prompt_wide)  # a prompt: never in 4 bits
        assert torch.equal(step_int4, step_wide) == (rows > INT4_ROWS), rows


def _greedy(loaded: LoadedModel, prompt: list[int], steps: int) -> list[int]:
    cache = loaded.new_kv_cache(num_blocks=8, block_size=16)
    table = cache.allocator.allocate(cache.blocks_needed(len(prompt) + steps))
    logits = loaded.model.forward_paged([SeqInput(prompt, 0, table)], cache)
    tokens = [int(logits[0].argmax())]
    for position in range(len(prompt), len(prompt) + steps - 1):
        logits = loaded.model.forward_paged([SeqInput([tokens[-1]], position, table)], cache)
        tokens.append(int(logits[0].argmax()))
    return tokens


def _smollm2(int4_weights: str) -> LoadedModel:
    try:
        return load_model(EngineConfig(model="smollm2-135m-instruct", int4_weights=int4_weights))
    except BuiltinModelUnavailable as exc:
        pytest.skip(str(exc))


def test_smollm2_decodes_in_4_bits_where_asked_with_the_same_greedy_answer() -> None:
    quantized, wide = _smollm2("auto"), _smollm2(EngineConfig().int4_weights)
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
