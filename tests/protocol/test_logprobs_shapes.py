"""Token logprobs in OpenAI's shapes: whole bodies and streamed chunks (sync, no IO)."""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from hypothesis import given
from hypothesis import strategies as st

from pdtrio.protocol.link.wire import TokenLogprob, Usage
from pdtrio.protocol.openai import (
    chat_completion_body,
    chat_logprobs,
    completion_body,
    completion_logprobs,
)
from pdtrio.protocol.openai.sse import StreamShaper

A = TokenLogprob(" a", -0.5, (" a", " b", " c"), (-0.5, -1.5, -2.5))
B = TokenLogprob(" bé", -1.25, (" x", " bé"), (-0.75, -1.25))
PARTIAL = TokenLogprob("\ufffd", -3.0, ("\ufffd",), (-3.0,))
USAGE = Usage(3, 2)


def shaper(kind: Literal["chat", "completion"], top: int) -> StreamShaper:
    return StreamShaper(
        kind=kind,
        request_id="r",
        model="m",
        created=1,
        include_usage=False,
        continuous_usage_stats=False,
        top_logprobs=top,
    )


def chunks(data: bytes) -> list[dict[str, Any]]:
    text = data.decode()
    return [
        json.loads(block[len("data: ") :])
        for block in text.split("\n\n")
        if block and block != "data: [DONE]"
    ]


def test_chat_logprobs_have_bytes_and_the_asked_alternatives() -> None:
    shaped = chat_logprobs([A, B, PARTIAL], 2)
    assert shaped["content"][0] == {
        "token": " a",
        "logprob": -0.5,
        "bytes": [32, 97],
        "top_logprobs": [
            {"token": " a", "logprob": -0.5, "bytes": [32, 97]},
            {"token": " b", "logprob": -1.5, "bytes": [32, 98]},
        ],
    }
    assert shaped["content"][1]["bytes"] == list(" bé".encode())
    assert shaped["content"][2]["bytes"] == [0xEF, 0xBF, 0xBD]
    assert chat_logprobs([A], 0)["content"][0]["top_logprobs"] == []


def test_completion_logprobs_always_hold_the_sampled_token_and_offsets() -> None:
    shaped = completion_logprobs([A, B], 1, text_offset=10)
    assert shaped == {
        "tokens": [" a", " bé"],
        "token_logprobs": [-0.5, -1.25],
        # the likeliest one, and the sampled token where it is not among them
        "top_logprobs": [{" a": -0.5}, {" x": -0.75, " bé": -1.25}],
        "text_offset": [10, 12],
    }


def test_an_infinite_logprob_is_written_as_vllm_does() -> None:
    ruled_out = TokenLogprob(" z", -math.inf, (" z",), (-math.inf,))
    shaped = chat_logprobs([ruled_out], 1)
    assert shaped["content"][0]["logprob"] == -9999.0
    json.dumps(shaped, allow_nan=False)


def test_bodies_carry_logprobs_only_when_asked() -> None:
    plain = chat_completion_body(
        request_id="r", model="m", created=1, text=" a bé", finish_reason="length", usage=USAGE
    )
    assert plain["choices"][0]["logprobs"] is None
    asked = chat_completion_body(
        request_id="r",
        model="m",
        created=1,
        text=" a bé",
        finish_reason="length",
        usage=USAGE,
        logprobs=[A, B],
        top_logprobs=1,
    )
    assert [c["token"] for c in asked["choices"][0]["logprobs"]["content"]] == [" a", " bé"]
    whole = completion_body(
        request_id="r",
        model="m",
        created=1,
        text=" a bé",
        finish_reason="length",
        usage=USAGE,
        logprobs=[A, B],
        top_logprobs=0,
    )
    assert whole["choices"][0]["logprobs"]["text_offset"] == [0, 2]


def test_a_stream_without_logprobs_is_unchanged() -> None:
    plain = StreamShaper(
        kind="chat",
        request_id="r",
        model="m",
        created=1,
        include_usage=False,
        continuous_usage_stats=False,
    )
    role, first = chunks(plain.delta(" a", 1, None))
    assert role["choices"][0]["logprobs"] is None and first["choices"][0]["logprobs"] is None


def test_a_chunk_carries_the_logprobs_of_every_token_since_the_last() -> None:
    stream = shaper("chat", 1)
    out = chunks(stream.delta(" a", 1, None, logprobs=[A]))
    role, first = out
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["token"] for c in first["choices"][0]["logprobs"]["content"]] == [" a"]
    # a token whose text is not complete yet sends nothing: its logprob waits for the next
    assert stream.delta("", 1, None, logprobs=[PARTIAL]) == b""
    [second] = chunks(stream.delta("é", 1, None, logprobs=[B]))
    assert second["choices"][0]["delta"] == {"content": "é"}
    assert [c["token"] for c in second["choices"][0]["logprobs"]["content"]] == ["\ufffd", " bé"]
    [last] = chunks(stream.delta("", 1, "length", USAGE, logprobs=[A]))
    assert last["choices"][0]["delta"] == {}
    assert last["choices"][0]["finish_reason"] == "length"
    assert len(last["choices"][0]["logprobs"]["content"]) == 1


def test_streamed_text_offsets_continue_across_chunks() -> None:
    stream = shaper("completion", 0)
    [first] = chunks(stream.delta(" a", 1, None, logprobs=[A]))
    [second] = chunks(stream.delta(" bé a", 2, "stop", USAGE, logprobs=[B, A]))
    assert first["choices"][0]["logprobs"]["text_offset"] == [0]
    assert second["choices"][0]["logprobs"]["text_offset"] == [2, 5]
    assert second["choices"][0]["text"] == " bé a"


@given(st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=12))
def test_however_deltas_split_every_token_gets_one_entry(sizes: list[int]) -> None:
    stream = shaper("completion", 1)
    sent: list[str] = []
    for number, size in enumerate(sizes):
        items = [
            TokenLogprob(f" t{number}.{i}", -1.0, (f" t{number}.{i}",), (-1.0,))
            for i in range(size)
        ]
        last = number == len(sizes) - 1
        text = "".join(item.token for item in items)
        out = stream.delta(text, size, "length" if last else None, USAGE if last else None, items)
        for chunk in chunks(out):
            sent += chunk["choices"][0]["logprobs"]["tokens"]
    expected = [f" t{n}.{i}" for n, size in enumerate(sizes) for i in range(size)]
    assert sent == expected
