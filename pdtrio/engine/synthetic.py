"""The synthetic engine: no torch, deterministic tokens, counted KV blocks.

Output is a pure function of (prompt token ids, seed, position), so a request
gives the same text disaggregated or colocated; so are its logprobs
(:func:`synthetic_logprob`: a made-up distribution in which the token produced
is the likeliest).  KV blocks are real bytes
derived from the prompt, so a handoff that moves the wrong bytes is caught.
It runs as trio tasks (it does no real work) and is cheap enough to be the
load generator of the router benchmarks.
"""

from __future__ import annotations

import ctypes
import math
import time
import zlib
from typing import final

import attrs
import trio

from pdtrio.config import SyntheticEngineConfig
from pdtrio.engine.api import (
    EngineError,
    EngineOutput,
    EngineStatistics,
    KvRegion,
    PrefillResult,
    PromptRejected,
    StepLogprobs,
    StepObserver,
    StepOutputs,
    kv_buffer,
)
from pdtrio.engine.blocks import BlockAllocator, BlockOwnership
from pdtrio.engine.budget import (
    check_choices,
    check_continuation,
    check_logit_bias,
    check_prompt_length,
    check_start_choices,
    checked_token_ids,
    token_budget,
    tokens_left,
)
from pdtrio.engine.prefix_cache import PrefixCache, chain_root, layout_salt
from pdtrio.engine.scheduler import Scheduler, SchedulerLimits, StepSchedule
from pdtrio.engine.stopping import OutputProcessor
from pdtrio.protocol.kv_layout import KvLayout, blocks_needed
from pdtrio.protocol.link.wire import (
    MAX_TOP_LOGPROBS,
    ChatPrompt,
    FirstToken,
    KvEvents,
    Prompt,
    TextPrompt,
    TokenEntry,
    TokenLogprob,
    TokenLogprobs,
    Usage,
    choice_request_id,
)
from pdtrio.protocol.sampling import SamplingParams, choice_sampling

