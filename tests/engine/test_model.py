"""The paged forward must give the same logits as a plain causal forward."""

from __future__ import annotations

import math
import random

import attrs
import pytest
import torch

from pdtrio.engine.config import ModelConfig, RopeScaling
from pdtrio.engine.torch.kv_cache import PagedKvCache
from pdtrio.engine.torch.model import CausalLM, SeqInput, random_state_dict, rope_inv_freq

BASE = ModelConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)

VARIANTS = {
    "gqa": BASE,
    "mha": attrs.evolve(BASE, num_kv_heads=4),
    "mqa-bias": attrs.evolve(BASE, num_kv_heads=1, attention_bias=True),
    "tied": attrs.evolve(BASE, tie_word_embeddings=True),
    "wide-head": attrs.evolve(BASE, num_heads=2, num_kv_heads=2, head_dim=48),
    "rope-linear": attrs.evolve(BASE, rope_scaling=RopeScaling(kind="linear", factor=4.0)),
    "rope-llama3": attrs.evolve(
        BASE,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(kind="llama3", factor=8.0, original_max_position_embeddings=64),
    ),
}


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def make_model(config: ModelConfig = BASE, seed: int = 0) -> CausalLM:
    return CausalLM.build(config, random_state_dict(config, seed=seed))


def make_cache(config: ModelConfig = BASE, *, num_blocks: int = 64, block_size: int = 4):
    return PagedKvCache.for_model(config, num_blocks=num_blocks, block_size=block_size)


def prompt(length: int, seed: int, vocab: int = BASE.vocab_size) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def scattered_table(cache: PagedKvCache, num_tokens: int, seed: int) -> list[int]:
    """Blocks in a shuffled order, so a layout bug cannot hide behind contiguous ids."""
    ids = cache.allocator.allocate(cache.blocks_needed(num_tokens))
    random.Random(seed).shuffle(ids)
    return ids


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_whole_prompt_prefill_matches_reference(variant: str) -> None:
    config = VARIANTS[variant]
    model = make_model(config)
    cache = make_cache(config)
    tokens = prompt(23, seed=1)
    reference = model.forward_reference(tokens)

    logits = model.forward_paged([SeqInput(tokens, 0, scattered_table(cache, 23, 1))], cache)

    assert logits.shape == (1, config.vocab_size)
    assert logits.dtype == torch.float32
    assert_logits_close(logits[0], reference[-1])


@pytest.mark.parametrize("split", [1, 4, 9, 22])
def test_prefill_in_two_chunks_matches_reference(split: int) -> None:
    model, cache = make_model(), make_cache()
    tokens = prompt(23, seed=2)
    reference = model.forward_reference(tokens)
    table = scattered_table(cache, 23, 2)

    first = model.forward_paged([SeqInput(tokens[:split], 0, table)], cache)
    second = model.forward_paged([SeqInput(tokens[split:], split, table)], cache)

    assert_logits_close(first[0], reference[split - 1])
    assert_logits_close(second[0], reference[-1])


