"""benchmarks.engine_reads against a real vLLM pair of its own (it kills its decode):
both routers serve, go quiet, and find the decode stopped, back, and dead."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.benchmark]


def test_the_benchmark_runs_quick(tmp_path: Path) -> None:
    out = tmp_path / "engine_reads.json"
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine_reads", "--quick", "--json", str(out)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-8000:]
    report = json.loads(out.read_text())
    assert len(report) == 2  # this tree and the baseline
    for figures in report.values():
        assert figures["idle_cpu_ms_per_s"] >= 0
        for found in ("stopped_found_s", "back_up_found_s", "dead_found_s"):
            assert figures[found] is not None, (found, figures)
