"""Command line: ``pdtrio serve``, ``pdtrio worker``, ``pdtrio register``, ``pdtrio faults``.

Each command has its own parser (``pdtrio COMMAND --help``); this one only picks the
command, so a command's options and help stay its own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from importlib import metadata

import pdtrio

COMMANDS = {
    "serve": "serve the OpenAI-compatible router (hypercorn's trio worker, in this "
    "process or --workers N); `pdtrio serve --help` lists every option and variable",
    "worker": "run one worker (prefill, decode or both); `pdtrio worker --help` lists "
    "every option with its environment variable and default",
    "register": "register a vLLM or SGLang engine in etcd while its /health answers, "
    "for routers with etcd discovery; `pdtrio register --help`",
    "faults": "a TCP proxy that injects faults between two parts of a deployment "
    "(tests, chaos runs); `pdtrio faults --help`",
}

EPILOG = """\
quick start (from a checkout, with the worker extras installed):
  pdtrio serve
serves on 127.0.0.1:8000 and, with no configuration, starts and supervises an embedded
cluster of one prefill and one decode worker (SmolLM2-135M-Instruct on the CPU).

`hypercorn -k trio -b 127.0.0.1:8000 pdtrio.app:app` serves the same router
(configured by PDTRIO_CONFIG and the variables `pdtrio serve --help` lists); see
docs/operating.md for what pdtrio serve adds (exit statuses, supervision).
"""


def version() -> str:
    try:
        return metadata.version("pdtrio")
    except metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return pdtrio.__version__


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdtrio",
        description="pdtrio: prefill/decode disaggregated LLM serving on Trio.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"pdtrio {version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, summary in COMMANDS.items():
        commands.add_parser(name, help=summary, add_help=False)
    return parser


def _command(name: str) -> Callable[[list[str]], int]:
    # imported when chosen: `pdtrio --help` loads none of them
    if name == "serve":
        from pdtrio.serving import main as serve_main

        return serve_main
    if name == "worker":
        from pdtrio.worker.main import main as worker_main

        return worker_main
    if name == "register":
        from pdtrio.discovery.register_engine import main as register_main

        return register_main
    from pdtrio.faults.__main__ import main as faults_main

    return faults_main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argument_parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    if argv[0] in COMMANDS:
        return _command(argv[0])(argv[1:])
    parser.parse_args(argv[:1])  # --help, --version, or an unknown command: exits
    return 2


if __name__ == "__main__":
    sys.exit(main())
