"""Reading an engine's decode stream (vLLM's and SGLang's OpenAI SSE), without I/O.

The decode leg hands each line of the response body to :meth:`DecodeEventReader.line`
and pushes the delta it returns to its stream; when the body ends (or the transport
fails: :meth:`DecodeEventReader.lost`), :meth:`DecodeEventReader.end` says how the
stream ends: the finishing delta, held until the counts that end the stream (its usage
chunk), or why it failed.  Token counts come from the engine's running usage when it
sends one, one per logprob item when logprobs are read, else one per non-empty chunk.
"""

from __future__ import annotations

from typing import Final, final

import attrs

from pdtrio.protocol.engines.vllm import (
    Endpoint,
    EngineAnswerError,
    EngineToolCalls,
    parse_decode_event,
)
from pdtrio.protocol.link.wire import TokenLogprob, Usage
from pdtrio.protocol.openai.tools import ToolCall

# the finish reasons with which an engine ends an answer it did not complete
ENDED_EARLY: Final = frozenset({"abort", "error"})


@final
@attrs.frozen
class Delta:
    """What goes to the client now (the finishing one: :attr:`DecodeEventReader.ending`)."""

    text: str
    tokens: int
    finish_reason: str | None
    logprobs: tuple[TokenLogprob, ...] | None
    tool_calls: list[ToolCall]


@final
class DecodeEventReader:
    def __init__(self, endpoint: Endpoint, *, with_logprobs: bool) -> None:
        self._endpoint = endpoint
        self._with_logprobs = with_logprobs
        self._tool_calls = EngineToolCalls()
        self.seen = 0  # tokens counted so far
        self.produced = False  # a token or text came: decode holds the request's KV
        self.ending: Delta | None = None  # the finishing delta, once it came
        self.final_usage: Usage | None = None  # the usage chunk's counts
        self.failure: str | None = None
        self._done = False

    def line(self, line: str) -> Delta | None:
        """One line of the body; the delta to push now, if any."""
        if self._done or self.failure is not None or not line.startswith("data:"):
            return None
        try:
            chunk = parse_decode_event(
                line[5:].strip(), self._endpoint, with_logprobs=self._with_logprobs
            )
            whole = (
                self._tool_calls.feed(chunk.tool_calls)
                if chunk is not None and chunk.tool_calls and self.ending is None
                else []
            )
        except EngineAnswerError as exc:
            self.failure = f"decode's stream: {exc}"
            return None
        if chunk is None:  # [DONE]
            self._done = True
            return None
        if chunk.error is not None:
            self.failure = f"decode failed the request: {chunk.error}"
            return None
        if chunk.usage is not None:
            self.final_usage = chunk.usage
            return None
        tokens = self._count(
            chunk.logprobs, chunk.completion_tokens, bool(chunk.text or chunk.tool_calls)
        )
        if self.ending is not None or not (tokens or chunk.text or chunk.finish_reason or whole):
            return None
        if tokens or chunk.text:
            self.produced = True
        if chunk.finish_reason is None:
            return Delta(chunk.text, tokens, None, chunk.logprobs, whole)
        if chunk.finish_reason in ENDED_EARLY:
            # the engine gave up on the request (vLLM's and SGLang's abort): the answer
            # is not whole, so it is never passed on as a finish
            self.failure = f"decode ended the request early (finish_reason {chunk.finish_reason!r})"
            return None
        try:
            whole += self._tool_calls.finish()
        except EngineAnswerError as exc:
            self.failure = f"decode's stream: {exc}"
            return None
        self.ending = Delta(chunk.text, tokens, chunk.finish_reason, chunk.logprobs, whole)
        return None

    def _count(
        self,
        logprobs: tuple[TokenLogprob, ...] | None,
        completion_tokens: int | None,
        has_content: bool,
    ) -> int:
        if logprobs:
            # one item per token: counted so, each logprob goes out with its token
            tokens = len(logprobs)
            self.seen = max(self.seen + tokens, completion_tokens or 0)
        elif completion_tokens is not None:
            tokens = max(completion_tokens - self.seen, 0)
            self.seen = max(self.seen, completion_tokens)
        else:
            # (an engine not counting as it goes)
            tokens = 1 if has_content else 0
            self.seen += tokens
        return tokens

    def lost(self, why: str) -> None:
        """The transport failed before the body ended."""
        self.failure = why

    def end(self) -> Delta | str:
        """The body ended: the finishing delta, or why the stream failed."""
        if self.failure is None and self.ending is None:
            self.failure = "decode's stream ended before the answer did"
        if self.failure is not None:
            return self.failure
        assert self.ending is not None
        return self.ending
