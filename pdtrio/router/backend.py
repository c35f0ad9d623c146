"""The one seam between the request path and the instances: :class:`Backend`.

Which kind of instance serves is chosen once, as the router starts
(``pdtrio.router.core.choose_backend``): pdtrio's workers over their links
(``pdtrio.router.workers.backend``), or the vLLM or SGLang engines the router fronts
over HTTP (``pdtrio.router.engines.backend``).  The router, the app, the lifespan, the
metrics collector and the request shell know it only through :class:`Backend`: its
models, context lengths, health, admission, the figures ``/metrics`` exports
(``pdtrio.router.state_metrics.BackendFigures``), who hears the registries, its start and stop, and the legs
it makes for each request (:class:`PrefillSide`, :class:`DecodeSide`), which carry out
the request machine's commands that reach an instance.  A backend owns its parts (the
pdtrio backend its instance table, links, decode-room queue and KV lease clock); the
router lends it only what is the router's (the nursery, the HTTP client, the
credentials, the metrics' callbacks).

A backend reports why a call did not go through by raising
:class:`BackendUnreachable` (the instance never saw it: another may take it) or
:class:`BackendLost` (it went down with the call out: the instance dropped it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, final

import attrs
import trio

from pdtrio.config import PdtrioConfig, RouterConfig
from pdtrio.protocol import request as rm
from pdtrio.protocol.link.wire import TokenLogprob
from pdtrio.protocol.openai import ChatCompletionRequest, CompletionRequest
from pdtrio.protocol.openai.answers import AnswerDelta, AnswerKind, AnyRequest, Shaper
from pdtrio.protocol.openai.tools import ToolCall
from pdtrio.protocol.tokens.egress import EgressController
from pdtrio.protocol.tokens.stream_buffer import StreamBuffer
from pdtrio.router.metrics import RequestFigures, RouterMetrics
from pdtrio.router.state_metrics import BackendFigures
from pdtrio.router.stream_outcome import StreamOutcome

if TYPE_CHECKING:
    from pdtrio.discovery.registry import EngineListener, Registry, RegistryListener
    from pdtrio.router.request.hold_timer import HoldTimer


class BackendError(Exception):
    """A call to an instance did not complete."""


class BackendUnreachable(BackendError):
    """The call could not be sent: the instance never saw it."""


class BackendLost(BackendError):
    """The instance was lost with the call out: it holds nothing of it."""


class DecodeRun(Protocol):
    """One request running on a decode instance, as the request path reads it."""

    buffer: StreamBuffer  # the tokens decode pushed, merged into deltas
    outcome: StreamOutcome  # decode's answer, then its failure if it failed
    token_ids: list[int] | None  # every token id pushed, when kept (a migration needs them)
    # the logprobs of tokens sent ahead of them and not delivered yet (None: not asked)
    logprobs: list[TokenLogprob] | None
    # the tool calls an engine read out of its answer itself, not delivered yet (None: a
    # backend whose calls the router reads out of the text, as pdtrio's workers')
    tool_calls: list[ToolCall] | None

    async def wait_update(self) -> None:
        """Until something new arrived (an answer, tokens, a failure)."""

    async def hold_until(self, deadline: float, timer: HoldTimer) -> None:
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


class RouterServices(Protocol):
    """What the router lends every backend's legs (``pdtrio.router.core.Router``)."""

    @property
    def config(self) -> PdtrioConfig: ...

    @property
    def metrics(self) -> RouterMetrics: ...

    @property
    def egress(self) -> EgressController: ...

    @property
    def hold_timer(self) -> HoldTimer: ...

    @property
    def now(self) -> Callable[[], float]:
        """The run's clock."""
        ...


@final
@attrs.frozen
class RunDecode:
    """The shell's own wait after the machine heard the start is going out: the start,
    the answer and the stream, under a timer of the deadlines that hold from then on.

    Placing disarms the KV lease's deadline; had that timer fired meanwhile (the room
    came free as the lease ran out), the rest of the wait would be cut by a deadline
    no longer armed, so it runs under a timer of its own.  What it was placed on, the
    decode leg keeps itself.
    """

    sent_at: float  # (perf_counter) when the start went out: the handoff's time counts from it


Wait = rm.SendPrefill | rm.WaitForPrefill | rm.PlaceDecode | rm.WaitForDecode | RunDecode
"""What the shell waits on: the machine's commands that start a wait, and its own."""


