"""How a worker process is started and how it says it is ready: one definition for the
embedded cluster, the test and benchmark harness, and the worker itself."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any, Final

READY_PREFIX: Final = b"PDTRIO_READY "


def worker_command(config: Mapping[str, Any]) -> list[str]:
    """``pdtrio worker`` for a whole worker configuration; it exits when its stdin closes."""
    return [
        sys.executable,
        "-m",
        "pdtrio",
        "worker",
        "--config-json",
        json.dumps(config),
        "--exit-with-stdin",
    ]


def ready_line(info: Mapping[str, Any]) -> str:
    """The line a worker prints once it serves: its ports and identity."""
    return READY_PREFIX.decode() + json.dumps(info)


def parse_ready_line(line: bytes) -> dict[str, Any] | None:
    """What a ready line reports, or None for any other line."""
    if not line.startswith(READY_PREFIX):
        return None
    info: dict[str, Any] = json.loads(line[len(READY_PREFIX) :])
    return info
