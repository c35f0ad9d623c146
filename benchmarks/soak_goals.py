"""The soak's accounting: each request attributed to the faults active in its life, each
answer checked against the synthetic engine's, and issue 53's goals judged from that.

Pure functions over what the soak recorded (no I/O), so they are tested on their own
(``tests/e2e/test_soak_goals.py``).  A request counts under every fault that was active
(or still wearing off, ``settle_s``) at some moment between its send and its end; a goal
is judged on the requests whose faults were all of that goal's class, so a failure under
a KV stall and a decode's SIGSTOP at once does not count against the KV path.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from benchmarks.kit import percentile
from pdtrio.engine.synthetic import prompt_digest, synthetic_text, synthetic_token

KV_PATH = "KV path"
PARTITION = "partition"
SLOW = "latency/loss"
LINK = "link or process"
NO_FAULT = "no fault"

WELL_FORMED_FAILURES = ("http ", "error event")
"""A failed request that ended this way got an answer it can read (an error), not a cut."""


@attrs.frozen
class FaultSpan:
    """One fault: ``label`` (what it hit and how), its goal ``kind``, from ``began`` to
    ``cleared`` (trio clock)."""

    label: str
    kind: str
    began: float
    cleared: float


@attrs.frozen
class RequestRecord:
    """One client request: when it ran, how it ended, and whether its answer was wrong
    (None: no complete answer to check); for a complete stream read at full speed, its
    time to first token and per output token after it."""

    began: float
    ended: float
    outcome: str
    wrong: bool | None = None
    request_id: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None


def fault_kind(target: str, fault: str) -> str:
    """The goal class of ``fault`` on ``target`` (the soak's names for both)."""
    if fault in ("latency", "bandwidth", "loss"):
        return SLOW
    if target == "prefill KV" or fault == "corrupt":
        return KV_PATH
    if fault.startswith("cut_") or fault == "flap":
        return PARTITION
    return LINK


def expected_text(prompt: Sequence[int], max_tokens: int, vocab_size: int) -> str:
    """The synthetic engine's greedy answer to ``prompt`` (``ignore_eos``): what a colocated,
    undisturbed worker answers (the seed of a greedy, unseeded request's choice 0 is 0)."""
    digest = prompt_digest(list(prompt))
    start = len(prompt)
    return "".join(
        synthetic_text(synthetic_token(digest, 0, start + i, vocab_size)) for i in range(max_tokens)
    )


def _dechunk(body: bytes) -> bytes:
    out = bytearray()
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";", 1)[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2 :]
    return bytes(out)


def answer(response: bytes, stream: bool) -> tuple[str | None, str]:
    """A complete 200 response's id and its choice 0's text (streamed or not)."""
    head, _, body = response.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    if not stream:
        document = json.loads(body)
        return document.get("id"), document["choices"][0]["text"]
    request_id, parts = None, []
    for line in body.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        request_id = request_id or event.get("id")
        parts += [c.get("text", "") for c in event.get("choices", []) if c.get("index", 0) == 0]
    return request_id, "".join(parts)


def _active(record: RequestRecord, spans: Iterable[FaultSpan], settle_s: float) -> set[str]:
    return {
        span.label
        for span in spans
        if span.began <= record.ended and span.cleared + settle_s >= record.began
    }


def _failed(outcome: str) -> bool:
    return outcome not in ("ok", "client disconnected")


@attrs.define
class Row:
    requests: int = 0
    completed: int = 0
    migrated: int = 0
    failed: int = 0
    cut: int = 0
    """Failed without a well-formed answer (a socket closed mid-way)."""
    wrong: int = 0

    def add(self, record: RequestRecord, migrated: bool) -> None:
        self.requests += 1
        self.completed += record.outcome == "ok" and record.wrong is False
        self.migrated += migrated
        self.failed += _failed(record.outcome)
        self.cut += _failed(record.outcome) and not record.outcome.startswith(WELL_FORMED_FAILURES)
        self.wrong += bool(record.wrong)


def account(
    records: Sequence[RequestRecord],
    spans: Sequence[FaultSpan],
    migrated_ids: set[str],
    settle_s: float,
) -> tuple[dict[str, Row], dict[str, Row]]:
    """Per fault label (every request under each fault it saw, ``no fault`` for none) and
    per goal class (:func:`goal_classes`)."""
    kinds = {span.label: span.kind for span in spans}
    by_label: dict[str, Row] = {}
    by_kind: dict[str, Row] = {}
    for record in records:
        labels = _active(record, spans, settle_s)
        migrated = record.request_id is not None and record.request_id in migrated_ids
        for label in labels or {NO_FAULT}:
            by_label.setdefault(label, Row()).add(record, migrated)
        for kind in goal_classes({kinds[label] for label in labels}):
            by_kind.setdefault(kind, Row()).add(record, migrated)
    return dict(sorted(by_label.items())), by_kind


