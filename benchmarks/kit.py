"""What every benchmark shares: one percentile, one streaming client, one report helper.

**Percentiles.** :func:`percentile` is the one definition every report uses: linear
interpolation between the closest ranks, numpy's default (``method="linear"``, also
R's type 7, Excel's ``PERCENTILE.INC`` and ``statistics.quantiles(method="inclusive")``).
For ``n`` sorted values the ``p``-th percentile sits at rank ``p / 100 * (n - 1)``: p0 is
the smallest, p100 the largest, p50 the median as :func:`statistics.median` gives it (the
mean of the two middle values when ``n`` is even), and a p99 of fewer than 101 values lies
between the two largest.  Nothing measured is ever dropped or rounded to a sample.  An
empty sample has no percentile: ``nan``.  :func:`quantile` is the same with ``q`` in 0..1
(what :mod:`benchmarks.plotting` takes), so a figure's marked p50/p99 are the table's.

**Streaming.** :func:`stream_completion` posts one streamed OpenAI request with httpx and
reads its ``text/event-stream`` with :class:`StreamReader`: when each event arrived
(``time.perf_counter``), the first token's (TTFT) and the gaps between token events
(ITL), the text, usage, an error event or error body, and whether ``data: [DONE]`` came.
:func:`stream_completion_sync` is the same over a blocking ``httpx.Client``.  It is for
benchmarks that measure the server with an ordinary client; those that measure the
router's own cost per token (``router_cost``, ``token_path``) and those that must not
spend a client's CPU per request (raw-socket loads) keep their lean readers.

**Reports.** :func:`aligned_table` (padded columns, optionally a rule under the header)
and :func:`markdown_table` render the tables; :func:`write_json` writes ``--json PATH``
the same way everywhere.
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

# --- percentiles ---------------------------------------------------------------------------


def percentile(values: Iterable[float], p: float) -> float:
    """The ``p``-th percentile (0..100) of ``values``, linearly interpolated; nan when empty."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is not within 0..100")
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = p / 100 * (len(ordered) - 1)
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    fraction = rank - below
    return ordered[below] + (ordered[above] - ordered[below]) * fraction


def quantile(values: Sequence[float], q: float) -> float:
    """:func:`percentile` with ``q`` in 0..1."""
    return percentile(values, q * 100)


# --- one streamed OpenAI request --------------------------------------------------------------


@attrs.define(eq=False)
class StreamResult:
    """What one streamed request brought, with each event's arrival time."""

    started: float  # time.perf_counter() just before the request went out
    status: int = 0
    # arrival of every event that carried text or a finish_reason (a token event)
    arrivals: list[float] = attrs.field(factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    # the error event's (or a non-200 answer's) ``error`` object
    error: dict[str, Any] | None = None
    done: bool = False  # ``data: [DONE]`` arrived
    events: int = 0  # every ``data: {...}`` event
    body: str = ""  # a non-200 answer's body
    finished: float | None = None  # when the stream (or the body) ended

    @property
    def ttft(self) -> float | None:
        """Seconds from sending to the first token event; None when none came."""
        return self.arrivals[0] - self.started if self.arrivals else None

    @property
    def gaps(self) -> list[float]:
        """Seconds between consecutive token events (the first token's wait excluded)."""
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]

    @property
    def ok(self) -> bool:
        """200, ended by ``[DONE]``, no error event."""
        return self.status == 200 and self.done and self.error is None


class StreamReader:
    """Reads an OpenAI ``text/event-stream`` a line at a time (sans-IO: the caller times)."""

    def __init__(self, result: StreamResult) -> None:
        self.result = result

    def line(self, line: str, now: float) -> None:
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.result.done = True
            return
        if not data.startswith("{"):
            return
        event = json.loads(data)
        self.result.events += 1
        if "error" in event:
            self.result.error = event["error"]
            return
        if event.get("usage"):
            self.result.usage = event["usage"]
        for choice in event.get("choices") or ():
            piece = choice.get("text")
            if piece is None:  # chat: the delta's content
                piece = (choice.get("delta") or {}).get("content")
            if piece or choice.get("finish_reason"):
                self.result.arrivals.append(now)
            self.result.text += piece or ""
            if choice.get("finish_reason"):
                self.result.finish_reason = choice["finish_reason"]

    def body(self, text: str) -> None:
        """A non-streamed (non-200) answer's body."""
        self.result.body = text
        try:
            error = json.loads(text).get("error")
        except (ValueError, AttributeError):
            error = None
        self.result.error = error if isinstance(error, dict) else {"message": text[:200]}


async def stream_completion(
    http: httpx.AsyncClient, body: Mapping[str, Any], path: str = "/v1/completions"
) -> StreamResult:
    """POST one streamed request (``body`` should say ``"stream": true``) and read it all.

    A transport error is raised (httpx's); a non-200 answer is returned, its body read.
    """
    result = StreamResult(started=time.perf_counter())
    reader = StreamReader(result)
    async with http.stream("POST", path, json=body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            reader.body((await response.aread()).decode(errors="replace"))
        else:
            async for line in response.aiter_lines():
                reader.line(line, time.perf_counter())
    result.finished = time.perf_counter()
    return result


def stream_completion_sync(
    http: httpx.Client, body: Mapping[str, Any], path: str = "/v1/completions"
) -> StreamResult:
    """:func:`stream_completion` over a blocking client."""
    result = StreamResult(started=time.perf_counter())
    reader = StreamReader(result)
    with http.stream("POST", path, json=body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            reader.body(response.read().decode(errors="replace"))
        else:
            for line in response.iter_lines():
                reader.line(line, time.perf_counter())
    result.finished = time.perf_counter()
    return result


# --- reports ------------------------------------------------------------------------------


def aligned_table(
    header: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    align: str | None = None,
    separator: str = " | ",
    rule: str | None = "-+-",
) -> str:
    """Columns padded to their widest cell, ``rule`` (joined dashes) under the header.

    ``align``, one letter a column (``l`` or ``r``): how each column is padded (all
    left by default).
    """
    align = _alignment(align, len(header))
    lines = [list(header), *(list(row) for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]

    def render(cells: Sequence[str]) -> str:
        padded = (
            cell.rjust(width) if a == "r" else cell.ljust(width)
            for cell, width, a in zip(cells, widths, align, strict=True)
        )
        return separator.join(padded).rstrip()

    out = [render(lines[0])]
    if rule is not None:
        out.append(rule.join("-" * width for width in widths))
    out += [render(line) for line in lines[1:]]
    return "\n".join(out)


def _alignment(align: str | None, columns: int) -> str:
    if align is None:
        return "l" * columns
    if len(align) != columns or set(align) - {"l", "r"}:
        raise ValueError(f"align {align!r} does not fit {columns} columns")
    return align


def markdown_table(
    header: Sequence[str], rows: Iterable[Sequence[str]], *, align: str | None = None
) -> str:
    """A GitHub markdown table: the header, its ``|---|`` rule, one line a row.

    ``align``, one letter a column (``l`` or ``r``), right-aligns the ``r`` ones (``---:``).
    """
    rules = ["---:" if a == "r" else "---" for a in _alignment(align, len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rules) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path | None, report: Any) -> None:
    """``--json PATH``: the report, indented; values JSON lacks (paths, ...) as strings."""
    if path is not None:
        path.write_text(json.dumps(report, indent=2, default=str))


def cpu_model() -> str:
    """The CPU's model name (benchmarks print it: figures compare only within one machine)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
