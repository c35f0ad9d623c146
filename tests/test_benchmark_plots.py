"""``--plot``: the shared helpers draw latency CDFs and throughput curves into a PNG."""

from __future__ import annotations

import importlib.util
import random
from functools import partial
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from benchmarks.plotting import latency_cdfs, save_figure, throughput_vs_concurrency  # noqa: E402

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_latency_cdfs_and_throughput_are_written_as_a_png(tmp_path: Path) -> None:
    rng = random.Random(7)
    ttft = {
        "pd": [rng.lognormvariate(3.0, 1.2) for _ in range(200)],  # a wide spread: log x
        "colocated": [rng.lognormvariate(2.5, 0.4) for _ in range(200)],
    }
    itl = {"pd": [rng.gauss(10, 1) for _ in range(500)], "colocated": []}  # one mode empty
    throughput = {"egress on": [(8, 700.0), (16, 1300.0)], "egress off": [(8, 650.0)]}
    path = save_figure(
        tmp_path / "figures" / "bench.png",
        partial(latency_cdfs, series=ttft, xlabel="TTFT (ms)", title="TTFT"),
        partial(latency_cdfs, series=itl, xlabel="ITL (ms)"),
        partial(throughput_vs_concurrency, series=throughput),
        title="synthetic benchmark",
    )
    assert path == tmp_path / "figures" / "bench.png"
    data = path.read_bytes()
    assert data.startswith(_PNG_MAGIC) and len(data) > 10_000


def test_a_benchmark_asks_for_the_extra_when_matplotlib_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from benchmarks import plotting

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match=r"pip install 'pdtrio\[plot\]'"):
        plotting.require_matplotlib()
