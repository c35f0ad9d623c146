"""Pick the next token of every request in a batch.

A seeded request's draw is a pure function of (seed, position, filtered
distribution): the uniform number comes from a counter-based generator keyed
by (seed, position) — splitmix64, computed in Python — never from a shared
generator's state.  So a request samples the same tokens whether prefill and
decode run on one instance or two, alone or in any batch, in any order.
Unseeded requests take their uniforms from the ``generator`` the caller
passes, or from the OS when there is none; there is no global random state.

Per row: ban → logit_bias → repetition, frequency, presence penalties
(vLLM's order and meaning) → greedy's argmax, or temperature → min-p → top-k
→ top-p → inverse CDF over the kept tokens, sorted by logit (ties by id).
A row with no bias and no penalty costs nothing extra.  ``temperature`` below 1e-5 is greedy.
With a large vocabulary a row is first tried on its top ``_HEAD_SIZE``
logits, which decide the same draw without a full sort whenever the kept
tokens (or the drawn one) lie strictly inside that head.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import attrs
import torch

from pdtrio.protocol.sampling import SamplingParams

__all__ = ["RowLogprobs", "TokenHistory", "logprobs_of", "sample", "seeded_uniform"]

# A row's (prompt token ids, output token ids so far): what the penalties look at.
TokenHistory = tuple[Sequence[int], Sequence[int]]

_MASK64 = (1 << 64) - 1
# Below this a temperature would overflow the scaled logits: treat as greedy (as vLLM does).
_MIN_TEMPERATURE = 1e-5
# Larger vocabularies first try to decide the draw from this many top logits (no full sort).
_HEAD_SIZE = 1024


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that a request with ``seed`` draws at ``position``."""
    key = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (key >> 11) * (1.0 / (1 << 53))


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    *,
    banned_token_ids: Sequence[frozenset[int] | None] | None = None,
    generator: torch.Generator | None = None,
    histories: Sequence[TokenHistory | None] | None = None,
) -> list[int]:
    """One token id per row of ``logits`` ([B, V]).

    ``positions[i]`` is the sequence position of the token being sampled for
    row ``i`` (it keys the seeded draw).  ``banned_token_ids[i]`` are ids row
    ``i`` may not produce (EOS before ``min_tokens``).  ``generator`` feeds
    the unseeded rows.  ``histories[i]`` is row ``i``'s tokens so far, needed
    where its params penalize (``SamplingParams.penalizes``).  Raises ValueError
    if a row has no allowed token.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    batch, vocab = logits.shape
    if len(params) != batch or len(positions) != batch:
        raise ValueError(
            f"{batch} rows of logits but {len(params)} sampling params and {len(positions)} positions"
        )
    if banned_token_ids is not None and len(banned_token_ids) != batch:
        raise ValueError(f"{batch} rows of logits but {len(banned_token_ids)} banned sets")
    if batch == 0:
        return []

    device = logits.device
    x = logits.float()
    if banned_token_ids is not None:
        rows: list[int] = []
        cols: list[int] = []
        for row, banned in enumerate(banned_token_ids):
            for token_id in banned or ():
                if 0 <= token_id < vocab:
                    rows.append(row)
                    cols.append(token_id)
        if rows:
            x = x.clone()
            x[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")
    adjusted = [i for i, p in enumerate(params) if p.adjusts_logits]
    if adjusted:
        if x is logits:
            x = x.clone()
        for row in adjusted:
            _adjust_row(x[row], params[row], None if histories is None else histories[row])

    best_ids = x.argmax(dim=-1)  # the first of equal maxima: the lowest id
    nothing_left = torch.isneginf(x.gather(1, best_ids.unsqueeze(1)).squeeze(1))
    if bool(nothing_left.any()):
        bad = nothing_left.nonzero().flatten().tolist()
        raise ValueError(f"rows {bad} have no token left to sample")
    result: list[int] = best_ids.tolist()

    sampled = [i for i, p in enumerate(params) if p.temperature >= _MIN_TEMPERATURE]
    if not sampled:
        return result
    if len(sampled) < batch:
        x = x.index_select(0, torch.tensor(sampled, device=device))
    rows_params = [params[i] for i in sampled]
    min_p = [j for j, p in enumerate(rows_params) if p.min_p > 0.0]
    if min_p:
        if x is logits:
            x = x.clone()
        _apply_min_p(x, rows_params, min_p)
    draw = _Draw(
        temperature=torch.tensor(
            [p.temperature for p in rows_params], dtype=torch.float64, device=device
        ).unsqueeze(1),
        top_k=torch.tensor(
            [p.top_k if 0 < p.top_k < vocab else vocab for p in rows_params], device=device
        ).unsqueeze(1),
        top_p=torch.tensor(
            [p.top_p for p in rows_params], dtype=torch.float64, device=device
        ).unsqueeze(1),
        uniform=torch.tensor(
            _uniforms(rows_params, [positions[i] for i in sampled], generator),
            dtype=torch.float64,
            device=device,
        ).unsqueeze(1),
    )

    chosen: list[int | None] = [None] * len(sampled)
    if vocab > _HEAD_SIZE:
        chosen = _draw_from_head(x, draw)
    unresolved = [j for j, token_id in enumerate(chosen) if token_id is None]
    if unresolved:
        index = torch.tensor(unresolved, device=device)
        subset = x if len(unresolved) == len(sampled) else x.index_select(0, index)
        full = _draw_by_full_sort(subset, draw.select(index))
        for j, drawn in zip(unresolved, full, strict=True):
            chosen[j] = drawn
    for row, picked in zip(sampled, chosen, strict=True):
        assert picked is not None
        result[row] = picked
    return result


# A row's logprobs: the sampled token's, and the ids and logprobs of its likeliest, best first.
RowLogprobs = tuple[float, list[int], list[float]]


def logprobs_of(
    logits: torch.Tensor, rows: Sequence[int], token_ids: Sequence[int], counts: Sequence[int]
) -> list[RowLogprobs]:
    """For each of ``rows`` of ``logits`` ([B, V]), the log-probability of its sampled
    token (``token_ids``, one per row listed) and its ``counts`` likeliest tokens.

    From the raw logits, before any sampling parameter (ban, bias, penalty,
    temperature, min-p, top-k, top-p) changes them: vLLM's default
    (``logprobs_mode="raw_logprobs"``), which OpenAI's are too (they do not move
    with temperature).  In float32, as vLLM computes them.
    """
    if not rows:
        return []
    device = logits.device
    raw = logits.index_select(0, torch.tensor(list(rows), device=device)).float()
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = torch.tensor(list(token_ids), device=device).unsqueeze(1)
    sampled: list[float] = logprobs.gather(1, chosen).squeeze(1).tolist()
    most = min(max(counts), logprobs.shape[1])
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if most > 0:
        values, ids = torch.topk(logprobs, most, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    return [
        (sampled[j], top_ids[j][:count], top_values[j][:count]) for j, count in enumerate(counts)
    ]


def _adjust_row(row: torch.Tensor, params: SamplingParams, history: TokenHistory | None) -> None:
    """logit_bias, then the penalties, in place on one row of logits (as vLLM's sampler)."""
    vocab = row.shape[0]
    device = row.device
    if params.logit_bias:
        pairs = [(t, b) for t, b in params.logit_bias if 0 <= t < vocab]
        if pairs:
            ids = torch.tensor([t for t, _ in pairs], device=device)
            row[ids] += torch.tensor([b for _, b in pairs], dtype=row.dtype, device=device)
    if not params.penalizes:
        return
    if history is None:
        raise ValueError("a penalizing request needs its token history")
    prompt_ids, output_ids = history
    if params.repetition_penalty != 1.0:
        seen = {t for t in prompt_ids if 0 <= t < vocab}
        seen.update(t for t in output_ids if 0 <= t < vocab)
        if seen:
            ids = torch.tensor(sorted(seen), device=device)
            values = row[ids]
            penalty = params.repetition_penalty
            row[ids] = torch.where(values > 0, values / penalty, values * penalty)
    if output_ids and (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0):
        outputs = torch.tensor([t for t in output_ids if 0 <= t < vocab], device=device)
        counts = torch.bincount(outputs, minlength=vocab).to(row.dtype)
        row -= params.frequency_penalty * counts
        row -= params.presence_penalty * (counts > 0).to(row.dtype)


def _apply_min_p(x: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[int]) -> None:
    """Drop, in ``rows`` of ``x`` (modified in place), the tokens whose probability at the
    row's temperature is below ``min_p`` times the likeliest one's: p_i < min_p * p_max
    exactly when x_i < x_max + T * ln(min_p), so no softmax is needed."""
    index = torch.tensor(rows, device=x.device)
    sub = x.index_select(0, index).double()
    threshold = torch.tensor(
        [params[j].temperature * math.log(params[j].min_p) for j in rows],
        dtype=torch.float64,
        device=x.device,
    ).unsqueeze(1)
    cut = sub < sub.max(dim=-1, keepdim=True).values + threshold
    x[index] = x.index_select(0, index).masked_fill(cut, float("-inf"))


@attrs.frozen
class _Draw:
    """Per-row parameters of the sampled rows, as [n, 1] columns."""

    temperature: torch.Tensor
    top_k: torch.Tensor  # vocab size when off
    top_p: torch.Tensor
    uniform: torch.Tensor

    def select(self, index: torch.Tensor) -> _Draw:
        return _Draw(
            temperature=self.temperature.index_select(0, index),
            top_k=self.top_k.index_select(0, index),
            top_p=self.top_p.index_select(0, index),
            uniform=self.uniform.index_select(0, index),
        )


def _draw_by_full_sort(x: torch.Tensor, draw: _Draw) -> list[int]:
    """The definition: inverse CDF over all tokens in canonical order."""
    vocab = x.shape[1]
    # Canonical order: logit descending, ties by id (a stable sort keeps id order).
    sorted_logits, sorted_ids = torch.sort(x, dim=-1, descending=True, stable=True)
    scaled = sorted_logits.double() / draw.temperature
    beyond_k = torch.arange(vocab, device=x.device).unsqueeze(0) >= draw.top_k
    probs = torch.softmax(scaled.masked_fill(beyond_k, float("-inf")), dim=-1)
    # Keep the smallest head whose mass reaches top_p: a token stays while the mass before it < p.
    outside = (probs.cumsum(dim=-1) - probs >= draw.top_p) & (draw.top_p < 1.0)
    outside[:, 0] = False
    probs = probs.masked_fill(outside, 0.0)
    cdf = probs.cumsum(dim=-1)
    picks = torch.searchsorted(cdf, draw.uniform * cdf[:, -1:], right=True)
    # Probabilities do not increase along the order, so the positive ones are a prefix;
    # the clamp covers u * total rounding up to total.
    positive = (probs > 0).sum(dim=-1, keepdim=True)
    picks = torch.minimum(picks, positive - 1).clamp_min(0)
    return sorted_ids.gather(1, picks).squeeze(1).tolist()


def _draw_from_head(x: torch.Tensor, draw: _Draw) -> list[int | None]:
    """The same draw from the top ``_HEAD_SIZE`` logits only, where that decides it.

    A row is decided when its kept tokens (and, without top-k/top-p, the draw
    itself) lie strictly above the head's smallest logit: which tokens tie
    with that logit depends on topk's internals, so they are never used.
    Undecided rows (None) go to the full sort.  Whether a row is decided
    depends only on that row, so the result never depends on the batch.
    """
    device = x.device
    vocab = x.shape[1]
    head_values, head_ids = torch.topk(x, _HEAD_SIZE, dim=-1)
    # Canonical order inside the head: by id, then stably by logit descending.
    head_ids, by_id = torch.sort(head_ids, dim=-1)
    head_values = head_values.gather(1, by_id)
    head_values, order = torch.sort(head_values, dim=-1, descending=True, stable=True)
    head_ids = head_ids.gather(1, order)
    certain = (head_values > head_values[:, -1:]).sum(dim=-1, keepdim=True)  # [n, 1]

    position = torch.arange(_HEAD_SIZE, device=device).unsqueeze(0)
    has_top_k = draw.top_k < vocab
    has_top_p = draw.top_p < 1.0
    scaled = head_values.double() / draw.temperature
    # Normaliser: over the top-k tokens, or over the whole row.
    in_top_k = position < draw.top_k
    log_norm = torch.logsumexp(scaled.masked_fill(~in_top_k, float("-inf")), dim=-1, keepdim=True)
    if bool((~has_top_k).any()):
        whole = torch.logsumexp(x.double() / draw.temperature, dim=-1, keepdim=True)
        log_norm = torch.where(has_top_k, log_norm, whole)
    known = torch.where(has_top_k, torch.minimum(draw.top_k, certain), certain)
    probs = torch.exp(scaled - log_norm).masked_fill(position >= known, 0.0)
    cum = probs.cumsum(dim=-1)
    decided = ~has_top_k | (draw.top_k <= certain)

    # Top-p: the kept prefix is the tokens whose mass before them is < p.
    mass_before = cum - probs
    nucleus = ((mass_before < draw.top_p) & (position < known)).sum(dim=-1, keepdim=True)
    nucleus = nucleus.clamp_min(1)
    mass_known = cum.gather(1, (known - 1).clamp_min(0))
    # Without top-k the nucleus must end inside the certain tokens.
    decided &= ~has_top_p | has_top_k | (nucleus < certain) | (mass_known >= draw.top_p)
    kept = torch.where(has_top_p, nucleus, known)

    filtered = has_top_k | has_top_p
    total = torch.where(filtered, cum.gather(1, (kept - 1).clamp_min(0)), 1.0)
    target = draw.uniform * total
    picks = ((cum <= target) & (position < kept)).sum(dim=-1, keepdim=True)
    # Unfiltered, the draw must land on a certain token; filtered, clamp as the full sort does.
    decided &= filtered | (picks < certain)
    positive = ((probs > 0) & (position < kept)).sum(dim=-1, keepdim=True)
    picks = torch.minimum(picks, positive - 1).clamp(0, _HEAD_SIZE - 1)
    chosen = head_ids.gather(1, picks).squeeze(1).tolist()
    ok = decided.squeeze(1).tolist()
    return [
        token_id if decided_row else None for token_id, decided_row in zip(chosen, ok, strict=True)
    ]


def _uniforms(
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    generator: torch.Generator | None,
) -> list[float]:
    unseeded = sum(1 for p in params if p.seed is None)
    fresh: list[float] = []
    if unseeded:
        if generator is not None:
            fresh = torch.rand(
                unseeded, generator=generator, dtype=torch.float64, device=generator.device
            ).tolist()
        else:
            fresh = [secrets.randbits(53) * (1.0 / (1 << 53)) for _ in range(unseeded)]
    out: list[float] = []
    it = iter(fresh)
    for p, position in zip(params, positions, strict=True):
        out.append(next(it) if p.seed is None else seeded_uniform(p.seed, position))
    return out
