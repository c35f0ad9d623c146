"""The embedded cluster's secret: made per start, handed over in the environment only."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from pdtrio.testing.processes import Processes, descendants

CONFIG = Path(__file__).parents[2] / "configs" / "synthetic.toml"


def test_the_embedded_workers_get_a_secret_no_command_line_shows() -> None:
    with Processes(stop_grace_s=10) as processes:
        router = processes.router(CONFIG, output="capture")
        children = [pid for pid in descendants(router.pid) if _is_worker(pid)]
        assert len(children) == 2
        secrets = set()
        for pid in children:
            environ = dict(
                entry.split(b"=", 1)
                for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if b"=" in entry
            )
            secret = environ[b"PDTRIO_WORKER_SECRET"]
            assert len(secret) >= 32
            assert secret not in Path(f"/proc/{pid}/cmdline").read_bytes()
            secrets.add(secret)
        assert len(secrets) == 1  # one for the cluster
        # the router still serves through them
        response = httpx.post(
            f"{router.url}/v1/completions",
            json={"model": "synthetic", "prompt": "hi", "max_tokens": 3},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        # and a local peer without the secret gets nothing from a worker
        log = processes.output(router.process, timeout=1).decode(errors="replace")
        urls = re.findall(
            r"ready in [0-9.]+ s at (http://[0-9.:]+)|ready at (http://[0-9.:]+)", log
        )
        worker_urls = [a or b for a, b in urls]
        assert worker_urls, log[-2000:]
        for url in worker_urls:
            assert httpx.get(f"{url}/pd/info", timeout=10).status_code == 401
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def _is_worker(pid: int) -> bool:
    try:
        return b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
