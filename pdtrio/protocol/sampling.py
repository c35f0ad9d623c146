"""Sampling parameters: the part of a request every layer agrees on."""

from __future__ import annotations

from typing import Any, final

import attrs


@final
@attrs.frozen
class SamplingParams:
    """How to pick tokens and when to stop.

    ``max_tokens`` is None when the client set no limit: the prefill side then
    fills the budget up to the model's context.  ``top_k`` <= 0 and
    ``top_p`` == 1.0 mean "off"; ``temperature`` == 0 means greedy.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def to_wire(self) -> list[Any]:
        return [
            self.temperature,
            self.top_p,
            self.top_k,
            self.seed,
            self.max_tokens,
            self.min_tokens,
            list(self.stop),
            self.ignore_eos,
        ]

    @classmethod
    def from_wire(cls, raw: list[Any]) -> SamplingParams:
        temperature, top_p, top_k, seed, max_tokens, min_tokens, stop, ignore_eos = raw
        return cls(
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=int(top_k),
            seed=None if seed is None else int(seed),
            max_tokens=None if max_tokens is None else int(max_tokens),
            min_tokens=int(min_tokens),
            stop=tuple(str(s) for s in stop),
            ignore_eos=bool(ignore_eos),
        )