class ShellFailure(Exception):
    """A failure the shell found itself (reported to the machine as ``Failed``)."""

    def __init__(self, failure: rm.Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class LegHost(Protocol):
    """What a leg needs of the shell that runs it."""

    @property
    def router(self) -> RouterServices: ...

    request: ChatCompletionRequest | CompletionRequest
    request_id: str
    figures: RequestFigures
    machine: rm.RequestMachine
    shaper: Shaper | None
    # decode sent a delta's tokens without the logprobs asked for: said once per request
    logprobs_shortfall_logged: bool

    @property
    def prefill_traceparent(self) -> str:
        """The span a prefill call sent now is a child of ("": the request is not traced)."""
        ...

    @property
    def decode_traceparent(self) -> str:
        """The span a decode call sent now is a child of ("": the request is not traced)."""
        ...

    async def report(self, event: rm.Event) -> Wait | None:
        """Tell the machine ``event``, write what it emits; the wait it starts, if any."""
        ...

    async def deliver(self, delta: AnswerDelta) -> None:
        """Count ``delta`` as delivered, and hand it to the client."""


class PrefillSide(Protocol):
    """What the shell does with a request's prefill leg, whatever the backend."""

    @property
    def instance_id(self) -> str | None:
        """The prefill instance called last (the access line's), if any."""
        ...

    async def send(self, command: rm.SendPrefill) -> Wait | None: ...

    async def wait_for_instance(self, command: rm.WaitForPrefill) -> Wait | None:
        """Until a prefill instance not in the command's ``exclude`` could take the request
        (the machine's PREFILL_WAIT deadline bounds it); reports ``PrefillConnected``."""
        ...

    def release(self) -> None:
        """Free what prefill holds of the request (its KV, or its running call)."""

    def drop_lease(self) -> None:
        """The request holds prefill's KV no more."""

    def no_instance_reason(self) -> str:
        """Why no prefill instance takes the request (the machine's ``explain_no_prefill``)."""
        ...

    async def emit_first_token(self, final: bool) -> None:
        """Deliver the token prefill sampled (``final``: the whole answer); asked only of
        legs whose prefill samples it (``MakeLegs``' third value)."""

    def migrate(self, command: rm.Migrate) -> None:
        """Make the next prefill call the continuation of a decode lost mid-stream; asked
        only of legs whose machine keeps the tokens delivered."""


class DecodeSide(Protocol):
    """What the shell does with a request's decode leg, whatever the backend."""

    @property
    def instance_id(self) -> str | None:
        """The decode instance the request was started on (the access line's), if any."""
        ...

    def reserve_place(self) -> bool: ...

    def unreserve(self) -> None: ...

    async def place(self, command: rm.PlaceDecode) -> Wait | None: ...

    async def run(self, wait: RunDecode) -> Wait | None: ...

    async def wait_for_link(self, command: rm.WaitForDecode) -> Wait | None: ...

    def abort(self) -> None: ...

    def stop_counting(self) -> None: ...


def continues(config: RouterConfig) -> bool:
    """Whether a request whose prefill samples the first token may go on from a new
    prefill of the tokens delivered (a migration, a failed handoff's new round): it keeps
    them."""
    return config.migration_limit > 0 or config.handoff_attempts > 1


MakeLegs = Callable[[LegHost], tuple[PrefillSide, DecodeSide, bool]]
"""A backend's legs for a request, and whether its prefill samples the first token."""


class Backend(Protocol):
    """What serves the router's requests: pdtrio's workers, or the engines it fronts."""

    @property
    def models(self) -> list[str]:
        """The models served, sorted (``/v1/models``)."""
        ...

    @property
    def registrations(self) -> EngineListener | None:
        """Who hears of the engines registered in etcd (None: pdtrio workers' only)."""
        ...

    @property
    def registry_listener(self) -> RegistryListener:
        """Who hears what registries say: pdtrio workers' registrations, and every entry
        ignored or refused."""
        ...

    @property
    def admission_full(self) -> bool:
        """No request more may wait for room: one is refused up front (429)."""
        ...

    def serving_at(self, server: Any) -> None:
        """A request reached the router at ``server`` (ASGI's [host, port]): a
        registration naming it is the router itself."""

    def figures(self) -> BackendFigures:
        """What ``/metrics`` exports of the backend, now."""
        ...

    def context_lengths(self) -> dict[str, int]:
        """Each model's context length: the largest of the instances that prefill it, so
        that a prompt is refused only if no instance could take it."""
        ...

    def health(self, active_requests: int) -> dict[str, Any]:
        """``/health``'s report (with the registrations ignored, and why)."""
        ...

    def describe(self) -> str:
        """What serves, in one line (the start's log)."""
        ...

    async def start(self, nursery: trio.Nursery, etcd: Registry | None) -> None:
        """Start what finds and watches the instances in ``nursery`` (``etcd``: the
        registry of etcd's registrations, when configured); return once they are known."""

    async def stop_processes(self) -> None:
        """Stop the processes it started, as hypercorn's stop would (the embedded
        cluster's workers; nothing for a backend that starts none)."""

    def legs_for(self, request: AnyRequest, kind: AnswerKind, body: bytes | bytearray) -> MakeLegs:
        """What makes ``request``'s legs (``body``: the client's request as it came)."""
        ...
