"""The contract between a worker's trio shell and its engine.

Two engines implement it: the synthetic engine (no torch, for tests and load
generation) and the torch engine.  Nothing here imports torch.

Blocks belong to a request id.  ``prefill`` leaves the prompt's blocks owned
by the request until ``free_request``; ``allocate_blocks`` + ``write_blocks``
is how a decode instance receives them; ``start_decode`` runs the request on
the blocks it owns, and frees them itself when the request finishes or is
aborted (an abort the engine takes between steps ends with a ``BlocksFreed`` output,
so the worker knows when the room is there).  With the prefix cache on, a prompt's first blocks may be cached blocks
that other requests own too: freeing a request frees only what nobody else holds
(``pdtrio.engine.prefix_cache``).  Decode then allocates with
``allocate_blocks_reusing_prefix``, receives only the blocks it did not find cached,
and caches the prompt's full blocks with ``cache_received_prompt`` once they are in
place (so a conversation's next turn moves only its new tokens' KV).

``kv_region`` is the cache's memory as one range that never moves, for
transports that copy blocks without the engine (NIXL reads and writes it
directly): block ``b`` is ``block_nbytes`` bytes at ``address + b * block_nbytes``,
in the byte order ``read_blocks`` produces.

The token budget is computed once, by ``prefill`` (``engine.budget.token_budget``),
and handed to ``start_decode`` with how much of it is spent; usage is counted
by the engine that finishes the request, and travels on its last output.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable
from typing import Protocol, final

import attrs
import trio

from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.link.wire import (
    FirstToken,
    KvEvents,
    Prompt,
    TokenEntry,
    TokenLogprob,
    TokenLogprobs,
    Usage,
)
from pdtrio.protocol.sampling import SamplingParams


class EngineError(Exception):
    """Base of the errors an engine raises to its shell."""


class PromptRejected(EngineError):
    """The prompt cannot be served (too long, bad template, bad token ids): a 400."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class NoRoom(EngineError):
    """Not enough free KV blocks right now: try another instance, or 503."""


@final
@attrs.frozen
class EngineStatistics:
    running_requests: int
    kv_blocks_in_use: int
    kv_blocks_total: int
    # requests waiting for a step (prefills queued, decodes past the batch limit)
    waiting_requests: int = 0
    # the prefix cache (all 0 when it is off); kv_blocks_in_use counts what requests hold,
    # so cached blocks nobody holds count as free: an allocation evicts them when it must
    prefix_cache_hit_tokens: int = 0  # prompt tokens found cached, since start
    prefix_cache_miss_tokens: int = 0  # prompt tokens looked up and not found
    prefix_cache_evicted_blocks: int = 0  # since start
    prefix_cache_blocks: int = 0  # blocks cached now, held by requests or not
    # decode (received prompts): full blocks found cached here, and blocks pulled, since start
    prefix_cache_decode_reused_blocks: int = 0
    prefix_cache_decode_pulled_blocks: int = 0


# Told after each engine step that computed something: its seconds, how many requests it
# ran (the batch size) and how many tokens it produced.  Called on the engine's thread
# (torch), so it must be cheap and thread-safe (prometheus_client's metrics are).
StepObserver = Callable[[float, int, int], None]


@final
@attrs.frozen
class PrefillResult:
    first_token_id: int
    first_text: str
    finish_reason: str | None
    block_ids: tuple[int, ...]  # empty when finish_reason is set: blocks are already free
    cached_tokens: int
    token_budget: int  # the whole completion budget, the first token included
    usage: Usage | None  # set when finish_reason is
    first_logprob: TokenLogprob | None = None  # when the request asked for logprobs
    # n > 1: the first tokens of choices 1.. (the fields above are choice 0's); block_ids
    # is then empty only when every choice finished
    choices: tuple[FirstToken, ...] = ()


@final
@attrs.frozen
class KvRegion:
    """An engine's whole KV cache as one fixed range of memory, block after block."""

    address: int
    num_blocks: int
    block_nbytes: int
    device: str  # "cpu", or "cuda" when the cache lives on a GPU
    device_id: int = 0  # the GPU's index for "cuda"

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    def block_address(self, block_id: int) -> int:
        return self.address + block_id * self.block_nbytes


def kv_buffer(nbytes: int) -> mmap.mmap:
    """Zeroed, page-aligned memory for a KV cache on the CPU, in transparent huge pages
    where the kernel allows: a copy between processes (CMA) walks 512 times fewer pages.

    Private (a shared mapping is shmem, which gets no huge pages) and touched
    once here, so no transfer or step pays for faulting its pages in; ``nbytes`` > 0.
    """
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    view = (ctypes.c_char * nbytes).from_buffer(buffer)
    ctypes.memset(view, 0, nbytes)
    del view  # the export ends: the caller may take its own views
    return buffer


# One engine step's outputs: at most one entry per request that produced something.
StepOutputs = list[TokenEntry]


@final
@attrs.frozen
class StepFailed:
    """A step failed: these requests ended (their blocks are free) and produce nothing more."""

    request_ids: tuple[str, ...]
    message: str


@final
@attrs.frozen
class StepLogprobs:
    """The logprobs of a step's tokens, for the requests in it that asked for them: sent
    just before the step's outputs (so a request that asked none costs nothing)."""

    entries: list[TokenLogprobs]


@final
@attrs.frozen
class BlocksFreed:
    """Aborted requests whose blocks the engine freed after ``abort`` (or ``free_request``)
    returned: the torch engine drops a request it runs between steps, on its own thread.
    Their blocks are free now, so the worker reports its room (nothing else would)."""

    request_ids: tuple[str, ...]


