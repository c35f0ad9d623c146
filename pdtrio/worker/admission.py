"""Whether a decode instance takes a prefilled request, and getting its KV here if so.

Admission checks the start (layout, budget, handle), reserves blocks for the
whole request, and moves the prompt's KV into them: over the transport from
another instance, or by taking over the prefill lease when prefill ran here.
With the engine's prefix cache on, a transported prompt starts on the blocks of
its longest prefix cached here (an earlier turn of the conversation, say): only
the rest are pulled (none at all when every block is cached; prefill's lease
still ends with the router's release, as always), and once they are in place the
prompt's full blocks are cached for the next turn.
Pulled blocks are checked against what prefill says it wrote in them (each block's
digest and generation, ``pdtrio.kv.digest``) before anything else uses them: a
mismatch rejects the start as a failed transfer (``transfer_failed``: the router
places it elsewhere), is counted and logged, and never decodes.
It answers with a value, never an exception, and leaves nothing allocated
unless it accepts.  The router link decides what to send; admission sends
nothing.
"""

from __future__ import annotations

import logging
from typing import final

import attrs
import msgspec
import trio

from pdtrio.engine.api import Engine, EngineError, NoRoom
from pdtrio.engine.budget import tokens_left
from pdtrio.kv.api import KvTransferError, KvTransport
from pdtrio.kv.digest import KvDigestCounts, KvDigestMismatch, mismatched_blocks
from pdtrio.protocol.kv_layout import KvLayout, blocks_needed, layout_mismatch
from pdtrio.protocol.link.wire import (
    DecodeStart,
    DecodeStartChoices,
    KvDigests,
    KvHandle,
    RejectReason,
    choice_request_id,
    lease_deadline,
    with_lease_left,
)
from pdtrio.worker.leases import KvLeases

log = logging.getLogger("pdtrio.worker")

# mismatched blocks described one by one in the log (all are named)
_DETAILED_MISMATCHES = 4


@final
@attrs.frozen
class Accepted:
    """The engine owns blocks for the whole request, the prompt's KV in them."""


@final
@attrs.frozen
class Rejected:
    """Nothing is allocated for the request; ``message`` says why, for the client."""

    reason: RejectReason
    message: str


Decision = Accepted | Rejected

_ACCEPTED = Accepted()


