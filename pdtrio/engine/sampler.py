"""Pick the next token of every request in a batch.

A seeded request's draw is a pure function of (seed, position, filtered
distribution): the uniform number comes from a counter-based generator keyed
by (seed, position) — splitmix64, computed in Python — never from a shared
generator's state.  So a request samples the same tokens whether prefill and
decode run on one instance or two, alone or in any batch, in any order.
Unseeded requests take their uniforms from the ``generator`` the caller
passes, or from the OS when there is none; there is no global random state.

Per row: ban → temperature → top-k → top-p → inverse CDF over the kept
tokens, sorted by logit (ties by id).  ``temperature`` below 1e-5 is greedy.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from pdtrio.protocol.sampling import SamplingParams

__all__ = ["sample", "seeded_uniform"]

_MASK64 = (1 << 64) - 1
# Below this a temperature would overflow the scaled logits: treat as greedy (as vLLM does).
_MIN_TEMPERATURE = 1e-5


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
) -> list[int]:
    """One token id per row of ``logits`` ([B, V]).

    ``positions[i]`` is the sequence position of the token being sampled for
    row ``i`` (it keys the seeded draw).  ``banned_token_ids[i]`` are ids row
    ``i`` may not produce (EOS before ``min_tokens``).  ``generator`` feeds
    the unseeded rows.  Raises ValueError if a row has no allowed token.
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
    x = logits.to(torch.float32, copy=True)
    if banned_token_ids is not None:
        rows: list[int] = []
        cols: list[int] = []
        for row, banned in enumerate(banned_token_ids):
            for token_id in banned or ():
                if 0 <= token_id < vocab:
                    rows.append(row)
                    cols.append(token_id)
        if rows:
            x[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")

    best_ids = x.argmax(dim=-1)  # the first of equal maxima: the lowest id
    nothing_left = torch.isneginf(x.gather(1, best_ids.unsqueeze(1)).squeeze(1))
    if bool(nothing_left.any()):
        bad = nothing_left.nonzero().flatten().tolist()
        raise ValueError(f"rows {bad} have no token left to sample")
    result: list[int] = best_ids.tolist()

    sampled = [i for i, p in enumerate(params) if p.temperature >= _MIN_TEMPERATURE]
    if not sampled:
        return result
    uniforms = _uniforms([params[i] for i in sampled], [positions[i] for i in sampled], generator)

    if len(sampled) < batch:
        x = x.index_select(0, torch.tensor(sampled, device=device))
    temperatures = torch.tensor(
        [params[i].temperature for i in sampled], dtype=torch.float32, device=device
    )
    x = x / temperatures.unsqueeze(1)
    # Stable, so equal logits keep id order: the draw cannot depend on the batch.
    sorted_logits, sorted_ids = torch.sort(x, dim=-1, descending=True, stable=True)

    top_k = [params[i].top_k for i in sampled]
    if any(0 < k < vocab for k in top_k):
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=device)
        beyond_k = torch.arange(vocab, device=device).unsqueeze(0) >= ks.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(beyond_k, float("-inf"))

    probs = torch.softmax(sorted_logits, dim=-1).to(torch.float64)

    top_p = [params[i].top_p for i in sampled]
    if any(p < 1.0 for p in top_p):
        ps = torch.tensor(top_p, dtype=torch.float64, device=device).unsqueeze(1)
        # Keep the smallest head whose mass reaches top_p: a token stays while the mass before it < p.
        mass_before = probs.cumsum(dim=-1) - probs
        outside = mass_before >= ps
        outside[:, 0] = False
        probs = probs.masked_fill(outside, 0.0)

    cdf = probs.cumsum(dim=-1)
    u = torch.tensor(uniforms, dtype=torch.float64, device=device).unsqueeze(1)
    picks = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    # Probabilities are non-increasing along the sorted axis, so the kept tokens are a prefix;
    # clamping guards the u * total == total rounding case.
    kept = (probs > 0).sum(dim=-1, keepdim=True)
    picks = torch.minimum(picks, kept - 1).clamp_min(0)
    chosen = sorted_ids.gather(1, picks).squeeze(1).tolist()
    for row, token_id in zip(sampled, chosen, strict=True):
        result[row] = token_id
    return result


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
