"""The verified handoff: a digest of each KV block prefill wrote, checked by decode.

When prefill has written a request's KV (before it answers), it records each
block's generation (``Engine.block_generations``: it grows every time the block is
allocated) and a CRC-32 of its bytes (:class:`WrittenBlocks`, kept in the lease).
When it grants a read, it sends the record of the blocks asked for, with their
generations at that moment (``wire.KvDigests``, in the transfer's own answer, on the
TCP session and the NIXL session alike).  Decode, once the blocks are in its own
memory and before it admits the request, computes the same digests and compares
(:func:`mismatched_blocks`): a block whose bytes differ from what prefill wrote, or
that prefill freed and reused in between, fails the handoff (:class:`KvDigestMismatch`,
a :class:`KvTransferError`), so the request goes elsewhere rather than decode on
stale or damaged KV.  CRC-32 finds accidents (stale, reused, torn or flipped
bytes), not an attacker: the KV port's peers are authenticated already.

Coverage (the worker's ``kv_digest``): ``full`` digests every byte; ``sampled``
digests ``SAMPLE_LINES`` of each block's lines of ``LINE_BYTES`` bytes, spread evenly,
the first and the last included, which costs a small fixed amount per block whatever
its size.  A sample catches a block that holds other bytes than prefill's (another
request's KV, a block never written, a transfer that put blocks in the wrong place or
left some out) and, with the generations, a block reused since prefill wrote it; it
misses damage confined to the lines it does not read (a flipped bit there), which
``full`` catches.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Sequence
from typing import Any, Final, Protocol, final

import attrs
import numpy as np
import trio

from pdtrio.config import KvDigestCoverage
from pdtrio.engine.api import KvRegion
from pdtrio.kv.api import KvTransferError
from pdtrio.protocol.link.wire import KvDigests

# lines a sampled digest reads from each block, and their length (a cache line)
SAMPLE_LINES: Final = 64
LINE_BYTES: Final = 64
# full digests of more bytes than this are computed on a worker thread (zlib lets go
# of the GIL), so trio's thread never waits on them
INLINE_DIGEST_BYTES: Final = 1 << 20


class KvDigestMismatch(KvTransferError):
    """The pulled blocks are not what prefill wrote; ``blocks`` are their indexes in the pull."""

    def __init__(self, message: str, blocks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.blocks = blocks


class KvBlocks(Protocol):
    """An engine's KV blocks, as the digests read them."""

    def kv_region(self) -> KvRegion: ...

    async def read_blocks(self, block_ids: tuple[int, ...]) -> bytes: ...


@final
@attrs.frozen
class Coverage:
    """Which bytes of a block a digest reads: every one (``sample_lines`` 0), or
    ``sample_lines`` of its ``line_bytes``-long lines, spread evenly, first and last included."""

    sample_lines: int
    line_bytes: int = LINE_BYTES

    def lines(self, block_nbytes: int) -> np.ndarray[Any, Any] | None:
        """The indexes of the lines a digest of a block of ``block_nbytes`` reads, in order
        (line ``k`` is bytes ``k * line_bytes`` up to the next line); None: every byte (full
        coverage, or a block of no more lines than the sample)."""
        count, width = self.sample_lines, self.line_bytes
        whole_lines = block_nbytes // width
        if count <= 0 or count >= whole_lines:
            return None
        if count == 1:
            return np.zeros(1, dtype=np.int64)
        return np.arange(count, dtype=np.int64) * (whole_lines - 1) // (count - 1)

    def sample(self, block_nbytes: int) -> np.ndarray[Any, Any] | None:
        """The byte offsets a digest reads, in order; None: every byte."""
        lines = self.lines(block_nbytes)
        return None if lines is None else _line_bytes(lines, self.line_bytes)


def _line_bytes(lines: np.ndarray[Any, Any], width: int) -> np.ndarray[Any, Any]:
    """The offsets of every byte of these lines, in order."""
    return (lines[:, None] * width + np.arange(width, dtype=np.int64)).reshape(-1)


FULL: Final = Coverage(0)
SAMPLED: Final = Coverage(SAMPLE_LINES)


def coverage_for(setting: KvDigestCoverage) -> Coverage | None:
    """The coverage a ``kv_digest`` setting asks for; None: no digests at all."""
    return {"full": FULL, "sampled": SAMPLED, "off": None}[setting]


def _region_array(region: KvRegion) -> np.ndarray[Any, Any] | None:
    """The region's bytes as a (blocks, block bytes) array over its memory, no copy; None
    for memory this process cannot read directly (a GPU's)."""
    if region.device != "cpu" or region.nbytes <= 0:
        return None
    memory = (ctypes.c_uint8 * region.nbytes).from_address(region.address)
    return np.ctypeslib.as_array(memory).reshape(region.num_blocks, region.block_nbytes)


