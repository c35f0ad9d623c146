"""Constrained decoding: the tokens a request may produce next, from its grammar.

A request's ``SamplingParams.structured`` (JSON mode, a JSON schema, a regex,
a Lark grammar) is compiled by llguidance against the model's tokenizer into
a matcher, one per running sequence.  Each step the matcher gives the set of
allowed next tokens (a bitmask over the vocabulary, computed in Rust in about
a millisecond, mostly less), the engine masks the other logits to -inf before
sampling, and the sampled token advances the matcher.  When the grammar is
complete (a JSON value closed, a regex matched to its end) the request
finishes with "stop", as it would on EOS.

llguidance, because it installs here from PyPI as one wheel with no compiler
at run time, computes masks on the CPU without a precomputation over the
vocabulary (a schema costs well under a millisecond to set up, where
grammars that precompute pay per schema), takes JSON schemas, regexes and
Lark grammars (with ``%json`` inside, which is how tools are forced) through
one interface, and is the library vLLM and SGLang both ship as a backend.

Matchers are built off the engine thread (``start`` is called in a worker
thread); the engine thread only masks and advances, so no step waits on a
compile.  The state is a pure function of the tokens consumed, so decode
rebuilds it from the prompt's generated part and the first token: nothing of
it crosses the wire.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence
from typing import final

import llguidance
import torch

from pdtrio.engine.api import PromptRejected
from pdtrio.engine.tokenizer import Tokenizer
from pdtrio.protocol.sampling import StructuredOutput

__all__ = ["GrammarCompiler", "TokenConstraint", "apply_constraints"]

# Compact JSON with one space after ':' and ',' (the common shape small models have seen
# most), no free whitespace: with it a small model can pad with newlines until its budget.
_JSON_OPTIONS: llguidance.JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# distinct grammars whose compiled matcher is kept for reuse (a copy per request)
_COMPILED_CACHE_SIZE = 64
# the request field a grammar error is reported against
_PARAM = "response_format"


@final
class TokenConstraint:
    """One sequence's grammar state: which tokens may come next, and whether it is done."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    @property
    def done(self) -> bool:
        """The grammar is complete: no token but EOS may follow."""
        return self._matcher.is_stopped()

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens, one bit each, into ``row`` (int32, contiguous)."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def advance(self, token_id: int) -> bool:
        """Consume a sampled token; False if the grammar did not allow it (the matcher then
        stays in error)."""
        return self._matcher.consume_token(token_id)

    @property
    def error(self) -> str:
        return self._matcher.get_error()


@final
class GrammarCompiler:
    """Compiles a request's constraint for one tokenizer; thread-safe.

    The llguidance tokenizer (a quarter of a second to build for a 49k
    vocabulary) is built on first use, so engines that never see a
    constrained request never pay for it.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled = functools.lru_cache(maxsize=_COMPILED_CACHE_SIZE)(self._compile)

    @property
    def bitmask_words(self) -> int:
        """int32 words in one row's bitmask."""
        return (self._vocab_size + 31) // 32

    def start(self, structured: StructuredOutput, generated: Sequence[int] = ()) -> TokenConstraint:
        """A fresh constraint, advanced over ``generated`` (tokens the request produced
        before, as on a continuation or on decode after prefill's first token).

        Raises ``PromptRejected`` for a grammar that does not compile, or for
        tokens that it does not allow.
        """
        with self._lock:  # the cache and the pristine matchers it holds are shared
            pristine = self._compiled(structured)
            matcher = pristine.deep_copy()
        if generated and not matcher.consume_tokens(list(generated)):
            raise PromptRejected(
                f"the output so far does not match the requested format: {matcher.get_error()}",
                param=_param(structured),
            )
        return TokenConstraint(matcher)

    def _compile(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        grammar = grammar_text(structured)
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.LLTokenizer(
                self._tokenizer.backend_json(),
                n_vocab=self._vocab_size,
                eos_token=sorted(self._tokenizer.eos_token_ids),
            )
        error = llguidance.LLMatcher.validate_grammar(grammar, self._ll_tokenizer)
        if error:
            raise PromptRejected(
                f"Invalid {_describe(structured)}: {error}", param=_param(structured)
            )
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise PromptRejected(
                f"Invalid {_describe(structured)}: {matcher.get_error()}",
                param=_param(structured),
            )
        return matcher


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar for a constraint (not yet checked against a tokenizer)."""
    kind = structured.kind
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, overrides=_JSON_OPTIONS
        )
    if kind == "json_schema":
        try:
            schema = json.loads(structured.spec)
        except ValueError as exc:
            raise PromptRejected(f"Invalid JSON schema: {exc}", param=_PARAM) from exc
        if not isinstance(schema, dict | bool):
            raise PromptRejected("Invalid JSON schema: not an object", param=_PARAM)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        except ValueError as exc:
            raise PromptRejected(f"Invalid JSON schema: {exc}", param=_PARAM) from exc
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(structured.spec)
    return llguidance.LLMatcher.grammar_from_lark(structured.spec)


def apply_constraints(
    logits: torch.Tensor,
    rows: Sequence[int],
    constraints: Sequence[TokenConstraint],
    bitmask_words: int,
) -> torch.Tensor:
    """``logits`` ([B, V]) with every token the row's constraint forbids at -inf, as a
    copy (the raw logits stay for logprobs); rows not listed are unchanged."""
    bitmask = torch.empty((len(rows), bitmask_words), dtype=torch.int32)
    for i, constraint in enumerate(constraints):
        constraint.fill_bitmask(bitmask[i])
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(list(rows), device=logits.device)
    masked = logits.clone()
    masked[index] = masked.index_select(0, index).masked_fill(
        ~allowed.to(logits.device), float("-inf")
    )
    return masked


def _describe(structured: StructuredOutput) -> str:
    return {
        "json_object": "JSON mode",
        "json_schema": "JSON schema",
        "regex": "regex",
        "lark": "grammar",
        "tool_call": "tools (a function's parameters are not a JSON schema the grammar takes)",
    }[structured.kind]


def _param(structured: StructuredOutput) -> str:
    return "tools" if structured.kind == "tool_call" else _PARAM
