"""The prefill role: one prefill per call, its KV leased under a grant decode carries.

A prefill call comes over a router's link (``pdtrio.worker.router_link``) or as
``POST /pd/prefill`` (``pdtrio.worker.http_api``); either way
:meth:`PrefillRole.prefill_call` runs it: the request is checked (the worker trusts
no peer), refused while the worker drains or while its id is in use, prefilled,
and its blocks leased (``pdtrio.worker.leases``) under a fresh grant that the
handle carries to decode, with what it wrote in them (each block's generation and
digest, ``pdtrio.kv.digest``) recorded before it answers.  The role is also the KV
transport's ``KvBlockSource``: which blocks a peer may read, what it wrote in them
(for decode to check), and the releases that free them; a release that comes while
the prefill still runs stops it.
"""

from __future__ import annotations

import logging
import math
from typing import Protocol, final

import trio

from pdtrio.engine.api import Engine, EngineError, NoRoom, PromptRejected
from pdtrio.kv.digest import Coverage, WrittenBlocks, record_written
from pdtrio.protocol.errors import Reason
from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.link.wire import (
    DRAINING_ERROR_TYPE,
    MAX_TOP_LOGPROBS,
    KvDigests,
    KvHandle,
    PrefillFailed,
    PrefillReply,
    PrefillReplyWithChoices,
    PrefillReplyWithLogprob,
    PrefillRequest,
    TokenPrompt,
    WireError,
    prefill_failed,
    request_id_in_use,
)
from pdtrio.protocol.sampling import MAX_CHOICES
from pdtrio.security import new_access_token
from pdtrio.worker.fault_hooks import FaultHooks
from pdtrio.worker.leases import KvLeases, release_token_matches
from pdtrio.worker.router_link import RouterLinkServer

log = logging.getLogger("pdtrio.worker")


class PrefillHost(Protocol):
    """What the role reads of its worker at each call: it changes while the worker runs."""

    @property
    def draining(self) -> bool: ...

    @property
    def instance_id(self) -> str: ...

    @property
    def transfer_endpoint(self) -> tuple[str, int]: ...

    @property
    def kv_layout(self) -> KvLayout: ...

    @property
    def link_server(self) -> RouterLinkServer | None: ...