def goal_classes(classes: set[str]) -> list[str]:
    """The goal rows a request with faults of ``classes`` counts in: the KV path's and
    latency/loss's when its faults were only of those two (each goal is that nothing
    fails: the soak's corrupting decode is a KV-path fault all along, so neither could be
    judged alone), a partition's whatever else, a link's or process's unless partitioned
    too."""
    if not classes:
        return [NO_FAULT]
    rows = []
    if KV_PATH in classes and classes <= {KV_PATH, SLOW}:
        rows.append(KV_PATH)
    if PARTITION in classes:
        rows.append(PARTITION)
    if SLOW in classes and classes <= {KV_PATH, SLOW}:
        rows.append(SLOW)
    if LINK in classes and PARTITION not in classes:
        rows.append(LINK)
    return rows


def after_partition_s(
    records: Sequence[RequestRecord], spans: Sequence[FaultSpan], settle_s: float
) -> tuple[float, float]:
    """How long after the last partition of its life each request under one ended, the
    longest: of those that failed, and of all."""
    failed, every = 0.0, 0.0
    for record in records:
        starts = [
            max(span.began, record.began)
            for span in spans
            if span.kind == PARTITION
            and span.began <= record.ended
            and span.cleared + settle_s >= record.began
        ]
        if not starts:
            continue
        took = record.ended - max(starts)
        every = max(every, took)
        if _failed(record.outcome):
            failed = max(failed, took)
    return failed, every


def goals(
    by_kind: dict[str, Row],
    all_rows: Row,
    leaks: dict[str, Any],
    hung: int,
    digest: dict[str, int] | None,
    partition_bound: tuple[float, float] = (0.0, 0.0),
    judged: Sequence[str] = (),
) -> list[tuple[str, bool]]:
    """Issue 53's goals, each met or not, from the soak's accounting.

    ``partition_bound``: the longest a request that failed under a partition took to end
    after it began, and the most it may (``link_timeout_s`` plus the migration bound).
    ``judged``: the goal classes that must have requests to judge (a goal met by no
    request is not met)."""
    kv, partition, slow = (by_kind.get(k, Row()) for k in (KV_PATH, PARTITION, SLOW))
    took, bound = partition_bound
    result = [
        (f"KV-path faults: 0 lost ({kv.failed} of {kv.requests} failed)", kv.failed == 0),
        (
            f"partitions: every stream completes or ends well-formed "
            f"({partition.cut} of {partition.requests} cut, {hung} hung)",
            partition.cut == 0 and hung == 0,
        ),
        (
            f"partitions: a failure ends within {bound:g} s of the partition "
            f"(longest {took:.1f} s)",
            took <= bound,
        ),
        (
            f"latency/loss (and KV path): no failed request ({slow.failed} of {slow.requests})",
            slow.failed == 0,
        ),
        (f"0 wrong answers, any fault ({all_rows.wrong})", all_rows.wrong == 0),
        (f"0 leaked on every worker ({len(leaks)} holding)", not leaks),
    ]
    result += [
        (f"{kind}: judged on requests ({by_kind.get(kind, Row()).requests})", False)
        for kind in judged
        if not by_kind.get(kind, Row()).requests
    ]
    if digest is not None:
        corrupted, mismatches = digest["corrupted_pulls"], digest["digest_mismatches"]
        result.append(
            (
                f"every corrupted pull detected ({mismatches} mismatches, {corrupted} corrupted)",
                mismatches >= corrupted,
            )
        )
    return result


def render_table(
    by_label: dict[str, Row], by_kind: dict[str, Row], leaked: dict[str, int] | None = None
) -> list[str]:
    """The per-fault and per-goal rows; ``leaked``: the blocks still held after the phase of
    each fault (faults one class at a time), when there were phases."""
    head = f"    {'fault':30} {'requests':>8} {'done':>6} {'migr':>5} {'failed':>6} {'cut':>4} {'wrong':>5}"
    head += f" {'leaked':>6}" if leaked is not None else ""
    lines = ["  per fault (a request under each fault active in its life)", head]

    def row(name: str, r: Row, blocks: int | None = None) -> str:
        line = (
            f"    {name[:30]:30} {r.requests:8d} {r.completed:6d} {r.migrated:5d} "
            f"{r.failed:6d} {r.cut:4d} {r.wrong:5d}"
        )
        return line + (f" {blocks:6d}" if blocks is not None else "")

    lines += [
        row(label, r, None if leaked is None else leaked.get(label, 0))
        for label, r in by_label.items()
    ]
    lines.append("  per goal (the requests each goal is judged on)")
    lines += [row(kind, r) for kind, r in sorted(by_kind.items())]
    return lines


