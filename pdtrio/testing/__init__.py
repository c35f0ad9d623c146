"""Helpers for driving pdtrio from outside: its processes, as tests and benchmarks start them.

Nothing here is imported by the router or the workers, and nothing here needs torch.
"""

from pdtrio.testing.fault_proxy import FaultProxyProcess, start_fault_proxy
from pdtrio.testing.processes import (
    LOOPBACK,
    ProcessError,
    Processes,
    Service,
    alive,
    command_line,
    cpu_seconds,
    descendants,
    free_port,
    pin,
    router_command,
    router_config_toml,
    synthetic_worker_config,
    write_router_config,
)
from pdtrio.worker.launch import READY_PREFIX, worker_command

__all__ = [
    "LOOPBACK",
    "FaultProxyProcess",
    "READY_PREFIX",
    "ProcessError",
    "Processes",
    "Service",
    "alive",
    "command_line",
    "cpu_seconds",
    "descendants",
    "free_port",
    "pin",
    "router_command",
    "router_config_toml",
    "start_fault_proxy",
    "synthetic_worker_config",
    "worker_command",
    "write_router_config",
]
