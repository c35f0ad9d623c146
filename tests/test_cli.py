"""``python -m pdtrio --help``, ``pdtrio worker --help`` and ``pdtrio register --help``:
every option, with its default."""

from __future__ import annotations

import subprocess
import sys

from pdtrio.discovery.register_engine import argument_parser as register_argument_parser
from pdtrio.worker.main import argument_parser


def test_top_level_help_names_the_commands_the_router_and_the_environment() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdtrio", "--help"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0
    for text in (
        "worker",
        "register",
        "hypercorn -k trio -b 127.0.0.1:8000 pdtrio.app:app",
        "PDTRIO_CONFIG",
        "PDTRIO_ETCD_ENDPOINTS",
        "PDTRIO_LOG_LEVEL",
        "PDTRIO_LOG_FORMAT",
    ):
        assert text in result.stdout


def test_no_command_prints_the_usage_and_fails() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdtrio"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "usage: pdtrio" in result.stderr


def test_every_worker_option_is_described_with_its_default() -> None:
    parser = argument_parser()
    flags = set()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help and "default" in action.help, action.option_strings
        flags.update(action.option_strings)
    for flag in (
        "--config",
        "--device",
        "--dtype",
        "--kv-blocks",
        "--transfer-port",
        "--served-model-name",
        "--log-level",
        "--log-format",
    ):
        assert flag in flags


def test_every_register_option_is_described_with_its_default_or_as_required() -> None:
    parser = register_argument_parser()
    flags = set()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help and ("default" in action.help or "required" in action.help), (
            action.option_strings
        )
        flags.update(action.option_strings)
    for flag in ("--kind", "--role", "--url", "--etcd", "--prefix", "--api-key", "--worker-secret"):
        assert flag in flags


def test_register_help_runs_from_the_command_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdtrio", "register", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0
    assert "usage: pdtrio register" in result.stdout and "PDTRIO_ETCD_ENDPOINTS" in result.stdout
