"""W3C trace context: the ``traceparent`` a client sends and the one each leg carries on.

Pure text handling, so that a request without tracing, or with a bad header, costs no
OpenTelemetry object (https://www.w3.org/TR/trace-context/#traceparent-header).
"""

from __future__ import annotations

import re
from typing import Final, final

import attrs

TRACEPARENT_HEADER: Final = b"traceparent"

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_VERSION_00_LENGTH: Final = 55
_INVALID_VERSION: Final = "ff"
SAMPLED_FLAG: Final = 0x01


@final
@attrs.frozen
class RemoteParent:
    """A span of another process that a request's spans are children of."""

    trace_id: int
    span_id: int
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED_FLAG)


def parse_traceparent(value: str) -> RemoteParent | None:
    """The parent ``value`` names, or None when it is not a valid ``traceparent``.

    A later version's header is read by its version-00 prefix, as the spec asks.
    """
    stripped = value.strip()
    match = _TRACEPARENT.match(stripped)
    if match is None:
        return None
    version, trace_hex, span_hex, flags_hex = match.groups()
    if version == _INVALID_VERSION:
        return None
    if version == "00" and len(stripped) != _VERSION_00_LENGTH:
        return None
    if len(stripped) > _VERSION_00_LENGTH and stripped[_VERSION_00_LENGTH] != "-":
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if trace_id == 0 or span_id == 0:
        return None
    return RemoteParent(trace_id, span_id, int(flags_hex, 16))


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"
