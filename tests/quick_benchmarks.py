"""Running a benchmark's ``--quick`` mode from a test: the same command a user runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_quick(
    module: str, tmp_path: Path, *, timeout: float, args: tuple[str, ...] = ()
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``python -m <module> --quick --json <file> [args]`` from the repository root; the
    finished process and where its JSON report is (if it wrote one)."""
    out = tmp_path / f"{module.rsplit('.', 1)[-1]}.json"
    completed = subprocess.run(
        [sys.executable, "-m", module, "--quick", "--json", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return completed, out
