"""The seam between the request path and the instances: what a backend must do.

The request machine's commands (``pdtrio.protocol.request.machine``) reach an
instance only through these interfaces: a prefill call and the release of its
KV, a decode start (a stream of its answer and tokens) and its abort.  The
pdtrio worker link (:class:`pdtrio.router.workers.link.WorkerLink`) is the first
implementation; a backend speaking another protocol (vLLM's or SGLang's HTTP
PD protocols) implements the same and plugs in without the machine changing.

A backend reports why a call did not go through by raising
:class:`BackendUnreachable` (the instance never saw it: another may take it) or
:class:`BackendLost` (it went down with the call out: the instance dropped it);
the worker link's own errors are these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from pdtrio.protocol.link.wire import (
    DecodeRejected,
    DecodeStart,
    PrefillFailed,
    PrefillReply,
    TokenLogprob,
)
from pdtrio.protocol.link.wire import PrefillRequest as PrefillCall
from pdtrio.protocol.openai.tools import ToolCall
from pdtrio.protocol.tokens.stream_buffer import StreamBuffer


class BackendError(Exception):
    """A call to an instance did not complete."""


class BackendUnreachable(BackendError):
    """The call could not be sent: the instance never saw it."""


class BackendLost(BackendError):
    """The instance was lost with the call out: it holds nothing of it."""


class DecodeRun(Protocol):
    """One request running on a decode instance, as the request path reads it."""

    buffer: StreamBuffer  # the tokens decode pushed, merged into deltas
    accepted: bool
    rejection: DecodeRejected | None
    failure: str | None
    failure_reason: str  # a metric label: link_lost, link_timeout, decode_failed, ...
    cut_off: bool  # the backend ended it for a client too slow
    token_ids: list[int] | None  # every token id pushed, when kept (a migration needs them)
    # the logprobs of tokens sent ahead of them and not delivered yet (None: not asked)
    logprobs: list[TokenLogprob] | None
    # the tool calls an engine read out of its answer itself, not delivered yet (None: a
    # backend whose calls the router reads out of the text, as pdtrio's workers')
    tool_calls: list[ToolCall] | None

    async def wait_update(self) -> None:
        """Until something new arrived (an answer, tokens, a failure)."""

    async def hold_until(self, deadline: float, timer: Any) -> None:
        """Until about ``deadline`` (adaptive egress spacing its sends); a finish or a
        failure ends it early.  ``timer``: the router's, which wakes the holds."""


class ChoiceRuns(Protocol):
    """A request with ``n`` > 1 on decode: each of its choices' runs, woken together."""

    @property
    def choices(self) -> Mapping[int, DecodeRun] | None:
        """Each choice's run, by its index (None: the request runs one choice)."""
        ...

    async def wait_choices_update(self) -> None:
        """Until any choice's run got something new."""


class PrefillBackend(Protocol):
    """An instance that prefills a prompt and holds its KV for a decode to pull."""

    @property
    def instance_id(self) -> str: ...

    async def prefill(self, call: PrefillCall) -> PrefillReply | PrefillFailed:
        """Prefill ``call``; cancelled, it frees what the instance allocated for it."""
        ...

    def release(self, request_id: str, access_token: str = "") -> None:
        """Free the request's KV (or stop its prefill); never blocks, idempotent."""


class DecodeBackend(Protocol):
    """An instance that pulls a prefilled request's KV and generates its tokens."""

    @property
    def instance_id(self) -> str: ...

    @property
    def connects(self) -> int:
        """Which connection to the instance this is: a request that failed on one may be
        tried again on a later one (the instance ended everything of the old one)."""
        ...

    async def start(
        self, start: DecodeStart, blocks: int = 0, *, keep_token_ids: bool = False
    ) -> DecodeRun:
        """Send the start (``blocks``: what decode allocates, promised before the first
        checkpoint); the run reports decode's answer and tokens."""
        ...

    def abort(self, request_id: str) -> None:
        """End the request on the instance if it still runs there; never blocks."""
