"""The releases of prefill's KV a worker link owes, so that none is lost with the link.

A release shows the request's release token (``LeaseClock.release_token``, sent with
the call), so the worker honours it over any link, whether its reply was sent or not.
Releases made while the link is down, those sent in the last two link timeouts before
it was lost (they may be lost with it), and one for each prefill call the link's loss
cut off (its reply may be lost with it, the KV leased) are sent when it comes back:
nothing stays pinned until its lease ends.
"""

from __future__ import annotations

from collections import deque
from typing import final

# releases kept for when a link that is down comes back (past this, the oldest are dropped:
# their leases expire)
_RELEASES_DUE_LIMIT = 65536


@final
class OwedReleases:
    """A link's releases to send once it is back up, and those it sent lately."""

    def __init__(self) -> None:
        # request id -> token of the releases to send once the link is back up
        self._due: dict[str, str] = {}
        # (when, request id, token) of the releases sent on this connection lately: a link
        # that is lost may have lost them (unsent, or unread by a worker that hung), so they
        # are sent again on the next (a release is idempotent)
        self._recent: deque[tuple[float, str, str]] = deque()

    def later(self, request_id: str, token: str) -> None:
        """Send the release once the link is back (bounded: past it, leases expire)."""
        due = self._due
        due[request_id] = token
        if len(due) > _RELEASES_DUE_LIMIT:
            del due[next(iter(due))]

    def sent(self, request_id: str, token: str, now: float, keep_s: float) -> None:
        """The release went out at ``now``: kept for ``keep_s`` in case the link is lost."""
        recent = self._recent
        recent.append((now, request_id, token))
        kept_since = now - keep_s
        while recent[0][0] < kept_since or len(recent) > _RELEASES_DUE_LIMIT:
            recent.popleft()

    def link_lost(self) -> None:
        """The releases sent lately may be lost with the link: due again once it is back."""
        for _, request_id, token in self._recent:
            self.later(request_id, token)
        self._recent.clear()

    def take_due(self) -> dict[str, str]:
        """The releases to send now the link is back (request id -> token), owed no more."""
        due, self._due = self._due, {}
        return due