@final
class PrefillRole:
    """The worker's prefills, their leases, and the releases that free or stop them."""

    def __init__(
        self,
        host: PrefillHost,
        engine: Engine,
        leases: KvLeases,
        *,
        lease_s: float,
        digest: Coverage | None = None,
        faults: FaultHooks | None = None,
    ) -> None:
        self._host = host
        self._engine = engine
        self._leases = leases
        self._lease_s = lease_s
        self._digest = digest  # what of each block's bytes is recorded; None: nothing
        self._faults = faults  # testing only: None unless a fault hook is configured
        # prefills in progress: their scope, and the release token of the router that asked
        self._running: dict[str, tuple[trio.CancelScope, str]] = {}
        self.served_prefills = 0

    @property
    def in_progress(self) -> int:
        """Prefills running now."""
        return len(self._running)

    # --- KvBlockSource for the transport server -----------------------------------

    def holds(
        self, request_id: str, block_ids: tuple[int, ...], access_token: str | None = None
    ) -> bool:
        return self._leases.holds(request_id, block_ids, access_token)

    def release_granted(self, request_id: str, access_token: str) -> bool:
        """A peer's release: frees the blocks of the grant's holder; the release token of
        the router that asked for the prefill also stops it while it runs (asked over a
        link that is gone since, say)."""
        running = self._running.get(request_id)
        if running is not None:
            scope, owner = running
            if release_token_matches(access_token, owner):
                scope.cancel()
                return True
            return False
        return self._leases.release_granted(request_id, access_token)

    async def read_blocks(self, block_ids: tuple[int, ...]) -> bytes:
        return await self._engine.read_blocks(block_ids)

    def kv_digests(self, request_id: str, block_ids: tuple[int, ...]) -> KvDigests | None:
        written = self._leases.written(request_id)
        if written is None:
            return None
        return written.for_grant(block_ids, self._engine.block_generations(block_ids))

    def release(self, request_id: str) -> bool:
        running = self._running.get(request_id)
        if running is not None:
            running[0].cancel()  # released while still prefilling: stop it
        return self._leases.release(request_id)

    # --- prefill calls ------------------------------------------------------------

    async def prefill_call(self, request: PrefillRequest) -> PrefillReply | PrefillFailed | None:
        """One prefill, from the link or the HTTP route: the reply, the error, or None.

        None: a release stopped it (the caller gave up).  Whatever does not end
        in a reply frees the request's blocks here.
        """
        request_id = request.request_id
        try:
            check_prefill_request(request)
        except WireError as exc:
            return prefill_failed(request_id, Reason.INVALID_REQUEST, f"malformed request: {exc}")
        if self._host.draining:
            return prefill_failed(
                request_id,
                Reason.SHUTTING_DOWN,
                "the instance is draining",
                error_type=DRAINING_ERROR_TYPE,
            )
        if self._knows(request_id):
            return request_id_in_use(request_id)
        outcome: PrefillReply | PrefillFailed | None = None
        scope = trio.CancelScope()
        self._running[request_id] = (scope, request.release_token)
        try:
            with scope:
                outcome = await self._prefill_or_error(request)
        finally:
            del self._running[request_id]
            if not isinstance(outcome, PrefillReply):
                self._engine.free_request(request_id)
        if isinstance(outcome, PrefillReply):
            self.served_prefills += 1
        return outcome

    def _knows(self, request_id: str) -> bool:
        """Whether the id is in use here: a second request would share its blocks."""
        links = self._host.link_server
        return (
            request_id in self._running
            or self._leases.holds(request_id, ())
            or (links is not None and request_id in links.owner)
        )

    async def _prefill_or_error(self, request: PrefillRequest) -> PrefillReply | PrefillFailed:
        """The reply, or the error the engine's refusal or failure maps to."""
        request_id = request.request_id
        try:
            if self._faults is not None and self._faults.watches_prefill:
                failed = await self._faults.before_prefill(request_id)
                if failed is not None:
                    return failed
            return await self._prefill(request)
        except PromptRejected as exc:
            return prefill_failed(request_id, Reason.INVALID_REQUEST, exc.message, param=exc.param)
        except NoRoom as exc:
            return prefill_failed(
                request_id, Reason.SERVICE_UNAVAILABLE, f"prefill has no KV room: {exc}"
            )
        except EngineError as exc:
            log.error("prefill of %s failed", request_id, exc_info=exc)
            return prefill_failed(request_id, Reason.INTERNAL, f"prefill failed: {exc}")

    async def _prefill(self, request: PrefillRequest) -> PrefillReply:
        request_id = request.request_id
        token_ids = await self._engine.tokenize(request.prompt)
        result = await self._engine.prefill(
            request_id, token_ids, request.sampling, request.max_tokens, request.generated_tokens
        )
        handle: KvHandle | None = None
        # (n > 1: the blocks stay while any choice runs, choice 0 finished or not)
        if result.finish_reason is None or result.block_ids:
            written = await self._record_written(result.block_ids)
            lease_s = self._lease_s
            access_token = new_access_token()
            self._leases.hold(
                request_id,
                result.block_ids,
                trio.current_time() + lease_s,
                access_token,
                request.release_token,
                written,
            )
            host = self._host
            transfer_host, transfer_port = host.transfer_endpoint
            handle = KvHandle(
                request_id=request_id,
                instance_id=host.instance_id,
                transfer_host=transfer_host,
                transfer_port=transfer_port,
                block_ids=result.block_ids,
                num_tokens=len(token_ids),
                layout=host.kv_layout,
                # a duration: the router and decode count it from their own clocks
                lease_ttl_s=lease_s,
                access_token=access_token,
            )
        fields = (
            request_id,
            tuple(token_ids),
            result.cached_tokens,
            result.first_token_id,
            result.first_text,
            result.finish_reason,
            result.token_budget,
            handle,
            result.usage,
        )
        if result.choices:
            return PrefillReplyWithChoices(
                *fields, first_logprob=result.first_logprob, choices=result.choices
            )
        if result.first_logprob is not None:
            return PrefillReplyWithLogprob(*fields, first_logprob=result.first_logprob)
        return PrefillReply(*fields)

    async def _record_written(self, block_ids: tuple[int, ...]) -> WrittenBlocks | None:
        """The blocks' generations and digests as prefill leaves them, for decode to check."""
        if self._digest is None or not block_ids:
            return None
        engine = self._engine
        generations = engine.block_generations(block_ids)
        return await record_written(engine, block_ids, generations, self._digest)


def check_prefill_request(request: PrefillRequest) -> None:
    """What msgspec's types cannot say about a prefill request; WireError (a 400) if wrong.

    The router validated the client's request, but the worker trusts no peer:
    a bad value here would fail deep in the engine, as a 500.
    """
    if not request.request_id:
        raise WireError("request_id is empty")
    sampling = request.sampling
    if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0.0):
        raise WireError(f"temperature {sampling.temperature} is not a finite number >= 0")
    if not 0.0 < sampling.top_p <= 1.0:
        raise WireError(f"top_p {sampling.top_p} is not in (0, 1]")
    if sampling.min_tokens < 0:
        raise WireError(f"min_tokens {sampling.min_tokens} is negative")
    if any(not stop for stop in sampling.stop):
        raise WireError("a stop sequence is empty")
    if not -1 <= sampling.logprobs <= MAX_TOP_LOGPROBS:
        raise WireError(f"logprobs {sampling.logprobs} is not in -1..{MAX_TOP_LOGPROBS}")
    if request.max_tokens is not None and request.max_tokens < 1:
        raise WireError(f"max_tokens {request.max_tokens} is less than 1")
    if not 1 <= sampling.n <= MAX_CHOICES:
        raise WireError(f"n {sampling.n} is not in 1..{MAX_CHOICES}")
    if sampling.n > 1 and request.generated_tokens:
        raise WireError("a continuation (generated_tokens > 0) has one choice, not n > 1")
    if request.generated_tokens:
        prompt = request.prompt
        if not isinstance(prompt, TokenPrompt) or not (
            0 < request.generated_tokens < len(prompt.token_ids)
        ):
            raise WireError(
                f"generated_tokens {request.generated_tokens} needs a token prompt longer than that"
            )
