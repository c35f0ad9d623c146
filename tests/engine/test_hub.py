"""Models named by Hugging Face repo id, from huggingface_hub's cache; and the load's progress.

Nothing here can reach the Hub: each test lays a cache out the way ``hf download``
leaves it (``models--Org--Name/{blobs,snapshots/<rev>,refs/main}``) and loads with
``HF_HUB_OFFLINE=1``.  The download path itself (``snapshot_download`` online) is
huggingface_hub's, and untested here.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdtrio.config import EngineConfig
from pdtrio.engine.config import ModelConfig, UnsupportedModel
from pdtrio.engine.hub import ModelNotAvailable, is_repo_id, resolve_repo_id
from pdtrio.engine.progress import LoadProgress
from pdtrio.engine.torch.builtin import BuiltinModelUnavailable, smollm2_gguf_path
from pdtrio.engine.torch.engine import load_model
from pdtrio.engine.torch.hf_export import install_in_hub_cache
from pdtrio.engine.torch.model import CausalLM, random_state_dict
from tests.engine.test_loaders import assert_same_model, hf_config, write_hf_checkpoint

REPO = "TestOrg/Tiny-Llama"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty huggingface_hub cache, offline, that this process uses."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _tiny_repo(tmp_path: Path, cache: Path, **overrides: object) -> ModelConfig:
    raw = hf_config(**overrides)
    config = ModelConfig.from_hf_config(raw)
    write_hf_checkpoint(tmp_path / "ckpt", raw, random_state_dict(config, seed=7))
    install_in_hub_cache(tmp_path / "ckpt", REPO, cache)
    return config


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("Qwen/Qwen2.5-0.5B-Instruct", True),
        ("smollm2-135m-instruct", False),
        ("/models/llama", False),
        ("./models/llama", False),
        ("models/llama/", False),
        ("model.gguf", False),
        ("a/b/c", False),
    ],
)
def test_a_repo_id_is_told_from_a_path_and_a_builtin_name(name: str, expected: bool) -> None:
    assert is_repo_id(name) is expected


def test_an_existing_directory_is_a_path_even_when_it_reads_like_a_repo_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "Org" / "Name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_repo_id("Org/Name")


def test_a_model_by_repo_id_loads_from_the_cache_offline_under_its_id(
    tmp_path: Path, hub: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _tiny_repo(tmp_path, hub)
    caplog.set_level(logging.INFO, logger="pdtrio.engine")

    loaded = load_model(EngineConfig(model=REPO, dtype="float32"))

    assert loaded.name == REPO  # what clients put in `model`, as vLLM serves it
    assert_same_model(loaded, CausalLM.build(config, random_state_dict(config, seed=7)))
    stages = [r.getMessage() for r in caplog.records if r.name == "pdtrio.engine.load"]
    assert any(s.startswith(f"resolving {REPO} in the Hugging Face cache") for s in stages)
    assert any("reading weights: " in s and "tensors from 1 safetensors file" in s for s in stages)
    assert any(s.startswith("read ") and " tensors in " in s for s in stages), stages


def test_a_repo_id_not_in_the_cache_offline_is_named_as_not_cached(hub: Path) -> None:
    with pytest.raises(ModelNotAvailable, match="not in the Hugging Face cache") as caught:
        resolve_repo_id("NoSuchOrg/NoSuchModel")
    message = str(caught.value)
    assert "'NoSuchOrg/NoSuchModel'" in message and "HF_HUB_OFFLINE=1" in message
    assert str(hub) in message
    assert isinstance(caught.value, OSError)  # the worker's one-line "cannot load model"


def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(
    tmp_path: Path, hub: Path
) -> None:
    checkpoint = tmp_path / "gpt2"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    install_in_hub_cache(checkpoint, "openai-community/gpt2", hub)

    with pytest.raises(UnsupportedModel) as caught:
        load_model(EngineConfig(model="openai-community/gpt2", dtype="float32"))

    message = str(caught.value)
    assert "openai-community/gpt2" in message and "GPT2LMHeadModel" in message
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert supported in message


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_is_drawn_on_a_terminal_only(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdtrio.engine.load")
    terminal = _Terminal()
    assert list(LoadProgress(terminal).track(iter(range(5)), 5, "tensors")) == list(range(5))
    drawn = terminal.getvalue()
    assert drawn.startswith("\rloading weights [") and "5/5 tensors" in drawn
    assert drawn.endswith("\n")  # the next log line starts on its own line

    log_file = io.StringIO()
    assert list(LoadProgress(log_file).track(iter(range(5)), 5, "tensors")) == list(range(5))
    assert log_file.getvalue() == ""
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == ["read 5 tensors"] * 2


@pytest.mark.slow  # SmolLM2's weights, exported and loaded
def test_smollm2_by_its_hub_name_from_a_cache_laid_out_from_the_shipped_weights(
    tmp_path: Path, hub: Path
) -> None:
    try:
        gguf = smollm2_gguf_path()
    except BuiltinModelUnavailable as exc:
        pytest.skip(str(exc))
    from pdtrio.tools.export_hf import main as export_hf

    repo = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert export_hf([str(tmp_path / "hf"), "--gguf", str(gguf), "--repo-id", repo]) == 0

    loaded = load_model(EngineConfig(model=repo, dtype="float32"))

    assert loaded.name == repo
    assert loaded.tokenizer is not None
    prompt = loaded.tokenizer.encode_chat([("user", "What is the capital of France?")])
    answer: list[int] = []
    for _ in range(8):
        logits = loaded.model.forward_reference(prompt + answer)
        answer.append(int(logits[-1].argmax()))
    assert "Paris" in loaded.tokenizer.decode(answer)


def _worker(hub: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "pdtrio", "worker", "--num-kv-blocks", "8", *args]
    return subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow  # starts a worker process
def test_a_worker_serves_a_model_by_repo_id_from_the_cache_offline(
    tmp_path: Path, hub: Path
) -> None:
    _tiny_repo(tmp_path, hub)
    worker = _worker(hub, "--model", REPO, "--dtype", "float32", "--exit-with-stdin")
    try:
        assert worker.stdout is not None
        ready = next(line for line in worker.stdout if line.startswith("PDTRIO_READY "))
        assert json.loads(ready.removeprefix("PDTRIO_READY "))["model"] == REPO
    finally:
        _, stderr = worker.communicate(timeout=60)  # (stdin closes: the worker exits)
    assert worker.returncode == 0, stderr
    assert f"resolving {REPO} in the Hugging Face cache ({hub}), offline" in stderr
    assert "KV cache allocated: 8 blocks" in stderr


@pytest.mark.slow  # starts a worker process
def test_a_worker_asked_for_a_model_not_cached_offline_exits_with_one_line(hub: Path) -> None:
    worker = _worker(hub, "--model", "NoSuchOrg/NoSuchModel")
    _, stderr = worker.communicate(timeout=120)
    assert worker.returncode == 2
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("pdtrio worker: cannot load model 'NoSuchOrg/NoSuchModel': ")
    assert "not in the Hugging Face cache" in last and "HF_HUB_OFFLINE=1" in last
