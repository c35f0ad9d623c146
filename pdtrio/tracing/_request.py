"""A request's spans on the router, read from what its machine is told and answers.

The request shell hands each event and the machine's commands here (only when the
request is traced), so one reading serves every backend: a span for the request, one
per prefill attempt, per decode attempt (from its placement: the wait for room, then
``placed`` on an instance, ``accepted`` once its KV is pulled) and per wait for a decode
to connect; retries, migrations, the first token and a client that left are events.  Token batches are not seen: the machine hears of a
stream's first and last, nothing between.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

from opentelemetry.trace import Span, Status, StatusCode

from pdtrio.protocol import request as rm
from pdtrio.tracing._otel import Tracing, traceparent_of


def _failure_text(failure: rm.AnyFailure) -> str:
    if isinstance(failure, rm.WorkerFailure):
        return f"{failure.status} {failure.error_type}: {failure.message}"
    return f"{failure.reason.name.lower()}: {failure.message}"


@final
class RequestTrace:
    """One request's spans.  ``prefill_traceparent`` and ``decode_traceparent``: what each
    leg's calls carry on (its attempt's span while one is open, else the request's; the
    two may be open at once, as in front of SGLang)."""

    def __init__(
        self,
        tracing: Tracing,
        incoming: str,
        *,
        request_id: str,
        model: str,
        endpoint: str,
        key_id: str,
    ) -> None:
        self._tracing = tracing
        attributes: dict[str, str | int] = {
            "pdtrio.request_id": request_id,
            "gen_ai.request.model": model,
            "http.route": endpoint,
        }
        if key_id:
            attributes["pdtrio.api_key_id"] = key_id  # the key's id, never the key
        self.span = span = tracing.request_span(f"POST {endpoint}", incoming, attributes)
        self.recording = span.is_recording()
        self.trace_id = f"{span.get_span_context().trace_id:032x}"
        self._request_traceparent = traceparent_of(span)
        self.prefill_traceparent = self.decode_traceparent = self._request_traceparent
        self._prefill: Span | None = None
        self._decode: Span | None = None
        self._waiting: Span | None = None
        self._prefill_attempts = 0
        self._decode_attempts = 0
        self._first_token = False

    # --- what the machine hears and answers --------------------------------------

    def observe(self, event: rm.Event, commands: Sequence[rm.Command]) -> None:
        if not self.recording:
            return
        self._on_event(event)
        for command in commands:
            self._on_command(command)

    def _on_event(self, event: rm.Event) -> None:  # noqa: C901 (one case per event)
        kind = type(event)
        if kind is rm.PrefillSent:
            assert isinstance(event, rm.PrefillSent)
            if self._prefill is not None:
                self._prefill.set_attribute("pdtrio.instance", event.instance)
        elif kind is rm.Prefilled:
            self._prefill = self._close(self._prefill)
        elif kind is rm.PrefillFailed:
            assert isinstance(event, rm.PrefillFailed)
            self._prefill = self._close(self._prefill, _failure_text(event.failure))
        elif kind is rm.PrefillLost:
            assert isinstance(event, rm.PrefillLost)
            self._prefill = self._close(self._prefill, f"link lost: {event.message}")
        elif kind is rm.PrefillNotSent:
            self._prefill = self._close(self._prefill, "not sent: the link was closed")
        elif kind is rm.PrefillUnavailable:
            self._prefill = self._close(self._prefill, "no prefill instance takes it")
        elif kind is rm.DecodeStartSent:
            assert isinstance(event, rm.DecodeStartSent)
            if self._decode is not None:
                self._decode.set_attribute("pdtrio.instance", event.instance)
                self._decode.add_event("placed")  # the wait for room is over
        elif kind is rm.DecodeUnavailable:
            assert isinstance(event, rm.DecodeUnavailable)
            self._decode = self._close(self._decode, _failure_text(event.failure))
        elif kind is rm.DecodeNotSent:
            assert isinstance(event, rm.DecodeNotSent)
            self._decode = self._close(self._decode, f"not sent: {event.message}")
        elif kind is rm.DecodeAccepted:
            if self._decode is not None:
                self._decode.add_event("accepted")  # its KV is pulled: the handoff is done
        elif kind is rm.DecodeRejected:
            assert isinstance(event, rm.DecodeRejected)
            self._decode = self._close(self._decode, f"rejected: {event.message}")
        elif kind is rm.DecodeTokens:
            assert isinstance(event, rm.DecodeTokens)
            self._first_token_out()
            if event.final:
                self._decode = self._close(self._decode)
        elif kind is rm.DecodeFailed:
            assert isinstance(event, rm.DecodeFailed)
            self._decode = self._close(self._decode, f"{event.reason}: {event.message}")
        elif kind is rm.DecodeConnected:
            self._waiting = self._close(self._waiting)
        else:
            self._on_ending_event(event)

    def _on_ending_event(self, event: rm.Event) -> None:
        kind = type(event)
        if kind is rm.DeadlinePassed:
            assert isinstance(event, rm.DeadlinePassed)
            self.span.add_event("deadline_passed", {"pdtrio.deadline": event.deadline.value})
            self._close_legs(f"the {event.deadline.value} deadline passed")
        elif kind is rm.ClientGone:
            self.span.add_event("client_gone")
        elif kind is rm.ClientStalled:
            self.span.add_event("client_stalled")
        elif kind is rm.DrainCut:
            self.span.add_event("drain_cut")
        elif kind is rm.Failed:
            assert isinstance(event, rm.Failed)
            self.span.add_event("failed", {"pdtrio.message": event.failure.message})

    def _on_command(self, command: rm.Command) -> None:
        kind = type(command)
        if kind is rm.SendPrefill:
            assert isinstance(command, rm.SendPrefill)
            self._prefill_attempts += 1
            if command.retry:
                self.span.add_event("retry", {"pdtrio.leg": "prefill"})
            self._prefill = self._open(
                "prefill",
                {
                    "pdtrio.attempt": self._prefill_attempts,
                    "pdtrio.continuation": command.continuation,
                },
            )
        elif kind is rm.PlaceDecode:
            assert isinstance(command, rm.PlaceDecode)
            if command.retry:
                self.span.add_event(
                    "retry", {"pdtrio.leg": "decode", "pdtrio.reason": command.last_reason}
                )
            # from the wait for decode room on: the pick, the KV handoff, the tokens
            self._decode_attempts += 1
            self._decode = self._open(
                "decode", {"pdtrio.attempt": self._decode_attempts, "pdtrio.retry": command.retry}
            )
        elif kind is rm.WaitForDecode:
            self._waiting = self._open("wait for decode", {})
        elif kind is rm.Migrate:
            assert isinstance(command, rm.Migrate)
            self.span.add_event(
                "migration",
                {"pdtrio.reason": str(command.reason), "pdtrio.lost_on": command.lost_on},
            )
        elif kind is rm.EmitFirstToken:
            self._first_token_out()

    # --- the spans ---------------------------------------------------------------

    def _open(self, name: str, attributes: dict[str, str | int | bool]) -> Span:
        span = self._tracing.child_span(name, self.span, attributes)
        if name == "prefill":
            self.prefill_traceparent = traceparent_of(span)
        else:  # the decode attempt, or the wait for a decode
            self.decode_traceparent = traceparent_of(span)
        return span

    def _close(self, span: Span | None, error: str | None = None) -> Span | None:
        """End ``span`` (if open); what its slot holds after: None."""
        if span is not None:
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, error))
            span.end()
            if span is self._prefill:
                self.prefill_traceparent = self._request_traceparent
            else:
                self.decode_traceparent = self._request_traceparent
        return None

    def _close_legs(self, error: str | None) -> None:
        self._prefill = self._close(self._prefill, error)
        self._decode = self._close(self._decode, error)
        self._waiting = self._close(self._waiting, error)

    def _first_token_out(self) -> None:
        if not self._first_token:
            self._first_token = True
            self.span.add_event("first_token")

    # --- the end -----------------------------------------------------------------

    def end(
        self,
        *,
        outcome: str,
        status: int | None,
        failure: rm.AnyFailure | None,
        prompt_tokens: int,
        completion_tokens: int,
        prefill: str | None,
        decode: str | None,
    ) -> None:
        """The request is over: its figures on its span, every span of it ended."""
        span = self.span
        if self.recording:
            error = None if failure is None else _failure_text(failure)
            self._close_legs(error)
            span.set_attribute("pdtrio.outcome", outcome)
            span.set_attribute("http.response.status_code", 200 if status is None else status)
            span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
            if prefill is not None:
                span.set_attribute("pdtrio.prefill.instance", prefill)
            if decode is not None:
                span.set_attribute("pdtrio.decode.instance", decode)
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, error))
        span.end()
