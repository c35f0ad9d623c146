"""The OpenAI streaming shape: text deltas in, ``text/event-stream`` bytes out.

Sans-IO and on the router's hot path: the JSON around each chunk is built once
per stream, so a content chunk costs one ``json.dumps`` of its text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Final, Literal, final

from pdtrio.protocol.link.wire import TokenLogprob, Usage
from pdtrio.protocol.openai.errors import OpenAIError
from pdtrio.protocol.openai.logprobs import chat_logprobs, completion_logprobs
from pdtrio.protocol.openai.tools import ToolCall

DONE_EVENT: Final = b"data: [DONE]\n\n"

_FINISH_JSON: Final = {"stop": '"stop"', "length": '"length"', "abort": '"abort"'}
_dumps: Final = json.dumps
_compact: Final = json.JSONEncoder(separators=(",", ":")).encode


def _finish_json(finish_reason: str) -> str:
    encoded = _FINISH_JSON.get(finish_reason)
    return encoded if encoded is not None else _dumps(finish_reason)


def usage_json(prompt: int, completion: int, cached: int) -> str:
    """A stream's ``usage`` object, as JSON text."""
    return (
        f'{{"prompt_tokens":{prompt},"completion_tokens":{completion},'
        f'"total_tokens":{prompt + completion},'
        f'"prompt_tokens_details":{{"cached_tokens":{cached}}}}}'
    )


