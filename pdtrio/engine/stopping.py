"""When a request stops, and which text a client sees on the way.

``OutputProcessor`` takes a request's generated tokens one at a time and
returns the text to send now and, on the last one, why generation ended.  It
is a pure function of (tokenizer, prompt, sampling, budget, token ids pushed):
a decode instance that receives a request from prefill rebuilds the state by
pushing the first token again and discarding what it returns.

The rules, in the order they are checked for each token:

- EOS (any of ``tokenizer.eos_token_ids``) once ``min_tokens`` tokens came
  before it, unless ``ignore_eos``: finish with ``"stop"``; EOS has no text.
  An EOS the sampler let through earlier (it masks EOS before ``min_tokens``)
  is an ordinary token.
- A stop string that ends in the new text, once more than ``min_tokens``
  tokens have been generated (vLLM's rule: stop strings that complete earlier
  are ordinary text): the output is cut right before its earliest start, and
  generation finishes with ``"stop"``.
- The ``max_new_tokens``-th token finishes with ``"length"``.

Text that may still become the start of a stop string is held back until it
cannot; on finish, held-back text that is not part of a stop string is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

from pdtrio.engine.detokenizer import IncrementalDetokenizer
from pdtrio.engine.tokenizer import Tokenizer
from pdtrio.protocol.sampling import SamplingParams

__all__ = ["OutputProcessor"]

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@final
class OutputProcessor:
    """One request's stop rules and text stream.

    ``push(token_id)`` returns ``(text_to_emit_now, finish_reason_or_None)``.
    Concatenating every emitted text gives the detokenized output cut at the
    first stop string.  Pushing after the finish is an error.
    """

    __slots__ = (
        "_detokenizer",
        "_eos_token_ids",
        "_finish_reason",
        "_ignore_eos",
        "_max_new_tokens",
        "_min_tokens",
        "_num_generated",
        "_pending",
        "_stop",
        "_stop_reason",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        max_new_tokens: int,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._eos_token_ids = tokenizer.eos_token_ids
        self._ignore_eos = sampling.ignore_eos
        self._min_tokens = max(sampling.min_tokens, 0)
        self._max_new_tokens = max_new_tokens
        self._stop = tuple(dict.fromkeys(s for s in sampling.stop if s))
        self._num_generated = 0
        # Detokenized text not sent yet: a possible start of a stop string.
        self._pending = ""
        self._finish_reason: str | None = None
        self._stop_reason: str | None = None

    @property
    def num_generated(self) -> int:
        """Tokens pushed so far, EOS included (the usage's completion_tokens)."""
        return self._num_generated

    @property
    def finish_reason(self) -> str | None:
        return self._finish_reason

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended generation, if one did."""
        return self._stop_reason

    def push(self, token_id: int) -> tuple[str, str | None]:
        if self._finish_reason is not None:
            raise RuntimeError(f"request already finished ({self._finish_reason})")
        self._num_generated += 1
        past_min = self._num_generated > self._min_tokens

        if past_min and not self._ignore_eos and token_id in self._eos_token_ids:
            # EOS itself is invisible; a trailing incomplete character is flushed.
            return self._finish(self._detokenizer.flush(), FINISH_STOP, check_stop=True)

        delta = self._detokenizer.push(token_id)
        if self._num_generated >= self._max_new_tokens:
            return self._finish(
                delta + self._detokenizer.flush(), FINISH_LENGTH, check_stop=past_min
            )
        if past_min:
            cut = self._find_stop(delta)
            if cut is not None:
                return self._stop_at(cut)
        else:
            self._pending += delta
        return self._emit_safe(), None

    def _finish(self, delta: str, reason: str, *, check_stop: bool) -> tuple[str, str | None]:
        if check_stop:
            cut = self._find_stop(delta)
            if cut is not None:
                return self._stop_at(cut)
        else:
            self._pending += delta
        text, self._pending = self._pending, ""
        self._finish_reason = reason
        return text, reason

    def _find_stop(self, delta: str) -> int | None:
        """Append ``delta`` to the pending text; index in it where a stop string starts.

        Only matches that end inside ``delta`` count: earlier text was checked
        when it arrived (or came before ``min_tokens``).  Held-back text
        covers every possible start, so no match starts before ``_pending``.
        """
        old_len = len(self._pending)
        self._pending += delta
        if not delta:
            return None
        best: int | None = None
        for stop in self._stop:
            start = self._pending.find(stop, max(0, old_len - len(stop) + 1))
            if start != -1 and (best is None or start < best):
                best = start
                self._stop_reason = stop
        return best

    def _stop_at(self, cut: int) -> tuple[str, str | None]:
        text = self._pending[:cut]
        self._pending = ""
        self._finish_reason = FINISH_STOP
        return text, FINISH_STOP

    def _emit_safe(self) -> str:
        """Send the pending text except a tail that may begin a stop string."""
        pending = self._pending
        hold = 0
        for stop in self._stop:
            # Longest proper prefix of ``stop`` that the pending text ends with.
            for k in range(min(len(stop) - 1, len(pending)), hold, -1):
                if pending.endswith(stop[:k]):
                    hold = k
                    break
        if hold:
            text, self._pending = pending[:-hold], pending[-hold:]
        else:
            text, self._pending = pending, ""
        return text