SYNTHETIC_MODEL_NAME = "synthetic"
_FIRST_WORD_ID = 300  # ids below are bytes and specials
_HEAD_DIM = 2  # bytes per token per K or V: keeps blocks small but real
_MASK64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """splitmix64 over the values: a stable hash with no global state."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        state ^= state >> 31
        state = state * 0x94D049BB133111EB & _MASK64
        state ^= state >> 29
    return state


def prompt_digest(prompt_token_ids: list[int] | tuple[int, ...]) -> int:
    return zlib.crc32(b"".join(t.to_bytes(4, "little") for t in prompt_token_ids))


def synthetic_token(digest: int, seed: int, position: int, vocab_size: int) -> int:
    return _FIRST_WORD_ID + _mix(digest, seed, position) % max(1, vocab_size - _FIRST_WORD_ID)


# below this a temperature is greedy (as the torch sampler's): every choice the same
_GREEDY_TEMPERATURE = 1e-5


def choice_seed(sampling: SamplingParams, choice: int) -> int:
    """The seed choice ``choice`` of a request draws with: ``choice_sampling``'s, and for an
    unseeded request's choices past the first a salt of their own, so that they differ
    (choice 0 is the request's single sequence, as with n = 1); a greedy request's
    choices are all choice 0, as a real model's argmax would be."""
    if sampling.temperature < _GREEDY_TEMPERATURE:
        choice = 0
    seed = choice_sampling(sampling, choice).seed
    if seed is not None:
        return seed
    return 0 if choice == 0 else _mix(0xC401CE, choice)


def synthetic_text(token_id: int) -> str:
    return f" t{token_id}"


def synthetic_logprob(
    digest: int, seed: int, position: int, vocab_size: int, token_id: int, top: int
) -> TokenLogprob:
    """The logprob of ``token_id`` (the token made at ``position``) and the ``top``
    likeliest: it has probability 0.5 to 0.75, and the others, made as it is with other
    seeds, share what is left, each half the one before (so the mass stays below 1)."""
    first = 0.5 + _mix(digest, seed, position, 1) % 1000 / 4000
    top = max(0, min(top, MAX_TOP_LOGPROBS))
    tokens = [token_id]
    salt = 0
    while len(tokens) < top and salt < 4 * MAX_TOP_LOGPROBS:
        salt += 1
        other = synthetic_token(digest, seed ^ _mix(salt), position, vocab_size)
        if other not in tokens:
            tokens.append(other)
    logprobs = [math.log(first)]
    mass = 1.0 - first
    for _ in tokens[1:]:
        mass /= 2
        logprobs.append(math.log(mass))
    return TokenLogprob(
        synthetic_text(token_id),
        logprobs[0],
        tuple(synthetic_text(t) for t in tokens[:top]),
        tuple(logprobs[:top]),
    )


def expected_kv_bytes(prompt_token_ids: list[int] | tuple[int, ...], layout: KvLayout) -> bytes:
    """The bytes a prefill of this prompt leaves in its blocks (padded to whole blocks)."""
    per_token = bytearray()
    for position, token in enumerate(prompt_token_ids):
        key = (token * 131 + position) & 0xFFFF
        per_token += key.to_bytes(2, "little")
    # block layout: [K|V][block_size][head_dim bytes]
    out = bytearray()
    token_bytes = _HEAD_DIM
    for start in range(0, len(prompt_token_ids), layout.block_size):
        chunk = bytes(per_token[start * token_bytes : (start + layout.block_size) * token_bytes])
        chunk = chunk.ljust(layout.block_size * token_bytes, b"\0")
        out += chunk  # K
        out += bytes(b ^ 0x5A for b in chunk)  # V
    return bytes(out)


def _utf8_length(text: str) -> int:
    # isascii is O(1) on CPython's compact strings: no 15 MB copy for the common case
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def _token_count(prompt: Prompt) -> int:
    """How many ids ``SyntheticEngine.tokenize`` gives the prompt, without making them."""
    if isinstance(prompt, ChatPrompt):
        return 2 + sum(
            _utf8_length(role) + _utf8_length(content) + 3 for role, content in prompt.messages
        )
    if isinstance(prompt, TextPrompt):
        return 1 + _utf8_length(prompt.text)
    return len(prompt.token_ids)


@final
class _SyntheticText:
    """The made-up words as a text stream: each token is its own word."""

    __slots__ = ()

    def push(self, token_id: int) -> str:
        return synthetic_text(token_id)

    def flush(self) -> str:
        return ""


_TEXT = _SyntheticText()


@attrs.define(eq=False)
class _Running:
    request_id: str
    digest: int
    seed: int
    position: int  # position of the next token to generate
    prompt_tokens: int
    cached_tokens: int
    processor: OutputProcessor
    logprobs: int = -1  # the request's SamplingParams.logprobs


@attrs.define(eq=False)
class _WaitingPrompt:
    """A prompt waiting for its steps (scheduled prefill): set once its last chunk ran."""

    done: trio.Event = attrs.field(factory=trio.Event)


@final
class SyntheticEngine:
    """``scheduler_limits``: schedule steps as the torch engine does (pdtrio.engine.scheduler):
    a step decodes at most ``max_batch_size`` sequences, and a prefill waits for the
    steps that take its prompt a chunk at a time with what the decodes leave of the
    step's token budget; a step then lasts ``decode_step_s`` plus ``prefill_s_per_token``
    for each prompt token in it.  None (the default): every prefill runs at once
    (``prefill_s_per_token`` each token), every running sequence decodes each step."""

    def __init__(
        self,
        config: SyntheticEngineConfig,
        *,
        num_blocks: int,
        block_size: int,
        model_name: str = SYNTHETIC_MODEL_NAME,
        default_max_tokens: int = 2048,
        scheduler_limits: SchedulerLimits | None = None,
        prefix_cache: bool = False,
        prefix_cache_max_blocks: int = 0,
    ) -> None:
        self._config = config
        self._scheduler: Scheduler[_WaitingPrompt, _Running] | None = (
            None if scheduler_limits is None else Scheduler(scheduler_limits)
        )
        self._left_out = 0  # requests the last scheduled step left waiting
        # the step under way, when steps are scheduled (a subclass's _step sees it too)
        self._plan: StepSchedule[_WaitingPrompt, _Running] | None = None
        self._default_max_tokens = default_max_tokens
        self._model_name = model_name
        allocator = BlockAllocator(num_blocks)
        cache = PrefixCache(
            allocator, enabled=prefix_cache, max_cached_blocks=prefix_cache_max_blocks
        )
        self._blocks = BlockOwnership(allocator, block_size, cache)
        self._layout = KvLayout(
            model_fingerprint=f"synthetic-v1-vocab{config.vocab_size}",
            num_layers=1,
            num_kv_heads=1,
            head_dim=_HEAD_DIM,
            block_size=block_size,
            dtype="synthetic",
        )
        self._chain_root = chain_root(layout_salt(self._layout))
        # the blocks' bytes in one buffer, so a transport can register it (see kv_region);
        # the ctypes view gives its address (and keeps the mapping from being closed)
        self._kv = kv_buffer(max(1, num_blocks * self._layout.block_nbytes))
        self._kv_view = (ctypes.c_char * len(self._kv)).from_buffer(self._kv)
        self._running: dict[str, _Running] = {}
        self._work_arrived = trio.Event()
        self._prefilling = 0
        self._step_observer: StepObserver | None = None

    # --- identity ---------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def layout(self) -> KvLayout:
        return self._layout

    @property
    def max_model_len(self) -> int:
        return self._config.max_model_len

    def statistics(self) -> EngineStatistics:
        cache = self._blocks.prefix_cache.statistics()
        return EngineStatistics(
            running_requests=len(self._running) + self._prefilling,
            kv_blocks_in_use=self._blocks.num_used,
            kv_blocks_total=self._blocks.num_blocks,
            waiting_requests=self._left_out,
            prefix_cache_hit_tokens=cache.hit_tokens,
            prefix_cache_miss_tokens=cache.miss_tokens,
            prefix_cache_evicted_blocks=cache.evicted_blocks,
            prefix_cache_blocks=cache.cached_blocks,
            prefix_cache_decode_reused_blocks=cache.decode_reused_blocks,
            prefix_cache_decode_pulled_blocks=cache.decode_pulled_blocks,
        )

    def observe_steps(self, observer: StepObserver) -> None:
        self._step_observer = observer

    def kv_events(self, cursor: int | None) -> tuple[int, KvEvents | None]:
        return self._blocks.prefix_cache.events_since(cursor)

    # --- prompts ----------------------------------------------------------------

    async def tokenize(self, prompt: Prompt) -> list[int]:
        await trio.lowlevel.checkpoint()
        # one token per UTF-8 byte: the count is known, and checked, before any list is built
        check_prompt_length(_token_count(prompt), self.max_model_len)
        if isinstance(prompt, ChatPrompt):
            text = "".join(f"<{role}>{content}\n" for role, content in prompt.messages)
            return [1, *(b + 4 for b in text.encode("utf-8")), 3]
        if isinstance(prompt, TextPrompt):
            return [1, *(b + 4 for b in prompt.text.encode("utf-8"))]
        return checked_token_ids(prompt.token_ids, self._config.vocab_size)

    # --- prefill ----------------------------------------------------------------

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        max_tokens: int | None,
        generated_tokens: int = 0,
    ) -> PrefillResult:
        own = check_continuation(len(prompt_token_ids), generated_tokens)
        check_logit_bias(sampling, self._config.vocab_size)
        if sampling.n != 1:
            check_choices(sampling.n, generated_tokens)
        if sampling.structured is not None:
            # its tokens are made-up words with no text a grammar could read
            raise PromptRejected(
                "Structured output (and a forced tool call) is not supported by the "
                "synthetic engine (it has no real vocabulary); serve a model with the "
                "torch engine.",
                param="tools" if sampling.structured.kind == "tool_call" else "response_format",
            )
        budget = token_budget(
            own,
            max_tokens,
            max_model_len=self._config.max_model_len,
            kv_capacity_tokens=self._blocks.num_blocks * self._blocks.block_size,
            default_max_tokens=self._default_max_tokens,
        )
        if tokens_left(budget, generated_tokens) < 1:
            raise PromptRejected(
                f"no token left to generate: {generated_tokens} of {budget} spent",
                param="max_tokens",
            )
        block_ids, cached = self._blocks.ensure_prompt(
            request_id, prompt_token_ids, self._chain_root
        )
        to_compute = len(prompt_token_ids) - cached
        self._prefilling += 1
        try:
            if self._scheduler is not None:
                await self._scheduled_prefill(self._scheduler, to_compute)
            elif self._config.prefill_s_per_token > 0:
                await trio.sleep(self._config.prefill_s_per_token * to_compute)
            else:
                await trio.lowlevel.checkpoint()
        except BaseException:
            self._blocks.release(request_id)
            raise
        finally:
            self._prefilling -= 1
        # the cached blocks hold their prefix's bytes already: only the rest is written
        first_new = cached // self._layout.block_size
        kv = expected_kv_bytes(prompt_token_ids, self._layout)
        self._write_store(block_ids[first_new:], kv[first_new * self._layout.block_nbytes :])
        self._blocks.cache_prompt(request_id)
        cached_tokens = min(cached, own)  # of the prompt proper, as usage counts it
        seed = 0 if sampling.seed is None else sampling.seed
        # a continuation's tokens depend on the prompt proper and the position only: the
        # same as if the request had never moved
        digest = prompt_digest(prompt_token_ids[:own])
        first = synthetic_token(digest, seed, len(prompt_token_ids), self._config.vocab_size)
        processor = OutputProcessor(
            _TEXT, sampling, token_budget=budget, tokens_generated=generated_tokens
        )
        for earlier in prompt_token_ids[own:]:
            processor.replay(earlier)
        text, finish = processor.push(first)
        usage: Usage | None = None
        if sampling.n > 1:
            return self._prefill_choices(
                request_id, prompt_token_ids, sampling, budget, block_ids, cached_tokens
            )
        if finish is not None:
            self._blocks.release(request_id)
            block_ids = ()
            usage = Usage(own, processor.num_generated, cached_tokens)
        first_logprob = None
        if sampling.wants_logprobs:
            first_logprob = synthetic_logprob(
                digest,
                seed,
                len(prompt_token_ids),
                self._config.vocab_size,
                first,
                sampling.logprobs,
            )
        return PrefillResult(
            first_token_id=first,
            first_text=text,
            finish_reason=finish,
            block_ids=block_ids,
            cached_tokens=cached_tokens,
            token_budget=budget,
            usage=usage,
            first_logprob=first_logprob,
        )

    def _prefill_choices(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        budget: int,
        block_ids: tuple[int, ...],
        cached_tokens: int,
    ) -> PrefillResult:
        """The first tokens of a prefill of n > 1 choices (no continuation has them): each
        choice's own draw, stop rules and logprob; the blocks stay while any choice runs."""
        own = len(prompt_token_ids)
        digest = prompt_digest(prompt_token_ids)
        vocab = self._config.vocab_size
        firsts: list[FirstToken] = []
        for choice in range(sampling.n):
            seed = choice_seed(sampling, choice)
            first = synthetic_token(digest, seed, own, vocab)
            processor = OutputProcessor(
                _TEXT, choice_sampling(sampling, choice), token_budget=budget, tokens_generated=0
            )
            text, finish = processor.push(first)
            usage = None if finish is None else Usage(own, processor.num_generated, cached_tokens)
            logprob = None
            if sampling.wants_logprobs:
                logprob = synthetic_logprob(digest, seed, own, vocab, first, sampling.logprobs)
            firsts.append(FirstToken(choice, first, text, finish, usage, logprob))
        if all(first.finish_reason is not None for first in firsts):
            self._blocks.release(request_id)
            block_ids = ()
        head = firsts[0]
        return PrefillResult(
            first_token_id=head.token_id,
            first_text=head.text,
            finish_reason=head.finish_reason,
            block_ids=block_ids,
            cached_tokens=cached_tokens,
            token_budget=budget,
            usage=head.usage,
            first_logprob=head.logprob,
            choices=tuple(firsts[1:]),
        )

    def free_request(self, request_id: str) -> None:
        state = self._running.pop(request_id, None)
        if state is not None and self._scheduler is not None:
            self._scheduler.remove_decode(state)
        self._blocks.release(request_id)

    # --- KV blocks ----------------------------------------------------------------

    def allocate_blocks(self, request_id: str, num_tokens: int) -> tuple[int, ...]:
        return self._blocks.ensure(request_id, num_tokens)

    def allocate_blocks_reusing_prefix(
        self, request_id: str, prompt_token_ids: list[int], num_tokens: int
    ) -> tuple[tuple[int, ...], int]:
        return self._blocks.ensure_received(
            request_id, prompt_token_ids, self._chain_root, num_tokens
        )

    def cache_received_prompt(self, request_id: str) -> None:
        self._blocks.cache_prompt(request_id)

    def fork_blocks(
        self, request_id: str, choice_id: str, shared_tokens: int, num_tokens: int
    ) -> tuple[int, ...]:
        return self._blocks.fork(request_id, choice_id, shared_tokens, num_tokens)

    def _write_store(self, block_ids: tuple[int, ...], data: bytes) -> None:
        size = self._layout.block_nbytes
        for index, block in enumerate(block_ids):
            self._kv[block * size : (block + 1) * size] = data[index * size : (index + 1) * size]

    async def read_blocks(self, block_ids: tuple[int, ...]) -> bytes:
        await trio.lowlevel.checkpoint()
        size = self._layout.block_nbytes
        return b"".join(self._kv[b * size : (b + 1) * size] for b in block_ids)

    def block_generations(self, block_ids: tuple[int, ...]) -> tuple[int, ...]:
        return self._blocks.allocator.generations(block_ids)

    def kv_region(self) -> KvRegion:
        return KvRegion(
            address=ctypes.addressof(self._kv_view),
            num_blocks=self._blocks.num_blocks,
            block_nbytes=self._layout.block_nbytes,
            device="cpu",
        )

    async def write_blocks(self, block_ids: tuple[int, ...], data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        if len(data) != len(block_ids) * self._layout.block_nbytes:
            raise EngineError(
                f"KV data is {len(data)} bytes, expected "
                f"{len(block_ids) * self._layout.block_nbytes} for {len(block_ids)} blocks"
            )
        self._write_store(block_ids, data)

    # --- decode -------------------------------------------------------------------

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
        await trio.lowlevel.checkpoint()
        if not 0 <= generated_tokens < len(prompt_token_ids):
            raise EngineError(f"request {request_id}: {generated_tokens} generated tokens")
        own = len(prompt_token_ids) - generated_tokens
        if tokens_generated <= generated_tokens or tokens_left(token_budget, tokens_generated) <= 0:
            raise EngineError(
                f"request {request_id} has no token budget left "
                f"({tokens_generated} of {token_budget} spent)"
            )
        if not all(0 <= t < self._config.vocab_size for t in (*prompt_token_ids, first_token_id)):
            raise EngineError(f"request {request_id} has token ids out of the vocabulary")
        if choices:
            check_start_choices(request_id, sampling, generated_tokens, choices)
            await self._start_choices(
                request_id, prompt_token_ids, sampling, token_budget, cached_tokens, choices
            )
            return
        table = self._blocks.owned(request_id)
        prompt_blocks = blocks_needed(len(prompt_token_ids), self._layout.block_size)
        if len(table) < prompt_blocks:
            raise EngineError(f"request {request_id} owns no KV for its prompt")
        held = await self.read_blocks(tuple(table[:prompt_blocks]))
        if held != expected_kv_bytes(prompt_token_ids, self._layout):
            raise EngineError(f"KV blocks of {request_id} do not hold its prompt")
        processor = OutputProcessor(
            _TEXT, sampling, token_budget=token_budget, tokens_generated=tokens_generated
        )
        # the first token's text went out from prefill (a continuation's earlier tokens'
        # before it); a stop string may begin in them
        for earlier in (*prompt_token_ids[own:], first_token_id):
            processor.replay(earlier)
        self._add_running(
            _Running(
                request_id=request_id,
                digest=prompt_digest(prompt_token_ids[:own]),
                seed=0 if sampling.seed is None else sampling.seed,
                position=own + tokens_generated,
                prompt_tokens=own,
                cached_tokens=cached_tokens,
                processor=processor,
                logprobs=sampling.logprobs,
            )
        )

    async def _start_choices(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        token_budget: int,
        cached_tokens: int,
        choices: tuple[tuple[int, int], ...],
    ) -> None:
        """start_decode's n > 1: each choice runs as a request of its own, on its forked
        blocks, once its copy of the prompt's partial last block is made (and checked)."""
        vocab = self._config.vocab_size
        if not all(0 <= first < vocab for _, first in choices):
            raise EngineError(f"request {request_id} has token ids out of the vocabulary")
        block_size = self._layout.block_size
        prompt_tokens = len(prompt_token_ids)
        full = prompt_tokens // block_size
        prompt_blocks = blocks_needed(prompt_tokens, block_size)
        parent = self._blocks.owned(request_id)
        if len(parent) < prompt_blocks:
            raise EngineError(f"request {request_id} owns no KV for its prompt")
        expected = expected_kv_bytes(prompt_token_ids, self._layout)
        if await self.read_blocks(tuple(parent[:prompt_blocks])) != expected:
            raise EngineError(f"KV blocks of {request_id} do not hold its prompt")
        tables: list[list[int]] = []
        for choice, _ in choices:
            choice_id = choice_request_id(request_id, choice)
            table = self._blocks.owned(choice_id)
            if len(table) < prompt_blocks or table[:full] != parent[:full]:
                raise EngineError(f"{choice_id} does not own its prompt's shared blocks")
            tables.append(table)
        size = self._layout.block_nbytes
        if prompt_tokens % block_size:
            partial = self._kv[parent[full] * size : (parent[full] + 1) * size]
            for (choice, _), table in zip(choices, tables, strict=True):
                if choice:
                    self._write_store((table[full],), partial)
        for table in tables:
            if await self.read_blocks(tuple(table[:prompt_blocks])) != expected:
                raise EngineError(
                    f"the KV blocks of a choice of {request_id} do not hold its prompt"
                )
        digest = prompt_digest(prompt_token_ids)
        for choice, first in choices:
            processor = OutputProcessor(
                _TEXT,
                choice_sampling(sampling, choice),
                token_budget=token_budget,
                tokens_generated=1,
            )
            processor.replay(first)  # its text went out from prefill
            choice_id = choice_request_id(request_id, choice)
            self._add_running(
                _Running(
                    request_id=choice_id,
                    digest=digest,
                    seed=choice_seed(sampling, choice),
                    position=prompt_tokens + 1,
                    prompt_tokens=prompt_tokens,
                    cached_tokens=cached_tokens,
                    processor=processor,
                    logprobs=sampling.logprobs,
                )
            )
        if all(choice != 0 for choice, _ in choices):
            # choice 0 ended at prefill: the shared blocks stay, held by the others
            self._blocks.release(request_id)

    def abort(self, request_id: str) -> None:
        self.free_request(request_id)

    def _add_running(self, state: _Running) -> None:
        self._running[state.request_id] = state
        if self._scheduler is not None:
            self._scheduler.add_decode(state)
        self._work_arrived.set()

    async def _scheduled_prefill(
        self, scheduler: Scheduler[_WaitingPrompt, _Running], num_tokens: int
    ) -> None:
        waiting = _WaitingPrompt()
        scheduler.add_prompt(waiting, num_tokens)
        self._work_arrived.set()
        try:
            await waiting.done.wait()
        finally:
            scheduler.remove_prompt(waiting)  # (cancelled while it waited)

    def _step(self) -> tuple[StepOutputs, StepLogprobs | None, int]:
        """One step's outputs, their logprobs (None: no request in it asked), and how many
        sequences (prompts and decodes) it ran: the scheduler's plan's (its requests freed
        since were dropped), or every running sequence's."""
        plan = self._plan
        if plan is None:
            running = list(self._running.values())
            batch = len(running)
        else:
            # a decode aborted while the step ran produces nothing
            running = [s for s in plan.decodes if self._running.get(s.request_id) is s]
            batch = len(plan.prefills) + len(plan.decodes)
        outputs: StepOutputs = []
        logprobs: list[TokenLogprobs] = []
        vocab = self._config.vocab_size
        per_step = self._config.tokens_per_step
        finished: list[_Running] = []
        for state in running:
            processor = state.processor
            tokens: list[int] = []
            texts: list[str] = []
            finish: str | None = None
            while finish is None and len(tokens) < per_step:
                token = synthetic_token(state.digest, state.seed, state.position, vocab)
                state.position += 1
                tokens.append(token)
                text, finish = processor.push(token)
                texts.append(text)
            if state.logprobs >= 0:
                start = state.position - len(tokens)
                items = [
                    synthetic_logprob(state.digest, state.seed, at, vocab, t, state.logprobs)
                    for at, t in enumerate(tokens, start)
                ]
                logprobs.append(TokenLogprobs(state.request_id, items))
            usage: Usage | None = None
            if finish is not None:
                usage = Usage(state.prompt_tokens, processor.num_generated, state.cached_tokens)
                finished.append(state)
            outputs.append(TokenEntry(state.request_id, tokens, "".join(texts), finish, usage))
        for state in finished:
            self.free_request(state.request_id)
        if plan is not None and self._scheduler is not None:
            for waiting in self._scheduler.update_from_output(plan, finished):
                waiting.done.set()
        return outputs, StepLogprobs(logprobs) if logprobs else None, batch

    async def run(
        self,
        outputs: trio.MemorySendChannel[EngineOutput],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        step = self._config.decode_step_s
        per_prompt_token = self._config.prefill_s_per_token
        scheduler = self._scheduler
        task_status.started()
        async with outputs:
            next_step = -math.inf
            while True:
                if not self._running and (scheduler is None or not scheduler.has_work):
                    self._work_arrived = trio.Event()
                    await self._work_arrived.wait()
                    next_step = trio.current_time()
                # steady pace: the next step is due one interval after the last
                next_step = max(next_step + step, trio.current_time()) if step else 0.0
                if step:
                    await trio.sleep_until(next_step)
                else:
                    await trio.lowlevel.checkpoint()
                self._plan = plan = None
                if scheduler is not None:
                    self._plan = plan = scheduler.schedule()
                    self._left_out = plan.waiting
                    prompt_tokens = plan.num_tokens - len(plan.decodes)
                    if prompt_tokens and per_prompt_token:
                        # the step's prompt chunks take their time: what arrives meanwhile
                        # waits for the next step
                        next_step = max(next_step, trio.current_time())
                        next_step += per_prompt_token * prompt_tokens
                        await trio.sleep_until(next_step)
                started = time.perf_counter()
                produced, produced_logprobs, batch = self._step()
                observer = self._step_observer
                if observer is not None:
                    tokens = sum(len(entry.token_ids) for entry in produced)
                    observer(time.perf_counter() - started, batch, tokens)
                if produced_logprobs is not None:
                    await outputs.send(produced_logprobs)  # ahead of their tokens
                if produced:
                    await outputs.send(produced)
