"""``python -m benchmarks.kv_digest [--quick] [--json PATH]``: what the verified handoff costs.

A KV handoff at SmolLM2-135M's sizes (30 layers, 3 KV heads of 64, blocks of 16
tokens: 720 KiB a block in float32, 360 KiB in bfloat16), ISL 256 and 1024 (16 and
64 blocks), from a prefill process into this one, over NIXL and over TCP, with each
``kv_digest`` coverage in the same run, interleaved: ``off`` (no record, no check),
``sampled``, ``full``, and a sample of a quarter as many lines (``lines:16``, for
comparison: no setting asks for it).  A handoff is what the check adds to and sits in: prefill's
record of what it wrote (generations and digests, before it answers: timed in the
prefill process), the pull, and decode's check of the pulled blocks, each through the
worker's own functions (``pdtrio.kv.digest``).  The table gives each part's median,
the digest's share of the handoff, the handoff against the same one unchecked, and
the CPU the record and the check take.  Every checked pull must pass its check.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Final

import numpy as np
import trio

from benchmarks.kit import aligned_table, percentile, write_json
from pdtrio.config import KvDigestCoverage, SyntheticEngineConfig
from pdtrio.engine.api import NoRoom
from pdtrio.engine.synthetic import SyntheticEngine
from pdtrio.kv.api import KvTransport
from pdtrio.kv.digest import Coverage, coverage_for, mismatched_blocks, record_written
from pdtrio.kv.nixl import NixlKvTransport
from pdtrio.kv.tcp import TcpKvTransport
from pdtrio.protocol.link.wire import KvHandle
from pdtrio.security import new_access_token
from pdtrio.testing import Processes
from pdtrio.testing.kv_blocks import LeasedBlocks

LOOPBACK = "127.0.0.1"
REPO = Path(__file__).resolve().parents[1]
READY = b"KV_DIGEST_PREFILL_READY "
HANDLE = b"KV_DIGEST_HANDLE "
SEED = 20261207
# SmolLM2-135M: bytes of K and V of one token, every layer, in float32
SMOLLM2_TOKEN_BYTES_F32: Final = 30 * 2 * 3 * 64 * 4
SMOLLM2_BLOCK_TOKENS: Final = 16
DTYPE_BYTES: Final = {"float32": 4, "bfloat16": 2}
ISLS: Final = (256, 1024)
# the settings, and a smaller sample beside them
COVERAGES: Final = ("off", "sampled", "full", "lines:16")
GOAL_SHARE: Final = 0.05  # the full check's share of a handoff above which sampling is the default


def block_nbytes(dtype: str) -> int:
    return SMOLLM2_TOKEN_BYTES_F32 * SMOLLM2_BLOCK_TOKENS * DTYPE_BYTES[dtype] // 4


def engine(nbytes: int, num_blocks: int) -> SyntheticEngine:
    """A synthetic engine whose blocks are ``nbytes`` long (it keeps 4 bytes a token)."""
    return SyntheticEngine(SyntheticEngineConfig(), num_blocks=num_blocks, block_size=nbytes // 4)


def num_blocks() -> int:
    # the longest prompt's blocks, twice (a lease and the next), and a few spare
    return 2 * max(ISLS) // SMOLLM2_BLOCK_TOKENS + 8


# --- the prefill process ------------------------------------------------------------------


async def serve_prefill(nbytes: int) -> None:
    """Blocks of ``nbytes`` holding random bytes, served over NIXL and TCP.  On stdin,
    ``lease ID BLOCKS COVERAGE`` leases blocks with prefill's record of them (timed) and
    prints the handle's fields; ``release ID`` frees them, as the router's release does."""
    blocks = num_blocks()
    prefill = engine(nbytes, blocks)
    pattern = np.random.default_rng(SEED).integers(0, 256, blocks * nbytes, dtype=np.uint8)
    await prefill.write_blocks(tuple(range(blocks)), pattern.tobytes())
    source = LeasedBlocks(prefill)
    transport = NixlKvTransport(prefill, required=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(source.leases.run_expiry)
        endpoint = await nursery.start(transport.run, source, LOOPBACK, 0)
        print(READY.decode() + json.dumps({"port": endpoint[1]}), flush=True)
        stdin = trio.lowlevel.FdStream(os.dup(0))
        buffer = b""
        async with stdin:
            while chunk := await stdin.receive_some(4096):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    command, request_id, *rest = line.decode().split()
                    if command == "release":
                        source.release(request_id)
                        continue
                    count, setting = int(rest[0]), rest[1]
                    reply = await lease(source, request_id, count, setting)
                    print(HANDLE.decode() + json.dumps(reply), flush=True)
        nursery.cancel_scope.cancel()


def coverage_named(setting: str) -> Coverage | None:
    """A ``kv_digest`` setting's coverage, or ``lines:N``: a sample of N lines."""
    if setting.startswith("lines:"):
        return Coverage(int(setting.removeprefix("lines:")))
    settings: dict[str, KvDigestCoverage] = {"off": "off", "sampled": "sampled", "full": "full"}
    return coverage_for(settings[setting])


