"""Workers that die or hang, on real processes: fault hooks that end a worker process
(``[faults]``: os._exit kills it), a SIGKILL or SIGSTOP from outside, and a fault proxy
(``python -m pdtrio.faults``) that resets the router's link to one.

The client sees a retry, a stream continued on another decode, or a clear error, and the
workers still standing hold nothing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdtrio.testing import (
    LOOPBACK,
    Processes,
    Service,
    start_fault_proxy,
    synthetic_worker_config,
    write_router_config,
)
from pdtrio.worker.fault_hooks import FAULT_EXIT_CODE
from tests.cluster import eventually
from tests.metrics import value

# generous: these bound liveness, they do not measure it
LIVENESS_S = 15.0
ROUTER = {"link_timeout_s": 2.0, "link_heartbeat_s": 0.5}


@pytest.fixture
def procs() -> Iterator[Processes]:
    with Processes(stop_grace_s=30) as group:
        yield group


def _worker_config(role: str, **faults: Any) -> dict[str, Any]:
    config = synthetic_worker_config(role, decode_step_s=0.02)
    # answers are compared with undisturbed ones, usage included: a prefix cache that the
    # undisturbed run filled would report cached_tokens the first run did not
    config["engine"]["prefix_cache"] = False
    if faults:
        config["faults"] = faults
    return config


def _cluster(
    procs: Processes,
    tmp_path: Path,
    workers: list[dict[str, Any]],
    router: dict[str, Any] | None = None,
) -> tuple[list[Service], Service]:
    started = [procs.start_worker(config) for config in workers]
    services = [procs.wait_ready(process) for process in started]
    config = write_router_config(
        tmp_path / "router.toml",
        [(config["role"], service.url) for config, service in zip(workers, services, strict=True)],
        router=router or ROUTER,
    )
    return services, procs.router(config, output="capture")


def _eventually(condition: Callable[[], bool], timeout: float = LIVENESS_S) -> bool:
    return eventually(condition, timeout)


def _exited_by_fault(service: Service) -> bool:
    return _eventually(lambda: service.process.poll() is not None) and (
        service.process.returncode == FAULT_EXIT_CODE
    )


def _stats(service: Service) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(f"{service.url}/pd/stats", timeout=LIVENESS_S).json()
    return stats


def _holds_nothing(service: Service) -> bool:
    stats = _stats(service)
    return not any(
        stats[key]
        for key in (
            "kv_blocks_in_use",
            "running_requests",
            "kv_leases",
            "decode_requests",
            "prefills_in_progress",
        )
    )


def _body(max_tokens: int, *, stream: bool) -> dict[str, Any]:
    return {"model": "synthetic", "prompt": "hello", "max_tokens": max_tokens, "stream": stream}


def _post(router: Service, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{router.url}/v1/completions", json=body, timeout=LIVENESS_S)


def test_a_prefill_that_exits_is_retried_on_the_other_prefill(
    procs: Processes, tmp_path: Path
) -> None:
    workers = [
        _worker_config("prefill", prefill_exit_after=1),
        _worker_config("prefill"),
        _worker_config("decode"),
    ]
    (faulty, prefill, decode), router = _cluster(procs, tmp_path, workers)
    for _ in range(4):  # round-robin: the faulty one gets one of them
        response = _post(router, _body(4, stream=False))
        assert response.status_code == 200, response.text
    assert _exited_by_fault(faulty)
    assert _eventually(lambda: _holds_nothing(prefill) and _holds_nothing(decode))


def test_the_only_prefill_exiting_is_a_503(procs: Processes, tmp_path: Path) -> None:
    workers = [_worker_config("prefill", prefill_exit_after=1), _worker_config("decode")]
    (faulty, decode), router = _cluster(procs, tmp_path, workers)
    response = _post(router, _body(4, stream=False))
    assert response.status_code == 503, response.text
    assert _exited_by_fault(faulty)
    assert _eventually(lambda: _holds_nothing(decode))


def test_without_migration_decode_exiting_at_token_n_ends_the_stream_or_is_a_502(
    procs: Processes, tmp_path: Path
) -> None:
    workers = [
        _worker_config("prefill"),
        _worker_config("decode", decode_exit_at_token=5),
        _worker_config("decode", decode_exit_at_token=5),
    ]
    (prefill, *decodes), router = _cluster(
        procs, tmp_path, workers, router={**ROUTER, "migration_limit": 0}
    )
    # streaming: the stream ends with an error event and [DONE]
    with httpx.stream(
        "POST", f"{router.url}/v1/completions", json=_body(50, stream=True), timeout=LIVENESS_S
    ) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert "error" in json.loads(events[-2].removeprefix("data: ")), events[-2]
    assert _eventually(lambda: any(d.process.poll() is not None for d in decodes))
    (gone,) = [d for d in decodes if d.process.poll() is not None]
    assert gone.process.returncode == FAULT_EXIT_CODE
    # non-streaming, on the decode left: a 502
    response = _post(router, _body(50, stream=False))
    assert response.status_code == 502, response.text
    assert all(_exited_by_fault(d) for d in decodes)
    assert _eventually(lambda: _holds_nothing(prefill))


@pytest.mark.parametrize("stream", [False, True])
def test_decode_exiting_before_its_first_token_is_replaced_by_another(
    procs: Processes, tmp_path: Path, stream: bool
) -> None:
    workers = [
        _worker_config("prefill"),
        _worker_config("decode", decode_exit_at_token=1),
        _worker_config("decode"),
    ]
    (prefill, faulty, decode), router = _cluster(procs, tmp_path, workers)
    for _ in range(3):  # whichever decode takes the first, the faulty one gets one of them
        if stream:
            with httpx.stream(
                "POST",
                f"{router.url}/v1/completions",
                json=_body(12, stream=True),
                timeout=LIVENESS_S,
            ) as response:
                assert response.status_code == 200
                events = [line for line in response.iter_lines() if line]
            assert events[-1] == "data: [DONE]"
            chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
            assert not any("error" in chunk for chunk in chunks), events
            text = "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"])
        else:
            response = _post(router, _body(12, stream=False))
            assert response.status_code == 200, response.text
            text = response.json()["choices"][0]["text"]
        # all twelve tokens, the first (from prefill) once: prefill kept the KV for the retry
        assert len(text.split()) == 12, text
    assert _exited_by_fault(faulty)
    assert _eventually(lambda: _holds_nothing(prefill) and _holds_nothing(decode))


def test_a_damaged_kv_handoff_is_refused_and_answered_unchanged_by_the_other_decode(
    procs: Processes, tmp_path: Path
) -> None:
    # decode checks the KV it pulled against what prefill wrote: the faulty decode's pulls
    # land damaged (a byte of each block flipped), each is refused as a failed handoff, and
    # the router answers the request from the other decode, as undisturbed
    workers = [
        _worker_config("prefill"),
        _worker_config("decode", kv_transfer_corrupt=True),
        _worker_config("decode"),
    ]
    (prefill, faulty, decode), router = _cluster(
        procs, tmp_path, workers, router={**ROUTER, "decode_policy": "round_robin"}
    )
    bodies = [{**_body(6, stream=False), "prompt": f"handoff {i} " * (3 + 5 * i)} for i in range(4)]
    answers = []
    for body in bodies:
        response = _post(router, body)
        assert response.status_code == 200, response.text
        answers.append(response.json()["choices"][0]["text"])
    faulty_metrics = httpx.get(f"{faulty.url}/metrics", timeout=LIVENESS_S).text
    mismatches = value(faulty_metrics, "pdtrio_worker_kv_digest_mismatches_total")
    info = httpx.get(f"{faulty.url}/pd/info", timeout=LIVENESS_S).json()
    assert mismatches == info["kv_transport"]["fault_hooks"]["corrupted_pulls"] >= 1
    healthy_metrics = httpx.get(f"{decode.url}/metrics", timeout=LIVENESS_S).text
    assert value(healthy_metrics, "pdtrio_worker_kv_digest_checks_total") == len(bodies)
    assert value(healthy_metrics, "pdtrio_worker_kv_digest_mismatches_total") == 0
    # the same requests again, undisturbed: on the healthy decode (round robin skips none)
    procs.stop(faulty.process)
    assert _eventually(lambda: _holds_nothing(prefill) and _holds_nothing(decode))
    for body, answer in zip(bodies, answers, strict=True):
        response = _post(router, body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == answer


def _chat_stream(
    router: Service, index: int, flowing: threading.Barrier | None = None
) -> list[dict[str, Any]]:
    """A streaming chat request's chunks; ``flowing`` is waited on after its third event."""
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": f"story number {index}"}],
        "max_tokens": 40,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", f"{router.url}/v1/chat/completions", json=body, timeout=LIVENESS_S
    ) as response:
        assert response.status_code == 200
        events = []
        for line in response.iter_lines():
            if line:
                events.append(line)
                if flowing is not None and len(events) == 3:
                    flowing.wait(LIVENESS_S)
    assert events[-1] == "data: [DONE]", events
    return [json.loads(event.removeprefix("data: ")) for event in events[:-1]]


