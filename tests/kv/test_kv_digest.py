"""The verified handoff: prefill's record of what it wrote in each block, checked by decode
after the pull, over TCP and NIXL alike (pdtrio/kv/digest.py, pdtrio/worker/admission.py)."""

from __future__ import annotations

import importlib.util
import logging
import random
import zlib

import msgspec
import numpy as np
import pytest

from pdtrio.config import WorkerFaultsConfig
from pdtrio.engine.synthetic import SyntheticEngine
from pdtrio.kv.api import KvTransport
from pdtrio.kv.digest import (
    FULL,
    LINE_BYTES,
    SAMPLE_LINES,
    SAMPLED,
    Coverage,
    KvDigestCounts,
    block_digests,
    coverage_for,
    mismatched_blocks,
)
from pdtrio.kv.nixl import NixlKvTransport
from pdtrio.kv.tcp import TcpKvTransport
from pdtrio.protocol.link import wire
from pdtrio.protocol.link.wire import (
    DecodeStart,
    KvDigests,
    KvHandle,
    RejectReason,
    TransferAnswer,
    TransferAnswerWithDigests,
)
from pdtrio.protocol.sampling import SamplingParams
from pdtrio.worker.admission import Accepted, DecodeAdmission, Rejected
from pdtrio.worker.fault_hooks import FaultyKvTransport
from pdtrio.worker.leases import KvLeases
from tests.kv.blocks import leased_request, running_pair, synthetic

NIXL = importlib.util.find_spec("nixl") is not None
TRANSPORTS = [
    pytest.param("nixl", marks=pytest.mark.skipif(not NIXL, reason="NIXL is not installed")),
    "tcp",
]
# blocks of 64 tokens, 256 bytes each: a sample of 64 lines of 64 bytes would be the
# whole block, so these tests use blocks big enough to be sampled (4 KiB and more)
BIG_BLOCK = 2048  # tokens: 8 KiB a synthetic block


def transport(kind: str, engine: SyntheticEngine) -> KvTransport:
    if kind == "nixl":
        return NixlKvTransport(engine, required=True)
    return TcpKvTransport()


def start_for(handle: KvHandle) -> DecodeStart:
    """A decode start for the handle's request (the synthetic engine is not asked to run it)."""
    prompt = tuple(range(10, 10 + handle.num_tokens))
    return DecodeStart(handle.request_id, prompt, 11, SamplingParams(), 8, 1, 0, handle)


# --- the digests ----------------------------------------------------------------------------


def test_a_sample_reads_evenly_spread_lines_the_first_and_last_included() -> None:
    sample = SAMPLED.sample(368_640)  # a SmolLM2 block in bfloat16
    assert sample is not None and sample.size == SAMPLE_LINES * LINE_BYTES
    assert sample[0] == 0 and sample[-1] == 368_640 - 1
    starts = sample[::LINE_BYTES]
    assert np.all(np.diff(starts) > LINE_BYTES)  # lines apart, none overlapping
    # a block no bigger than the sample, or full coverage: every byte
    assert SAMPLED.sample(SAMPLE_LINES * LINE_BYTES) is None
    assert FULL.sample(368_640) is None
    assert coverage_for("off") is None and coverage_for("full") == FULL


async def test_digests_are_crc32_of_the_block_or_of_its_sample() -> None:
    engine = synthetic(num_blocks=8, block_size=BIG_BLOCK)
    nbytes = engine.layout.block_nbytes
    blocks = engine.allocate_blocks("r", 3 * BIG_BLOCK)
    data = random.Random(1).randbytes(3 * nbytes)
    await engine.write_blocks(blocks, data)
    full = await block_digests(engine, blocks, FULL)
    assert full == tuple(zlib.crc32(data[i * nbytes : (i + 1) * nbytes]) for i in range(3))
    sample = SAMPLED.sample(nbytes)
    assert sample is not None
    sampled = await block_digests(engine, blocks, SAMPLED)
    array = np.frombuffer(data, dtype=np.uint8).reshape(3, nbytes)
    assert sampled == tuple(zlib.crc32(array[i, sample].tobytes()) for i in range(3))


