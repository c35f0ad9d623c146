"""``benchmarks/kit.py``: the one percentile, the streaming client's reader, the tables."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.kit import (
    StreamReader,
    StreamResult,
    aligned_table,
    markdown_table,
    percentile,
    quantile,
    stream_completion,
    write_json,
)

samples = st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=60)


def test_percentile_is_linear_interpolation_between_ranks() -> None:
    values = [15.0, 20.0, 35.0, 40.0, 50.0]
    assert percentile(values, 0) == 15
    assert percentile(values, 100) == 50
    assert percentile(values, 50) == 35
    assert percentile(values, 40) == pytest.approx(29.0)  # rank 1.6: 20 + 0.6 * 15
    assert percentile([1.0, 2.0], 50) == 1.5  # the mean of the two middle ones
    # p99 of 10 values lies between the two largest
    assert percentile([float(i) for i in range(1, 11)], 99) == pytest.approx(9.91)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    assert quantile(values, 0.4) == percentile(values, 40)
    with pytest.raises(ValueError):
        percentile(values, 101)


@given(samples)
def test_p50_is_the_median(values: list[float]) -> None:
    assert percentile(values, 50) == pytest.approx(statistics.median(values))


@given(samples.filter(lambda v: len(v) >= 2), st.integers(1, 99))
def test_it_is_numpys_default_and_statistics_inclusive_quantiles(
    values: list[float], p: int
) -> None:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    assert percentile(values, p) == pytest.approx(cuts[p - 1], abs=1e-6)


@given(samples, st.floats(0, 100), st.floats(0, 100))
def test_percentile_is_monotonic_and_within_the_sample(
    values: list[float], p: float, q: float
) -> None:
    low, high = sorted((p, q))
    assert min(values) <= percentile(values, low) <= percentile(values, high) <= max(values)


def _read(lines: list[str]) -> StreamResult:
    result = StreamResult(started=0.0)
    reader = StreamReader(result)
    for i, line in enumerate(lines, start=1):
        reader.line(line, float(i))
    return result


def test_the_reader_times_token_events_and_keeps_text_usage_and_done() -> None:
    result = _read(
        [
            'data: {"choices":[{"index":0,"text":"Hel","finish_reason":null}]}',
            "",
            'data: {"choices":[{"index":0,"text":"lo","finish_reason":null}]}',
            "",
            'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}',
            'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":3}}',
            "data: [DONE]",
        ]
    )
    assert result.text == "Hello"
    assert result.arrivals == [1.0, 3.0, 5.0]
    assert result.ttft == 1.0 and result.gaps == [2.0, 2.0]
    assert result.finish_reason == "length"
    assert result.usage == {"prompt_tokens": 3, "completion_tokens": 3}
    assert result.done and result.error is None and result.events == 4


def test_the_reader_reads_chat_deltas_skips_the_role_chunk_and_sees_an_error_event() -> None:
    result = _read(
        [
            'data: {"choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":null}]}',
            'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}',
            'data: {"error":{"code":"shutting_down","message":"the server is stopping"}}',
            "data: [DONE]",
        ]
    )
    assert result.text == "Hi" and result.arrivals == [2.0]
    assert result.error == {"code": "shutting_down", "message": "the server is stopping"}
    result.status = 200
    assert result.done and not result.ok


async def test_stream_completion_over_httpx() -> None:
    events = [
        {"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "b", "finish_reason": "stop"}]},
    ]
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["model"] == "missing":
            return httpx.Response(404, json={"error": {"code": "model_not_found"}})
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    async with httpx.AsyncClient(
        transport=httpx.MockTransport(handler), base_url="http://x"
    ) as http:
        answer = await stream_completion(http, {"model": "m", "stream": True})
        missing = await stream_completion(http, {"model": "missing", "stream": True})
    assert answer.ok and answer.text == "ab" and len(answer.arrivals) == 2
    assert answer.ttft is not None and answer.ttft >= 0
    assert answer.finished is not None and answer.finished >= answer.arrivals[-1]
    assert missing.status == 404 and not missing.ok
    assert missing.error == {"code": "model_not_found"}


def test_aligned_table_pads_each_column_to_its_widest_cell() -> None:
    text = aligned_table(["name", "n"], [["a", "10"], ["long name", "2"]], align="lr")
    assert text.splitlines() == [
        "name      |  n",
        "----------+---",
        "a         | 10",
        "long name |  2",
    ]
    bare = aligned_table(["x", "y"], [], separator="  ", rule=None)
    assert bare == "x  y"
    with pytest.raises(ValueError):
        aligned_table(["x"], [], align="lr")


def test_markdown_table() -> None:
    assert markdown_table(["a", "b"], [["1", "2"]], align="lr").splitlines() == [
        "| a | b |",
        "|---|---:|",
        "| 1 | 2 |",
    ]
    assert markdown_table(["a"], []).splitlines() == ["| a |", "|---|"]


def test_write_json_writes_only_when_asked(tmp_path: Path) -> None:
    write_json(None, {"a": 1})
    path = tmp_path / "r.json"
    write_json(path, {"a": 1, "where": tmp_path})
    assert json.loads(path.read_text()) == {"a": 1, "where": str(tmp_path)}
