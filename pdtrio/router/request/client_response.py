"""One request's response to its client: the writes, how it ends, and a client that
stopped reading.

The request shell (:mod:`pdtrio.router.request.pipeline`) decides what goes out; this
object puts it on the wire as hypercorn's ASGI sends, streamed (server-sent
events through the :class:`~pdtrio.protocol.openai.sse.StreamShaper`) or gathered into
one JSON body, and keeps what the shell and the router's stall sweep need to
know of the wire: how far the response got (:class:`Progress`: a write torn
among it), whose the connection still is (:class:`Connection`: the client left,
or was hung up on), and whether a send is under way.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from typing import Any, final

import trio

from pdtrio.asgi import Message, Receive, Send, send_json
from pdtrio.protocol.link.wire import TokenLogprob, Usage
from pdtrio.protocol.openai import OpenAIError, chat_completion_body, completion_body
from pdtrio.protocol.openai.answers import AnswerDelta, AnswerKind, Shaper
from pdtrio.protocol.openai.responses_sse import ResponsesStreamShaper
from pdtrio.protocol.openai.sse import ChoiceShapers, StreamShaper
from pdtrio.protocol.openai.tools import ToolCall, ToolCallParser, tool_finish_reason

log = logging.getLogger("pdtrio.router.pipeline")

_SSE_HEADERS = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)


@enum.unique
class Progress(enum.Enum):
    """How far the response got towards its client."""

    NOT_STARTED = enum.auto()  # nothing sent: a body being gathered, a stream before its headers
    STREAMING = enum.auto()  # the stream's headers are out, and whole events after them
    TORN = enum.auto()  # an event's write was cut mid-way: no byte may follow it
    COMPLETE = enum.auto()  # the response's last body message is going (or went) out


@enum.unique
class Connection(enum.Enum):
    """Whether the client's connection is still the response's, and if not, who ended it."""

    OPEN = enum.auto()
    CLIENT_LEFT = enum.auto()  # it disconnected before the response was complete
    # it left with a send stuck on its connection (half-closed), which the router shut down
    CLIENT_LEFT_HUNG_UP = enum.auto()
    # the router shut the connection down on a send stuck on a client that stopped reading:
    HUNG_UP = enum.auto()  # after the request was cut (a deadline, the drain, an error)
    STALLED = enum.auto()  # before: that ends the request


# the connection is the response's no more: the router shut it down
_HUNG_UP = (Connection.CLIENT_LEFT_HUNG_UP, Connection.HUNG_UP, Connection.STALLED)


@final
class ClientResponse:
    """The response of request ``request_id`` (``shaper``: streamed; None: one body)."""

    def __init__(
        self,
        *,
        request_id: str,
        kind: AnswerKind,
        model: str,
        created: int,
        shaper: Shaper | None,
        send: Send,
        hang_up: Callable[[], bool],
        draining: Callable[[], bool],
        top_logprobs: int | None = None,
        tool_names: Sequence[str] | None = None,
        body_of: Callable[..., dict[str, Any]] | None = None,
        choices: int = 1,
    ) -> None:
        """``body_of``: the non-streamed body's builder where the endpoint has its own
        (:attr:`~pdtrio.protocol.openai.answers.AnswerShape.own_body`); None: chat's or
        completions', by ``kind`` (with the tool calls read out of a chat answer).
        ``choices``: the request's ``n`` (streamed, ``shaper`` is then a ChoiceShapers)."""
        self.request_id = request_id
        self.kind = kind
        self.model = model
        self.created = created
        self.shaper = shaper
        self._body_of = body_of
        self._send_to_server = send
        # shuts the client's connection down (a client that stopped reading); True if done
        self._hang_up = hang_up
        self._draining = draining
        # how far the response got, and whose the connection is: two states, not one (a
        # client leaves, or is hung up on, at any point of the response, and the writes
        # the shell shields still go to the server after that, under the ASGI exchange's
        # rules: the headers once, no byte after a torn event)
        self._progress = Progress.NOT_STARTED
        self._connection = Connection.OPEN
        # for the stall sweep, no clock read per send: a send under way is an activity of
        # the request's task (it ends as the send returns, or is cut), not a state of the
        # response; the sweep times it by which send it saw under way, and since when
        self._sending = False
        self._sends = 0  # sends started: the sweep tells one from the next
        self._stall_mark: tuple[int, float] | None = None  # (send, when first seen under way)
        # the request asked for logprobs (with this many alternatives): gathered too
        self._top_logprobs = top_logprobs
        self._choices = choices
        # not streaming: each choice's answer, gathered
        self._answers = (
            [_Answer(top_logprobs is not None) for _ in range(choices)] if shaper is None else []
        )
        # streaming n > 1 choices: the shaper of each
        self._choice_shapers = shaper if isinstance(shaper, ChoiceShapers) else None
        # the request has tools: each choice's <tool_call> blocks are read into tool_calls
        self._tool_names = tool_names
        self._tool_parsers = (
            [ToolCallParser(tool_names) for _ in range(choices)]
            if tool_names is not None and shaper is not None
            else None
        )

    @property
    def torn(self) -> bool:
        """No byte may go to the client any more: a write was cut mid-way, or it ended."""
        return self._progress is Progress.TORN or (self.shaper is not None and self.shaper.closed)

    @property
    def client_gone(self) -> bool:
        """The client disconnected before the response was complete."""
        connection = self._connection
        return connection is Connection.CLIENT_LEFT or connection is Connection.CLIENT_LEFT_HUNG_UP

    @property
    def client_stalled(self) -> bool:
        """The router hung up on a client that stopped reading, which ends the request."""
        return self._connection is Connection.STALLED

    @property
    def hung_up(self) -> bool:
        """A stuck send was given up: the connection is the response's no more."""
        return self._connection in _HUNG_UP

    async def watch_disconnect(self, receive: Receive, on_gone: Callable[[], None]) -> None:
        """Until the client disconnects; ``on_gone`` if it left before the end."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                # (after the last body message, it is hypercorn closing the connection;
                # after our hang-up on a client that stopped reading, it is ours)
                if self._progress is not Progress.COMPLETE and self._connection is Connection.OPEN:
                    self._connection = Connection.CLIENT_LEFT
                    on_gone()
                return

    # --- writing ----------------------------------------------------------------

    async def deliver(self, delta: AnswerDelta) -> None:
        """Send (or, not streaming, gather) ``delta``; a final one ends the response."""
        choice = delta.choice
        if self.shaper is None:
            self._answers[choice].add(
                delta.text, delta.finish_reason, delta.usage, delta.logprobs, delta.tool_calls
            )
            return
        shaper: Shaper = (
            self.shaper if self._choice_shapers is None else self._choice_shapers.choice(choice)
        )
        if delta.tool_calls and self._tool_parsers is None:
            # an engine's calls where none are read out of the text (tool_choice "none"):
            # relayed as the engine made them
            self._tool_parsers = [ToolCallParser(()) for _ in range(self._choices)]
        if self._tool_parsers is None:
            chunk = shaper.delta(
                delta.text, delta.num_tokens, delta.finish_reason, delta.usage, delta.logprobs
            )
        else:
            chunk = self._tool_chunks(shaper, self._tool_parsers[choice], delta)
        if self._progress is Progress.NOT_STARTED:
            self._progress = Progress.STREAMING
            await self._send(
                {"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS}
            )
        if delta.final:
            # the last event and [DONE] in one write, shielded: a client that closes its
            # connection once it has them has hypercorn close it inside this send and
            # cancel the request's task, before the machine heard the stream end (a
            # client that stops reading cannot hold it: the stall sweep hangs up on it)
            self._progress = Progress.COMPLETE
            with trio.CancelScope(shield=True):
                await self._write(
                    {
                        "type": "http.response.body",
                        "body": chunk + self.shaper.done(),
                        "more_body": False,
                    }
                )
        elif chunk:
            try:
                await self._write({"type": "http.response.body", "body": chunk, "more_body": True})
            except BaseException:
                self._progress = Progress.TORN  # cancelled or failed: part of it may be out
                raise

    @staticmethod
    def _tool_chunks(shaper: Shaper, parser: ToolCallParser, delta: AnswerDelta) -> bytes:
        """``shaper.delta`` for a request with tools: its text less the calls, then the
        calls (those read out of the text, then the engine's own), then the finish
        (``tool_calls`` once a call was made)."""
        # (a chat or a Responses stream: each shaper takes the calls)
        assert isinstance(shaper, StreamShaper | ResponsesStreamShaper)
        num_tokens, finish_reason, usage, logprobs = (
            delta.num_tokens,
            delta.finish_reason,
            delta.usage,
            delta.logprobs,
        )
        content, calls = parser.feed(delta.text)
        calls += [parser.adopt(call) for call in delta.tool_calls]
        if finish_reason is not None:
            more, more_calls = parser.finish()
            content, calls = content + more, calls + more_calls
            finish_reason = parser.finish_reason(finish_reason)
        if not calls:
            return shaper.delta(content, num_tokens, finish_reason, usage, logprobs)
        chunk = shaper.delta(content, num_tokens, None, None, logprobs) + shaper.tool_calls(calls)
        if finish_reason is not None:
            chunk += shaper.delta("", 0, finish_reason, usage)
        return chunk

    async def finish(self) -> None:
        """End a successful response (streamed: ``[DONE]``; else the whole body)."""
        if self.shaper is not None and self.shaper.closed:
            return  # the last delta ended the stream
        self._progress = Progress.COMPLETE
        if self.shaper is not None:
            await self._send(
                {"type": "http.response.body", "body": self.shaper.done(), "more_body": False}
            )
            return
        usage = self.usage
        assert usage is not None  # the shell refuses a finish without it
        if self._body_of is not None:  # an endpoint's own body (/v1/responses; one choice)
            (answer,) = self._answers
            # its calls read as a chat answer's: out of the text, and an engine's own
            text = answer.text
            calls: list[ToolCall] = []
            if self._tool_names is not None or answer.engine_called:
                text, calls = answer.content_and_calls(self._tool_names or ())
            payload = self._body_of(
                request_id=self.request_id,
                created=self.created,
                text=text,
                finish_reason=answer.finish_reason,
                usage=usage,
                logprobs=answer.logprobs,
                top_logprobs=self._top_logprobs or 0,
                tool_calls=calls,
            )
            await send_json(self._send, 200, payload)
            return
        bodies = [self._body(answer, usage) for answer in self._answers]
        payload = bodies[0]
        if len(bodies) > 1:
            payload["choices"] = [
                {**body["choices"][0], "index": index} for index, body in enumerate(bodies)
            ]
        await send_json(self._send, 200, payload)

    def _body(self, answer: _Answer, usage: Usage) -> dict[str, Any]:
        """The body of one choice's answer (with the whole request's ``usage``)."""
        text = answer.text
        if self.kind == "chat":
            calls = None
            finish_reason = answer.finish_reason
            if self._tool_names is not None or answer.engine_called:
                text, calls = answer.content_and_calls(self._tool_names or ())
                if finish_reason is not None:
                    finish_reason = tool_finish_reason(finish_reason, bool(calls))
            return chat_completion_body(
                request_id=self.request_id,
                model=self.model,
                created=self.created,
                text=text,
                finish_reason=finish_reason,
                usage=usage,
                logprobs=answer.logprobs,
                top_logprobs=self._top_logprobs or 0,
                tool_calls=calls,
            )
        return completion_body(
            request_id=self.request_id,
            model=self.model,
            created=self.created,
            text=text,
            finish_reason=answer.finish_reason,
            usage=usage,
            logprobs=answer.logprobs,
            top_logprobs=self._top_logprobs or 0,
        )

    @property
    def usage(self) -> Usage | None:
        """Not streaming, once every choice finished: the answer's counts (the prompt
        once, every choice's completion tokens)."""
        answers = self._answers
        if not answers or any(answer.usage is None for answer in answers):
            return None
        first = answers[0].usage
        assert first is not None
        if len(answers) == 1:
            return first
        completion = sum(answer.usage.completion_tokens for answer in answers if answer.usage)
        return Usage(first.prompt_tokens, completion, first.cached_tokens)

    async def fail(self, error: OpenAIError, *, headers_sent: bool) -> None:
        """End the response with ``error`` as it can still go out: an error event and
        ``[DONE]`` after the headers (unless the wire is torn), else its status and body."""
        if self.hung_up:
            return  # the connection is gone
        if headers_sent:
            if (
                self.shaper is not None
                and not self.shaper.closed
                and self._progress is not Progress.TORN
            ):
                # a client that is not reading cannot hold this: the router's stall sweep
                # hangs up on it after cleanup_grace_s
                await self._send(
                    {
                        "type": "http.response.body",
                        "body": self.shaper.error(error),
                        "more_body": False,
                    }
                )
            return
        extra = [(name.encode(), value.encode()) for name, value in error.headers]
        await send_json(self._send, error.status, error.to_body(), extra or None)

    async def _send(self, message: Message) -> None:
        """Send to the server, marked as under way (the hot path, _write, marks its own)."""
        self._sending = True
        self._sends += 1
        try:
            await self._send_to_server(message)
        finally:
            self._sending = False

    async def _write(self, message: dict[str, Any]) -> None:
        """Send a body part (the hot path: marked as under way here, as _send does).

        While the router drains, the cut that may come next must not tear a write
        in progress (the client would get half an event and no error): the write
        is shielded.  A client that does not read cannot hold it past the cut's
        grace: the router's stall sweep hangs up on it.
        """
        self._sending = True
        self._sends += 1
        try:
            if not self._draining():
                await self._send_to_server(message)
                return
            with trio.CancelScope(shield=True):
                await self._send_to_server(message)
        finally:
            self._sending = False

    # --- a client that stopped reading ----------------------------------------------

    def hang_up_if_stalled(
        self, now: float, write_timeout: float, cut_grace: float, *, cut: bool
    ) -> bool:
        """The router's periodic look for a send that waits on a client that stopped
        reading; True when it hung up on a client the request had not given up on
        (``cut``: it had: a deadline, the drain, an error), which ends the request.

        hypercorn shields its socket writes from cancellation, so such a send
        would hold the request (and a server shutting down) for as long as the
        client's TCP stays up.  A send seen under way ``write_timeout`` ago, or
        ``cut_grace`` ago once the request was cut, is given up: the router
        hangs up on the client and the send fails.  No clock read per send: the
        look notes which send it saw, and when.
        """
        connection = self._connection
        if not self._sending or connection in _HUNG_UP:
            self._stall_mark = None
            return False
        mark = self._stall_mark
        if mark is None or mark[0] != self._sends:
            self._stall_mark = (self._sends, now)
            return False
        if now - mark[1] < (cut_grace if cut else write_timeout):
            return False
        if connection is Connection.CLIENT_LEFT:
            self._connection = Connection.CLIENT_LEFT_HUNG_UP  # (its leaving cut the request)
        elif cut:
            self._connection = Connection.HUNG_UP
        else:
            self._connection = Connection.STALLED  # the request ends for it
        why = "stopped reading" if cut else f"has read nothing for {write_timeout:g}s"
        if self._hang_up():
            log.warning("request %s: its client %s; hung up on it", self.request_id, why)
        else:
            log.warning(
                "request %s: its client %s; its connection is not found", self.request_id, why
            )
        return not cut