async def test_a_sample_misses_a_flip_between_its_lines_which_full_coverage_catches() -> None:
    engine = synthetic(num_blocks=8, block_size=BIG_BLOCK)
    nbytes = engine.layout.block_nbytes
    (block,) = engine.allocate_blocks("r", BIG_BLOCK)
    data = bytearray(random.Random(2).randbytes(nbytes))
    await engine.write_blocks((block,), bytes(data))
    sampled, full = (
        await block_digests(engine, (block,), SAMPLED),
        await block_digests(engine, (block,), FULL),
    )
    sample = SAMPLED.sample(nbytes)
    assert sample is not None
    between = int(sample[LINE_BYTES - 1]) + 1  # just past the first line
    assert between not in set(sample.tolist())
    data[between] ^= 0x01
    await engine.write_blocks((block,), bytes(data))
    assert await block_digests(engine, (block,), SAMPLED) == sampled
    assert await block_digests(engine, (block,), FULL) != full


async def test_a_description_of_another_number_of_blocks_is_not_checkable() -> None:
    engine = synthetic()
    blocks = engine.allocate_blocks("r", 8)
    expected = KvDigests(0, 64, (1,), (1,), (1,))
    with pytest.raises(Exception, match="not checkable"):
        await mismatched_blocks(engine, blocks, expected)


def test_an_answer_without_digests_is_the_array_a_decode_that_knows_none_reads() -> None:
    plain = wire.encode(TransferAnswer(True, nbytes=64))
    assert msgspec.msgpack.decode(plain) == [True, 64, ""]
    both = wire.Decoder(TransferAnswerWithDigests)
    assert both.decode(plain) == TransferAnswerWithDigests(True, 64, "", None)
    digests = KvDigests(64, 64, (7,), (1,), (1,))
    with_digests = wire.encode(TransferAnswerWithDigests(True, 64, "", digests))
    assert both.decode(with_digests).digests == digests


# --- handoffs -------------------------------------------------------------------------------


@pytest.mark.parametrize("coverage", [SAMPLED, FULL], ids=["sampled", "full"])
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_handoff_passes_the_check_with_prefills_bytes(
    kind: str, coverage: Coverage
) -> None:
    prefill, decode = synthetic(block_size=BIG_BLOCK), synthetic(block_size=BIG_BLOCK)
    pulling = transport(kind, decode)
    async with running_pair(transport(kind, prefill), pulling, prefill, decode) as pair:
        handle, data = await leased_request(
            pair.prefill, "r", 5 * BIG_BLOCK - 3, pair.endpoint, digest=coverage
        )
        counts = KvDigestCounts()
        admission = DecodeAdmission(
            decode, KvLeases(decode.free_request), pulling, "decode-0", digest_counts=counts
        )
        assert await admission.admit(start_for(handle)) == Accepted()
        assert counts == KvDigestCounts(checked=1, mismatched=0)
        assert await decode.read_blocks(decode_blocks(decode, "r", 5)) == data
        assert pulling.info()["pulls"][kind] == 1


def decode_blocks(engine: SyntheticEngine, request_id: str, count: int) -> tuple[int, ...]:
    return tuple(engine._blocks.owned(request_id)[:count])


