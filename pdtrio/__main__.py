"""Command line: ``pdtrio worker ...`` (the router runs under hypercorn)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: pdtrio worker [--role prefill|decode|both] [--engine synthetic|torch] ...\n"
            "the router: hypercorn -k trio pdtrio.app:app"
        )
        return 0 if argv else 2
    if argv[0] == "worker":
        from pdtrio.worker.main import main as worker_main

        return worker_main(argv[1:])
    print(f"pdtrio: unknown command {argv[0]!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