@final
class _Answer:
    """One choice's answer, gathered (not streaming)."""

    __slots__ = ("_parts", "engine_called", "finish_reason", "logprobs", "usage")

    def __init__(self, with_logprobs: bool) -> None:
        # its text, and the calls an engine read out of it, in the order they came
        self._parts: list[str | ToolCall] = []
        self.engine_called = False
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.logprobs: list[TokenLogprob] | None = [] if with_logprobs else None

    def add(
        self,
        text: str,
        finish_reason: str | None,
        usage: Usage | None,
        logprobs: Sequence[TokenLogprob] | None,
        tool_calls: Sequence[ToolCall] = (),
    ) -> None:
        if logprobs and self.logprobs is not None:
            self.logprobs += logprobs
        if text:
            self._parts.append(text)
        if tool_calls:
            self.engine_called = True
            self._parts += tool_calls
        if finish_reason is not None:
            self.finish_reason = finish_reason
            self.usage = usage

    @property
    def text(self) -> str:
        return "".join(part for part in self._parts if isinstance(part, str))

    def content_and_calls(self, names: Sequence[str]) -> tuple[str, list[ToolCall]]:
        """Its text less the calls of ``names`` read out of it, and every call (the
        engine's own among them, numbered in the order they came), as streamed."""
        parser = ToolCallParser(names)
        content: list[str] = []
        calls: list[ToolCall] = []
        for part in self._parts:
            if isinstance(part, str):
                text, found = parser.feed(part)
                content.append(text)
                calls += found
            else:
                calls.append(parser.adopt(part))
        text, found = parser.finish()
        return "".join(content) + text, calls + found
