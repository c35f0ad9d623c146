"""``python -m pdtrio --help``, ``pdtrio worker --help`` and ``pdtrio register --help``:
every option, with its default (``pdtrio serve``'s: tests/test_serve.py)."""

from __future__ import annotations

import argparse
import subprocess
import sys

from pdtrio.discovery.register_engine import argument_parser as register_argument_parser
from pdtrio.worker.main import argument_parser


def test_top_level_help_names_the_commands_and_how_the_router_runs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdtrio", "--help"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0
    for text in (
        "serve",
        "worker",
        "register",
        "faults",
        "--version",
        "pdtrio serve --help",
        # the way it ran before pdtrio serve still does
        "hypercorn -k trio -b 127.0.0.1:8000 pdtrio.app:app",
    ):
        assert text in result.stdout


def test_an_unknown_command_is_refused_naming_the_commands() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdtrio", "route"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "invalid choice: 'route'" in result.stderr and "'serve'" in result.stderr


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
        if action.dest == "help" or action.help == argparse.SUPPRESS:
            continue  # (a suppressed one: a previous release's flag, hidden)
        assert action.help and "default" in action.help, action.option_strings
        flags.update(action.option_strings)
    for flag in (
        "--config",
        "--device",
        "--dtype",
        "--num-kv-blocks",
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
