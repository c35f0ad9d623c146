"""An engine's decode stream read without I/O: deltas as they come, the finish held until
the usage chunk, and a stream that ends early or breaks said so."""

from __future__ import annotations

import json

from pdtrio.protocol.engines.decode_events import DecodeEventReader, Delta


def _chat(text: str, finish: str | None = None, tokens: int | None = None) -> str:
    event: dict[str, object] = {
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]
    }
    if tokens is not None:
        event["usage"] = {
            "prompt_tokens": 3,
            "completion_tokens": tokens,
            "total_tokens": 3 + tokens,
        }
    return "data: " + json.dumps(event)


def _usage(tokens: int) -> str:
    usage = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}
    return "data: " + json.dumps({"choices": [], "usage": usage})


def test_deltas_go_on_as_they_come_and_the_finish_waits_for_the_counts() -> None:
    reader = DecodeEventReader("chat", with_logprobs=False)
    assert reader.line(": a comment") is None and not reader.produced
    first = reader.line(_chat("Hel", tokens=1))
    assert first == Delta("Hel", 1, None, None, [])
    assert reader.produced
    assert reader.line(_chat("lo", tokens=3)) == Delta("lo", 2, None, None, [])
    assert reader.line(_chat("!", "stop", tokens=4)) is None  # held: the counts come last
    assert reader.line(_usage(4)) is None
    assert reader.line("data: [DONE]") is None
    ending = reader.end()
    assert ending == Delta("!", 1, "stop", None, [])
    assert reader.final_usage is not None and reader.final_usage.completion_tokens == 4
    assert reader.seen == 4


def test_a_stream_that_ends_before_its_answer_or_breaks_says_why() -> None:
    reader = DecodeEventReader("chat", with_logprobs=False)
    reader.line(_chat("Hel"))
    assert reader.end() == "decode's stream ended before the answer did"
    broken = DecodeEventReader("chat", with_logprobs=False)
    assert broken.line("data: {not json") is None
    ending = broken.end()
    assert isinstance(ending, str) and ending.startswith("decode's stream:")
    lost = DecodeEventReader("completion", with_logprobs=False)
    lost.lost("decode lost: reset")
    assert lost.end() == "decode lost: reset"


def test_an_answer_the_engine_aborted_is_a_failure_never_a_finish() -> None:
    for reason in ("abort", "error"):
        reader = DecodeEventReader("chat", with_logprobs=False)
        assert reader.line(_chat("Hel", tokens=1)) == Delta("Hel", 1, None, None, [])
        assert reader.line(_chat("", reason, tokens=1)) is None
        assert reader.line(_usage(1)) is None and reader.line("data: [DONE]") is None
        assert reader.end() == f"decode ended the request early (finish_reason {reason!r})"
