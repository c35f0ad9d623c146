"""Sampling parameters: how to pick tokens and when to stop, the same on every layer."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """How to pick tokens and when to stop.

    The token budget is not here: prefill computes it once from the request's
    ``max_tokens`` and the model, and it travels beside these parameters.
    ``top_k`` <= 0 and ``top_p`` == 1.0 mean "off"; ``temperature`` == 0 means greedy.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0
