"""A GGUF model written as a Hugging Face checkpoint directory (``pdtrio.tools.export_hf``
is its command line): what vLLM and SGLang load, from pdtrio's own GGUF reader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_ARCH_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def export(gguf_path: Path, out_dir: Path, dtype_name: str = "bfloat16") -> None:
    """Convert ``gguf_path`` into ``out_dir`` (created; files in it are overwritten)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from pdtrio.engine.tokenizer import Tokenizer
    from pdtrio.engine.torch import loaders

    fields, tensors, _ = loaders._read_gguf_fields_and_tensors(gguf_path)
    arch = fields.get("general.architecture")
    if arch not in _ARCH_CLASSES:
        raise SystemExit(f"{gguf_path}: GGUF architecture {arch!r} is not supported")
    if "rope_freqs.weight" in tensors:
        raise SystemExit(f"{gguf_path}: rope frequency factors are not exported")
    config = loaders._gguf_config(fields, arch, set(tensors), None)
    dtype = getattr(torch, dtype_name)
    state: dict[str, torch.Tensor] = {}
    for gguf_name, values_of in tensors.items():
        values = values_of()
        role = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        if arch in loaders._GGUF_PERMUTED_ARCHS and role == "attn_q":
            values = loaders._unpermute_rows(values, config.num_heads)
        elif arch in loaders._GGUF_PERMUTED_ARCHS and role == "attn_k":
            values = loaders._unpermute_rows(values, config.num_kv_heads)
        state[loaders._hf_name(gguf_name)] = torch.from_numpy(
            np.ascontiguousarray(values, dtype=np.float32)
        ).to(dtype)

    tokenizer_fields = {k: v for k, v in fields.items() if k.startswith("tokenizer.")}
    tokenizer = Tokenizer.from_gguf_metadata(tokenizer_fields)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer._tok.save(str(out_dir / "tokenizer.json"))
    eos_ids = list(config.eos_token_ids)
    hf_config: dict[str, Any] = {
        "architectures": [_ARCH_CLASSES[arch]],
        "model_type": arch,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "torch_dtype": dtype_name,
    }
    if config.rope_scaling is not None:
        scaling = config.rope_scaling
        hf_config["rope_scaling"] = {"rope_type": scaling.kind, "factor": scaling.factor}
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": hf_config["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    def token(key: str) -> str | None:
        value = fields.get(key)
        return None if value is None else tokenizer._tok.id_to_token(int(value))

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
        "chat_template": fields.get("tokenizer.chat_template"),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