@final
class DecodeAdmission:
    def __init__(
        self,
        engine: Engine,
        leases: KvLeases,
        transport: KvTransport,
        instance_id: str,
        *,
        layout: KvLayout | None = None,
        digest_counts: KvDigestCounts | None = None,
    ) -> None:
        self._engine = engine
        self.digest_counts = digest_counts if digest_counts is not None else KvDigestCounts()
        # what starts are checked against: the engine's, unless a fault hook alters it
        self._layout = layout
        self._leases = leases
        self._transport = transport
        self._instance_id = instance_id

    async def admit(self, start: DecodeStart, received_at: float | None = None) -> Decision:
        """Accept the request with its KV in place, or reject it; frees all on the way out.

        ``received_at``: when the start arrived (trio clock; None: now), where its KV
        lease's TTL counts from. Cancellation (the router aborted) frees whatever was
        allocated, too.
        """
        engine = self._engine
        handle = start.kv_handle
        now = trio.current_time()
        lease_ends = lease_deadline(handle, now if received_at is None else received_at)
        mismatch = layout_mismatch(handle.layout, self._layout or engine.layout)
        if mismatch is not None:
            return Rejected(RejectReason.LAYOUT_MISMATCH, mismatch)
        problem = _malformed(start)
        if problem is not None:
            return Rejected(RejectReason.BAD_REQUEST, problem)
        request_id = start.request_id
        # a continuation's earlier output is in its prompt ids and spent from its budget
        total_tokens = start.own_prompt_tokens + start.token_budget
        accepted = False
        forks: list[str] = []  # n > 1: the choices' ids that hold blocks
        try:
            if handle.instance_id == self._instance_id:
                # prefill ran here: its blocks become the request's, no copy
                if not self._leases.hand_over(request_id):
                    return Rejected(RejectReason.TRANSFER_FAILED, "the KV lease has expired")
                engine.allocate_blocks(request_id, total_tokens)
                if isinstance(start, DecodeStartChoices):
                    self._fork(start, total_tokens, forks)
            else:
                blocks, reused = engine.allocate_blocks_reusing_prefix(
                    request_id, list(start.prompt_token_ids), total_tokens
                )
                if isinstance(start, DecodeStartChoices):
                    self._fork(start, total_tokens, forks)
                prompt_blocks = len(handle.block_ids)
                if reused < prompt_blocks:
                    # the transport counts the TTL from its call: what is left of it now;
                    # it moves the blocks not found here, a subset of those the lease
                    # holds, which prefill grants (KvLeases.holds); num_tokens still
                    # counts the whole prompt, which no transport reads
                    handle = with_lease_left(handle, lease_ends, trio.current_time())
                    handle = msgspec.structs.replace(handle, block_ids=handle.block_ids[reused:])
                    # (the request's blocks: the choices share their full ones, filled with them)
                    pulled = blocks[reused:prompt_blocks]
                    digests = await self._transport.pull(handle, engine, pulled)
                    if digests is not None:
                        await self._check(handle, pulled, digests, reused)
                engine.cache_received_prompt(request_id)
            accepted = True
            return _ACCEPTED
        except NoRoom as exc:
            return Rejected(RejectReason.NO_ROOM, f"decode has no KV room: {exc}")
        except KvTransferError as exc:
            return Rejected(RejectReason.TRANSFER_FAILED, str(exc))
        except EngineError as exc:  # a fork's id in use
            return Rejected(RejectReason.BAD_REQUEST, str(exc))
        finally:
            if not accepted:
                for choice_id in forks:
                    engine.free_request(choice_id)
                engine.free_request(request_id)

    async def _check(
        self, handle: KvHandle, pulled: tuple[int, ...], digests: KvDigests, reused: int
    ) -> None:
        """The pulled blocks are what prefill wrote in them; else KvDigestMismatch, counted
        and logged with the blocks (their indexes in the prompt) named."""
        counts = self.digest_counts
        counts.checked += 1
        mismatches = await mismatched_blocks(self._engine, pulled, digests)
        if not mismatches:
            return
        counts.mismatched += 1
        indexes = tuple(reused + mismatch.index for mismatch in mismatches)
        # every block named; why, for the first few (a torn pull fails them all alike)
        details = "; ".join(
            f"block {reused + m.index} (prefill's {handle.block_ids[m.index]}): {m.why}"
            for m in mismatches[:_DETAILED_MISMATCHES]
        )
        log.warning(
            "KV digest mismatch: the KV of %s pulled from %s is not what prefill wrote "
            "in prompt blocks %s (%d of %d pulled); %s",
            handle.request_id,
            handle.instance_id,
            ",".join(map(str, indexes)),
            len(mismatches),
            len(pulled),
            details,
        )
        shown = ",".join(map(str, indexes[:_DETAILED_MISMATCHES]))
        more = "..." if len(indexes) > _DETAILED_MISMATCHES else ""
        raise KvDigestMismatch(
            f"the KV pulled from {handle.instance_id} is not what prefill wrote "
            f"(digest mismatch in prompt blocks {shown}{more})",
            indexes,
        )

    def _fork(self, start: DecodeStartChoices, total_tokens: int, forks: list[str]) -> None:
        """Blocks for every choice but 0 (which runs on the request's own): the prompt's
        full blocks shared, the rest their own; ``forks`` names each that got them."""
        engine = self._engine
        for choice, _ in start.choices:
            if choice:
                choice_id = choice_request_id(start.request_id, choice)
                engine.fork_blocks(
                    start.request_id, choice_id, len(start.prompt_token_ids), total_tokens
                )
                forks.append(choice_id)


def _malformed(start: DecodeStart) -> str | None:
    """What makes the start impossible to run, whatever instance gets it."""
    handle = start.kv_handle
    prompt_tokens = len(start.prompt_token_ids)
    if handle.request_id != start.request_id:
        return f"the KV handle is for {handle.request_id!r}, not {start.request_id!r}"
    if handle.num_tokens != prompt_tokens:
        return f"the KV handle holds {handle.num_tokens} tokens, the prompt has {prompt_tokens}"
    expected_blocks = blocks_needed(prompt_tokens, handle.layout.block_size)
    if len(handle.block_ids) != expected_blocks:
        return f"the KV handle names {len(handle.block_ids)} blocks, expected {expected_blocks}"
    if not 0 <= start.generated_tokens < prompt_tokens:
        return f"{start.generated_tokens} generated tokens in a prompt of {prompt_tokens}"
    if start.tokens_generated <= start.generated_tokens or (
        tokens_left(start.token_budget, start.tokens_generated) < 1
    ):
        return (
            f"no token left to generate: {start.tokens_generated} of a budget of "
            f"{start.token_budget} spent"
        )
    if not 0 <= start.cached_tokens <= prompt_tokens:
        return f"cached_tokens {start.cached_tokens} is not within the prompt's {prompt_tokens}"
    if isinstance(start, DecodeStartChoices):
        return _malformed_choices(start)
    return None


def _malformed_choices(start: DecodeStartChoices) -> str | None:
    """What is wrong with a start's choices (n > 1), if anything."""
    n = start.sampling.n
    if n <= 1:
        return f"choices for a request of n = {n}"
    if start.generated_tokens:
        return "a continuation has one choice"
    if not start.choices:
        return "no choice to run"
    indexes = [choice for choice, _ in start.choices]
    if len(set(indexes)) != len(indexes) or not all(0 <= c < n for c in indexes):
        return f"choices {indexes} are not distinct choices of 0..{n - 1}"
    if not all(type(first) is int for _, first in start.choices):
        return "a choice's first token id is not an integer"
    return None