def _digest_rows(
    blocks: np.ndarray[Any, Any], rows: Sequence[int], coverage: Coverage
) -> tuple[int, ...]:
    block_nbytes = blocks.shape[1]
    lines = coverage.lines(block_nbytes)
    if lines is None:
        return tuple(zlib.crc32(blocks[row]) for row in rows)
    chosen = np.asarray(rows, dtype=np.int64)
    width = coverage.line_bytes
    if block_nbytes % width == 0:
        # whole lines gathered at once: a sample costs a copy of its lines, no more
        by_line = blocks.reshape(blocks.shape[0], block_nbytes // width, width)
        gathered = by_line[np.ix_(chosen, lines)].reshape(len(chosen), -1)
    else:
        gathered = blocks[np.ix_(chosen, _line_bytes(lines, width))]
    return tuple(zlib.crc32(row) for row in gathered)


async def block_digests(
    memory: KvBlocks, block_ids: tuple[int, ...], coverage: Coverage
) -> tuple[int, ...]:
    """The digest of each block, as it is in ``memory`` now."""
    if not block_ids:
        return ()
    region = memory.kv_region()
    blocks = _region_array(region)
    rows: Sequence[int] = block_ids
    if blocks is None:
        # (a GPU's memory: its blocks copied out first)
        data = await memory.read_blocks(block_ids)
        blocks = np.frombuffer(data, dtype=np.uint8).reshape(len(block_ids), region.block_nbytes)
        rows = range(len(block_ids))
    if coverage.sample(region.block_nbytes) is None and (
        len(block_ids) * region.block_nbytes > INLINE_DIGEST_BYTES
    ):
        return await trio.to_thread.run_sync(_digest_rows, blocks, rows, coverage)
    return _digest_rows(blocks, rows, coverage)


@final
@attrs.frozen
class WrittenBlocks:
    """What prefill wrote in a request's blocks: each one's generation and digest."""

    coverage: Coverage
    generations: dict[int, int]
    digests: dict[int, int]

    def for_grant(
        self, block_ids: tuple[int, ...], granted_generations: tuple[int, ...]
    ) -> KvDigests | None:
        """What a grant of ``block_ids`` (their generations now) tells decode; None for a
        block this record does not know (no check then: the lease decides the grant)."""
        if not all(block_id in self.digests for block_id in block_ids):
            return None
        return KvDigests(
            sample_lines=self.coverage.sample_lines,
            line_bytes=self.coverage.line_bytes,
            digests=tuple(self.digests[block_id] for block_id in block_ids),
            written_generations=tuple(self.generations[block_id] for block_id in block_ids),
            granted_generations=granted_generations,
        )


async def record_written(
    memory: KvBlocks,
    block_ids: tuple[int, ...],
    generations: tuple[int, ...],
    coverage: Coverage,
) -> WrittenBlocks:
    """The record of blocks just written (``generations`` read as they were)."""
    digests = await block_digests(memory, block_ids, coverage)
    return WrittenBlocks(
        coverage,
        dict(zip(block_ids, generations, strict=True)),
        dict(zip(block_ids, digests, strict=True)),
    )


@final
@attrs.frozen
class Mismatch:
    """A pulled block that is not what prefill wrote: its index in the pull and why."""

    index: int
    why: str


async def mismatched_blocks(
    memory: KvBlocks, block_ids: tuple[int, ...], expected: KvDigests
) -> list[Mismatch]:
    """The blocks of ``memory`` (just pulled, in the order asked) that are not what prefill
    wrote; KvTransferError when ``expected`` does not describe that many blocks."""
    count = len(block_ids)
    sizes = {
        len(expected.digests),
        len(expected.written_generations),
        len(expected.granted_generations),
    }
    if sizes != {count}:
        raise KvTransferError(
            f"prefill described {sorted(sizes)} blocks for a pull of {count}: not checkable"
        )
    if expected.sample_lines < 0 or expected.line_bytes <= 0:
        raise KvTransferError(
            f"prefill's digests cover {expected.sample_lines} lines of {expected.line_bytes} "
            "bytes: not checkable"
        )
    coverage = Coverage(expected.sample_lines, expected.line_bytes)
    found = await block_digests(memory, block_ids, coverage)
    mismatches = []
    for index in range(count):
        written = expected.written_generations[index]
        granted = expected.granted_generations[index]
        if written != granted:
            why = f"reused since prefill wrote it (generation {written}, then {granted})"
            mismatches.append(Mismatch(index, why))
        elif found[index] != expected.digests[index]:
            why = f"digest {found[index]:08x}, prefill wrote {expected.digests[index]:08x}"
            mismatches.append(Mismatch(index, why))
    return mismatches


@final
@attrs.define
class KvDigestCounts:
    """Decode's checks, for ``/metrics``: handoffs checked, and those that failed."""

    checked: int = 0
    mismatched: int = 0