@pytest.mark.parametrize("variant", ["gqa", "mqa-bias", "rope-llama3"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_step_by_step_across_block_boundaries(variant: str, block_size: int) -> None:
    config = VARIANTS[variant]
    model = make_model(config)
    cache = make_cache(config, num_blocks=64, block_size=block_size)
    tokens = prompt(21, seed=3)
    reference = model.forward_reference(tokens)
    table = scattered_table(cache, 21, 3)

    model.forward_paged([SeqInput(tokens[:3], 0, table)], cache)
    for pos in range(3, 21):
        logits = model.forward_paged([SeqInput([tokens[pos]], pos, table)], cache)
        assert_logits_close(logits[0], reference[pos])


def test_mixed_batch_of_prefills_and_decodes_matches_reference() -> None:
    model, cache = make_model(), make_cache(num_blocks=128)
    lengths = [1, 5, 17, 8, 30]
    prompts = [prompt(n + 6, seed=10 + i) for i, n in enumerate(lengths)]
    references = [model.forward_reference(p) for p in prompts]
    tables = [scattered_table(cache, len(p), 20 + i) for i, p in enumerate(prompts)]

    # step 1: prefill every prompt but its last 6 tokens, all in one call
    first = model.forward_paged(
        [SeqInput(p[:n], 0, t) for p, n, t in zip(prompts, lengths, tables, strict=True)], cache
    )
    for i, n in enumerate(lengths):
        assert_logits_close(first[i], references[i][n - 1])

    # steps 2..: some sequences decode one token while others prefill a chunk
    positions = list(lengths)
    chunk_plan = [[1, 1, 1, 1, 1, 1], [3, 1, 2], [1, 5], [6], [1, 1, 4]]
    step = 0
    while any(plan for plan in chunk_plan):
        seqs, owners = [], []
        for i, plan in enumerate(chunk_plan):
            if step < len(plan):
                n = plan[step]
                seqs.append(
                    SeqInput(prompts[i][positions[i] : positions[i] + n], positions[i], tables[i])
                )
                owners.append(i)
                positions[i] += n
        if not seqs:
            break
        logits = model.forward_paged(seqs, cache)
        for row, i in enumerate(owners):
            assert_logits_close(logits[row], references[i][positions[i] - 1])
        step += 1
    assert positions == [len(p) for p in prompts]


def test_decode_batch_of_many_lengths_matches_reference() -> None:
    model, cache = make_model(), make_cache(num_blocks=128, block_size=8)
    prompts = [prompt(n, seed=n) for n in (2, 7, 8, 9, 33, 64)]
    references = [model.forward_reference(p) for p in prompts]
    tables = [scattered_table(cache, len(p), len(p)) for p in prompts]
    for p, t in zip(prompts, tables, strict=True):
        model.forward_paged([SeqInput(p[:-1], 0, t)], cache)

    logits = model.forward_paged(
        [SeqInput([p[-1]], len(p) - 1, t) for p, t in zip(prompts, tables, strict=True)], cache
    )

    for i, ref in enumerate(references):
        assert_logits_close(logits[i], ref[-1])


def test_shared_prefix_blocks_serve_a_second_sequence() -> None:
    model, cache = make_model(), make_cache(block_size=4)
    shared = prompt(12, seed=5)  # three full blocks
    a = shared + prompt(5, seed=6)
    b = shared + prompt(9, seed=7)
    prefix_blocks = cache.allocator.allocate(3)
    model.forward_paged([SeqInput(a, 0, prefix_blocks + cache.allocator.allocate(2))], cache)

    b_table = prefix_blocks + cache.allocator.allocate(3)
    logits = model.forward_paged([SeqInput(b[12:], 12, b_table)], cache)

    assert_logits_close(logits[0], model.forward_reference(b)[-1])


def test_one_sequence_does_not_disturb_another() -> None:
    model, cache = make_model(), make_cache()
    a, b = prompt(10, seed=8), prompt(10, seed=9)
    ta, tb = scattered_table(cache, 11, 8), scattered_table(cache, 11, 9)
    model.forward_paged([SeqInput(a, 0, ta)], cache)
    model.forward_paged([SeqInput(b, 0, tb)], cache)

    logits = model.forward_paged([SeqInput([4], 10, ta)], cache)

    assert_logits_close(logits[0], model.forward_reference([*a, 4])[-1])


def test_bad_inputs_are_refused() -> None:
    model, cache = make_model(), make_cache(block_size=4)
    table = cache.allocator.allocate(2)
    with pytest.raises(ValueError, match="block table"):
        model.forward_paged([SeqInput(prompt(9, seed=1), 0, table)], cache)
    with pytest.raises(ValueError, match="token id"):
        model.forward_paged([SeqInput([BASE.vocab_size], 0, table)], cache)
    with pytest.raises(ValueError, match="at least one"):
        model.forward_paged([SeqInput([], 0, table)], cache)
    with pytest.raises(ValueError, match="block id"):
        model.forward_paged([SeqInput([1], 0, [cache.num_blocks])], cache)
    other = PagedKvCache.for_model(attrs.evolve(BASE, num_layers=3), num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="does not match"):
        model.forward_paged([SeqInput([1], 0, [0])], other)
    assert model.forward_paged([], cache).shape == (0, BASE.vocab_size)


def test_load_rejects_wrong_checkpoints() -> None:
    weights = random_state_dict(BASE, seed=0)
    missing = {k: v for k, v in weights.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="lacks"):
        CausalLM.build(BASE, missing)
    with pytest.raises(ValueError, match="no place"):
        CausalLM.build(BASE, {**weights, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    wrong = dict(weights)
    wrong["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        CausalLM.build(BASE, wrong)


def test_same_seed_same_model_and_different_seed_different_model() -> None:
    tokens = prompt(6, seed=0)
    a = make_model(seed=1).forward_reference(tokens)
    assert torch.equal(a, make_model(seed=1).forward_reference(tokens))
    assert not torch.allclose(a, make_model(seed=2).forward_reference(tokens))


def test_rope_scaling_follows_the_checkpoint() -> None:
    plain = rope_inv_freq(BASE)
    linear = rope_inv_freq(VARIANTS["rope-linear"])
    torch.testing.assert_close(linear, plain / 4.0)

    config = VARIANTS["rope-llama3"]
    unscaled = rope_inv_freq(attrs.evolve(config, rope_scaling=None))
    scaled = rope_inv_freq(config)
    wavelen = 2 * math.pi / unscaled
    assert config.rope_scaling is not None
    old_len = config.rope_scaling.original_max_position_embeddings
    high = wavelen < old_len / 4.0  # short wavelengths are kept
    low = wavelen > old_len / 1.0  # long ones are divided by the factor
    assert high.any() and low.any()
    torch.testing.assert_close(scaled[high], unscaled[high])
    torch.testing.assert_close(scaled[low], unscaled[low] / 8.0)
    middle = ~high & ~low
    assert torch.all(scaled[middle] < unscaled[middle])
    assert torch.all(scaled[middle] > unscaled[middle] / 8.0)


def test_bfloat16_paged_forward_tracks_reference() -> None:
    model = CausalLM.build(BASE, random_state_dict(BASE, seed=0), dtype=torch.bfloat16)
    cache = PagedKvCache.for_model(BASE, num_blocks=16, block_size=4, dtype=torch.bfloat16)
    tokens = prompt(12, seed=4)
    table = scattered_table(cache, 12, 4)
    model.forward_paged([SeqInput(tokens[:8], 0, table)], cache)
    logits = model.forward_paged([SeqInput(tokens[8:], 8, table)], cache)
    reference = model.forward_reference(tokens)[-1]
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], reference, rtol=0.05, atol=0.1)
    with pytest.raises(ValueError, match="KV cache is"):
        model.forward_paged([SeqInput([1], 0, [0])], make_cache())
