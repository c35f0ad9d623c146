"""Command line: ``pdtrio worker ...``, ``pdtrio register ...`` (the router runs under
hypercorn)."""

from __future__ import annotations

import sys

USAGE = """\
usage: pdtrio [-h] {worker,register} ...
       python -m pdtrio [-h] {worker,register} ...

pdtrio: prefill/decode disaggregated LLM serving on Trio.

commands:
  worker        run one worker (prefill, decode or both); `pdtrio worker --help`
                lists every option with its environment variable and default
  register      register a vLLM or SGLang engine in etcd while its /health answers,
                for routers with etcd discovery; `pdtrio register --help`

options:
  -h, --help    show this help and exit

the router is an ASGI app, served by hypercorn's trio worker:
  hypercorn -k trio -b 127.0.0.1:8000 pdtrio.app:app
with no configuration it starts and supervises an embedded cluster of one prefill and
one decode worker (SmolLM2-135M-Instruct on the CPU).

environment (the router; the worker reads the same PDTRIO_LOG_* and
PDTRIO_ETCD_ENDPOINTS):
  PDTRIO_CONFIG          the router's TOML configuration file (default: none, the
                         embedded cluster); every key: docs/configuration.md
  PDTRIO_ETCD_ENDPOINTS  etcd client URLs, comma-separated: find workers (router) or
                         register (worker) there (default: none)
  PDTRIO_ENGINE_API_KEY  the --api-key of the vLLM or SGLang engines found in etcd:
                         sent to them (router), used to read /v1/models (register)
  PDTRIO_LOG_LEVEL       DEBUG, INFO, WARNING, ERROR or CRITICAL; request content is
                         only logged at DEBUG (default: INFO)
  PDTRIO_LOG_FORMAT      text, or json for log collectors (default: text)
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        if argv:
            print(USAGE, end="")
            return 0
        print(USAGE, end="", file=sys.stderr)
        return 2
    if argv[0] == "worker":
        from pdtrio.worker.main import main as worker_main

        return worker_main(argv[1:])
    if argv[0] == "register":
        from pdtrio.discovery.register_engine import main as register_main

        return register_main(argv[1:])
    print(
        f"pdtrio: unknown command {argv[0]!r} (commands: worker, register; see --help)",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
