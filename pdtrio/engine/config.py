"""The shape of a Llama-family decoder, read from a HF config.json or GGUF metadata."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, final

import attrs

# HF model_type values whose checkpoints this decoder runs unchanged, with the
# `architectures` class each names in config.json (what docs/engines.md lists).
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
SUPPORTED_MODEL_TYPES = frozenset(SUPPORTED_ARCHITECTURES)


class UnsupportedModel(ValueError):
    """The checkpoint describes a model this engine cannot run correctly."""


def supported_architectures() -> str:
    """The architectures this engine runs, as a message names them."""
    return ", ".join(
        f"{name} (model_type {kind!r})" for kind, name in sorted(SUPPORTED_ARCHITECTURES.items())
    )


def check_supported_architecture(raw: Mapping[str, Any], source: str) -> None:
    """Refuse a HF ``config.json`` of an architecture this engine cannot run, naming the
    ones it can (before any weight is read or downloaded)."""
    model_type = raw.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        return
    named = raw.get("architectures") or []
    described = ", ".join(str(a) for a in named) if isinstance(named, list) else str(named)
    raise UnsupportedModel(
        f"{source}: model_type {model_type!r}{f' ({described})' if described else ''} is not "
        f"supported; this engine runs {supported_architectures()}"
    )


@final
@attrs.frozen
class RopeScaling:
    """How the checkpoint stretches RoPE beyond its training length.

    ``kind`` is ``"linear"`` (positions divided by ``factor``), ``"llama3"``
    (Llama 3.1's band-wise frequency scaling) or ``"freq_factors"`` (one divisor
    per frequency, as GGUF's ``rope_freqs`` tensor stores llama3 scaling).
    """

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.kind not in ("linear", "llama3", "freq_factors"):
            raise UnsupportedModel(f"unsupported rope scaling {self.kind!r}")

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any] | None) -> RopeScaling | None:
        if not raw:
            return None
        kind = raw.get("rope_type", raw.get("type"))
        if kind in (None, "default"):
            return None
        if kind == "linear":
            return cls(kind="linear", factor=float(raw["factor"]))
        if kind == "llama3":
            return cls(
                kind="llama3",
                factor=float(raw["factor"]),
                low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
                high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(
                    raw.get("original_max_position_embeddings", 8192)
                ),
            )
        raise UnsupportedModel(
            f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)"
        )


@final
@attrs.frozen
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModel(f"head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def from_hf_config(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Read a Llama / Mistral / Qwen2 ``config.json``."""
        model_type = raw.get("model_type")
        check_supported_architecture(raw, "config.json")
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        # transformers >= 5 moves theta and scaling into rope_parameters
        rope_params = raw.get("rope_parameters") or {}
        rope_theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling") or rope_params or None
        if model_type == "qwen2":
            attention_bias = bool(raw.get("attention_bias", True))
        else:
            attention_bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, list | tuple):
            eos_ids = tuple(int(e) for e in eos)
        else:
            eos_ids = (int(eos),)
        bos = raw.get("bos_token_id")
        head_dim = raw.get("head_dim") or hidden // heads
        max_positions = int(raw.get("max_position_embeddings", 2048))
        window = raw.get("sliding_window")
        uses_window = raw.get("use_sliding_window", model_type == "mistral")
        if window and uses_window:
            # no sliding-window attention here: stay exact by never going past the window
            max_positions = min(max_positions, int(window))
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=RopeScaling.from_hf(scaling),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
        )

    def with_eos(self, extra: tuple[int, ...]) -> ModelConfig:
        """The config with more stop ids (e.g. from generation_config.json), order kept."""
        merged = tuple(dict.fromkeys((*self.eos_token_ids, *extra)))
        return attrs.evolve(self, eos_token_ids=merged)

    def to_json_dict(self) -> dict[str, Any]:
        """A canonical, JSON-serialisable form (used for fingerprints)."""
        return attrs.asdict(self, recurse=True)