@pytest.mark.parametrize("coverage", [SAMPLED, FULL], ids=["sampled", "full"])
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_corrupted_pull_is_refused_counted_logged_and_freed(
    kind: str, coverage: Coverage, caplog: pytest.LogCaptureFixture
) -> None:
    prefill, decode = synthetic(block_size=BIG_BLOCK), synthetic(block_size=BIG_BLOCK)
    faulty = FaultyKvTransport(
        transport(kind, decode), WorkerFaultsConfig(kv_transfer_corrupt=True)
    )
    async with running_pair(transport(kind, prefill), faulty, prefill, decode) as pair:
        handle, _ = await leased_request(
            pair.prefill, "r", 3 * BIG_BLOCK, pair.endpoint, digest=coverage
        )
        counts = KvDigestCounts()
        admission = DecodeAdmission(
            decode, KvLeases(decode.free_request), faulty, "decode-0", digest_counts=counts
        )
        with caplog.at_level(logging.WARNING, logger="pdtrio.worker"):
            decision = await admission.admit(start_for(handle))
        assert isinstance(decision, Rejected), decision
        assert decision.reason == RejectReason.TRANSFER_FAILED
        assert "digest mismatch in prompt blocks 0,1,2" in decision.message
        assert counts == KvDigestCounts(checked=1, mismatched=1)
        assert faulty.corrupted_pulls == 1
        (warning,) = [r for r in caplog.records if "KV digest mismatch" in r.getMessage()]
        assert warning.levelno == logging.WARNING
        assert "the KV of r pulled from prefill-0" in warning.getMessage()
        assert "prompt blocks 0,1,2 (3 of 3 pulled)" in warning.getMessage()
        assert decode.statistics().kv_blocks_in_use == 0
        assert len(pair.prefill.leases) == 1  # prefill's lease stands, for another decode


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_block_freed_and_reused_before_the_pull_is_caught_even_with_its_bytes_back(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    # a lease that outlived its blocks (the bug this guards against): the engine freed the
    # request's blocks and another request got them, then wrote the very same bytes; the
    # bytes pass any digest, the generation does not
    prefill, decode = synthetic(block_size=BIG_BLOCK), synthetic(block_size=BIG_BLOCK)
    pulling = transport(kind, decode)
    async with running_pair(transport(kind, prefill), pulling, prefill, decode) as pair:
        handle, data = await leased_request(pair.prefill, "r", 2 * BIG_BLOCK, pair.endpoint)
        prefill.free_request("r")  # behind the lease's back
        reused = prefill.allocate_blocks("intruder", 2 * BIG_BLOCK)
        assert set(reused) == set(handle.block_ids)
        await prefill.write_blocks(handle.block_ids, data)
        counts = KvDigestCounts()
        admission = DecodeAdmission(
            decode, KvLeases(decode.free_request), pulling, "decode-0", digest_counts=counts
        )
        with caplog.at_level(logging.WARNING, logger="pdtrio.worker"):
            decision = await admission.admit(start_for(handle))
        assert isinstance(decision, Rejected), decision
        assert decision.reason == RejectReason.TRANSFER_FAILED
        assert counts.mismatched == 1
        (warning,) = [r for r in caplog.records if "KV digest mismatch" in r.getMessage()]
        assert "reused since prefill wrote it (generation 1, then 2)" in warning.getMessage()
        assert decode.statistics().kv_blocks_in_use == 0


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_block_overwritten_between_prefills_write_and_the_pull_is_caught(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    prefill, decode = synthetic(block_size=BIG_BLOCK), synthetic(block_size=BIG_BLOCK)
    pulling = transport(kind, decode)
    async with running_pair(transport(kind, prefill), pulling, prefill, decode) as pair:
        handle, _ = await leased_request(pair.prefill, "r", 4 * BIG_BLOCK, pair.endpoint)
        other = random.Random(9).randbytes(prefill.layout.block_nbytes)
        await prefill.write_blocks((handle.block_ids[2],), other)
        admission = DecodeAdmission(decode, KvLeases(decode.free_request), pulling, "decode-0")
        with caplog.at_level(logging.WARNING, logger="pdtrio.worker"):
            decision = await admission.admit(start_for(handle))
        assert isinstance(decision, Rejected), decision
        assert "prompt blocks 2" in decision.message
        (warning,) = [r for r in caplog.records if "KV digest mismatch" in r.getMessage()]
        assert f"block 2 (prefill's {handle.block_ids[2]}): digest" in warning.getMessage()


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_prefill_that_records_nothing_hands_off_unchecked(kind: str) -> None:
    # (kv_digest = "off", or a prefill that predates the check)
    prefill, decode = synthetic(), synthetic()
    pulling = transport(kind, decode)
    async with running_pair(transport(kind, prefill), pulling, prefill, decode) as pair:
        handle, data = await leased_request(pair.prefill, "r", 9, pair.endpoint, digest=None)
        counts = KvDigestCounts()
        admission = DecodeAdmission(
            decode, KvLeases(decode.free_request), pulling, "decode-0", digest_counts=counts
        )
        assert await admission.admit(start_for(handle)) == Accepted()
        assert counts == KvDigestCounts(checked=0, mismatched=0)
        assert await decode.read_blocks(decode_blocks(decode, "r", 3)) == data


async def test_a_pull_of_the_blocks_decode_lacks_is_checked_against_those_alone() -> None:
    # decode holding a prompt's first blocks pulls (and checks) only the rest
    prefill, decode = synthetic(), synthetic()
    pulling = TcpKvTransport()
    async with running_pair(TcpKvTransport(), pulling, prefill, decode) as pair:
        handle, data = await leased_request(pair.prefill, "r", 20, pair.endpoint, digest=FULL)
        tail = msgspec.structs.replace(handle, block_ids=handle.block_ids[2:])
        dest = decode.allocate_blocks("r", 20)[2:]
        digests = await pulling.pull(tail, decode, dest)
        assert digests is not None and len(digests.digests) == len(dest)
        assert await mismatched_blocks(decode, dest, digests) == []
        nbytes = handle.layout.block_nbytes
        assert await decode.read_blocks(dest) == data[2 * nbytes :]
