"""Which KV transport a worker runs: ``kv_transport = "nixl" | "tcp" | "auto"``."""

from __future__ import annotations

from pdtrio.config import KvTransportChoice
from pdtrio.kv.api import KvMemory, KvTransport, KvTransportUnavailable
from pdtrio.kv.tcp import TcpKvTransport


def kv_transport_for(choice: KvTransportChoice, memory: KvMemory) -> KvTransport:
    """The transport for ``choice``; NIXL itself is tried, and ``auto`` decides, when it runs.

    Raises KvTransportUnavailable for ``"nixl"`` when the NIXL transport does not import.
    """
    if choice == "tcp":
        return TcpKvTransport()
    try:
        from pdtrio.kv.nixl import NixlKvTransport
    except ImportError as exc:  # numpy, which NIXL needs, comes with the worker extras
        if (exc.name or "").partition(".")[0] == "pdtrio":
            raise  # a broken import inside pdtrio is a bug, not a missing extra: never TCP
        if choice == "nixl":
            raise KvTransportUnavailable(f"the NIXL transport does not import: {exc}") from exc
        return TcpKvTransport(nixl_unavailable=f"kv_transport = 'auto' and {exc}")
    return NixlKvTransport(memory, required=choice == "nixl")
