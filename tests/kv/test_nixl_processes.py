"""NIXL between processes: the bytes that arrive are the bytes prefill had, and a prefill
killed in the middle of a pull fails that start, nothing else."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from pdtrio.kv.nixl import NixlKvTransport
from pdtrio.kv.nixl_agent import coalesced_runs
from pdtrio.protocol.link.wire import KvHandle, RejectReason
from pdtrio.testing import Processes
from pdtrio.worker.admission import DecodeAdmission, Rejected
from pdtrio.worker.leases import KvLeases
from tests.cluster import wait_for_stats
from tests.kv.blocks import LOOPBACK, fragment, synthetic
from tests.kv.prefill_process import READY
from tests.kv.test_nixl_transport import start_for

pytest.importorskip("nixl")

REPO = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 1024  # a synthetic block is 4 bytes a token: 4 KiB
NUM_BLOCKS = 1024


@pytest.fixture
def procs() -> Iterator[Processes]:
    with Processes(stop_grace_s=10) as group:
        yield group


def start_prefill(procs: Processes, num_tokens: int, seed: int) -> tuple[Any, KvHandle]:
    config = {
        "num_blocks": NUM_BLOCKS,
        "block_size": BLOCK_SIZE,
        "holes": 5,
        "num_tokens": num_tokens,
        "seed": seed,
    }
    process = procs.start(
        [sys.executable, "-m", "tests.kv.prefill_process", json.dumps(config)],
        env={"PYTHONPATH": str(REPO)},
        stdin=True,
        output="lines",
    )
    ready = json.loads(procs.read_line(process, READY, timeout=60))
    layout = synthetic(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE).layout
    handle = KvHandle(
        "r",
        "prefill-0",
        LOOPBACK,
        ready["port"],
        tuple(ready["handle"]),
        num_tokens,
        layout,
        ready["lease_ttl_s"],  # (a TTL: counted from our receipt)
        ready["access_token"],
    )
    return process, handle


async def test_bytes_read_from_another_process_are_the_bytes_it_holds(procs: Processes) -> None:
    num_tokens = 300 * BLOCK_SIZE  # 300 blocks, 1.2 MiB
    process, handle = start_prefill(procs, num_tokens, seed=42)
    decode = synthetic(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    fragment(decode, holes=7)
    transport = NixlKvTransport(decode, required=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(transport.run, None, LOOPBACK, 0)
        dest = decode.allocate_blocks("r", num_tokens)
        assert len(coalesced_runs(handle.block_ids, dest)) > 1
        await transport.pull(handle, decode, dest)
        expected = random.Random(42).randbytes(len(dest) * decode.layout.block_nbytes)
        assert await decode.read_blocks(dest) == expected
        # (prefill keeps the blocks leased until the router releases them: not here)
        assert transport.info()["pulls"] == {"nixl": 1, "tcp": 0}
        nursery.cancel_scope.cancel()


async def test_a_prefill_killed_midway_fails_the_start_and_decode_frees_its_blocks(
    procs: Processes,
) -> None:
    process, handle = start_prefill(procs, 64 * BLOCK_SIZE, seed=7)
    decode = synthetic(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    transport = NixlKvTransport(decode, required=True)
    read_granted = transport._read_granted

    async def killed_first(*args: Any) -> None:
        # the grant is in: prefill dies between it and the READ
        os.kill(process.pid, signal.SIGKILL)
        await trio.to_thread.run_sync(process.wait)
        await read_granted(*args)

    transport._read_granted = killed_first  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        await nursery.start(transport.run, None, LOOPBACK, 0)
        admission = DecodeAdmission(decode, KvLeases(decode.free_request), transport, "decode-0")
        decision = await admission.admit(start_for(handle))
        assert isinstance(decision, Rejected)
        assert decision.reason == RejectReason.TRANSFER_FAILED
        assert "NIXL read" in decision.message, decision.message
        assert decode.statistics().kv_blocks_in_use == 0
        # the session's end drops the peer and its metadata
        await wait_for_stats(lambda: not transport.info()["peers"])
        nursery.cancel_scope.cancel()