async def lease(source: LeasedBlocks, request_id: str, count: int, setting: str) -> dict[str, Any]:
    prefill = source.engine
    while True:
        try:
            block_ids = prefill.allocate_blocks(request_id, count * prefill.layout.block_size)
            break
        except NoRoom:  # the last lease's release is on its way
            await trio.sleep(0.001)
    coverage = coverage_named(setting)
    written = None
    cpu_before, started = time.process_time(), time.perf_counter()
    if coverage is not None:
        generations = prefill.block_generations(block_ids)
        written = await record_written(prefill, block_ids, generations, coverage)
    record_s, record_cpu_s = time.perf_counter() - started, time.process_time() - cpu_before
    grant = new_access_token()
    source.leases.hold(request_id, block_ids, trio.current_time() + 60, grant, written=written)
    return {
        "block_ids": block_ids,
        "access_token": grant,
        "record_s": record_s,
        "record_cpu_s": record_cpu_s,
    }


# --- the decode side ------------------------------------------------------------------------


async def handoffs(procs: Processes, dtype: str, reps: int) -> list[dict[str, Any]]:
    nbytes = block_nbytes(dtype)
    process = procs.start(
        [sys.executable, "-m", "benchmarks.kv_digest", "--serve-prefill", str(nbytes)],
        env={"PYTHONPATH": str(REPO)},
        stdin=True,
        output="lines",
    )
    ready = json.loads(await trio.to_thread.run_sync(procs.read_line, process, READY, 120))
    port = ready["port"]
    decode = engine(nbytes, num_blocks())
    layout = decode.layout
    leases = 0

    def tell(line: str) -> None:
        assert process.stdin is not None
        process.stdin.write(f"{line}\n".encode())
        process.stdin.flush()

    async def one(transport: KvTransport, blocks: int, setting: str) -> dict[str, float]:
        nonlocal leases
        leases += 1
        request_id = f"r{leases}"
        tell(f"lease {request_id} {blocks} {setting}")
        reply = json.loads(await trio.to_thread.run_sync(procs.read_line, process, HANDLE, 60))
        ids = tuple(reply["block_ids"])
        handle = KvHandle(
            request_id, "prefill", LOOPBACK, port, ids, len(ids) * layout.block_size, layout,
            60.0, reply["access_token"],
        )  # fmt: skip
        dest = decode.allocate_blocks(request_id, handle.num_tokens)
        started = time.perf_counter()
        digests = await transport.pull(handle, decode, dest)
        pull_s = time.perf_counter() - started
        cpu_before, started = time.process_time(), time.perf_counter()
        if digests is not None:
            assert await mismatched_blocks(decode, dest, digests) == [], "a clean pull failed"
        check_s, check_cpu_s = time.perf_counter() - started, time.process_time() - cpu_before
        assert (digests is None) == (setting == "off"), (setting, digests)
        decode.free_request(request_id)
        tell(f"release {request_id}")
        return {
            "record_s": reply["record_s"],
            "record_cpu_s": reply["record_cpu_s"],
            "pull_s": pull_s,
            "check_s": check_s,
            "check_cpu_s": check_cpu_s,
        }

    rows = []
    nixl = NixlKvTransport(decode, required=True)
    tcp = TcpKvTransport()
    async with trio.open_nursery() as nursery:
        await nursery.start(nixl.run, None, LOOPBACK, 0)
        await one(nixl, 1, "off")  # meets prefill: the session and its metadata
        for isl in ISLS:
            blocks = isl // SMOLLM2_BLOCK_TOKENS
            for name, transport in (("nixl", nixl), ("tcp", tcp)):
                samples: dict[str, list[dict[str, float]]] = {c: [] for c in COVERAGES}
                await one(transport, blocks, "full")  # warm: pages touched, threads made
                for _ in range(reps):
                    for setting in COVERAGES:  # interleaved: the machine's drift hits all alike
                        samples[setting].append(await one(transport, blocks, setting))
                rows += summarize(dtype, isl, blocks, nbytes, name, samples)
        nursery.cancel_scope.cancel()
    return rows


