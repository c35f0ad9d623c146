"""A prefill's blocks for transport tests: a synthetic engine, its leases, and random bytes."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio

from pdtrio.config import SyntheticEngineConfig
from pdtrio.engine.synthetic import SyntheticEngine
from pdtrio.kv.api import KvTransport
from pdtrio.kv.digest import SAMPLED, Coverage, record_written
from pdtrio.protocol.link.wire import KvHandle
from pdtrio.security import new_access_token
from pdtrio.testing.kv_blocks import LeasedBlocks

LOOPBACK = "127.0.0.1"


def synthetic(
    *, num_blocks: int = 64, block_size: int = 4, vocab_size: int = 1000
) -> SyntheticEngine:
    return SyntheticEngine(
        SyntheticEngineConfig(vocab_size=vocab_size), num_blocks=num_blocks, block_size=block_size
    )


def fragment(engine: SyntheticEngine, holes: int) -> None:
    """Leave ``holes`` one-block holes in the free list, so a request's blocks are not contiguous."""
    for index in range(2 * holes):
        engine.allocate_blocks(f"filler-{index}", 1)
    for index in range(0, 2 * holes, 2):
        engine.free_request(f"filler-{index}")


async def leased_request(
    source: LeasedBlocks,
    request_id: str,
    num_tokens: int,
    endpoint: tuple[str, int],
    *,
    lease_s: float = 30.0,
    seed: int = 0,
    digest: Coverage | None = SAMPLED,
) -> tuple[KvHandle, bytes]:
    """Blocks for ``request_id`` filled with random bytes, leased (with what was written in
    them, as prefill records it, unless ``digest`` is None), and the handle naming them."""
    engine = source.engine
    block_ids = engine.allocate_blocks(request_id, num_tokens)
    data = random.Random(seed).randbytes(len(block_ids) * engine.layout.block_nbytes)
    await engine.write_blocks(block_ids, data)
    written = None
    if digest is not None:
        generations = engine.block_generations(block_ids)
        written = await record_written(engine, block_ids, generations, digest)
    access_token = new_access_token()
    source.leases.hold(
        request_id, block_ids, trio.current_time() + lease_s, access_token, written=written
    )
    handle = KvHandle(
        request_id=request_id,
        instance_id="prefill-0",
        transfer_host=endpoint[0],
        transfer_port=endpoint[1],
        block_ids=block_ids,
        num_tokens=num_tokens,
        layout=engine.layout,
        lease_ttl_s=lease_s,
        access_token=access_token,
    )
    return handle, data


@attrs.define
class Pair:
    prefill: LeasedBlocks
    decode: SyntheticEngine
    endpoint: tuple[str, int]


@asynccontextmanager
async def running_pair(
    prefill_transport: KvTransport,
    decode_transport: KvTransport,
    prefill: SyntheticEngine,
    decode: SyntheticEngine,
) -> AsyncIterator[Pair]:
    """Both transports running in this process, prefill's serving its KV port."""
    source = LeasedBlocks(prefill)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(source.leases.run_expiry)
        endpoint = await nursery.start(prefill_transport.run, source, LOOPBACK, 0)
        assert endpoint is not None
        assert await nursery.start(decode_transport.run, None, LOOPBACK, 0) is None
        yield Pair(source, decode, endpoint)
        nursery.cancel_scope.cancel()
