"""Load a model from a HF checkpoint directory or a GGUF file; nothing is downloaded."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, final

import attrs
import numpy as np
import torch

from pdtrio.engine.config import ModelConfig, RopeScaling, UnsupportedModel
from pdtrio.engine.progress import LoadProgress
from pdtrio.engine.torch.kv_cache import PagedKvCache
from pdtrio.engine.torch.model import CausalLM

if TYPE_CHECKING:
    from pdtrio.engine.tokenizer import Tokenizer

_HASHED_PREFIX_BYTES = 4 << 20  # enough to tell checkpoints apart without reading them whole

# GGUF architectures this decoder runs; llama's q/k rows are permuted by llama.cpp's converter.
_GGUF_ARCHS = frozenset({"llama", "qwen2"})
_GGUF_PERMUTED_ARCHS = frozenset({"llama"})

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@final
@attrs.frozen(eq=False)
class LoadedModel:
    """A model ready to run: weights on their device, its tokenizer, and its identity.

    ``fingerprint`` names the weights (not the dtype) for ``KvLayout``;
    ``tokenizer`` is None only when the loader was asked not to build one.
    """

    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer | None
    fingerprint: str
    name: str
    # the file stores every layer's linear weights in 4 bits (engine.int4_weights = "auto")
    int4_layers: bool = False

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def new_kv_cache(self, *, num_blocks: int, block_size: int = 16) -> PagedKvCache:
        """A KV cache for this model, on its device and in its dtype."""
        return PagedKvCache.for_model(
            self.config,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=self.dtype,
            device=self.device,
        )


def fingerprint_of(config: ModelConfig, *parts: bytes) -> str:
    """A short stable hash of the config and whatever bytes identify the weights."""
    digest = hashlib.sha256()
    digest.update(json.dumps(config.to_json_dict(), sort_keys=True).encode())
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()[:16]


def _file_identity(path: Path) -> bytes:
    with path.open("rb") as f:
        head = f.read(_HASHED_PREFIX_BYTES)
    return path.name.encode() + path.stat().st_size.to_bytes(8, "little") + head


# --- HF checkpoint directories ------------------------------------------------


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    # Mistral repos also ship consolidated.safetensors with other tensor names
    files = sorted(
        p for p in directory.glob("*.safetensors") if not p.name.startswith("consolidated")
    )
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")
    return files


def _count_safetensors(files: list[Path]) -> int:
    from safetensors import safe_open

    total = 0
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            total += len(f.keys())
    return total


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _mib(files: list[Path]) -> float:
    return sum(p.stat().st_size for p in files) / (1 << 20)


def _hf_tokenizer(directory: Path, extra_eos_token_ids: tuple[int, ...]) -> Tokenizer:
    from pdtrio.engine.tokenizer import Tokenizer

    tokenizer_json = directory / "tokenizer.json"
    if not tokenizer_json.exists():
        raise FileNotFoundError(f"{directory} has no tokenizer.json")
    config_path = directory / "tokenizer_config.json"
    tokenizer_config: dict[str, Any] = (
        json.loads(config_path.read_text()) if config_path.exists() else {}
    )
    if not tokenizer_config.get("chat_template"):
        # newer checkpoints keep the template beside tokenizer_config.json
        jinja = directory / "chat_template.jinja"
        as_json = directory / "chat_template.json"
        if jinja.exists():
            tokenizer_config["chat_template"] = jinja.read_text()
        elif as_json.exists():
            tokenizer_config["chat_template"] = json.loads(as_json.read_text())["chat_template"]
    return Tokenizer.from_files(
        tokenizer_json, tokenizer_config, extra_eos_token_ids=extra_eos_token_ids
    )


def _generation_eos(directory: Path) -> tuple[int, ...]:
    path = directory / "generation_config.json"
    if not path.exists():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def load_hf_checkpoint(
    directory: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    name: str | None = None,
    load_tokenizer: bool = True,
    progress: LoadProgress | None = None,
) -> LoadedModel:
    """Load config.json, the (possibly sharded) safetensors and the tokenizer files."""
    progress = LoadProgress() if progress is None else progress
    directory = Path(directory)
    config_path = directory / "config.json"
    try:
        raw_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise UnsupportedModel(f"{config_path} is not valid JSON: {exc}") from exc
    generation_eos = _generation_eos(directory)
    try:
        config = ModelConfig.from_hf_config(raw_config).with_eos(generation_eos)
    except KeyError as exc:
        # (from_hf_config reads the required keys with raw[...]: the file lacks one)
        raise UnsupportedModel(f"{config_path} has no {exc}") from exc
    files = _weight_files(directory)
    total = _count_safetensors(files)
    progress.stage(
        "reading weights: %d tensors from %d safetensors file%s (%.1f MiB) into %s on %s",
        total,
        len(files),
        "" if len(files) == 1 else "s",
        _mib(files),
        str(dtype).removeprefix("torch."),
        device,
    )
    model = CausalLM.build(
        config,
        progress.track(_iter_safetensors(files), total, "tensors"),
        device=device,
        dtype=dtype,
    )
    if load_tokenizer:
        progress.stage("reading the tokenizer")
    tokenizer = _hf_tokenizer(directory, generation_eos) if load_tokenizer else None
    return LoadedModel(
        config=config,
        model=model,
        tokenizer=tokenizer,
        fingerprint=fingerprint_of(config, *(_file_identity(p) for p in files)),
        name=name or directory.resolve().name,
    )


# --- GGUF ---------------------------------------------------------------------


def _native(value: Any) -> Any:
    """GGUF field contents as plain python values (no numpy scalars)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [_native(v) for v in value]
    return value