class BaseShaper:
    """What every endpoint's stream shaper shares: its counts and how it may be fed.

    A subclass shapes the bytes: :meth:`delta` for each text delta from the
    detokenizer (empty ones included: their tokens count for usage), then
    :meth:`done` or :meth:`error` once.  The pipeline feeds any shaper alike.
    """

    __slots__ = ("_cached_tokens", "_closed", "_completion_tokens", "_finished", "_prompt_tokens")

    def __init__(self) -> None:
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._completion_tokens = 0
        self._finished = False
        self._closed = False

    @property
    def completion_tokens(self) -> int:
        return self._completion_tokens

    @property
    def finished(self) -> bool:
        """A finish_reason was seen."""
        return self._finished

    @property
    def closed(self) -> bool:
        """done() or error() was called; nothing more may be sent."""
        return self._closed

    def set_prompt_usage(self, prompt_tokens: int, cached_tokens: int) -> None:
        self._prompt_tokens = prompt_tokens
        self._cached_tokens = cached_tokens

    def delta(
        self,
        text: str,
        num_tokens: int,
        finish_reason: str | None,
        usage: Usage | None = None,
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> bytes:
        raise NotImplementedError

    def done(self) -> bytes:
        raise NotImplementedError

    def error(self, error: OpenAIError) -> bytes:
        raise NotImplementedError

    def _check_delta(self, num_tokens: int) -> None:
        if self._closed:
            raise ValueError("delta() after the stream was closed")
        if self._finished:
            raise ValueError("delta() after a finish_reason was sent")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")

    def _count(self, num_tokens: int, usage: Usage | None) -> None:
        if usage is None:
            self._completion_tokens += num_tokens
        else:
            # decode's final count is authoritative (it covers tokens a stop string cut)
            self._prompt_tokens = usage.prompt_tokens
            self._completion_tokens = usage.completion_tokens
            self._cached_tokens = usage.cached_tokens

    def _close(self) -> None:
        if self._closed:
            raise ValueError("the stream is already closed")
        self._closed = True


@final
class StreamShaper(BaseShaper):
    """Shapes one streamed completion (``kind`` "chat" or "completion").

    Feed every text delta from the detokenizer to :meth:`delta`, empty ones
    included (their tokens count for usage), then end with :meth:`done` or
    :meth:`error`; each returns the bytes to write now.

    ``top_logprobs`` (not None: the request asked for logprobs, with that many
    alternatives) makes each delta take its tokens' logprobs: a chunk carries
    those of every token since the chunk before it (a delta that sends nothing,
    its text not complete yet, hands its own on to the next), so however deltas
    are merged, the logprobs of a chunk are those of its tokens.
    """

    __slots__ = (
        "_choice_open",
        "_held_logprobs",
        "_sent_chars",
        "_top_logprobs",
        "_chat",
        "_continuous",
        "_chunk_end",
        "_empty_finish_open",
        "_head",
        "_include_usage",
        "_role_body",
        "_role_sent",
        "_text_open",
        "_text_close",
        "_text_prefix",
        "_text_suffix",
    )

    def __init__(
        self,
        *,
        kind: Literal["chat", "completion"],
        request_id: str,
        model: str,
        created: int,
        include_usage: bool,
        continuous_usage_stats: bool,
        top_logprobs: int | None = None,
        index: int = 0,
    ) -> None:
        """``index``: the choice this shaper's chunks are of (a request with ``n`` > 1 has a
        shaper per choice, under :class:`ChoiceShapers`)."""
        if kind not in ("chat", "completion"):
            raise ValueError(f"unknown stream kind {kind!r}")
        self._chat = kind == "chat"
        self._top_logprobs = top_logprobs
        self._held_logprobs: list[TokenLogprob] = []
        self._sent_chars = 0  # text sent so far (where a completion's text_offset starts)
        super().__init__()
        self._include_usage = include_usage
        self._continuous = include_usage and continuous_usage_stats
        self._role_sent = not self._chat  # completions have no role chunk

        obj = "chat.completion.chunk" if self._chat else "text_completion"
        self._head = (
            f'data: {{"id":{_dumps(request_id)},"object":"{obj}","created":{int(created)},'
            f'"model":{_dumps(model)},"choices":'
        )
        self._choice_open = choice_open = f'[{{"index":{int(index)},'
        if self._chat:
            self._text_open = choice_open + '"delta":{"content":'
            self._text_close = '},"logprobs":null,"finish_reason":'
            self._empty_finish_open = choice_open + '"delta":{},"logprobs":null,"finish_reason":'
        else:
            self._text_open = choice_open + '"text":'
            self._text_close = ',"logprobs":null,"finish_reason":'
            self._empty_finish_open = choice_open + '"text":"","logprobs":null,"finish_reason":'
        self._role_body = (
            choice_open + '"delta":{"role":"assistant","content":""},'
            '"logprobs":null,"finish_reason":null}]'
        )
        # What closes a chunk after its choices, when usage is not running.
        self._chunk_end = ',"usage":null}\n\n' if include_usage else "}\n\n"
        # The common chunk, precomputed around its text: finish_reason null, usage not running.
        self._text_prefix = self._head + self._text_open
        self._text_suffix = self._text_close + "null}]" + self._chunk_end

    # --- events -------------------------------------------------------------------

    def delta(
        self,
        text: str,
        num_tokens: int,
        finish_reason: str | None,
        usage: Usage | None = None,
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> bytes:
        """The bytes to send for ``num_tokens`` more tokens decoding to ``text``.

        ``usage``, the engine's final count, comes with the finish and replaces
        the running count (which only serves ``continuous_usage_stats``).
        ``logprobs``: those tokens' (a stream that asked for them).

        b"" when nothing is due: empty text and no finish (an incomplete UTF-8
        sequence, say).  ``finish_reason`` rides on this last chunk.
        """
        self._check_delta(num_tokens)
        if self._top_logprobs is not None:
            return self._delta_with_logprobs(text, num_tokens, finish_reason, usage, logprobs)
        if not text and finish_reason is None:
            self._count(num_tokens, usage)
            return b""
        # the role chunk reports what was generated before this delta
        out = self._role_chunk() if not self._role_sent else ""
        self._count(num_tokens, usage)
        if finish_reason is None:
            if self._continuous:
                return (
                    out
                    + self._head
                    + self._text_open
                    + _dumps(text)
                    + self._text_close
                    + "null}]"
                    + self._usage_end()
                ).encode()
            return (out + self._text_prefix + _dumps(text) + self._text_suffix).encode()
        self._finished = True
        if text:
            body = self._text_open + _dumps(text) + self._text_close
        else:
            body = self._empty_finish_open
        end = self._usage_end() if self._continuous else self._chunk_end
        return (out + self._head + body + _finish_json(finish_reason) + "}]" + end).encode()

    def tool_calls(self, calls: Sequence[ToolCall]) -> bytes:
        """A chunk with ``calls`` as ``delta.tool_calls``, each whole (its name and all
        its arguments at once: a call is sent once its block is complete)."""
        if self._closed or self._finished:
            raise ValueError("tool_calls() after the stream ended")
        out = self._role_chunk() if not self._role_sent else ""
        deltas = [{"index": call.index, **call.to_body()} for call in calls]
        body = (
            self._choice_open
            + '"delta":{"tool_calls":'
            + _compact(deltas)
            + '},"logprobs":null,"finish_reason":null}]'
        )
        end = self._usage_end() if self._continuous else self._chunk_end
        return (out + self._head + body + end).encode()

    def done(self) -> bytes:
        """End the stream normally: the usage chunk if asked for, then [DONE]."""
        self._close()
        out = self._role_chunk() if not self._role_sent else ""
        if self._include_usage:
            out += self.usage_chunk(self._usage_json())
        return out.encode() + DONE_EVENT

    def usage_chunk(self, usage_json: str) -> str:
        """The chunk with no choices that carries the stream's usage."""
        return self._head + '[],"usage":' + usage_json + "}\n\n"

    def end_unsent(self) -> str:
        """Close this choice's shaper under :class:`ChoiceShapers`, which ends the
        stream: the role chunk if the choice never got one."""
        self._close()
        return self._role_chunk() if not self._role_sent else ""

    @property
    def usage_counts(self) -> tuple[int, int, int]:
        """(prompt, completion, cached) tokens as counted so far."""
        return self._prompt_tokens, self._completion_tokens, self._cached_tokens

    def error(self, error: OpenAIError) -> bytes:
        """End the stream with an error event, then [DONE]."""
        self._close()
        out = self._role_chunk() if not self._role_sent else ""
        out += "data: " + _dumps(error.to_body()) + "\n\n"
        return out.encode() + DONE_EVENT

    # --- internals -------------------------------------------------------------------

    def _delta_with_logprobs(
        self,
        text: str,
        num_tokens: int,
        finish_reason: str | None,
        usage: Usage | None,
        logprobs: Sequence[TokenLogprob] | None,
    ) -> bytes:
        """``delta`` for a stream that asked for logprobs (not the hot path's templates),
        its arguments checked by ``delta``."""
        if logprobs:
            self._held_logprobs += logprobs
        if not text and finish_reason is None:
            self._count(num_tokens, usage)
            return b""
        out = self._role_chunk() if not self._role_sent else ""
        self._count(num_tokens, usage)
        items, self._held_logprobs = self._held_logprobs, []
        top = self._top_logprobs or 0
        if self._chat:
            shaped = chat_logprobs(items, top)
            delta = '{"content":' + _dumps(text) + "}" if text or finish_reason is None else "{}"
            choice = self._choice_open + '"delta":' + delta
        else:
            shaped = completion_logprobs(items, top, self._sent_chars)
            choice = self._choice_open + '"text":' + _dumps(text)
        self._sent_chars += len(text)
        finish = "null"
        if finish_reason is not None:
            self._finished = True
            finish = _finish_json(finish_reason)
        body = choice + ',"logprobs":' + _compact(shaped) + ',"finish_reason":' + finish + "}]"
        end = self._usage_end() if self._continuous else self._chunk_end
        return (out + self._head + body + end).encode()

    def _role_chunk(self) -> str:
        self._role_sent = True
        end = self._usage_end() if self._continuous else self._chunk_end
        return self._head + self._role_body + end

    def _usage_json(self) -> str:
        return usage_json(self._prompt_tokens, self._completion_tokens, self._cached_tokens)

    def _usage_end(self) -> str:
        return ',"usage":' + self._usage_json() + "}\n\n"


@final
class ChoiceShapers(BaseShaper):
    """Shapes the stream of a request with ``n`` > 1 choices: a :class:`StreamShaper` per
    choice (its chunks carry its ``index``; its role chunk and finish are its own), one
    usage chunk for the whole answer (the prompt once, every choice's completion
    tokens) and one ``[DONE]``.

    :meth:`delta` feeds choice 0; :meth:`choice` is the shaper of any choice.
    ``continuous_usage_stats`` counts per choice: each chunk's usage is that of its
    choice so far.
    """

    __slots__ = ("_choices", "_include_usage")

    def __init__(self, choices: Sequence[StreamShaper], *, include_usage: bool) -> None:
        super().__init__()
        if len(choices) < 2:
            raise ValueError("ChoiceShapers is for two choices or more")
        self._choices = tuple(choices)
        self._include_usage = include_usage

    def choice(self, index: int) -> StreamShaper:
        return self._choices[index]

    @property
    def completion_tokens(self) -> int:
        return sum(shaper.completion_tokens for shaper in self._choices)

    @property
    def finished(self) -> bool:
        """Every choice has its finish_reason."""
        return all(shaper.finished for shaper in self._choices)

    def set_prompt_usage(self, prompt_tokens: int, cached_tokens: int) -> None:
        super().set_prompt_usage(prompt_tokens, cached_tokens)
        for shaper in self._choices:
            shaper.set_prompt_usage(prompt_tokens, cached_tokens)

    def delta(
        self,
        text: str,
        num_tokens: int,
        finish_reason: str | None,
        usage: Usage | None = None,
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> bytes:
        return self._choices[0].delta(text, num_tokens, finish_reason, usage, logprobs)

    def done(self) -> bytes:
        """End the stream: a role chunk for a choice that never had one, the usage chunk
        if asked for, then [DONE]."""
        self._close()
        out = "".join(shaper.end_unsent() for shaper in self._choices)
        if self._include_usage:
            counts = [shaper.usage_counts for shaper in self._choices]
            prompt, _, cached = counts[0]
            completion = sum(count[1] for count in counts)
            out += self._choices[0].usage_chunk(usage_json(prompt, completion, cached))
        return out.encode() + DONE_EVENT

    def error(self, error: OpenAIError) -> bytes:
        """End the stream with an error event, then [DONE]."""
        self._close()
        out = "".join(shaper.end_unsent() for shaper in self._choices)
        out += "data: " + _dumps(error.to_body()) + "\n\n"
        return out.encode() + DONE_EVENT
