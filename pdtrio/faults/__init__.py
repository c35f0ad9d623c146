"""Fault injection: a TCP proxy that adds latency, caps bandwidth, stalls, resets or refuses.

Put it between any two parts of a deployment (client and router, router and a
worker's link, decode and prefill's KV transfer) to see how the rest behaves;
from tests (:class:`FaultProxy`) or by hand (``python -m pdtrio.faults --help``).
Nothing in the router or the workers imports it.
"""

from pdtrio.faults.plan import Fault, FaultSpecError, TokenBucket, fault_from_options
from pdtrio.faults.proxy import FaultProxy, ProxyCounters

__all__ = [
    "Fault",
    "FaultProxy",
    "FaultSpecError",
    "ProxyCounters",
    "TokenBucket",
    "fault_from_options",
]