# What an engine's ``run`` sends, in order: a step's outputs (after their logprobs, if any
# request asked), the requests a step lost, or aborted requests' blocks freed late.
EngineOutput = StepOutputs | StepLogprobs | StepFailed | BlocksFreed


class Engine(Protocol):
    @property
    def model_name(self) -> str: ...

    @property
    def layout(self) -> KvLayout: ...

    @property
    def max_model_len(self) -> int: ...

    def statistics(self) -> EngineStatistics: ...

    def observe_steps(self, observer: StepObserver) -> None:
        """Call ``observer`` after each step from now on (the worker's /metrics)."""
        ...

    def kv_events(self, cursor: int | None) -> tuple[int, KvEvents | None]:
        """The prefix cache's changes since ``cursor`` (None: everything, a snapshot) and
        the cursor to ask with next (``PrefixCache.events_since``); None when nothing
        changed or the cache is off.  Cheap when nothing changed: a link asks often."""
        ...

    async def run(
        self,
        outputs: trio.MemorySendChannel[EngineOutput],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the engine loop until cancelled; decode outputs go to ``outputs``."""
        ...

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids for a prompt (chat template applied). Raises PromptRejected."""
        ...

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        max_tokens: int | None,
        generated_tokens: int = 0,
    ) -> PrefillResult:
        """Compute the prompt's KV and sample the first token. Raises NoRoom, PromptRejected.

        ``max_tokens`` is the client's limit (None: the configured default, capped by the context);
        the result's ``token_budget`` is the request's whole budget.  Cancellation
        frees whatever the request had allocated.  ``generated_tokens`` > 0: a
        continuation (``wire.PrefillRequest``): the last ``generated_tokens`` ids
        are output already delivered (replayed into the stop rules, spent from the
        budget, which the prompt before them sets); the token sampled comes after them.
        """
        ...

    def free_request(self, request_id: str) -> None:
        """Free every block the request owns and forget it. Idempotent.

        A request the engine is running may be freed later, between steps: ``run`` then
        sends ``BlocksFreed`` naming it once its blocks are free."""
        ...

    def allocate_blocks(self, request_id: str, num_tokens: int) -> tuple[int, ...]:
        """Reserve blocks for ``num_tokens`` of received KV. Raises NoRoom."""
        ...

    def allocate_blocks_reusing_prefix(
        self, request_id: str, prompt_token_ids: list[int], num_tokens: int
    ) -> tuple[tuple[int, ...], int]:
        """Blocks for ``num_tokens`` of a request whose prompt's KV is received (decode),
        starting with the cached blocks of the prompt's longest cached prefix: (the
        table, how many leading blocks are reused: their KV is in place, only the rest
        of the prompt's blocks are to be received).  Every full prompt block may be
        reused, since decode computes none of the prompt.  Raises NoRoom (and takes
        nothing).  With the prefix cache off: ``allocate_blocks``, nothing reused."""
        ...

    def cache_received_prompt(self, request_id: str) -> None:
        """The KV of the prompt allocated by ``allocate_blocks_reusing_prefix`` is in place:
        cache its full blocks for later prompts (a KV event, like a prefill's) and count
        the reuse.  Nothing with the cache off, or for blocks allocated otherwise."""
        ...

    def fork_blocks(
        self, request_id: str, choice_id: str, shared_tokens: int, num_tokens: int
    ) -> tuple[int, ...]:
        """Blocks for another choice of ``request_id`` (n > 1), owned by ``choice_id``: the
        request's full blocks of its first ``shared_tokens`` (shared, not copied), then
        blocks of its own up to ``num_tokens``. Raises NoRoom (and takes nothing)."""
        ...

    async def read_blocks(self, block_ids: tuple[int, ...]) -> bytes:
        """The blocks' bytes, block after block, in the engine's KV layout."""
        ...

    def block_generations(self, block_ids: tuple[int, ...]) -> tuple[int, ...]:
        """Each block's generation, which grows every time the block is allocated: a block
        freed and reused since a generation was read shows another one."""
        ...

    async def write_blocks(self, block_ids: tuple[int, ...], data: bytes) -> None:
        """Fill the blocks from bytes produced by ``read_blocks`` on a compatible engine."""
        ...

    def kv_region(self) -> KvRegion:
        """The cache's memory; valid, and at the same address, for the engine's lifetime."""
        ...

    async def start_decode(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        sampling: SamplingParams,
        token_budget: int,
        tokens_generated: int,
        cached_tokens: int,
        generated_tokens: int = 0,
        choices: tuple[tuple[int, int], ...] = (),
    ) -> None:
        """Join the running batch on the blocks the request owns. Raises EngineError.

        ``choices`` (n > 1): the (choice, first token id) pairs to run instead of one
        sequence, each as ``wire.choice_request_id`` on the blocks ``fork_blocks`` gave it
        (choice 0 on the request's own), with ``sampling.choice_sampling``; the partial
        last prompt block is copied into each choice's own before it runs.  Each choice
        is then a request of its own (its outputs, abort and free); when choice 0 is not
        among them, the request's own blocks are freed once the others have their copies.

        ``first_token_id`` is the last of the ``tokens_generated`` tokens already
        spent from ``token_budget`` (its text went out from prefill).  For a
        continuation the last ``generated_tokens`` of ``prompt_token_ids`` are
        earlier output (counted in ``tokens_generated``): replayed, never sent again.  Outputs
        come through ``run``'s channel; the last one for the request carries
        its finish_reason and usage, after which its blocks are free.
        """
        ...

    def abort(self, request_id: str) -> None:
        """Stop decoding the request (if it runs) and free its blocks, at once or, for a
        request the engine is running, later with a ``BlocksFreed`` from ``run``. Idempotent."""
        ...
