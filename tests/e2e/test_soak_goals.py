"""The soak's accounting (``benchmarks.soak_goals``): attribution, the answer check, the goals."""

from __future__ import annotations

import json

from benchmarks.soak_goals import (
    KV_PATH,
    LINK,
    NO_FAULT,
    PARTITION,
    SLOW,
    FaultSpan,
    RequestRecord,
    Row,
    account,
    after_partition_s,
    answer,
    fault_kind,
    goal_classes,
    goals,
    migrated_request_ids,
)


def test_fault_kinds() -> None:
    assert fault_kind("prefill KV", "stall") == KV_PATH
    assert fault_kind("decode", "corrupt") == KV_PATH
    assert fault_kind("prefill KV", "latency") == SLOW
    assert fault_kind("network", "loss") == SLOW
    assert fault_kind("etcd", "cut_drop") == PARTITION
    assert fault_kind("decode", "flap") == PARTITION
    assert fault_kind("decode", "sigstop") == LINK


def test_a_request_counts_under_each_fault_of_its_life_and_its_goal_rows() -> None:
    spans = [
        FaultSpan("prefill KV stall", KV_PATH, 1.0, 2.0),
        FaultSpan("decode sigstop", LINK, 5.0, 6.0),
        FaultSpan("prefill latency", SLOW, 10.0, 11.0),
    ]
    records = [
        RequestRecord(0.0, 1.5, "http 503 service_unavailable", None, "a"),  # KV only: lost
        RequestRecord(1.5, 5.5, "ok", False, "b"),  # KV and link
        RequestRecord(8.0, 8.5, "ok", True, "c"),  # no fault (settle 1 s), wrong
        RequestRecord(10.5, 12.5, "closed mid-stream", None, "d"),  # latency, within settle
    ]
    by_label, by_kind = account(records, spans, migrated_ids={"b"}, settle_s=1.0)
    assert by_label["prefill KV stall"] == Row(requests=2, completed=1, migrated=1, failed=1)
    assert by_label["decode sigstop"] == Row(requests=1, completed=1, migrated=1)
    assert by_label[NO_FAULT] == Row(requests=1, wrong=1)
    assert by_label["prefill latency"] == Row(requests=1, failed=1, cut=1)
    assert by_kind[KV_PATH].failed == 1 and by_kind[KV_PATH].requests == 1
    assert by_kind[LINK].requests == 1
    met = dict(goals(by_kind, Row(wrong=1), {}, hung=0, digest=None))
    assert list(met.values()) == [False, True, True, False, False, True]


def test_a_failure_under_a_partition_must_end_within_the_bound() -> None:
    spans = [FaultSpan("decode cut_link", PARTITION, 2.0, 4.0)]
    records = [
        RequestRecord(0.0, 9.0, "ok", False),  # 7 s after the cut began
        RequestRecord(3.0, 5.5, "http 502 decode_failed"),  # 2.5 s after it ran into it
        RequestRecord(6.0, 7.0, "http 503 service_unavailable"),  # past the settle: none
    ]
    assert after_partition_s(records, spans, settle_s=1.0) == (2.5, 7.0)
    met = goals({}, Row(), {}, 0, None, partition_bound=(2.5, 2.0))
    assert not met[2][1]


def test_kv_path_and_latency_faults_together_count_for_both_goals() -> None:
    assert goal_classes({KV_PATH, SLOW}) == [KV_PATH, SLOW]
    assert goal_classes({KV_PATH, LINK}) == [LINK]
    assert goal_classes({PARTITION, LINK}) == [PARTITION]
    assert goal_classes(set()) == [NO_FAULT]


def test_every_corrupted_pull_must_be_detected() -> None:
    digest = {"corrupted_pulls": 3, "digest_mismatches": 2}
    assert not goals({}, Row(), {}, 0, digest)[-1][1]
    assert goals({}, Row(), {}, 0, {**digest, "digest_mismatches": 3})[-1][1]


def test_answers_are_read_from_streamed_chunked_and_whole_responses() -> None:
    events = [{"id": "cmpl-1", "choices": [{"index": 0, "text": t}]} for t in (" t1", " t2")]
    sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    sse += b"data: [DONE]\n\n"
    chunked = f"{len(sse):x}\r\n".encode() + sse + b"\r\n0\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    assert answer(head + chunked, stream=True) == ("cmpl-1", " t1 t2")
    whole = json.dumps({"id": "cmpl-2", "choices": [{"index": 0, "text": " t9"}]}).encode()
    assert answer(b"HTTP/1.1 200 OK\r\n\r\n" + whole, stream=False) == ("cmpl-2", " t9")


def test_migrated_requests_come_from_the_access_lines() -> None:
    output = (
        b"INFO request_id=cmpl-1 status=200 migrations=decode_lost prefill_at=x\n"
        b"INFO request_id=cmpl-2 status=200 migrations=- prefill_at=x\n"
    )
    assert migrated_request_ids(output) == {"cmpl-1"}