def summarize(
    dtype: str,
    isl: int,
    blocks: int,
    nbytes: int,
    transport: str,
    samples: dict[str, list[dict[str, float]]],
) -> list[dict[str, Any]]:
    def median(setting: str, key: str) -> float:
        return percentile([sample[key] for sample in samples[setting]], 50)

    def handoff(sample: dict[str, float]) -> float:
        return sample["record_s"] + sample["pull_s"] + sample["check_s"]

    unchecked = percentile([handoff(s) for s in samples["off"]], 50)
    rows = []
    for setting in COVERAGES:
        total = percentile([handoff(s) for s in samples[setting]], 50)
        digest = median(setting, "record_s") + median(setting, "check_s")
        rows.append(
            {
                "dtype": dtype,
                "isl": isl,
                "blocks": blocks,
                "mib": blocks * nbytes / (1 << 20),
                "transport": transport,
                "kv_digest": setting,
                "record_ms": 1e3 * median(setting, "record_s"),
                "pull_ms": 1e3 * median(setting, "pull_s"),
                "check_ms": 1e3 * median(setting, "check_s"),
                "handoff_ms": 1e3 * total,
                "digest_share": digest / total if total else 0.0,
                "vs_unchecked": total / unchecked - 1 if unchecked else 0.0,
                "cpu_ms": 1e3 * (median(setting, "record_cpu_s") + median(setting, "check_cpu_s")),
            }
        )
    return rows


async def run(quick: bool) -> dict[str, Any]:
    reps = 2 if quick else 7
    dtypes = ("float32",) if quick else ("float32", "bfloat16")
    rows: list[dict[str, Any]] = []
    for dtype in dtypes:
        with Processes(stop_grace_s=10) as procs:
            rows += await handoffs(procs, dtype, reps)
    full = [row["digest_share"] for row in rows if row["kv_digest"] == "full"]
    sampled = [row["digest_share"] for row in rows if row["kv_digest"] == "sampled"]
    return {
        "benchmark": "kv_digest",
        "quick": quick,
        "reps": reps,
        "handoffs": rows,
        "full_share_max": max(full),
        "sampled_share_max": max(sampled),
        "sampling_needed": max(full) > GOAL_SHARE,
    }


def print_tables(result: dict[str, Any]) -> None:
    print(
        f"A KV handoff at SmolLM2-135M's sizes, with and without the check (median of "
        f"{result['reps']}; every check passed)"
    )
    header = [
        "dtype",
        "ISL",
        "MiB",
        "transport",
        "kv_digest",
        "record ms",
        "pull ms",
        "check ms",
        "handoff ms",
        "digest share",
        "vs unchecked",
        "CPU ms",
    ]
    rows = [
        [
            row["dtype"],
            str(row["isl"]),
            f"{row['mib']:.1f}",
            row["transport"],
            row["kv_digest"],
            f"{row['record_ms']:.2f}",
            f"{row['pull_ms']:.2f}",
            f"{row['check_ms']:.2f}",
            f"{row['handoff_ms']:.2f}",
            f"{row['digest_share']:.1%}",
            f"{row['vs_unchecked']:+.1%}",
            f"{row['cpu_ms']:.2f}",
        ]
        for row in result["handoffs"]
    ]
    print(aligned_table(header, rows, align="lrrllrrrrrrr"))
    print(
        "  (record: prefill's generations and digests, before it answers; check: decode's,"
        " before it admits; handoff: record + pull + check; digest share: (record + check) /"
        " handoff; CPU: of the record and the check)"
    )
    verdict = "sampled" if result["sampling_needed"] else "full"
    print(
        f"  the full check's largest share: {result['full_share_max']:.1%} (goal ≤"
        f" {GOAL_SHARE:.0%}); the sample's: {result['sampled_share_max']:.1%}; the default"
        f" this run argues for: {verdict}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, float32 only")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--serve-prefill", type=int, metavar="BLOCK_NBYTES", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_prefill:
        try:
            trio.run(serve_prefill, args.serve_prefill)
        except* KeyboardInterrupt:
            pass  # the harness's SIGINT, as stdin's closing already stops it: a clean stop
        return
    result = trio.run(run, args.quick)
    print_tables(result)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