def _unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Invert convert_hf_to_gguf's q/k row permutation (interleaved -> rotate_half RoPE)."""
    shape = weight.shape
    return (
        weight.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def _gguf_tensor(tensor: Any) -> np.ndarray:
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    values = values.astype(np.float32, copy=False).reshape(shape)
    # F32 comes back as a view of the read-only memmap: copy so torch gets writable memory
    return values if values.flags.writeable else values.copy()


def _gguf_config(
    fields: dict[str, Any], arch: str, tensor_names: set[str], rope_freqs: Any
) -> ModelConfig:
    def get(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    def need(key: str) -> Any:
        value = get(key)
        if value is None:
            raise UnsupportedModel(f"the GGUF metadata has no {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    vocab = get("vocab_size")
    if vocab is None:
        vocab = len(fields.get("tokenizer.ggml.tokens", ()))
    scaling: RopeScaling | None = None
    scaling_type = get("rope.scaling.type")
    if rope_freqs is not None:
        scaling = RopeScaling(kind="freq_factors", freq_factors=tuple(float(x) for x in rope_freqs))
    elif scaling_type == "linear":
        scaling = RopeScaling(kind="linear", factor=float(need("rope.scaling.factor")))
    elif scaling_type not in (None, "none"):
        raise UnsupportedModel(f"unsupported GGUF rope scaling {scaling_type!r}")
    eos_ids = tuple(
        dict.fromkeys(
            int(fields[key])
            for key in (
                "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id",
            )
            if key in fields
        )
    )
    bos = fields.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
    )


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_GGUF_LAYER_NAMES[parts[2]]}"
    raise UnsupportedModel(f"unexpected GGUF tensor {gguf_name!r}")


def _read_gguf_fields_and_tensors(
    path: Path,
) -> tuple[dict[str, Any], dict[str, Callable[[], np.ndarray]], dict[str, int]]:
    """The file's metadata, for each tensor a function giving its float32 values, and
    each tensor's GGML type."""
    from pdtrio.engine.torch.gguf_file import GGUFFormatError, dequantize, read_gguf

    try:
        parsed = read_gguf(path)
    except GGUFFormatError:
        # big-endian, GGUF v1, ...: gguf's own reader (slow, but it knows them all)
        return _read_gguf_with_gguf(path)
    values = {
        name: functools.partial(dequantize, tensor) for name, tensor in parsed.tensors.items()
    }
    types = {name: tensor.ggml_type for name, tensor in parsed.tensors.items()}
    return parsed.fields, values, types


def _read_gguf_with_gguf(
    path: Path,
) -> tuple[dict[str, Any], dict[str, Callable[[], np.ndarray]], dict[str, int]]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except ValueError as exc:  # what gguf raises for a file that is not GGUF it can read
        raise UnsupportedModel(f"{path} is not a GGUF file this engine reads: {exc}") from exc
    fields = {key: _native(field.contents()) for key, field in reader.fields.items()}
    values = {t.name: functools.partial(_gguf_tensor, t) for t in reader.tensors}
    return fields, values, {t.name: int(t.tensor_type) for t in reader.tensors}


_GGUF_Q4_1: Final = 3
_GGUF_LAYER_LINEARS = frozenset(
    {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
)


def _layers_in_q4_1(types: Mapping[str, int]) -> bool:
    """Whether every layer's linear weight is stored as GGUF Q4_1 (4-bit codes, groups of
    32 with a scale and a minimum each: what CausalLM.quantize_int4 finds again)."""
    linears = [
        ggml_type
        for name, ggml_type in types.items()
        if name.startswith("blk.")
        and name.endswith(".weight")
        and name.split(".")[2] in _GGUF_LAYER_LINEARS
    ]
    return bool(linears) and all(t == _GGUF_Q4_1 for t in linears)


def load_gguf(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    name: str | None = None,
    load_tokenizer: bool = True,
    progress: LoadProgress | None = None,
) -> LoadedModel:
    """Load a llama/qwen2 GGUF, dequantising every tensor to ``dtype``."""
    progress = LoadProgress() if progress is None else progress
    path = Path(path)
    fields, tensors, types = _read_gguf_fields_and_tensors(path)
    arch = fields.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise UnsupportedModel(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(_GGUF_ARCHS))})"
        )
    rope_freqs = tensors.pop("rope_freqs.weight", None)
    config = _gguf_config(
        fields,
        arch,
        set(tensors),
        None if rope_freqs is None else rope_freqs().reshape(-1).tolist(),
    )

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for gguf_name, tensor_values in tensors.items():
            values = tensor_values()
            role = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
            if arch in _GGUF_PERMUTED_ARCHS and role == "attn_q":
                values = _unpermute_rows(values, config.num_heads)
            elif arch in _GGUF_PERMUTED_ARCHS and role == "attn_k":
                values = _unpermute_rows(values, config.num_kv_heads)
            yield _hf_name(gguf_name), torch.from_numpy(np.ascontiguousarray(values))

    progress.stage(
        "reading weights: %d tensors from %s (%.1f MiB) into %s on %s",
        len(tensors),
        path.name,
        _mib([path]),
        str(dtype).removeprefix("torch."),
        device,
    )
    model = CausalLM.build(
        config, progress.track(weights(), len(tensors), "tensors"), device=device, dtype=dtype
    )
    tokenizer: Tokenizer | None = None
    if load_tokenizer:
        progress.stage("reading the tokenizer")
        from pdtrio.engine.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf_metadata(
            {key: value for key, value in fields.items() if key.startswith("tokenizer.")}
        )
    return LoadedModel(
        config=config,
        model=model,
        tokenizer=tokenizer,
        fingerprint=fingerprint_of(config, _file_identity(path)),
        name=name or path.stem,
        int4_layers=_layers_in_q4_1(types),
    )
