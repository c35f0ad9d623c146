"""When a request stops, and which text a client sees on the way.

Torch-free and tokenizer-free: both engines use it, the synthetic one over
its made-up words, the torch one over an ``IncrementalDetokenizer``.

``OutputProcessor`` takes a request's generated tokens one at a time and
returns the text to send now and, on the last one, why generation ended.  It
is a pure function of (text stream, sampling, budget, token ids pushed).  A
decode instance that receives a request from prefill rebuilds the state with
``replay(first_token_id)``: the token's text feeds the detokenizer and the
stop-string hold-back (a stop string may begin in it), but it is not counted
again and nothing is sent for it.

The rules, in the order they are checked for each token:

- EOS (any of ``eos_token_ids``) once ``min_tokens`` tokens came before it,
  unless ``ignore_eos``, or any of the request's ``stop_token_ids`` (even with
  ``ignore_eos``, as vLLM): finish with ``"stop"``; the token has no text.  One
  the sampler let through earlier (it masks them before ``min_tokens``) is an
  ordinary token.
- A stop string that ends in the new text, once more than ``min_tokens``
  tokens have been generated (vLLM's rule: stop strings that complete earlier
  are ordinary text): the output is cut right before its earliest start, and
  generation finishes with ``"stop"``.
- The token that completes the request's grammar (structured output: nothing
  but EOS may follow) finishes with ``"stop"``, its text sent.
- The token that spends the last of the budget finishes with ``"length"``.

Text that may still become the start of a stop string is held back until it
cannot (:class:`StopStringHoldBack`); on finish, held-back text that is not
part of a stop string is sent.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, final

from pdtrio.engine.budget import tokens_left
from pdtrio.protocol.sampling import SamplingParams

__all__ = ["FINISH_LENGTH", "FINISH_STOP", "OutputProcessor", "StopStringHoldBack", "TextStream"]

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


class TextStream(Protocol):
    """Token ids to text deltas (``IncrementalDetokenizer`` is one)."""

    def push(self, token_id: int) -> str:
        """The text this token completes ("" if none yet)."""
        ...

    def flush(self) -> str:
        """Text still held back by the stream itself, at the end."""
        ...


@final
class StopStringHoldBack:
    """A request's outgoing text: held back while it may begin a stop string, cut at the first.

    ``push`` returns the text that is safe to send now; ``finish`` returns all
    that is left.  With ``match``, a stop string that ends in the new text cuts
    the output right before the stop string's earliest start; then the second
    value is True and nothing is held any more.
    """

    __slots__ = ("_pending", "_stops")

    def __init__(self, stops: Iterable[str]) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stops if s))
        self._pending = ""  # text not sent yet: a possible start of a stop string

    def push(self, delta: str, *, match: bool = True) -> tuple[str, bool]:
        if not self._stops:
            return delta, False
        cut = self._append(delta, match)
        if cut is not None:
            return self._cut(cut), True
        return self._release_safe(), False

    def finish(self, delta: str, *, match: bool = True) -> tuple[str, bool]:
        if not self._stops:
            return delta, False
        cut = self._append(delta, match)
        if cut is not None:
            return self._cut(cut), True
        text, self._pending = self._pending, ""
        return text, False

    def _append(self, delta: str, match: bool) -> int | None:
        """Append ``delta``; the index where a stop string ending inside it starts.

        Only matches that end inside ``delta`` count: earlier text was checked
        when it arrived (or was not to be matched).  Held-back text covers
        every possible start, so no match starts before the pending text.
        """
        old_len = len(self._pending)
        self._pending += delta
        if not match or not delta:
            return None
        best: int | None = None
        for stop in self._stops:
            start = self._pending.find(stop, max(0, old_len - len(stop) + 1))
            if start != -1 and (best is None or start < best):
                best = start
        return best

    def _cut(self, index: int) -> str:
        text = self._pending[:index]
        self._pending = ""
        return text

    def _release_safe(self) -> str:
        """The pending text except a tail that may begin a stop string."""
        pending = self._pending
        hold = 0
        for stop in self._stops:
            # the longest proper prefix of ``stop`` that the pending text ends with
            for k in range(min(len(stop) - 1, len(pending)), hold, -1):
                if pending.endswith(stop[:k]):
                    hold = k
                    break
        if hold:
            text, self._pending = pending[:-hold], pending[-hold:]
        else:
            text, self._pending = pending, ""
        return text


@final
class OutputProcessor:
    """One request's stop rules and text stream.

    ``push(token_id)`` returns ``(text_to_emit_now, finish_reason_or_None)``.
    Concatenating every emitted text gives the streamed text cut at the first
    stop string.  Pushing after the finish is an error.  ``tokens_generated``
    tokens of ``token_budget`` were spent before this processor (and are
    counted in ``num_generated``).
    """

    __slots__ = (
        "_finish_reason",
        "_hold_back",
        "_min_tokens",
        "_num_generated",
        "_stop_token_ids",
        "_text",
        "_token_budget",
    )

    def __init__(
        self,
        text: TextStream,
        sampling: SamplingParams,
        *,
        token_budget: int,
        tokens_generated: int = 0,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        if tokens_generated < 0 or tokens_left(token_budget, tokens_generated) < 1:
            raise ValueError(
                f"no token left to generate: budget {token_budget}, {tokens_generated} spent"
            )
        self._text = text
        self._hold_back = StopStringHoldBack(sampling.stop)
        # EOS (unless ignore_eos) and the request's stop_token_ids: one lookup a token
        eos = frozenset() if sampling.ignore_eos else eos_token_ids
        self._stop_token_ids = eos | frozenset(sampling.stop_token_ids)
        self._min_tokens = max(sampling.min_tokens, 0)
        self._token_budget = token_budget
        self._num_generated = tokens_generated
        self._finish_reason: str | None = None

    @property
    def num_generated(self) -> int:
        """Tokens generated so far, EOS and replayed ones included (usage's completion_tokens)."""
        return self._num_generated

    @property
    def finish_reason(self) -> str | None:
        return self._finish_reason

    def replay(self, token_id: int) -> None:
        """Feed a token generated, counted and sent elsewhere: its text is context only."""
        self._hold_back.push(self._text.push(token_id), match=False)

    def push(self, token_id: int, *, complete: bool = False) -> tuple[str, str | None]:
        """``complete``: the request's grammar admits nothing after this token, so it is
        the last one (finishing with "stop", as EOS would, but with its text)."""
        if self._finish_reason is not None:
            raise RuntimeError(f"request already finished ({self._finish_reason})")
        self._num_generated += 1
        past_min = self._num_generated > self._min_tokens

        if past_min and token_id in self._stop_token_ids:
            # EOS (or a stop token id) itself is invisible; a trailing incomplete character
            # is flushed
            text, _ = self._hold_back.finish(self._text.flush())
            return self._finish(text, FINISH_STOP)

        delta = self._text.push(token_id)
        if complete or tokens_left(self._token_budget, self._num_generated) <= 0:
            text, stopped = self._hold_back.finish(delta + self._text.flush(), match=past_min)
            return self._finish(text, FINISH_STOP if stopped or complete else FINISH_LENGTH)
        text, stopped = self._hold_back.push(delta, match=past_min)
        if stopped:
            return self._finish(text, FINISH_STOP)
        return text, None

    def _finish(self, text: str, reason: str) -> tuple[str, str | None]:
        self._finish_reason = reason
        return text, reason
