"""One router process of ``pdtrio serve --workers N`` (started by its supervisor).

``python -m pdtrio.serving.process SPEC``: SPEC is JSON naming the inherited listening
sockets' file descriptors and the server settings; the router's configuration comes in
``PDTRIO_CONFIG_JSON``. Only strings cross from the supervisor: nothing is pickled.
"""

from __future__ import annotations

import json
import logging
import signal
import sys

from pdtrio.serving.server import ServerSettings, serve_here, sockets_from_fds

log = logging.getLogger("pdtrio.serve")


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    settings = ServerSettings.from_json(spec["settings"])
    sockets = sockets_from_fds(list(spec["fds"]), secure=bool(spec["secure"]))
    # The supervisor sends SIGTERM until we stop, and a signal to the whole group (systemd's
    # KillMode=control-group) reaches us too: the router's lifespan takes the first, and once
    # it stops listening the handler it restores is this one, so a late duplicate is ignored
    # instead of killing us mid-drain (the default action)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        serve_here(settings, sockets, stop_when_stdin_closes=True)
    except KeyboardInterrupt:
        return 0
    except BaseExceptionGroup as group:
        if group.split(KeyboardInterrupt)[1] is None:
            return 0
        log.critical("the router process failed", exc_info=group)
        return 1
    except Exception:
        log.critical("the router process failed", exc_info=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
