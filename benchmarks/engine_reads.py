"""What a router in front of a real vLLM PD pair costs while idle, and how soon it finds
an engine that stopped answering or died: this tree against a baseline commit.

    python -m benchmarks.engine_reads [--quick] [--baseline REV] [--idle-s S] [--json PATH]

One vLLM prefill and one vLLM decode (``pdtrio.testing.vllm``; PDTRIO_VLLM_PYTHON and
PDTRIO_VLLM_MODEL as for ``nox -s vllm``), and two routers over them at once, each
``hypercorn -k trio pdtrio.app:app`` in its own process: this tree's, and the baseline
commit's (checked out in a temporary git worktree; by default the commit before the
router read engines' ``/metrics`` only while placement wants loads). Both take one
request each, then sit through a quiet spell, then:

1. **idle**: each router's process CPU over ``--idle-s`` seconds with no request,
   ms a second (the router reads each engine's ``/health``, and the baseline its
   ``/metrics`` too, every second);
2. **stopped engine**: decode under ``SIGSTOP``: how long until each router's
   ``/health`` reports it down (``SIGCONT`` then, and both see it up again);
3. **dead engine**: decode under ``SIGKILL`` (its process group): how long until each
   router's ``/health`` reports it down.

Both routers see the same engines and the same signals at the same instant, so
the detection times compare directly; the idle CPU figures are read over the same
window. The machine's CPU is printed: compare figures within one run. ``--quick``
(run by ``nox -s vllm``, whose figures mean little) idles 3 s.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

import httpx
import trio

from benchmarks.kit import aligned_table, cpu_model, write_json
from pdtrio.testing.processes import cpu_seconds, descendants, free_port, router_command
from pdtrio.testing.vllm import NIXL_KV_CONFIG, SERVED_MODEL, VllmServer, vllm_pd_pair

LOOPBACK: Final = "127.0.0.1"
# the commit before reads of engines' /metrics followed placement
DEFAULT_BASELINE: Final = "ecb26ad"
QUIET_S: Final = 8.0  # past the 5 s placement keeps loads wanted after a pick
DETECTION_BOUND_S: Final = 60.0
_STOP_S: Final = 30.0


def _progress(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


async def _until_healthy(url: str, within_s: float = 300.0) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        with trio.fail_after(within_s):
            while True:
                try:
                    if (await http.get(f"{url}/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.5)


async def _complete(url: str) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        response = await http.post(
            f"{url}/v1/completions",
            json={"model": SERVED_MODEL, "prompt": "The capital of France is", "max_tokens": 4},
        )
        response.raise_for_status()


async def _engine_healthy(http: httpx.AsyncClient, router_url: str, engine_url: str) -> bool:
    engines = (await http.get(f"{router_url}/health")).json()["engines"]
    return bool(next(e["healthy"] for e in engines if e["url"] == engine_url))


async def _seconds_until(
    routers: dict[str, str], engine_url: str, healthy: bool
) -> dict[str, float]:
    """For each router, seconds from now until its /health says ``engine_url`` is
    ``healthy`` (polled every 20 ms; DETECTION_BOUND_S at most)."""
    started = time.monotonic()
    found: dict[str, float] = {}

    async def watch(name: str, url: str) -> None:
        async with httpx.AsyncClient(timeout=5) as http:
            with trio.move_on_after(DETECTION_BOUND_S):
                while True:
                    if await _engine_healthy(http, url, engine_url) == healthy:
                        found[name] = time.monotonic() - started
                        return
                    await trio.sleep(0.02)

    async with trio.open_nursery() as nursery:
        for name, url in routers.items():
            nursery.start_soon(watch, name, url)
    return found


async def _idle_cpu(pids: dict[str, int], idle_s: float) -> dict[str, float]:
    """Each router's process tree's CPU (hypercorn's worker is a child), ms a second."""
    trees = {name: [pid, *descendants(pid)] for name, pid in pids.items()}
    before = {name: cpu_seconds(tree) for name, tree in trees.items()}
    await trio.sleep(idle_s)
    return {
        name: (cpu_seconds(tree) - before[name]) / idle_s * 1000 for name, tree in trees.items()
    }


async def _measure(
    routers: dict[str, tuple[subprocess.Popen[bytes], str]],
    decode: VllmServer,
    idle_s: float,
) -> dict[str, Any]:
    urls = {name: url for name, (_, url) in routers.items()}
    for name, url in urls.items():
        await _until_healthy(url)
        await _complete(url)
        _progress(f"{name}: served a request")
    await trio.sleep(QUIET_S)
    _progress(f"idle for {idle_s:g} s")
    idle = await _idle_cpu({name: process.pid for name, (process, _) in routers.items()}, idle_s)
    _progress("decode under SIGSTOP")
    os.killpg(decode.process.pid, signal.SIGSTOP)
    try:
        stopped = await _seconds_until(urls, decode.url, healthy=False)
    finally:
        os.killpg(decode.process.pid, signal.SIGCONT)
    back = await _seconds_until(urls, decode.url, healthy=True)
    await trio.sleep(QUIET_S)
    _progress("decode killed")
    os.killpg(decode.process.pid, signal.SIGKILL)
    dead = await _seconds_until(urls, decode.url, healthy=False)
    return {
        name: {
            "idle_cpu_ms_per_s": idle[name],
            "stopped_found_s": stopped.get(name),
            "back_up_found_s": back.get(name),
            "dead_found_s": dead.get(name),
        }
        for name in urls
    }


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=_STOP_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    baseline_tree = work / "baseline"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(baseline_tree), args.baseline],
        check=True,
        capture_output=True,
    )
    try:
        _progress("starting the vLLM pair")
        with vllm_pd_pair(work, kv_config=NIXL_KV_CONFIG) as (prefill, decode):
            config = work / "router.toml"
            config.write_text(
                f'[[instances]]\nkind = "vllm"\nrole = "prefill"\nurl = "{prefill.url}"\n'
                f'[[instances]]\nkind = "vllm"\nrole = "decode"\nurl = "{decode.url}"\n'
            )
            trees = {"this tree": Path.cwd(), f"baseline {args.baseline}": baseline_tree}
            routers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
            try:
                for name, tree in trees.items():
                    port = free_port()
                    env = {**os.environ, "PDTRIO_CONFIG": str(config), "PYTHONPATH": str(tree)}
                    with (work / f"router-{port}.log").open("wb") as log:
                        routers[name] = (
                            subprocess.Popen(
                                router_command(f"{LOOPBACK}:{port}"),
                                cwd=tree,
                                env=env,
                                stdout=log,
                                stderr=subprocess.STDOUT,
                            ),
                            f"http://{LOOPBACK}:{port}",
                        )
                return trio.run(_measure, routers, decode, args.idle_s)
            finally:
                for process, _ in routers.values():
                    _stop(process)
    finally:
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(baseline_tree)],
            check=False,
            capture_output=True,
        )


def _seconds(value: float | None) -> str:
    return "not found" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="the commit to compare with")
    parser.add_argument("--idle-s", type=float, default=20.0, help="the idle window, seconds")
    parser.add_argument("--quick", action="store_true", help="a 3 s idle window (a check)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    if args.quick:
        args.idle_s = 3.0
    with tempfile.TemporaryDirectory(prefix="engine-reads-") as work:
        report = _run(args, Path(work))
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores")
    rows = [
        [
            name,
            f"{figures['idle_cpu_ms_per_s']:.2f}",
            _seconds(figures["stopped_found_s"]),
            _seconds(figures["back_up_found_s"]),
            _seconds(figures["dead_found_s"]),
        ]
        for name, figures in report.items()
    ]
    print(
        aligned_table(
            [
                "router",
                "idle CPU ms/s",
                "SIGSTOP found (s)",
                "SIGCONT found (s)",
                "SIGKILL found (s)",
            ],
            rows,
        )
    )
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
