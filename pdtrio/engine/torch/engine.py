"""The torch engine: a real model, a paged KV cache, continuous batching.

The model runs on its own thread.  The trio side hands it work through a
thread-safe queue and gets results back through ``trio.from_thread`` (prefill
results) and the bounded outputs channel (decode steps), so the trio loop
never waits on torch.  Each loop iteration is one forward pass over what the
scheduler (``pdtrio.engine.scheduler``) puts in the step: the running decodes,
then prompt chunks, within one token budget; requests join and leave between
steps.  Aborted requests leave before the next step, so no token is computed
that nobody will receive; their blocks are freed then, and a ``BlocksFreed``
output says so.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import final

import attrs
import torch
import trio

from pdtrio.config import EngineConfig
from pdtrio.engine.api import (
    BlocksFreed,
    EngineError,
    EngineOutput,
    EngineStatistics,
    KvRegion,
    PrefillResult,
    PromptRejected,
    StepFailed,
    StepLogprobs,
    StepObserver,
    StepOutputs,
)
from pdtrio.engine.blocks import BlockOwnership
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
from pdtrio.engine.detokenizer import IncrementalDetokenizer
from pdtrio.engine.hub import is_repo_id, resolve_repo_id
from pdtrio.engine.prefix_cache import PrefixCache, chain_root, layout_salt
from pdtrio.engine.progress import LoadProgress
from pdtrio.engine.scheduler import Scheduler, SchedulerLimits
from pdtrio.engine.stopping import OutputProcessor
from pdtrio.engine.tokenizer import Tokenizer
from pdtrio.engine.torch.builtin import load_builtin
from pdtrio.engine.torch.grammar import GrammarCompiler, TokenConstraint, apply_constraints
from pdtrio.engine.torch.loaders import LoadedModel, load_gguf, load_hf_checkpoint
from pdtrio.engine.torch.model import SeqInput, StepAbandoned
from pdtrio.engine.torch.sampler import RowLogprobs, TokenHistory, logprobs_of, sample
from pdtrio.engine.torch.threads import apply_num_threads, in_passing_thread, single_threaded
from pdtrio.protocol.kv_layout import KvLayout, blocks_needed
from pdtrio.protocol.link.wire import (
    MAX_TOP_LOGPROBS,
    ChatPrompt,
    ChatPromptWithTools,
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

log = logging.getLogger("pdtrio.engine")

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def load_model(config: EngineConfig) -> LoadedModel:
    _check_device(config.device)
    if config.dtype == "auto":
        dtype = auto_dtype(config.device)
        log.info("dtype auto: %s here", str(dtype).removeprefix("torch."))
    else:
        found = _DTYPES.get(config.dtype)
        if found is None:
            choices = ", ".join(["auto", *_DTYPES])
            raise EngineError(f"unsupported dtype {config.dtype!r} (one of {choices})")
        dtype = found
    name = config.model
    progress = LoadProgress()
    if name.endswith(".gguf"):
        loaded = load_gguf(name, device=config.device, dtype=dtype, progress=progress)
    elif is_repo_id(name):
        # a Hub repo id, served under that name (as vLLM and SGLang serve it)
        directory = resolve_repo_id(name, progress=progress)
        loaded = load_hf_checkpoint(
            directory, device=config.device, dtype=dtype, name=name, progress=progress
        )
    elif "/" in name:
        loaded = load_hf_checkpoint(name, device=config.device, dtype=dtype, progress=progress)
    else:
        loaded = load_builtin(name, device=config.device, dtype=dtype)
    wanted = config.int4_weights == "on" or (config.int4_weights == "auto" and loaded.int4_layers)
    if wanted:
        if loaded.model.quantize_int4():
            log.info("decode steps read 4-bit copies of the layer weights (engine.int4_weights)")
        elif config.int4_weights == "on":
            log.warning("engine.int4_weights = 'on': torch here has no 4-bit kernel for them")
    return loaded


def auto_dtype(device: str) -> torch.dtype:
    """``engine.dtype = "auto"``: bfloat16 where this device multiplies it fast (a GPU; a CPU
    with AMX or AVX-512 BF16, where oneDNN's bfloat16 products beat float32's: a SmolLM2
    256-token prefill 80 against 206 ms, 2 threads, Sapphire Rapids), else float32 (an
    AVX2 CPU widens every bfloat16 product to float32: no faster, and rounded)."""
    if torch.device(device).type == "cpu":
        fast = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return torch.bfloat16 if fast else torch.float32
    return torch.bfloat16


def _check_device(device: str) -> None:
    """Refuse a device torch cannot name or this machine lacks, as the operator's mistake
    (torch says either deep in the load: a RuntimeError, an AssertionError)."""
    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise EngineError(f"engine.device = {device!r} is not a torch device: {exc}") from exc
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise EngineError(
                f"engine.device = {device!r}, but this torch sees no CUDA device "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})"
            )
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise EngineError(
                f"engine.device = {device!r}, but there are {torch.cuda.device_count()} "
                "CUDA devices"
            )


@attrs.define(eq=False)
class _PrefillJob:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    budget: int
    block_table: list[int]
    # hands the result or an exception to the waiting trio task (called on the engine thread)
    deliver: Callable[[PrefillResult | BaseException], None]
    # prompt tokens whose KV is in the cache already (a long prompt goes a chunk a step)
    computed: int = 0
    # a continuation's: the last ids of the prompt that are earlier output
    generated_tokens: int = 0
    # prompt tokens found in the prefix cache (``computed`` starts there)
    cached_tokens: int = 0
    # structured output: the grammar the first token must obey
    constraint: TokenConstraint | None = None
    # n > 1: each choice's sampling and grammar state (choice 0's are the two above)
    choice_samplings: tuple[SamplingParams, ...] = ()
    choice_constraints: tuple[TokenConstraint | None, ...] = ()

    def remaining(self) -> int:
        """Prompt tokens still to prefill."""
        return len(self.prompt_token_ids) - self.computed


@attrs.define(eq=False)
class _DecodeSeq:
    request_id: str
    sampling: SamplingParams
    block_table: list[int]
    processor: OutputProcessor
    last_token: int
    position: int  # position of last_token
    prompt_tokens: int
    cached_tokens: int
    # (prompt ids, output ids so far): kept only for a request whose penalties need them
    history: tuple[list[int], list[int]] | None = None
    # structured output: the grammar state after the tokens so far
    constraint: TokenConstraint | None = None


@attrs.frozen
class _Abort:
    request_id: str


@final
class _Stop:
    """Tells the engine thread of one run to return (one per run: a stale one is ignored)."""


# How long a finished run waits for its engine thread to see the stop (one step at most).
_STOP_GRACE_S = 30.0


@final
class TorchEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        if loaded.tokenizer is None:
            raise EngineError(f"model {loaded.name} has no tokenizer")
        self._loaded = loaded
        self._tokenizer: Tokenizer = loaded.tokenizer
        self._config = config
        self._intra_op_threads = torch.get_num_threads()
        self._cache = loaded.new_kv_cache(
            num_blocks=config.num_kv_blocks, block_size=config.block_size
        )
        self._layout = self._cache.layout(loaded.fingerprint)
        log.info(
            "KV cache allocated: %d blocks of %d tokens (%.1f MiB) on %s",
            config.num_kv_blocks,
            config.block_size,
            config.num_kv_blocks * self._layout.block_nbytes / (1 << 20),
            loaded.device,
        )
        self._lock = threading.Lock()
        # one free list: the cache's own allocator (its statistics stay true)
        prefix_cache = PrefixCache(
            self._cache.allocator,
            enabled=config.prefix_cache,
            max_cached_blocks=config.prefix_cache_max_blocks,
        )
        self._blocks = BlockOwnership(  # under _lock
            self._cache.allocator, config.block_size, prefix_cache
        )
        self._chain_root = chain_root(layout_salt(self._layout))
        self._in_engine: set[str] = set()  # requests the engine thread may touch; under _lock
        self._inbox: queue.SimpleQueue[_PrefillJob | _DecodeSeq | _Abort | _Stop] = (
            queue.SimpleQueue()
        )
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(config.seed)
        self._tokenize_limiter = trio.CapacityLimiter(1)
        self._grammars = GrammarCompiler(self._tokenizer, loaded.config.vocab_size)
        self._thread: threading.Thread | None = None  # the engine thread of the latest run
        self._step_observer: StepObserver | None = None
        self._waiting = 0  # requests the last step left waiting (set by the engine thread)

    @classmethod
    def from_config(cls, config: EngineConfig) -> TorchEngine:
        apply_num_threads(config)
        try:
            # (not on this thread: see pdtrio.engine.torch.threads)
            return in_passing_thread(lambda: cls(load_model(config), config))
        except torch.OutOfMemoryError as exc:
            # the model and its KV cache (engine.num_kv_blocks) do not fit the device
            raise EngineError(
                f"out of memory on {config.device} loading the model and a KV cache of "
                f"{config.num_kv_blocks} blocks: {exc}"
            ) from exc

    # --- identity -------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        """The name clients use: ``engine.served_model_name``, else the model's own."""
        return self._config.served_model_name or self._loaded.name

    @property
    def layout(self) -> KvLayout:
        return self._layout

    @property
    def max_model_len(self) -> int:
        return self._loaded.config.max_position_embeddings

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def statistics(self) -> EngineStatistics:
        with self._lock:
            cache = self._blocks.prefix_cache.statistics()
            return EngineStatistics(
                running_requests=len(self._in_engine),
                kv_blocks_in_use=self._blocks.num_used,
                kv_blocks_total=self._blocks.num_blocks,
                waiting_requests=self._waiting,
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
        cache = self._blocks.prefix_cache
        # unlocked (an int read): the link asks before every frame it sends
        if not cache.enabled or cursor == cache.journal_end:
            return cache.journal_end, None
        with self._lock:
            return cache.events_since(cursor)

    # --- prompts ----------------------------------------------------------------------

    async def tokenize(self, prompt: Prompt) -> list[int]:
        tokenizer = self._tokenizer
        token_ids: list[int]
        if isinstance(prompt, ChatPromptWithTools):
            encode = functools.partial(
                tokenizer.encode_chat,
                tools_json=prompt.tools_json,
                message_extras=prompt.message_extras,
            )
            token_ids = await trio.to_thread.run_sync(
                encode, list(prompt.messages), limiter=self._tokenize_limiter
            )
        elif isinstance(prompt, ChatPrompt):
            token_ids = await trio.to_thread.run_sync(
                tokenizer.encode_chat, list(prompt.messages), limiter=self._tokenize_limiter
            )
        elif isinstance(prompt, TextPrompt):
            token_ids = await trio.to_thread.run_sync(
                tokenizer.encode, prompt.text, limiter=self._tokenize_limiter
            )
        else:
            # the length first: a huge id list is refused before its ids are checked one by one
            check_prompt_length(len(prompt.token_ids), self.max_model_len)
            return checked_token_ids(prompt.token_ids, self._loaded.config.vocab_size)
        check_prompt_length(len(token_ids), self.max_model_len)
        return token_ids

    # --- prefill ----------------------------------------------------------------------

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        max_tokens: int | None,
        generated_tokens: int = 0,
    ) -> PrefillResult:
        own = check_continuation(len(prompt_token_ids), generated_tokens)
        check_logit_bias(sampling, self._loaded.config.vocab_size)
        budget = token_budget(
            own,
            max_tokens,
            max_model_len=self.max_model_len,
            kv_capacity_tokens=self._blocks.num_blocks * self._blocks.block_size,
            default_max_tokens=self._config.default_max_tokens,
        )
        if tokens_left(budget, generated_tokens) < 1:
            raise PromptRejected(
                f"no token left to generate: {generated_tokens} of {budget} spent",
                param="max_tokens",
            )
        if sampling.n != 1:
            check_choices(sampling.n, generated_tokens)
        constraint = await self._constraint(sampling, prompt_token_ids[own:])
        choice_samplings: tuple[SamplingParams, ...] = ()
        choice_constraints: tuple[TokenConstraint | None, ...] = ()
        if sampling.n > 1:
            choice_samplings = tuple(choice_sampling(sampling, c) for c in range(sampling.n))
            # each choice's own grammar state, from the same (empty) output so far
            others = [await self._constraint(sampling, []) for _ in range(1, sampling.n)]
            choice_constraints = (constraint, *others)
        with self._lock:
            blocks, cached = self._blocks.ensure_prompt(
                request_id, prompt_token_ids, self._chain_root
            )
            self._in_engine.add(request_id)
        done = trio.Event()
        outcome: list[PrefillResult | BaseException] = []
        token = trio.lowlevel.current_trio_token()

        def deliver(result: PrefillResult | BaseException) -> None:
            outcome.append(result)
            done.set()

        job = _PrefillJob(
            request_id,
            prompt_token_ids,
            sampling,
            budget,
            list(blocks),
            lambda result: token.run_sync_soon(deliver, result),
            # the cached prefix's KV is in its blocks: the steps compute the rest
            computed=cached,
            generated_tokens=generated_tokens,
            cached_tokens=cached,
            constraint=constraint,
            choice_samplings=choice_samplings,
            choice_constraints=choice_constraints,
        )
        self._inbox.put(job)
        try:
            await done.wait()
        except BaseException:
            # the engine thread drops the job and frees its blocks at its next step
            self._inbox.put(_Abort(request_id))
            raise
        result = outcome[0]
        if isinstance(result, BaseException):
            self.free_request(request_id)
            raise result
        return result

    # --- blocks -------------------------------------------------------------------------

    def free_request(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._in_engine:
                self._inbox.put(_Abort(request_id))  # the thread frees it between steps
                return
            self._blocks.release(request_id)

    def allocate_blocks(self, request_id: str, num_tokens: int) -> tuple[int, ...]:
        with self._lock:
            return self._blocks.ensure(request_id, num_tokens)

    def allocate_blocks_reusing_prefix(
        self, request_id: str, prompt_token_ids: list[int], num_tokens: int
    ) -> tuple[tuple[int, ...], int]:
        with self._lock:
            return self._blocks.ensure_received(
                request_id, prompt_token_ids, self._chain_root, num_tokens
            )

    def cache_received_prompt(self, request_id: str) -> None:
        with self._lock:
            self._blocks.cache_prompt(request_id)

    def fork_blocks(
        self, request_id: str, choice_id: str, shared_tokens: int, num_tokens: int
    ) -> tuple[int, ...]:
        with self._lock:
            return self._blocks.fork(request_id, choice_id, shared_tokens, num_tokens)

    async def read_blocks(self, block_ids: tuple[int, ...]) -> bytes:
        return await trio.to_thread.run_sync(single_threaded, self._cache.read_blocks, block_ids)

    async def write_blocks(self, block_ids: tuple[int, ...], data: bytes) -> None:
        try:
            await trio.to_thread.run_sync(
                single_threaded, self._cache.write_blocks, block_ids, data
            )
        except ValueError as exc:
            raise EngineError(str(exc)) from exc

    def block_generations(self, block_ids: tuple[int, ...]) -> tuple[int, ...]:
        with self._lock:
            return self._blocks.allocator.generations(block_ids)

    def kv_region(self) -> KvRegion:
        return self._cache.region()

    # --- decode -------------------------------------------------------------------------

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
        if not 0 <= generated_tokens < len(prompt_token_ids):
            raise EngineError(f"request {request_id}: {generated_tokens} generated tokens")
        own = len(prompt_token_ids) - generated_tokens
        if tokens_generated <= generated_tokens or tokens_left(token_budget, tokens_generated) <= 0:
            raise EngineError(
                f"request {request_id} has no token budget left "
                f"({tokens_generated} of {token_budget} spent)"
            )
        vocab = self._loaded.config.vocab_size
        if not all(0 <= t < vocab for t in (*prompt_token_ids, first_token_id)):
            raise EngineError(f"request {request_id} has token ids out of the vocabulary")
        if choices:
            check_start_choices(request_id, sampling, generated_tokens, choices)
            await self._start_choices(
                request_id, prompt_token_ids, sampling, token_budget, cached_tokens, choices
            )
            return
        seq = await self._decode_seq(
            request_id,
            prompt_token_ids,
            own,
            first_token_id,
            sampling,
            token_budget,
            tokens_generated,
            cached_tokens,
        )
        with self._lock:
            table = list(self._blocks.owned(request_id))
            needed = blocks_needed(own + token_budget, self._blocks.block_size)
            if len(table) < needed:
                raise EngineError(f"request {request_id} owns {len(table)} blocks, needs {needed}")
            self._in_engine.add(request_id)
        seq.block_table = table
        self._inbox.put(seq)
        await trio.lowlevel.checkpoint()

    async def _decode_seq(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        own: int,
        first_token_id: int,
        sampling: SamplingParams,
        token_budget: int,
        tokens_generated: int,
        cached_tokens: int,
    ) -> _DecodeSeq:
        """A sequence to decode after ``first_token_id`` (its blocks are the caller's to
        set); the ids after the first ``own`` of the prompt are earlier output."""
        generated = [*prompt_token_ids[own:], first_token_id]
        try:
            # the grammar's state is rebuilt from the tokens: nothing of it crosses the wire
            constraint = await self._constraint(sampling, generated)
        except PromptRejected as exc:
            raise EngineError(f"request {seq_id}: {exc.message}") from exc
        if constraint is not None and constraint.done:
            raise EngineError(f"request {seq_id}: its grammar was complete at prefill")
        processor = OutputProcessor(
            IncrementalDetokenizer(self._tokenizer, prompt_token_ids[:own]),
            sampling,
            token_budget=token_budget,
            tokens_generated=tokens_generated,
            eos_token_ids=self._tokenizer.eos_token_ids,
        )
        # the first token's text went out from prefill (a continuation's earlier tokens'
        # before it); a stop string may begin in them, a character may be cut across them
        for earlier in generated:
            processor.replay(earlier)
        return _DecodeSeq(
            request_id=seq_id,
            sampling=sampling,
            block_table=[],
            processor=processor,
            last_token=first_token_id,
            # KV holds the prompt and every generated token but the last
            position=own + tokens_generated - 1,
            prompt_tokens=own,
            cached_tokens=cached_tokens,
            history=(list(prompt_token_ids[:own]), list(generated)) if sampling.penalizes else None,
            constraint=constraint,
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
        """start_decode's n > 1: one sequence per choice, each a request of its own on its
        forked blocks, after its copy of the prompt's partial last block."""
        vocab = self._loaded.config.vocab_size
        if not all(0 <= first < vocab for _, first in choices):
            raise EngineError(f"request {request_id} has token ids out of the vocabulary")
        prompt_tokens = len(prompt_token_ids)
        block_size = self._blocks.block_size
        seqs = [
            await self._decode_seq(
                choice_request_id(request_id, choice),
                prompt_token_ids,
                prompt_tokens,
                first,
                choice_sampling(sampling, choice),
                token_budget,
                1,
                cached_tokens,
            )
            for choice, first in choices
        ]
        full = prompt_tokens // block_size
        needed = blocks_needed(prompt_tokens + token_budget, block_size)
        with self._lock:
            parent = list(self._blocks.owned(request_id))
            if len(parent) < needed:
                raise EngineError(f"request {request_id} owns {len(parent)} blocks, needs {needed}")
            for seq in seqs:
                seq.block_table = list(self._blocks.owned(seq.request_id))
                if len(seq.block_table) < needed or seq.block_table[:full] != parent[:full]:
                    raise EngineError(
                        f"{seq.request_id} does not own its prompt's shared blocks and its own"
                    )
        copies = [seq.block_table[full] for seq in seqs if seq.request_id != request_id]
        if prompt_tokens % block_size and copies:
            # each choice writes its next tokens into its own copy of the partial block
            await trio.to_thread.run_sync(
                single_threaded, self._cache.copy_blocks, [parent[full]] * len(copies), copies
            )
        with self._lock:
            for seq in seqs:
                self._in_engine.add(seq.request_id)
            if all(seq.request_id != request_id for seq in seqs):
                # choice 0 ended at prefill: the shared blocks stay, held by the others
                self._blocks.release(request_id)
        for seq in seqs:
            self._inbox.put(seq)
        await trio.lowlevel.checkpoint()

    def abort(self, request_id: str) -> None:
        self.free_request(request_id)

    async def _constraint(
        self, sampling: SamplingParams, generated: list[int]
    ) -> TokenConstraint | None:
        """A constrained request's grammar state after ``generated``, built in a worker
        thread (a first compile builds the grammar library's view of the vocabulary)."""
        if sampling.structured is None:
            return None
        return await trio.to_thread.run_sync(
            single_threaded, self._grammars.start, sampling.structured, generated
        )

    # --- the engine thread ----------------------------------------------------------------

    async def run(
        self,
        outputs: trio.MemorySendChannel[EngineOutput],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        previous = self._thread
        if previous is not None and previous.is_alive():
            # two engine threads must never share the inbox: let the last run's one finish
            await trio.to_thread.run_sync(previous.join, abandon_on_cancel=True)
        token = trio.lowlevel.current_trio_token()
        crashed: list[BaseException] = []
        stop = _Stop()

        def send_outputs(entries: EngineOutput) -> None:
            trio.from_thread.run(outputs.send, entries, trio_token=token)

        def thread_main() -> None:
            try:
                torch.set_num_threads(self._intra_op_threads)  # the loading thread's count
                with torch.inference_mode():
                    self._loop(send_outputs, stop)
            except (trio.RunFinishedError, trio.Cancelled):
                pass
            except BaseException as exc:  # reported to the trio side below
                crashed.append(exc)
                token.run_sync_soon(lambda: None)

        thread = threading.Thread(target=thread_main, name="pdtrio-engine", daemon=True)
        self._thread = thread
        thread.start()
        try:
            async with outputs:
                task_status.started()
                await trio.to_thread.run_sync(thread.join, abandon_on_cancel=True)
        finally:
            self._inbox.put(stop)
            # outputs is closed: a send the thread waits in fails, so it ends within a step
            with trio.move_on_after(_STOP_GRACE_S, shield=True):
                await trio.to_thread.run_sync(thread.join, abandon_on_cancel=True)
        if crashed:
            raise EngineError(f"the engine thread crashed: {crashed[0]!r}") from crashed[0]

    def _loop(self, send_outputs: Callable[[EngineOutput], None], stop: _Stop) -> None:
        # the policy (pdtrio.engine.scheduler) holds the queues; these find a request by id
        prefills: dict[str, _PrefillJob] = {}
        running: dict[str, _DecodeSeq] = {}
        scheduler: Scheduler[_PrefillJob, _DecodeSeq] = Scheduler(
            SchedulerLimits(
                max_batch_size=self._config.max_batch_size,
                max_num_batched_tokens=self._config.max_num_batched_tokens,
                prefill_chunk_tokens=self._config.prefill_chunk_tokens,
            )
        )
        # what the inbox brought during a step, for the next turn of the loop
        carried: list[object] = []

        def nobody_waits(step_ids: set[str]) -> Callable[[], bool]:
            """Asked between layers of a prefill-only step: whether every request in it
            was aborted (or the engine stops) meanwhile, so the rest of the step is waste."""
            aborted: set[str] = set()

            def should_stop() -> bool:
                while True:
                    try:
                        item = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    carried.append(item)
                    if item is stop:
                        return True
                    if isinstance(item, _Abort):
                        aborted.add(item.request_id)
                return step_ids <= aborted

            return should_stop

        while True:
            # block only when there is nothing to compute: a wait, not a poll
            items = [self._inbox.get()] if not prefills and not running and not carried else []
            items[:0], carried = carried, []
            freed: list[str] = []  # the aborted requests whose blocks these items released
            while True:
                try:
                    items.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item is stop:
                    return
                if isinstance(item, _Stop):
                    continue  # an earlier run's, whose thread ended some other way
                if isinstance(item, _PrefillJob):
                    prefills[item.request_id] = item
                    scheduler.add_prompt(item, item.remaining())
                elif isinstance(item, _DecodeSeq):
                    running[item.request_id] = item
                    scheduler.add_decode(item)
                elif isinstance(item, _Abort):
                    job = prefills.pop(item.request_id, None)
                    if job is not None:
                        scheduler.remove_prompt(job)
                        job.deliver(EngineError("aborted"))
                    seq = running.pop(item.request_id, None)
                    if seq is not None:
                        scheduler.remove_decode(seq)
                    if self._forget(item.request_id):
                        freed.append(item.request_id)
            if freed:
                # free_request returned long ago: only this tells the worker the room is back
                send_outputs(BlocksFreed(tuple(freed)))
            if not prefills and not running:
                continue
            # what this step runs is the scheduler's to say (pdtrio.engine.scheduler)
            plan = scheduler.schedule()
            step_prefills, step_decodes = plan.prefills, plan.decodes
            self._waiting = plan.waiting
            step_started = time.perf_counter()
            seqs: list[SeqInput] = []
            # the prefills whose last chunk this is (the step samples their first token), and
            # their rows among the step's logits; every decode's row is sampled
            completing: list[_PrefillJob] = []
            sampled_rows: list[int] = []
            # n > 1: a completing prefill's row is sampled once per choice (None: all n = 1)
            row_choices: list[int] | None = None
            for row, (job, take) in enumerate(step_prefills):
                end = job.computed + take
                seqs.append(
                    SeqInput(
                        job.prompt_token_ids[job.computed : end],
                        job.computed,
                        job.block_table,
                        prompt=True,
                    )
                )
                if end == len(job.prompt_token_ids):
                    completing.append(job)
                    sampled_rows.append(row)
                    if job.choice_samplings:
                        row_choices = []
            if row_choices is not None:
                completing, sampled_rows, row_choices = _choice_rows(completing, sampled_rows)
            sampled_rows += range(len(seqs), len(seqs) + len(step_decodes))
            seqs += [SeqInput([s.last_token], s.position, s.block_table) for s in step_decodes]
            if row_choices is None:
                params = [job.sampling for job in completing]
            else:
                params = [
                    job.choice_samplings[c] if job.choice_samplings else job.sampling
                    for job, c in zip(completing, row_choices, strict=True)
                ]
            params += [s.sampling for s in step_decodes]
            positions = [len(job.prompt_token_ids) for job in completing]
            positions += [s.position + 1 for s in step_decodes]
            banned = [self._banned(job.sampling, job.generated_tokens) for job in completing]
            banned += [self._banned(s.sampling, s.processor.num_generated) for s in step_decodes]
            histories: list[TokenHistory | None] | None = None
            # (a decode keeps a history exactly when it penalizes: no property call a row)
            if any(s.history is not None for s in step_decodes) or any(
                job.sampling.penalizes for job in completing
            ):
                histories = [_prefill_history(job) for job in completing]
                histories += [s.history for s in step_decodes]
            try:
                # a step of decodes is short, and they need their tokens: never abandoned
                should_stop = (
                    None
                    if step_decodes
                    else nobody_waits({job.request_id for job, _ in step_prefills})
                )
                logits = self._loaded.model.forward_paged(seqs, self._cache, should_stop)
                # (choices repeat rows: then the count may match by chance)
                if row_choices is not None or len(sampled_rows) != len(seqs):
                    logits = logits[sampled_rows]
                if row_choices is None:
                    constraints = [job.constraint for job in completing]
                else:
                    constraints = [
                        job.choice_constraints[c] if job.choice_constraints else job.constraint
                        for job, c in zip(completing, row_choices, strict=True)
                    ]
                constraints += [s.constraint for s in step_decodes]
                constrained = [row for row, c in enumerate(constraints) if c is not None]
                allowed_logits = logits
                if constrained:
                    allowed_logits = self._constrain(logits, constrained, constraints, banned)
                tokens = (
                    sample(
                        allowed_logits,
                        params,
                        positions,
                        banned_token_ids=banned,
                        generator=self._generator,
                        histories=histories,
                    )
                    if sampled_rows
                    else []
                )
                # only where a request asked: the others' step is unchanged
                asking = [row for row, p in enumerate(params) if p.logprobs >= 0]
                row_logprobs: dict[int, RowLogprobs] = {}
                if asking:
                    counts = [min(params[row].logprobs, MAX_TOP_LOGPROBS) for row in asking]
                    found = logprobs_of(logits, asking, [tokens[row] for row in asking], counts)
                    row_logprobs = dict(zip(asking, found, strict=True))
            except StepAbandoned:
                continue  # the aborts are in ``carried``: taken at the top, blocks freed
            except (RuntimeError, ValueError) as exc:
                log.exception("engine step failed")
                for job, _ in step_prefills:
                    job.deliver(EngineError(f"prefill step failed: {exc}"))
                    prefills.pop(job.request_id, None)
                    scheduler.remove_prompt(job)
                    self._forget(job.request_id)
                for s in step_decodes:
                    running.pop(s.request_id, None)
                    scheduler.remove_decode(s)
                    self._forget(s.request_id)
                if step_decodes:
                    lost = tuple(s.request_id for s in step_decodes)
                    send_outputs(StepFailed(lost, f"decode step failed: {exc}"))
                continue
            for job, take in step_prefills:
                job.computed += take
            complete = (
                self._advance(constraints, tokens, constrained) if constrained else frozenset()
            )
            if row_choices is None:
                for row, (job, first) in enumerate(
                    zip(completing, tokens[: len(completing)], strict=True)
                ):
                    found_logprobs = row_logprobs.get(row)
                    first_logprob = (
                        None
                        if found_logprobs is None
                        else self._token_logprob(first, found_logprobs)
                    )
                    self._finish_prefill(job, first, first_logprob, complete=row in complete)
            else:
                self._finish_prefills_with_choices(completing, tokens, row_logprobs, complete)
            entries: StepOutputs = []
            step_logprobs: list[TokenLogprobs] = []
            finished: list[_DecodeSeq] = []
            for row, (seq, token_id) in enumerate(
                zip(step_decodes, tokens[len(completing) :], strict=True), len(completing)
            ):
                if row_logprobs:
                    found_logprobs = row_logprobs.get(row)
                    if found_logprobs is not None:
                        item = self._token_logprob(token_id, found_logprobs)
                        step_logprobs.append(TokenLogprobs(seq.request_id, [item]))
                text, finish = seq.processor.push(token_id, complete=row in complete)
                seq.last_token = token_id
                seq.position += 1
                if seq.history is not None:
                    seq.history[1].append(token_id)
                usage: Usage | None = None
                if finish is not None:
                    generated = seq.processor.num_generated
                    usage = Usage(seq.prompt_tokens, generated, seq.cached_tokens)
                    running.pop(seq.request_id, None)
                    finished.append(seq)
                    self._forget(seq.request_id)
                entries.append(TokenEntry(seq.request_id, [token_id], text, finish, usage))
            for job in scheduler.update_from_output(plan, finished):
                prefills.pop(job.request_id, None)
            observer = self._step_observer
            if observer is not None:
                batch = len(step_prefills) + len(step_decodes)
                observer(time.perf_counter() - step_started, batch, batch)
            if step_logprobs:
                send_outputs(StepLogprobs(step_logprobs))  # ahead of their tokens
            if entries:
                send_outputs(entries)

    def _constrain(
        self,
        logits: torch.Tensor,
        rows: list[int],
        constraints: list[TokenConstraint | None],
        banned: list[frozenset[int] | None],
    ) -> torch.Tensor:
        """The step's logits with what each constrained row's grammar forbids at -inf.

        A ban (EOS before ``min_tokens``) that would leave a row no token is
        lifted for that row: the grammar decides when the output is complete.
        """
        # ``rows`` are those with a constraint, in order: the constraints that are set
        masked = apply_constraints(
            logits, rows, [c for c in constraints if c is not None], self._grammars.bitmask_words
        )
        for row in rows:
            ban = banned[row]
            if ban and not bool(_allows_other_than(masked[row], ban)):
                banned[row] = None
        return masked

    def _advance(
        self, constraints: list[TokenConstraint | None], tokens: list[int], rows: list[int]
    ) -> frozenset[int]:
        """Feed each constrained row its sampled token; the rows whose grammar is complete
        now (their request ends with this token)."""
        complete: set[int] = set()
        for row in rows:
            constraint = constraints[row]
            assert constraint is not None
            if not constraint.advance(tokens[row]):
                # the mask allowed it, so this is the library's or our bug: end the request
                # rather than sample on from a broken state
                log.error("grammar refused its own sampled token: %s", constraint.error)
                complete.add(row)
            elif constraint.done:
                complete.add(row)
        return frozenset(complete)

    def _banned(self, sampling: SamplingParams, generated: int) -> frozenset[int] | None:
        if generated < sampling.min_tokens:
            # vLLM's min_tokens holds back the request's stop token ids as well as EOS
            eos = self._tokenizer.eos_token_ids
            return eos | frozenset(sampling.stop_token_ids) if sampling.stop_token_ids else eos
        return None

    def _token_logprob(self, token_id: int, found: RowLogprobs) -> TokenLogprob:
        """A sampled token's logprobs, its tokens named as each decodes on its own (special
        tokens included, as vLLM names them)."""
        logprob, top_ids, top_logprobs = found
        decode = self._tokenizer.decode
        return TokenLogprob(
            decode((token_id,), skip_special_tokens=False),
            logprob,
            tuple(decode((t,), skip_special_tokens=False) for t in top_ids),
            tuple(top_logprobs),
        )

    def _finish_prefill(
        self,
        job: _PrefillJob,
        first: int,
        first_logprob: TokenLogprob | None = None,
        *,
        complete: bool = False,
    ) -> None:
        own = len(job.prompt_token_ids) - job.generated_tokens
        processor = OutputProcessor(
            IncrementalDetokenizer(self._tokenizer, job.prompt_token_ids[:own]),
            job.sampling,
            token_budget=job.budget,
            tokens_generated=job.generated_tokens,
            eos_token_ids=self._tokenizer.eos_token_ids,
        )
        for earlier in job.prompt_token_ids[own:]:
            processor.replay(earlier)
        text, finish = processor.push(first, complete=complete)
        usage: Usage | None = None
        cached_tokens = min(job.cached_tokens, own)  # of the prompt proper, as usage counts it
        with self._lock:
            self._in_engine.discard(job.request_id)
            self._blocks.cache_prompt(job.request_id)
            table = tuple(self._blocks.owned(job.request_id))
            if finish is not None:
                self._blocks.release(job.request_id)
                table = ()
                usage = Usage(own, processor.num_generated, cached_tokens)
        job.deliver(
            PrefillResult(
                first_token_id=first,
                first_text=text,
                finish_reason=finish,
                block_ids=table,
                cached_tokens=cached_tokens,
                token_budget=job.budget,
                usage=usage,
                first_logprob=first_logprob,
            )
        )

    def _finish_prefills_with_choices(
        self,
        completing: list[_PrefillJob],
        tokens: list[int],
        row_logprobs: dict[int, RowLogprobs],
        complete: frozenset[int],
    ) -> None:
        """Finish a step's completing prefills when one of them has n > 1 choices, whose
        rows (one per choice, in order) follow each other in ``completing``."""
        draws: dict[_PrefillJob, list[tuple[int, TokenLogprob | None, bool]]] = {}
        for row, job in enumerate(completing):
            first = tokens[row]
            found_logprobs = row_logprobs.get(row)
            first_logprob = (
                None if found_logprobs is None else self._token_logprob(first, found_logprobs)
            )
            draws.setdefault(job, []).append((first, first_logprob, row in complete))
        for job, job_draws in draws.items():
            if job.choice_samplings:
                self._finish_prefill_choices(job, job_draws)
            else:
                first, first_logprob, is_complete = job_draws[0]
                self._finish_prefill(job, first, first_logprob, complete=is_complete)

    def _finish_prefill_choices(
        self, job: _PrefillJob, draws: list[tuple[int, TokenLogprob | None, bool]]
    ) -> None:
        """Deliver a prefill of n > 1 choices: each choice's first token through its own
        stop rules and text stream; the prompt's blocks stay while any choice runs."""
        own = len(job.prompt_token_ids)  # (no continuation has choices)
        cached_tokens = min(job.cached_tokens, own)
        firsts: list[FirstToken] = []
        for choice, (first, first_logprob, is_complete) in enumerate(draws):
            processor = OutputProcessor(
                IncrementalDetokenizer(self._tokenizer, job.prompt_token_ids),
                job.choice_samplings[choice],
                token_budget=job.budget,
                tokens_generated=0,
                eos_token_ids=self._tokenizer.eos_token_ids,
            )
            text, finish = processor.push(first, complete=is_complete)
            usage = None if finish is None else Usage(own, processor.num_generated, cached_tokens)
            firsts.append(FirstToken(choice, first, text, finish, usage, first_logprob))
        with self._lock:
            self._in_engine.discard(job.request_id)
            self._blocks.cache_prompt(job.request_id)
            table = tuple(self._blocks.owned(job.request_id))
            if all(first.finish_reason is not None for first in firsts):
                self._blocks.release(job.request_id)
                table = ()
        head = firsts[0]
        job.deliver(
            PrefillResult(
                first_token_id=head.token_id,
                first_text=head.text,
                finish_reason=head.finish_reason,
                block_ids=table,
                cached_tokens=cached_tokens,
                token_budget=job.budget,
                usage=head.usage,
                first_logprob=head.logprob,
                choices=tuple(firsts[1:]),
            )
        )

    def _forget(self, request_id: str) -> int:
        """Drop the request; how many block references it held (0: nothing to free)."""
        with self._lock:
            self._in_engine.discard(request_id)
            return self._blocks.release(request_id)


def _allows_other_than(row: torch.Tensor, banned: frozenset[int]) -> torch.Tensor:
    """Whether a masked row of logits leaves some token outside ``banned``."""
    allowed = torch.isfinite(row)
    ids = [t for t in banned if 0 <= t < row.shape[0]]
    if ids:
        allowed[torch.tensor(ids, device=row.device)] = False
    return allowed.any()


def _choice_rows(
    completing: list[_PrefillJob], rows: list[int]
) -> tuple[list[_PrefillJob], list[int], list[int]]:
    """The completing prefills, their logits' rows and choices, one entry per choice: a
    job of n > 1 choices samples its last position's logits n times."""
    jobs: list[_PrefillJob] = []
    choice_rows: list[int] = []
    choices: list[int] = []
    for job, row in zip(completing, rows, strict=True):
        for choice in range(len(job.choice_samplings) or 1):
            jobs.append(job)
            choice_rows.append(row)
            choices.append(choice)
    return jobs, choice_rows, choices


def _prefill_history(job: _PrefillJob) -> TokenHistory | None:
    """A completing prefill's tokens so far, where its penalties need them (a
    continuation's generated ids are output)."""
    if not job.sampling.penalizes:
        return None
    own = len(job.prompt_token_ids) - job.generated_tokens
    return job.prompt_token_ids[:own], job.prompt_token_ids[own:]


__all__ = ["TorchEngine", "load_model"]
