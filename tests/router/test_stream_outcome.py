"""A decode stream's outcome: what each loss says of the instance and the request, and
how each backend's stream moves from one outcome to the next."""

from __future__ import annotations

from pdtrio.protocol import request as rm
from pdtrio.protocol.link.wire import DecodeRejected, RejectReason
from pdtrio.router.engines.stream import EngineStream
from pdtrio.router.stream_outcome import (
    ACCEPTED,
    CUT_OFF_MESSAGE,
    UNANSWERED,
    DecodeLoss,
    StreamFailed,
    StreamRejected,
)
from pdtrio.router.workers.stream import DecodeStream


def test_only_a_loss_decode_may_be_lost_with_lets_the_request_migrate() -> None:
    migrating = {loss for loss in DecodeLoss if loss.may_migrate}
    assert migrating == {
        DecodeLoss.DECODE_FAILED,
        DecodeLoss.STALLED,
        DecodeLoss.LINK_LOST,
        DecodeLoss.LINK_TIMEOUT,
    }
    # every reason a lost stream gives; the machine's own, a failed handoff's new round,
    # is no stream's
    assert {loss.migration_reason.value for loss in migrating} == {
        reason.value for reason in rm.MigrationReason
    } - {rm.MigrationReason.HANDOFF_FAILED.value}
    # a loss that cannot migrate is counted as decode's, should the request go on
    assert DecodeLoss.ABORTED.migration_reason is rm.MigrationReason.DECODE_FAILED


def test_a_link_loss_is_not_the_instances_failure() -> None:
    assert {loss for loss in DecodeLoss if loss.is_link_loss} == {
        DecodeLoss.LINK_LOST,
        DecodeLoss.LINK_TIMEOUT,
    }


def test_a_worker_stream_keeps_its_first_failure_and_whether_decode_had_accepted() -> None:
    stream = DecodeStream("r", max_pending_tokens=16)
    assert stream.outcome is UNANSWERED
    stream.fail("link lost", DecodeLoss.LINK_LOST)
    stream.fail("aborted", DecodeLoss.ABORTED)
    assert stream.outcome == StreamFailed("link lost", DecodeLoss.LINK_LOST, accepted=False)

    accepted = DecodeStream("r", max_pending_tokens=16)
    accepted.accept()
    assert accepted.outcome is ACCEPTED and not accepted.updated  # (no wake-up for it)
    accepted.fail(CUT_OFF_MESSAGE, DecodeLoss.CUT_OFF)
    outcome = accepted.outcome
    assert isinstance(outcome, StreamFailed) and outcome.accepted and outcome.cut_off

    rejected = DecodeStream("r", max_pending_tokens=16)
    rejection = DecodeRejected("r", RejectReason.NO_ROOM, "full")
    rejected.reject(rejection)
    assert rejected.outcome == StreamRejected(rejection) and rejected.updated


def test_an_engine_stream_tells_its_latest_failure_but_keeps_who_is_to_blame() -> None:
    stream = EngineStream(max_pending_tokens=16)
    assert stream.outcome is ACCEPTED
    stream.fail("prefill failed choice 1", DecodeLoss.NOT_DECODES_FAULT)
    stream.fail("decode's stream ended")  # (it waited for KV that never came)
    assert stream.outcome == StreamFailed("decode's stream ended", DecodeLoss.NOT_DECODES_FAULT)
    stream.restart()
    assert stream.outcome is ACCEPTED
    stream.fail("decode's stream ended")
    assert stream.outcome == StreamFailed("decode's stream ended", DecodeLoss.DECODE_FAILED)


def test_an_engine_stream_cut_off_stays_cut_off() -> None:
    stream = EngineStream(max_pending_tokens=16)
    stream.fail("prefill failed choice 1", DecodeLoss.NOT_DECODES_FAULT)
    stream.fail(CUT_OFF_MESSAGE, DecodeLoss.CUT_OFF)
    stream.fail("prefill failed choice 1", DecodeLoss.NOT_DECODES_FAULT)
    assert stream.outcome == StreamFailed(CUT_OFF_MESSAGE, DecodeLoss.CUT_OFF)
