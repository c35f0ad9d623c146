"""Token ids → text, one token at a time.

A token's text depends on its neighbours: byte-level BPE splits a multi-byte
character across tokens, and SentencePiece decoders drop or add the leading
space of a word depending on what comes before.  So, as vLLM does, each step
decodes a short window of recent tokens twice — up to the last emitted token
(``prefix_offset:read_offset``) and up to the new one (``prefix_offset:``) —
and emits the difference, and only once the window no longer ends in an
incomplete UTF-8 sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

from pdtrio.engine.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

# Prompt tokens kept as left context for the first generated tokens.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


@final
class IncrementalDetokenizer:
    """Turns generated token ids into text deltas.

    The concatenation of every ``push`` result, then ``flush()``, equals
    ``tokenizer.decode(generated_ids)`` for a byte-level tokenizer (with a
    SentencePiece one, the first word keeps the space the prompt context gives
    it, as vLLM's output does).
    """

    __slots__ = ("_ids", "_prefix_offset", "_read_offset", "_skip_special_tokens", "_tokenizer")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Only the window is kept: ids before prefix_offset are dropped as it slides.
        context = list(prompt_token_ids[-(_PROMPT_CONTEXT + 2) :])
        # A prompt ending inside a character must not lend its bytes to the output.
        while context and tokenizer.decode(
            context, skip_special_tokens=skip_special_tokens
        ).endswith(_REPLACEMENT):
            context.pop()
        self._ids = context
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - _PROMPT_CONTEXT, 0)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" if none yet)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete UTF-8 tail decodes as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        prefix_text = decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip
        )
        new_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=skip)
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)):
            # Nothing visible yet, or the last character is still incomplete.
            return ""
        delta = new_text[len(prefix_text) :]
        # Slide the window: what was read becomes the new left context.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return delta
