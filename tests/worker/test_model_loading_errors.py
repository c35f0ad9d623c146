"""``pdtrio worker`` tells a configuration mistake (one clean line, exit 2) from a bug in
its own loading code (logged once, with its traceback, exit 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# main() as the CLI runs it, after the snippet (a monkeypatch) has run
_RUN = """
import sys
import pdtrio.worker.main as worker_main
{patch}
sys.exit(worker_main.main(["--config-json", {config!r}]))
"""


def _worker(engine: dict[str, object], patch: str = "") -> subprocess.CompletedProcess[str]:
    config = json.dumps({"role": "prefill", "engine": engine})
    script = _RUN.format(patch=textwrap.dedent(patch), config=config)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )


def _assert_clean_config_error(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("pdtrio worker: cannot load model"), result.stderr
    for word in words:
        assert word in last, result.stderr


def _assert_bug_with_traceback(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 1, result.stderr
    assert "CRITICAL pdtrio.worker: loading model" in result.stderr, result.stderr
    assert "a bug, not a configuration mistake" in result.stderr
    assert result.stderr.count("Traceback (most recent call last)") == 1, result.stderr
    assert "pdtrio worker: cannot load model" not in result.stderr  # not a config message
    for word in words:
        assert word in result.stderr, result.stderr


def test_a_bug_in_the_loader_shows_its_traceback() -> None:
    # a TypeError from our own code, deep in the torch engine's loading
    result = _worker(
        {"kind": "torch", "model": "tiny-random"},
        """
        import pdtrio.engine.torch.engine as engine

        def load_builtin(name, **kwargs):
            return broken_helper(name)

        def broken_helper(name):
            return name + 1

        engine.load_builtin = load_builtin
        """,
    )
    _assert_bug_with_traceback(result, "broken_helper", "TypeError", "engine/torch/engine.py")


def test_an_attribute_error_while_building_the_engine_shows_its_traceback() -> None:
    result = _worker(
        {"kind": "synthetic"},
        """
        def build_engine(config):
            return config.no_such_setting

        worker_main.build_engine = build_engine
        """,
    )
    _assert_bug_with_traceback(result, "AttributeError", "no_such_setting")


def test_a_broken_import_inside_pdtrio_is_a_bug_not_missing_extras() -> None:
    result = _worker(
        {"kind": "synthetic"},
        """
        def build_engine(config):
            raise ImportError(
                "cannot import name 'Gone' from 'pdtrio.engine.api'", name="pdtrio.engine.api"
            )

        worker_main.build_engine = build_engine
        """,
    )
    _assert_bug_with_traceback(result, "ImportError", "Gone")


def test_a_missing_extra_is_a_clean_line() -> None:
    result = _worker(
        {"kind": "synthetic"},
        """
        def build_engine(config):
            raise ModuleNotFoundError("No module named 'gguf'", name="gguf")

        worker_main.build_engine = build_engine
        """,
    )
    _assert_clean_config_error(result, "pdtrio[worker]", "gguf")


def test_a_missing_checkpoint_is_a_clean_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-checkpoint"
    result = _worker({"kind": "torch", "model": f"{missing}/"})
    _assert_clean_config_error(result, "No such file", "config.json")


def test_an_unknown_builtin_model_is_a_clean_line() -> None:
    result = _worker({"kind": "torch", "model": "no-such-model"})
    _assert_clean_config_error(result, "unknown built-in model 'no-such-model'", "tiny-random")


@pytest.mark.parametrize(
    ("files", "words"),
    [
        ({"config.json": "{not json"}, ("config.json is not valid JSON",)),
        ({"config.json": '{"model_type": "llama"}'}, ("config.json has no", "hidden_size")),
        ({"config.json": '{"model_type": "gpt2"}'}, ("model_type 'gpt2' is not supported",)),
    ],
)
def test_a_broken_checkpoint_is_a_clean_line(
    tmp_path: Path, files: dict[str, str], words: tuple[str, ...]
) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    result = _worker({"kind": "torch", "model": f"{tmp_path}/"})
    _assert_clean_config_error(result, *words)


def test_a_file_that_is_not_gguf_is_a_clean_line(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"this is not a GGUF file at all" * 4)
    result = _worker({"kind": "torch", "model": str(fake)})
    _assert_clean_config_error(result, "not a GGUF file", "magic")


def test_a_device_torch_cannot_name_is_a_clean_line() -> None:
    result = _worker({"kind": "torch", "model": "tiny-random", "device": "warp-drive"})
    _assert_clean_config_error(result, "engine.device = 'warp-drive'")


def test_a_config_mistake_keeps_its_cause_for_debug_logs(tmp_path: Path) -> None:
    # the one line is the answer; PDTRIO_LOG_LEVEL=DEBUG also says where it came from
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _RUN.format(
                patch="",
                config=json.dumps(
                    {"role": "prefill", "engine": {"kind": "torch", "model": f"{tmp_path}/x/"}}
                ),
            ),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PDTRIO_LOG_LEVEL": "DEBUG"},
    )
    assert result.returncode == 2, result.stderr
    assert "DEBUG pdtrio.worker: the configuration error came from here" in result.stderr
    assert "FileNotFoundError" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("pdtrio worker: cannot load model")


def test_bad_config_json_is_a_clean_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdtrio", "worker", "--config-json", "{role: prefill"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "pdtrio worker: --config-json is not valid JSON" in result.stderr
