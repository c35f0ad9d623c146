"""A stream of n > 1 choices: each chunk names its choice, one usage chunk and one [DONE]."""

from __future__ import annotations

from typing import Any, Literal

import pytest
from openai.types.chat import ChatCompletionChunk

from pdtrio.protocol.link.wire import TokenLogprob, Usage
from pdtrio.protocol.openai import service_unavailable
from pdtrio.protocol.openai.sse import ChoiceShapers, StreamShaper
from tests.protocol.test_sse import DONE, events


def choice_shapers(
    n: int,
    kind: Literal["chat", "completion"] = "chat",
    *,
    include_usage: bool = False,
    top_logprobs: int | None = None,
) -> ChoiceShapers:
    return ChoiceShapers(
        [
            StreamShaper(
                kind=kind,
                request_id="req-1",
                model="tiny",
                created=1700000000,
                include_usage=include_usage,
                continuous_usage_stats=False,
                top_logprobs=top_logprobs,
                index=index,
            )
            for index in range(n)
        ],
        include_usage=include_usage,
    )


def validated(kind: str, parsed: list[Any]) -> list[Any]:
    """The chunks, chat's checked against the openai client's own model (its Completion
    model is the whole body's: a streamed chunk's finish_reason null does not fit it)."""
    for event in parsed:
        if event is not DONE and kind == "chat":
            ChatCompletionChunk.model_validate(event)
    return parsed


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_each_choice_streams_under_its_index_and_usage_is_summed(
    kind: Literal["chat", "completion"],
) -> None:
    shapers = choice_shapers(3, kind, include_usage=True)
    shapers.set_prompt_usage(7, 2)
    out = b""
    texts = {0: ["a", "b"], 1: ["c"], 2: ["d", "e", "f"]}
    for step in range(3):
        for index, parts in texts.items():
            if step < len(parts):
                out += shapers.choice(index).delta(parts[step], 1, None)
    for index, parts in texts.items():
        out += shapers.choice(index).delta("", 0, "stop", Usage(7, len(parts), 2))
        assert shapers.finished is (index == 2)
    out += shapers.done()
    parsed = validated(kind, events(out))
    assert parsed[-1] is DONE
    usage_chunk = parsed[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens"] == 7
    assert usage_chunk["usage"]["completion_tokens"] == 6  # 2 + 1 + 3, the prompt once
    assert usage_chunk["usage"]["total_tokens"] == 13
    assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    got: dict[int, str] = {0: "", 1: "", 2: ""}
    finishes: dict[int, str] = {}
    roles: list[int] = []
    for event in parsed[:-2]:
        [item] = event["choices"]
        index = item["index"]
        if kind == "chat":
            delta = item["delta"]
            if delta.get("role") == "assistant":
                roles.append(index)
            got[index] += delta.get("content") or ""
        else:
            got[index] += item["text"]
        if item["finish_reason"] is not None:
            finishes[index] = item["finish_reason"]
    assert got == {index: "".join(parts) for index, parts in texts.items()}
    assert finishes == {0: "stop", 1: "stop", 2: "stop"}
    assert roles == ([0, 1, 2] if kind == "chat" else [])
    assert shapers.completion_tokens == 6


def test_logprobs_chunks_name_their_choice() -> None:
    shapers = choice_shapers(2, top_logprobs=1)
    item = TokenLogprob("x", -0.5, ("x",), (-0.5,))
    out = shapers.choice(1).delta("x", 1, None, None, [item])
    [chunk] = [event for event in events(out) if event["choices"][0]["delta"].get("content")]
    ChatCompletionChunk.model_validate(chunk)
    [only] = chunk["choices"]
    assert only["index"] == 1
    assert only["logprobs"]["content"][0]["token"] == "x"


def test_error_ends_every_choice_once() -> None:
    shapers = choice_shapers(2)
    out = shapers.choice(0).delta("a", 1, None)
    out += shapers.error(service_unavailable("decode failed"))
    parsed = events(out)
    assert parsed[-1] is DONE
    assert parsed[-2]["error"]["message"] == "decode failed"
    # choice 1 never sent anything: its role chunk still goes out, before the error
    roles = [e["choices"][0]["index"] for e in parsed[:-2] if "role" in e["choices"][0]["delta"]]
    assert roles == [0, 1]
    assert shapers.closed
    with pytest.raises(ValueError):
        shapers.done()


def test_one_choice_is_no_choice_shapers() -> None:
    with pytest.raises(ValueError):
        choice_shapers(1)
