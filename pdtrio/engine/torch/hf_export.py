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


def install_in_hub_cache(
    checkpoint_dir: Path, repo_id: str, cache_dir: Path, revision: str | None = None
) -> Path:
    """Lay ``checkpoint_dir`` out in a huggingface_hub cache as ``repo_id``'s ``main``: what
    ``hf download`` leaves (``models--Org--Name/blobs``, ``snapshots/<revision>``,
    ``refs/main``), so a machine that cannot reach the Hub serves the model by its name
    with ``HF_HUB_OFFLINE=1``.  The files are hard-linked where the file system allows,
    else copied.  Returns the snapshot directory."""
    import hashlib
    import os
    import shutil

    org, _, name = repo_id.partition("/")
    if not org or not name or "/" in name:
        raise SystemExit(f"{repo_id!r} is not a repo id (Org/Name)")
    files = sorted(p for p in checkpoint_dir.iterdir() if p.is_file())
    if revision is None:
        digest = hashlib.sha1()
        for path in files:
            digest.update(path.name.encode())
            digest.update(path.stat().st_size.to_bytes(8, "little"))
        revision = digest.hexdigest()
    repo = cache_dir / f"models--{org}--{name}"
    blobs = repo / "blobs"
    snapshot = repo / "snapshots" / revision
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in files:
        blob = blobs / _blob_name(path)
        if not blob.exists():
            try:
                os.link(path, blob)
            except OSError:
                shutil.copyfile(path, blob)
        link = snapshot / path.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def _blob_name(path: Path) -> str:
    """The Hub names a blob by its git object id (a sha256 for LFS files); any stable
    content hash serves the cache's readers, which follow the snapshot's links."""
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