def migrated_request_ids(router_output: bytes) -> set[str]:
    """The requests the router's access lines say migrated (``migrations=`` not ``-``)."""
    found = set()
    for line in router_output.decode(errors="replace").splitlines():
        if "migrations=" not in line or "request_id=" not in line:
            continue
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        if fields.get("migrations", "-") != "-":
            found.add(fields["request_id"])
    return found


# --- /health, judged against what the bed did -------------------------------------------


@attrs.frozen
class HealthSample:
    """What the router's ``/health`` said at ``at`` (trio clock)."""

    at: float
    prefill: int
    decode: int
    discovery_connected: bool


@attrs.frozen
class Presence:
    """``host`` (a ``role``) ran from ``began`` to ``ended``."""

    host: str
    role: str
    began: float
    ended: float
    faulty: bool = False
    """Broken on purpose (every handoff to it fails): the router may count it or not."""


@attrs.frozen
class Cut:
    """``host`` was cut off from ``began`` to ``cleared``; ``steady``: the whole time (a
    flap's link comes and goes within it)."""

    host: str
    began: float
    cleared: float
    steady: bool = True


def _cut_over(cuts: Sequence[Cut], host: str, start: float, end: float) -> bool:
    """Whether one steady cut of ``host`` covers ``start`` to ``end``."""
    return any(c.host == host and c.steady and c.began <= start and c.cleared >= end for c in cuts)


def _touched(cuts: Sequence[Cut], hosts: Iterable[str], start: float, end: float) -> bool:
    """Whether a cut of one of ``hosts`` overlaps ``start`` to ``end``."""
    wanted = set(hosts)
    return any(c.host in wanted and c.began <= end and c.cleared >= start for c in cuts)


def health_lies(
    samples: Sequence[HealthSample],
    roster: Sequence[Presence],
    cuts: Sequence[Cut],
    *,
    down_after_s: float,
    up_after_s: float,
    registry_host: str = "etcd",
) -> list[str]:
    """Where ``/health`` said what the bed makes untrue, each as a line.

    A worker cut off for ``down_after_s`` (the link timeout and its slack) must no longer
    count, nor one that left (stopped) ``down_after_s`` ago; one that has run untouched for
    ``up_after_s`` (neither it nor the registry cut off meanwhile: a registration that
    expired during an etcd cut is made anew) must.  A count between those bounds is true, whatever it is.  The registry must read
    disconnected once cut off for ``down_after_s`` and connected once untouched for
    ``up_after_s``."""
    lies = []
    for sample in samples:
        t = sample.at
        for role, reported in (("prefill", sample.prefill), ("decode", sample.decode)):
            # one that left less than down_after_s ago may still count
            present = [
                p for p in roster if p.role == role and p.began <= t <= p.ended + down_after_s
            ]
            settled = [
                p
                for p in present
                if p.began <= t - up_after_s
                and t <= p.ended
                and not p.faulty
                and not _touched(cuts, (p.host, registry_host), t - up_after_s, t)
            ]
            down = [p for p in present if _cut_over(cuts, p.host, t - down_after_s, t)]
            low, high = len(settled), len(present) - len(down)
            if not low <= reported <= high:
                lies.append(f"at {t:.1f}: {role} {reported}, true {low}..{high}")
        registry_down = _cut_over(cuts, registry_host, t - down_after_s, t)
        registry_up = not _touched(cuts, (registry_host,), t - up_after_s, t)
        if sample.discovery_connected and registry_down:
            lies.append(f"at {t:.1f}: discovery connected, etcd cut off")
        if not sample.discovery_connected and registry_up:
            lies.append(f"at {t:.1f}: discovery disconnected, etcd reachable")
    return lies


def latency_against(
    records: Sequence[RequestRecord], baseline: Sequence[RequestRecord]
) -> dict[str, float]:
    """TTFT and TPOT p50 and p99 of ``records``' measured streams, and each as a ratio to
    ``baseline``'s (the clean run's)."""

    figures: dict[str, float] = {}
    for name in ("ttft_s", "tpot_s"):
        mine = [v for r in records if (v := getattr(r, name)) is not None]
        theirs = [v for r in baseline if (v := getattr(r, name)) is not None]
        figures[f"{name[:-2]}_streams"] = len(mine)
        for label, q in (("p50", 50), ("p99", 99)):
            value, base = percentile(mine, q), percentile(theirs, q)
            figures[f"{name[:-2]}_{label}_ms"] = value * 1000
            figures[f"{name[:-2]}_{label}_ratio"] = value / base if base else float("nan")
    return figures
