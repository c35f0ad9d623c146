"""``python -m benchmarks.worker_limits --quick``: a peer without the worker secret is refused,
and a flood of silent connections keeps no peer out.

Structure and refusals only: no timing or memory figure is compared with anything
(the machine is shared).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.quick_benchmarks import run_quick


def test_quick_run_refuses_the_unauthenticated_peer(tmp_path: Path) -> None:
    completed, out = run_quick("benchmarks.worker_limits", tmp_path, timeout=120)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    assert "unauthenticated: nothing but refusals" in completed.stdout

    report = json.loads(out.read_text())
    unauth = report["unauthenticated"]
    probes = unauth["probes"]
    posts = probes.pop("posts")
    # each answered after its headers alone, none of its body sent yet
    assert [post["status"] for post in posts] == [401] * 8
    assert set(probes) == {
        "/pd/link on decode",
        "/pd/link on prefill",
        "KV port, zero proof",
        "POST /pd/release of a live request",
    }
    assert all(probe["refused"] for probe in probes.values()), probes
    assert "HTTP 403" in probes["/pd/link on prefill"]["answer"]
    assert probes["POST /pd/release of a live request"]["answer"] == "HTTP 401"
    assert unauth["kv_blocks_after"] == unauth["kv_blocks_before"] > 0
    assert unauth["kv_leases_after"] == unauth["kv_leases_before"] == 1
    assert unauth["freed_with_secret_without_grant"] is False

    # a flood of silent HTTP connections: the worker keeps its bound, a peer still gets in
    flood = report["http_flood"]
    assert flood["peer_answer"] == "200"
    assert flood["still_open"] <= 256  # the default max_unauthenticated_connections
    assert flood["evicted"] >= flood["count"] - 256
