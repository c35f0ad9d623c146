"""What the sections share: the two cores, a core's busy time, role processes.

(Percentiles are :func:`benchmarks.kit.percentile`, as in every benchmark.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdtrio.testing import Processes

# the CPUs this run may use, read once at import (before the driver pins itself)
_ALL_CPUS = sorted(os.sched_getaffinity(0))


def router_and_load_cpus() -> tuple[int, int]:
    """(the router's core, the load's core): the same one on a single-CPU machine."""
    return _ALL_CPUS[0], _ALL_CPUS[-1]


def core_busy_ticks(cpu: int) -> tuple[int, int]:
    """(busy, total) jiffies of one core so far, from /proc/stat."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{cpu} "):
            values = [int(v) for v in line.split()[1:]]
            idle = values[3] + values[4]
            return sum(values) - idle, sum(values)
    return 0, 0


def start_role(
    procs: Processes, role: str, spec: Mapping[str, Any], *, cpu: int
) -> subprocess.Popen[bytes]:
    """One of this benchmark's roles (see ``__main__.ROLES``) in a process of its own on ``cpu``.

    It reports on stdout: read it with ``procs.read_line``.
    """
    command = [
        sys.executable,
        "-m",
        "benchmarks.token_path",
        "--role",
        role,
        "--spec",
        json.dumps(spec),
    ]
    return procs.start(command, output="lines", cpus={cpu})
