"""The router reads a /v1/responses answer's calls as a chat answer's: its client
response, fed the model's text in any pieces, sends the same function_call items
streamed (the Responses events) and whole."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from openai.types.responses import Response

from pdtrio.protocol.link.wire import Usage
from pdtrio.protocol.openai.answers import AnswerDelta, answer_shape
from pdtrio.protocol.openai.responses import ResponsesRequest, parse_responses_request
from pdtrio.protocol.openai.tools import call_text
from pdtrio.router.request.client_response import ClientResponse
from tests.protocol.test_responses_tools import NAMES, TIME, WEATHER, _stream_events


def _parse(**fields: Any) -> ResponsesRequest:
    body = {"model": "m", "input": "hi", **fields}
    return parse_responses_request(
        json.dumps(body).encode(), served_models={"m"}, max_tokens_limit=100
    )


async def _deliver_through_client_response(request: ResponsesRequest, pieces: list[str]) -> bytes:
    """The router's client response, fed ``pieces`` of the model's text as decode sends
    them: what the client is sent."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    shape = answer_shape("responses", request)
    shaper = shape.stream_shaper("resp_7", 1, None) if request.chat.stream else None
    response = ClientResponse(
        request_id="resp_7",
        kind="responses",
        model="m",
        created=1,
        shaper=shaper,
        send=send,
        hang_up=lambda: True,
        draining=lambda: False,
        tool_names=NAMES,
        body_of=shape.own_body,
    )
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        await response.deliver(
            AnswerDelta(piece, 1, "stop" if last else None, Usage(3, len(pieces)) if last else None)
        )
    await response.finish()
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


@pytest.mark.parametrize("cut", [1, 3, 7, 11])
def test_the_router_reads_calls_out_of_streamed_and_whole_answers_alike(cut: int) -> None:
    text = "Sure." + call_text("get_weather", {"city": "Oslo"}) + "\n" + call_text("get_time", {})
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
    whole = trio.run(_deliver_through_client_response, _parse(tools=[WEATHER, TIME]), pieces)
    streamed = trio.run(
        _deliver_through_client_response, _parse(tools=[WEATHER, TIME], stream=True), pieces
    )
    body = Response.model_validate_json(whole)
    final = _stream_events(streamed)[-1].response
    assert final.status == body.status == "completed"

    def summary(response: Any) -> list[Any]:
        return [
            (item.type, item.id, getattr(item, "name", None), getattr(item, "arguments", None))
            for item in response.output
        ]

    assert (
        summary(final)
        == summary(body)
        == [
            ("message", "msg_7", None, None),
            ("function_call", "fc_7_1", "get_weather", '{"city": "Oslo"}'),
            ("function_call", "fc_7_2", "get_time", "{}"),
        ]
    )
    assert final.output_text == body.output_text == "Sure."