def _seen(chunks: list[dict[str, Any]]) -> tuple[int, str, list[str], dict[str, Any]]:
    """What a client saw: ids, role chunks, text, finish reasons, usage (no error event)."""
    assert not [chunk for chunk in chunks if "error" in chunk], chunks
    assert len({chunk["id"] for chunk in chunks}) == 1
    deltas = [choice for chunk in chunks for choice in chunk["choices"]]
    roles = sum("role" in choice["delta"] for choice in deltas)
    text = "".join(choice["delta"].get("content") or "" for choice in deltas)
    finishes = [c["finish_reason"] for c in deltas if c["finish_reason"] is not None]
    return roles, text, finishes, chunks[-1]["usage"]


def test_streams_on_a_decode_killed_mid_stream_finish_unbroken_on_the_other(
    procs: Processes, tmp_path: Path
) -> None:
    workers = [
        _worker_config("prefill"),
        _worker_config("decode", decode_exit_at_token=8),
        _worker_config("decode"),
    ]
    (prefill, faulty, decode), router = _cluster(
        procs, tmp_path, workers, router={**ROUTER, "decode_policy": "round_robin"}
    )
    clients = 4
    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda i: _seen(_chat_stream(router, i)), range(clients)))
    assert _exited_by_fault(faulty)  # os._exit at a stream's 8th token: no goodbye
    # the same requests again, undisturbed, on the decode left
    expected = [_seen(_chat_stream(router, i)) for i in range(clients)]
    assert answers == expected
    for roles, _, finishes, usage in answers:
        assert (roles, finishes, usage["completion_tokens"]) == (1, ["length"], 40)
    metrics = httpx.get(f"{router.url}/metrics", timeout=LIVENESS_S).text
    assert value(metrics, "pdtrio_migrations_total", reason="link_lost") >= 1
    assert _eventually(lambda: _holds_nothing(prefill) and _holds_nothing(decode))


