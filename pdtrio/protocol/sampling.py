"""Sampling parameters: how to pick tokens and when to stop, the same on every layer."""

from __future__ import annotations

from typing import Final, Literal

import msgspec

# the most sequences (choices) one request may ask for (``n``)
MAX_CHOICES: Final = 16

StructuredKind = Literal["json_object", "json_schema", "regex", "lark", "tool_call"]


class StructuredOutput(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A constraint on the text a request may produce, as the grammar library takes it.

    ``kind`` says how to read ``spec``: ``json_object`` (any JSON object, no spec),
    ``json_schema`` (a JSON Schema, as JSON text), ``regex``, ``lark`` (a Lark
    grammar, which may embed JSON schemas with ``%json``), or ``tool_call`` (a Lark
    grammar built from the request's tools: how a call is forced; its errors are
    the tools').
    The spec travels as text so that every layer passes it on unparsed.
    """

    kind: StructuredKind
    spec: str = ""


class SamplingParams(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """How to pick tokens and when to stop.

    The token budget is not here: prefill computes it once from the request's
    ``max_tokens`` and the model, and it travels beside these parameters.
    ``top_k`` <= 0 and ``top_p`` == 1.0 mean "off"; ``temperature`` == 0 means greedy.

    The fields after ``ignore_eos`` came later: they have defaults (a peer that
    sends the shorter array still decodes) and mean "off" at them, as vLLM's:
    ``logit_bias`` is (token id, bias) pairs, ascending by id, added to the
    logits; ``repetition_penalty`` divides (positive) or multiplies (negative)
    the logits of every token in the prompt or the output so far;
    ``frequency_penalty`` and ``presence_penalty`` subtract, per output token,
    its count times the one and the other once; ``min_p`` drops the tokens less
    likely than ``min_p`` times the likeliest (after temperature); a token of
    ``stop_token_ids`` ends the request with "stop" and no text of its own.
    ``logprobs`` >= 0 asks for each token's log-probability with that many of the
    likeliest alternatives (chat's ``top_logprobs``, completions' ``logprobs``);
    -1, the default, for none. ``structured``, when set, constrains the output to
    a grammar (JSON mode, a JSON schema, a regex, a Lark grammar for tools).
    ``n`` > 1 asks for that many sequences (choices) from one prompt: one
    prefill, the prompt's KV shared on decode; choice ``i`` samples with
    :func:`choice_sampling`.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = -1
    structured: StructuredOutput | None = None
    n: int = 1

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs >= 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before sampling (a bias or a penalty)."""
        return bool(self.logit_bias) or self.penalizes

    @property
    def penalizes(self) -> bool:
        """Whether the tokens already seen change the logits (the engine keeps them then)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def choice_sampling(sampling: SamplingParams, choice: int) -> SamplingParams:
    """Choice ``choice``'s parameters: a seeded request's choice ``i`` draws with
    ``seed + i`` (so every choice of the answer is reproducible, on any topology);
    an unseeded one's choices differ by their draws alone."""
    if choice == 0 or sampling.seed is None:
        return sampling
    return msgspec.structs.replace(sampling, seed=sampling.seed + choice)
