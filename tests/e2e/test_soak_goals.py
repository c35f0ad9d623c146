"""The soak's accounting (``benchmarks.soak_goals``): attribution, the answer check, the goals."""

from __future__ import annotations

import json

from benchmarks.soak_goals import (
    KV_PATH,
    LINK,
    NO_FAULT,
    PARTITION,
    SLOW,
    Cut,
    FaultSpan,
    HealthSample,
    Presence,
    RequestRecord,
    Row,
    account,
    after_partition_s,
    answer,
    fault_kind,
    goal_classes,
    goals,
    health_lies,
    latency_against,
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


def test_a_goal_no_request_was_judged_on_is_not_met() -> None:
    judged = (KV_PATH, PARTITION)
    met = goals({PARTITION: Row(requests=3, completed=3)}, Row(), {}, 0, None, judged=judged)
    assert [goal for goal, ok in met if not ok] == ["KV path: judged on requests (0)"]


def _lies(*samples: HealthSample, cuts: tuple[Cut, ...] = ()) -> list[str]:
    roster = [
        Presence("prefill", "prefill", 0.0, 100.0),
        Presence("decode", "decode", 0.0, 100.0),
        Presence("decode2", "decode", 0.0, 100.0),
    ]
    return health_lies(samples, roster, cuts, down_after_s=3.0, up_after_s=5.0)


def test_health_must_drop_a_worker_cut_off_past_the_bound_and_count_it_once_back() -> None:
    cut = (Cut("decode", 10.0, 20.0),)
    assert _lies(HealthSample(9.0, 1, 2, True), cuts=cut) == []
    assert _lies(HealthSample(12.0, 1, 2, True), cuts=cut) == []  # within the bound: either
    assert _lies(HealthSample(14.0, 1, 2, True), cuts=cut) == ["at 14.0: decode 2, true 1..1"]
    assert _lies(HealthSample(14.0, 1, 1, True), cuts=cut) == []
    assert _lies(HealthSample(22.0, 1, 1, True), cuts=cut) == []  # coming back: either
    assert _lies(HealthSample(26.0, 1, 1, True), cuts=cut) == ["at 26.0: decode 1, true 2..2"]


def test_a_worker_that_left_must_be_out_of_health_once_the_bound_has_passed() -> None:
    roster = [
        Presence("prefill", "prefill", 0.0, 100.0),
        Presence("decode", "decode", 0.0, 100.0),
        Presence("decode3", "decode", 10.0, 20.0),
    ]

    def lies(at: float, decodes: int) -> list[str]:
        sample = HealthSample(at, 1, decodes, True)
        return health_lies([sample], roster, (), down_after_s=3.0, up_after_s=5.0)

    assert lies(12.0, 1) == []  # just joined: either
    assert lies(16.0, 1) == ["at 16.0: decode 1, true 2..2"]
    assert lies(21.0, 2) == []  # just left: either
    assert lies(24.0, 2) == ["at 24.0: decode 2, true 1..1"]


def test_a_flap_never_has_to_be_reported_down_and_an_etcd_cut_is_judged_too() -> None:
    flap = (Cut("decode", 10.0, 20.0, steady=False),)
    assert _lies(HealthSample(18.0, 1, 2, True), cuts=flap) == []
    etcd = (Cut("etcd", 10.0, 20.0),)
    assert _lies(HealthSample(15.0, 1, 2, True), cuts=etcd) == [
        "at 15.0: discovery connected, etcd cut off"
    ]
    assert _lies(HealthSample(22.0, 1, 1, False), cuts=etcd) == []  # registrations come back
    assert _lies(HealthSample(30.0, 1, 2, False), cuts=etcd) == [
        "at 30.0: discovery disconnected, etcd reachable"
    ]


def test_latency_is_reported_against_the_clean_run() -> None:
    clean = [RequestRecord(0, 1, "ok", False, None, 0.010, 0.005) for _ in range(4)]
    slow = [RequestRecord(0, 1, "ok", False, None, 0.050, 0.006) for _ in range(4)]
    slow.append(RequestRecord(0, 1, "client disconnected"))  # not measured
    figures = latency_against(slow, clean)
    assert figures["ttft_streams"] == 4
    assert round(figures["ttft_p50_ratio"], 6) == 5.0
    assert round(figures["tpot_p50_ms"], 6) == 6.0