def _control(port: int, command: str) -> str:
    with socket.create_connection((LOOPBACK, port), timeout=LIVENESS_S) as sock:
        lines = sock.makefile("rwb")
        lines.readline()  # its greeting: the fault in force
        lines.write(command.encode() + b"\n")
        lines.flush()
        return lines.readline().decode()


@pytest.mark.parametrize(
    ("fault", "reason"),
    [("SIGKILL", "link_lost"), ("SIGSTOP", "link_timeout"), ("proxy reset", "link_lost")],
)
def test_sixteen_streams_on_a_decode_lost_mid_stream_finish_unbroken_on_the_other(
    procs: Processes, tmp_path: Path, fault: str, reason: str
) -> None:
    """SIGKILL: its link closes; SIGSTOP: it hangs past link_timeout_s; a fault proxy on
    the router's link to it resets the connection. Either way its streams go on on the
    other decode (or on it, once reconnected), each equal to the undisturbed answer."""
    roles = ("prefill", "decode", "decode")
    started = [procs.start_worker(_worker_config(role)) for role in roles]
    prefill, victim, decode = [procs.wait_ready(process) for process in started]
    proxy = start_fault_proxy(procs, victim.address, timeout=LIVENESS_S)
    victim_url, control = proxy.url, proxy.control_port
    config = write_router_config(
        tmp_path / "router.toml",
        [("prefill", prefill.url), ("decode", victim_url), ("decode", decode.url)],
        router={**ROUTER, "decode_policy": "round_robin"},
    )
    router = procs.router(config, output="capture")
    clients = 16
    expected = [_seen(_chat_stream(router, i)) for i in range(clients)]  # undisturbed
    flowing = threading.Barrier(clients + 1)

    def stream(index: int) -> tuple[int, str, list[str], dict[str, Any]]:
        return _seen(_chat_stream(router, index, flowing))

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(stream, i) for i in range(clients)]
        flowing.wait(LIVENESS_S)  # every stream has had its first events
        if fault == "proxy reset":
            assert _control(control, "reset").startswith("ok reset ")
        else:
            os.kill(victim.pid, getattr(signal, fault))
        try:
            answers = [future.result(LIVENESS_S) for future in futures]
        finally:
            if fault == "SIGSTOP":
                os.kill(victim.pid, signal.SIGCONT)
    assert answers == expected
    for roles_seen, _, finishes, usage in answers:
        assert (roles_seen, finishes, usage["completion_tokens"]) == (1, ["length"], 40)
    metrics = httpx.get(f"{router.url}/metrics", timeout=LIVENESS_S).text
    # round robin: half the streams were on it
    assert value(metrics, "pdtrio_migrations_total", reason=reason) == clients // 2
    assert value(metrics, "pdtrio_migrations_total") == clients // 2
    survivors = [prefill, decode]
    if fault == "SIGKILL":
        assert victim.process.wait(LIVENESS_S) == -signal.SIGKILL
    else:
        survivors.append(victim)
    assert _eventually(lambda: all(_holds_nothing(worker) for worker in survivors))
