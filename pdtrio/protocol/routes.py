"""An HTTP server's routes: each path it answers and the methods it takes there.

The router's app and the workers' HTTP API each hold one :class:`RouteTable`, so a
path neither knows is a 404 and a known path asked with another method is a 405
with ``Allow`` (both OpenAI error bodies), said the same way by both.

Sans-IO: a table and a check, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import final

import attrs

from pdtrio.protocol.openai.errors import method_not_allowed, not_found


@final
@attrs.frozen
class RouteTable:
    """Each known path and the methods it answers."""

    methods: Mapping[str, tuple[str, ...]]

    def __contains__(self, path: object) -> bool:
        return path in self.methods

    def check(self, method: str, path: str) -> None:
        """Raise the client's error unless ``path`` is known and takes ``method``:
        :func:`~pdtrio.protocol.openai.errors.not_found` for an unknown path,
        :func:`~pdtrio.protocol.openai.errors.method_not_allowed` (``Allow``: the
        path's methods) for a wrong method."""
        allowed = self.methods.get(path)
        if allowed is None:
            raise not_found(f"no route {method} {path}")
        if method not in allowed:
            raise method_not_allowed(method, path, allowed)
