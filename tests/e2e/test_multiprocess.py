"""More than one core: `hypercorn -k trio -w 2 pdtrio.app:app` over static instances.

Each process runs its own router with its own links to the same workers; the
embedded cluster is refused there (it would be started once per process).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdtrio.testing import (
    LOOPBACK,
    Processes,
    Service,
    alive,
    command_line,
    descendants,
    free_port,
    synthetic_worker_config,
    write_router_config,
)
from tests.cluster import eventually

SYNTHETIC_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "synthetic.toml"
PROCESSES = 2
# fresh connections tried before giving up on seeing every process (the kernel spreads them)
MAX_CONNECTIONS_TRIED = 200


@pytest.fixture
def procs() -> Iterator[Processes]:
    with Processes(stop_grace_s=30) as group:
        yield group


@pytest.fixture
def workers(procs: Processes) -> tuple[Service, Service]:
    started = [
        procs.start_worker(synthetic_worker_config(role, decode_step_s=0.02))
        for role in ("prefill", "decode")
    ]
    prefill, decode = (procs.wait_ready(process) for process in started)
    return prefill, decode


def _start(procs: Processes, config: Path) -> Service:
    port = free_port()
    command = [
        sys.executable, "-m", "hypercorn", "-k", "trio", "-w", str(PROCESSES),
        "--graceful-timeout", "10", "-b", f"{LOOPBACK}:{port}", "pdtrio.app:app",
    ]  # fmt: skip
    process = procs.start(command, env={"PDTRIO_CONFIG": str(config)}, output="capture")
    return Service(process, f"http://{LOOPBACK}:{port}")


@pytest.fixture
def router(procs: Processes, workers: tuple[Service, Service], tmp_path: Path) -> Service:
    prefill, decode = workers
    config = write_router_config(
        tmp_path / "router.toml",
        [("prefill", prefill.url), ("decode", decode.url)],
        router={"drain_s": 2},
    )
    service = _start(procs, config)
    procs.wait_healthy(service)
    return service


def _app_processes(router: Service) -> set[int]:
    """hypercorn's worker processes (multiprocessing's resource tracker aside)."""
    return {pid for pid in descendants(router.pid) if "spawn_main" in " ".join(command_line(pid))}


def _connect(router: Service) -> tuple[httpx.Client, int]:
    """A client on one fresh connection, and the PID of the process that accepted it."""
    http = httpx.Client(base_url=router.url, timeout=60, limits=httpx.Limits(max_connections=1))
    return http, http.get("/health").json()["pid"]


def _clients_on_every_process(router: Service, each: int) -> list[tuple[httpx.Client, int]]:
    """At least ``each`` clients connected to each process (extra ones closed)."""
    kept: list[tuple[httpx.Client, int]] = []
    count: dict[int, int] = {}
    for _ in range(MAX_CONNECTIONS_TRIED):
        http, pid = _connect(router)
        if count.get(pid, 0) < each:
            count[pid] = count.get(pid, 0) + 1
            kept.append((http, pid))
        else:
            http.close()
        if len(count) == PROCESSES and min(count.values()) >= each:
            return kept
    for http, _ in kept:
        http.close()
    pytest.fail(f"{MAX_CONNECTIONS_TRIED} connections reached only {count}")


def _stream(http: httpx.Client, max_tokens: int, started: list[int] | None = None) -> list[str]:
    body = {
        "model": "synthetic",
        "prompt": "hello",
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events: list[str] = []
        for line in response.iter_lines():
            if line:
                events.append(line)
                if started is not None and len(events) == 1:
                    started.append(max_tokens)
        return events


def _outcome(events: list[str]) -> str:
    """'complete', 'shutting_down', or what went wrong (never a bare EOF)."""
    if not events or events[-1] != "data: [DONE]":
        return f"no [DONE] after {len(events)} events"
    last = json.loads(events[-2][6:])
    if "error" in last:
        return str(last["error"]["code"])
    return "complete" if "usage" in last else "unfinished"


def test_every_process_serves_with_its_own_links(
    router: Service, workers: tuple[Service, Service]
) -> None:
    assert len(_app_processes(router)) == PROCESSES
    for worker in workers:
        # one link per router process, on each worker
        assert eventually(
            lambda w=worker: httpx.get(f"{w.url}/pd/stats").json()["router_links"] == PROCESSES,
            30,
        ), httpx.get(f"{worker.url}/pd/stats").json()
    clients = _clients_on_every_process(router, 1)
    try:
        for http, pid in clients:
            events = _stream(http, 4)
            assert _outcome(events) == "complete", events[-3:]
            assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 4
            assert http.get("/health").json()["pid"] == pid  # the same connection throughout
        assert {pid for _, pid in clients} == _app_processes(router)
    finally:
        for http, _ in clients:
            http.close()


def test_sigterm_to_the_master_drains_every_process_and_leaves_nothing(
    router: Service, workers: tuple[Service, Service]
) -> None:
    tree = router.tree()
    clients = _clients_on_every_process(router, 3)
    results: dict[int, list[str]] = {}
    errors: list[BaseException] = []
    started: list[int] = []
    short, long = 100, 500  # 2 s and 10 s of decode steps, against a 2 s drain

    def stream(index: int, http: httpx.Client, max_tokens: int) -> None:
        try:
            results[index] = _stream(http, max_tokens, started)
        except (httpx.HTTPError, AssertionError) as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=stream, args=(index, http, short if index % 2 else long))
        for index, (http, _) in enumerate(clients)
    ]
    try:
        for thread in threads:
            thread.start()
        assert eventually(lambda: len(started) == len(clients), 30), "not every stream started"
        router.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        assert router.process.wait(timeout=60) == 0
    finally:
        for http, _ in clients:
            http.close()
    assert not errors, errors
    assert len(results) == len(clients)
    outcomes = [_outcome(results[index]) for index in range(len(clients))]
    # short streams finish within the drain (or are cut, on a slow machine); long ones are cut
    assert set(outcomes[1::2]) <= {"complete", "shutting_down"}, outcomes
    assert set(outcomes[0::2]) == {"shutting_down"}, outcomes
    assert eventually(lambda: not any(alive(pid) for pid in tree), 10), "orphans left behind"
    # the workers are not the router's: they serve on, with no router link left
    for worker in workers:
        assert worker.process.poll() is None
        assert eventually(
            lambda w=worker: httpx.get(f"{w.url}/pd/stats").json()["router_links"] == 0, 10
        )


def test_each_process_stops_when_the_master_is_killed(router: Service) -> None:
    below = descendants(router.pid)
    assert len(_app_processes(router)) == PROCESSES
    os.kill(router.pid, signal.SIGKILL)
    router.process.wait(timeout=10)
    assert eventually(lambda: not any(alive(pid) for pid in below), 10), "orphans left behind"


def test_the_embedded_cluster_is_refused(procs: Processes) -> None:
    router = _start(procs, SYNTHETIC_CONFIG)
    # hypercorn's own exit status is 0 here (see README); what matters is that it stopped, and why
    router.process.wait(timeout=60)
    lines = procs.output(router.process).decode().strip().splitlines()
    # each process refuses; the master may stop the second before it gets to say so
    assert 1 <= len(lines) <= PROCESSES, lines
    assert all(
        line.startswith("pdtrio start-up failed: the embedded cluster") and "-w 2" in line
        for line in lines
    ), lines
    assert not descendants(router.pid)


def test_under_w_n_each_process_traces_as_an_instance_of_its_own(
    procs: Processes, tmp_path: Path
) -> None:
    """Tracing on by the standard environment (inherited by hypercorn's processes): a trace
    per request, its router spans from the process that served it, each process (and each
    worker) with a ``service.instance.id`` of its own, the workers' spans under the router's."""
    from tests.tracing_receiver import trace_receiver

    with trace_receiver() as receiver:
        tracing = {"endpoint": receiver.url}
        started = [
            procs.start_worker(
                {**synthetic_worker_config(role, decode_step_s=0.01), "tracing": tracing}
            )
            for role in ("prefill", "decode")
        ]
        prefill, decode = (procs.wait_ready(process) for process in started)
        config = write_router_config(
            tmp_path / "router.toml",
            [("prefill", prefill.url), ("decode", decode.url)],
            router={"drain_s": 2},
        )
        port = free_port()
        command = [
            sys.executable, "-m", "hypercorn", "-k", "trio", "-w", str(PROCESSES),
            "--graceful-timeout", "10", "-b", f"{LOOPBACK}:{port}", "pdtrio.app:app",
        ]  # fmt: skip
        env = {
            "PDTRIO_CONFIG": str(config),
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{receiver.url}/v1/traces",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        router = Service(
            procs.start(command, env=env, output="capture"), f"http://{LOOPBACK}:{port}"
        )
        procs.wait_healthy(router)
        clients = _clients_on_every_process(router, 2)
        try:
            for http, _ in clients:
                assert _outcome(_stream(http, 3)) == "complete"
        finally:
            for http, _ in clients:
                http.close()
        router.process.send_signal(signal.SIGTERM)  # each process flushes its spans as it stops
        assert router.process.wait(timeout=60) == 0
        for worker in (prefill, decode):
            procs.stop(worker.process)
        spans = receiver.received()

    requests = [s for s in spans if s.service == "pdtrio-router" and not s.parent_id]
    assert len(requests) == len(clients), [(s.name, s.service) for s in spans]
    # one router instance per hypercorn process, each request's spans all from its own
    assert len({s.instance for s in requests}) == PROCESSES
    by_id = {s.span_id: s for s in spans}
    for request in requests:
        trace = [s for s in spans if s.trace_id == request.trace_id]
        router_spans = [s for s in trace if s.service == "pdtrio-router"]
        assert {s.instance for s in router_spans} == {request.instance}
        worker_spans = [s for s in trace if s.service == "pdtrio-worker"]
        assert len({s.instance for s in worker_spans}) == 2, worker_spans  # prefill and decode
        for span in worker_spans:
            parent = by_id.get(span.parent_id)
            assert parent is not None and parent.trace_id == request.trace_id
    worker_instances = {s.instance for s in spans if s.service == "pdtrio-worker"}
    assert not worker_instances & {s.instance for s in requests}
