"""``python -m benchmarks.kv_transfer [--quick] [--json PATH]``: what a KV handoff costs.

1. Bandwidth, for 1, 16, 64 and 256 MiB of blocks: a NIXL pull (grant, READ,
   release notification) and a TCP pull from a prefill process into this one,
   a plain copy inside one process (the ceiling), and the kernel's copy from
   prefill's memory into this process (``process_vm_readv``: what UCX's ``cma``
   transport, NIXL's path between processes on one host, does under a READ),
   all in one run.  Every pull's bytes are checked against what prefill holds.
   The goal, READ >= 70% of the in-process copy from 16 MiB up, is judged per
   size under the table, against the kernel's copy as READ's floor: past some
   size glibc's memcpy switches to non-temporal stores (here between 64 and
   256 MiB; ``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold`` moves it)
   and the in-process copy speeds up by half, which the kernel's copy, and so
   a READ, does not.
2. The handoff at ISL 1024 on ``tiny-random``: ``pdtrio worker`` processes
   behind a ``hypercorn -k trio`` router, prefill+decode over NIXL, over TCP,
   and one colocated ``both`` worker.  The first token comes from prefill, so
   the handoff shows in the second token: the table gives TTFT, the time to
   the second token, what the handoff adds to it against colocated, and the
   decode's own mean pull time (``/pd/info``).
3. The CPU an idle worker uses, over a few seconds of /proc/PID/stat.
4. The verified handoff's cost at SmolLM2's sizes (``benchmarks.kv_digest``, also run on
   its own): prefill's record of what it wrote, the pull and decode's check, over NIXL and
   TCP, ``kv_digest`` off, sampled and full in the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import trio

from benchmarks import kv_digest
from benchmarks.kit import aligned_table, percentile, stream_completion, write_json
from pdtrio.config import SyntheticEngineConfig
from pdtrio.engine.api import NoRoom
from pdtrio.engine.synthetic import SyntheticEngine
from pdtrio.kv.api import KvTransport
from pdtrio.kv.nixl import NixlKvTransport
from pdtrio.kv.tcp import TcpKvTransport
from pdtrio.protocol.link.wire import KvHandle
from pdtrio.security import new_access_token
from pdtrio.testing import Processes, Service, cpu_seconds, write_router_config
from pdtrio.testing.kv_blocks import LeasedBlocks

LOOPBACK = "127.0.0.1"
MIB = 1 << 20
SIZES_MIB = (1, 16, 64, 256)
BLOCK_SIZE = 16384  # tokens: a synthetic block is 4 bytes a token, 64 KiB
NUM_BLOCKS = 256 * MIB // (4 * BLOCK_SIZE) + 64
SEED = 20260101
READY = b"KV_PREFILL_READY "
HANDLE = b"KV_HANDLE "
REPO = Path(__file__).resolve().parents[1]
ISL = 1024


def pattern(nbytes: int) -> np.ndarray[Any, Any]:
    """The bytes prefill's whole cache holds: random, the same in both processes."""
    return np.random.default_rng(SEED).integers(0, 256, nbytes, dtype=np.uint8)


def engine() -> SyntheticEngine:
    return SyntheticEngine(SyntheticEngineConfig(), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)


# --- the prefill process ------------------------------------------------------------


async def allocate(prefill: SyntheticEngine, request_id: str, blocks: int) -> tuple[int, ...]:
    """Blocks for a new lease, once the last pull's release has freed room for them."""
    while True:
        try:
            return prefill.allocate_blocks(request_id, blocks * BLOCK_SIZE)
        except NoRoom:
            await trio.sleep(0.001)


async def serve_prefill() -> None:
    """Hold the pattern, serve it over NIXL and TCP.  On stdin, ``lease ID BLOCKS`` leases
    blocks (and prints their handle's fields, grant included); ``release ID`` frees them,
    as the router's release does once decode has them (a pull alone frees nothing)."""
    prefill = engine()
    await prefill.write_blocks(
        tuple(range(NUM_BLOCKS)), pattern(NUM_BLOCKS * 4 * BLOCK_SIZE).tobytes()
    )
    source = LeasedBlocks(prefill, digests=False)
    transport = NixlKvTransport(prefill, required=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(source.leases.run_expiry)
        endpoint = await nursery.start(transport.run, source, LOOPBACK, 0)
        ready = {"port": endpoint[1], "kv_address": prefill.kv_region().address}
        print(READY.decode() + json.dumps(ready), flush=True)
        stdin = trio.lowlevel.FdStream(os.dup(0))
        buffer = b""
        async with stdin:
            while chunk := await stdin.receive_some(4096):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    command, request_id, *blocks = line.decode().split()
                    if command == "release":
                        source.release(request_id)
                        continue
                    block_ids = await allocate(prefill, request_id, int(blocks[0]))
                    grant = new_access_token()
                    source.leases.hold(request_id, block_ids, trio.current_time() + 60, grant)
                    reply = {
                        "block_ids": block_ids,
                        "lease_ttl_s": 60.0,
                        "access_token": grant,
                    }
                    print(HANDLE.decode() + json.dumps(reply), flush=True)
        nursery.cancel_scope.cancel()


# --- bandwidth --------------------------------------------------------------------------


async def bandwidth(procs: Processes, reps: int) -> list[dict[str, Any]]:
    process = procs.start(
        [sys.executable, "-m", "benchmarks.kv_transfer", "--serve-prefill"],
        env={"PYTHONPATH": str(REPO)},
        stdin=True,
        output="lines",
    )
    ready = json.loads(await trio.to_thread.run_sync(procs.read_line, process, READY, 120))
    port = ready["port"]
    expected = pattern(NUM_BLOCKS * 4 * BLOCK_SIZE)
    decode = engine()
    layout = decode.layout
    block_nbytes = layout.block_nbytes
    leases = 0

    def tell(line: str) -> None:
        assert process.stdin is not None
        process.stdin.write(f"{line}\n".encode())
        process.stdin.flush()

    async def lease(blocks: int) -> KvHandle:
        nonlocal leases
        leases += 1
        tell(f"lease r{leases} {blocks}")
        line = await trio.to_thread.run_sync(procs.read_line, process, HANDLE, 60)
        reply = json.loads(line)
        ids = tuple(reply["block_ids"])
        return KvHandle(
            f"r{leases}", "prefill", LOOPBACK, port, ids, len(ids) * BLOCK_SIZE, layout,
            reply["lease_ttl_s"], reply["access_token"],
        )  # fmt: skip

    async def pull_seconds(transport: KvTransport, blocks: int) -> tuple[float, float]:
        """Seconds of the whole pull, and of NIXL's READ in it (0 for TCP)."""
        handle = await lease(blocks)
        dest = decode.allocate_blocks(handle.request_id, handle.num_tokens)
        read_before = nixl.read_seconds
        started = time.perf_counter()
        await transport.pull(handle, decode, dest)
        seconds = time.perf_counter() - started
        received = np.frombuffer(await decode.read_blocks(dest), dtype=np.uint8)
        sent = np.concatenate(
            [expected[b * block_nbytes : (b + 1) * block_nbytes] for b in handle.block_ids]
        )
        assert np.array_equal(received, sent), "the bytes that arrived are not prefill's"
        decode.free_request(handle.request_id)
        tell(f"release {handle.request_id}")  # before the next lease: its room is this one's
        return seconds, nixl.read_seconds - read_before

    rows = []
    nixl = NixlKvTransport(decode, required=True)
    tcp = TcpKvTransport()
    async with trio.open_nursery() as nursery:
        await nursery.start(nixl.run, None, LOOPBACK, 0)
        await pull_seconds(nixl, 1)  # meets prefill: the session and its metadata
        for size in SIZES_MIB:
            blocks = size * MIB // block_nbytes
            nbytes = blocks * block_nbytes
            times: dict[str, list[float]] = {"nixl_pull": [], "nixl_read": [], "tcp_pull": []}
            for _ in range(reps):
                pull, read = await pull_seconds(nixl, blocks)
                times["nixl_pull"].append(pull)
                times["nixl_read"].append(read)
                times["tcp_pull"].append((await pull_seconds(tcp, blocks))[0])
            times["copy_cold"], times["copy_hot"] = copy_seconds(nbytes, reps)
            times["kernel_copy"] = kernel_copy_seconds(
                process.pid, ready["kv_address"], decode, nbytes, reps, expected
            )
            row: dict[str, Any] = {"size_mib": size, "blocks": blocks}
            for name, samples in times.items():
                row[f"{name}_gbps"] = nbytes / percentile(samples, 50) / 1e9
            row["read_vs_copy"] = row["nixl_read_gbps"] / row["copy_cold_gbps"]
            row["pull_vs_copy"] = row["nixl_pull_gbps"] / row["copy_cold_gbps"]
            row["kernel_vs_copy"] = row["kernel_copy_gbps"] / row["copy_cold_gbps"]
            row["read_vs_kernel"] = row["nixl_read_gbps"] / row["kernel_copy_gbps"]
            rows.append(row)
        nursery.cancel_scope.cancel()
    return rows


def copy_seconds(nbytes: int, reps: int) -> tuple[list[float], list[float]]:
    """Copies inside this process (the ceiling): cold, from and to parts of two cache-sized-
    dwarfing buffers the last copy did not touch (as a pull's blocks are); and hot, the same
    bytes again and again (what the CPU's caches add, for reference)."""
    span = NUM_BLOCKS * 4 * BLOCK_SIZE
    source = pattern(span)
    target = np.ones(span, dtype=np.uint8)
    cold, hot = [], []
    offset = 0
    for _ in range(reps):
        offset = (offset + nbytes + 7 * MIB) % (span - nbytes)
        into = (offset + span // 2) % (span - nbytes)
        started = time.perf_counter()
        np.copyto(target[into : into + nbytes], source[offset : offset + nbytes])
        cold.append(time.perf_counter() - started)
        assert np.array_equal(target[into : into + nbytes], source[offset : offset + nbytes])
    for _ in range(reps):
        started = time.perf_counter()
        np.copyto(target[:nbytes], source[:nbytes])
        hot.append(time.perf_counter() - started)
    return cold, hot


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def kernel_copy_seconds(
    pid: int,
    remote_address: int,
    decode: SyntheticEngine,
    nbytes: int,
    reps: int,
    expected: np.ndarray[Any, Any],
) -> list[float]:
    """The kernel's copy from prefill's cache into decode's, one ``process_vm_readv`` a rep:
    UCX's cma transport moves a READ's bytes this way, so NIXL READ between processes on
    one host cannot beat it.  Cold parts of both caches, as in ``copy_seconds``."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    libc.process_vm_readv.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    local_address = decode.kv_region().address
    span = NUM_BLOCKS * 4 * BLOCK_SIZE
    seconds = []
    offset = 0
    for _ in range(reps):
        offset = (offset + nbytes + 7 * MIB) % (span - nbytes)
        into = (offset + span // 2) % (span - nbytes)
        local = _IoVec(local_address + into, nbytes)
        remote = _IoVec(remote_address + offset, nbytes)
        started = time.perf_counter()
        moved = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        seconds.append(time.perf_counter() - started)
        if moved != nbytes:
            raise OSError(ctypes.get_errno(), f"process_vm_readv moved {moved} of {nbytes} bytes")
        arrived = np.ctypeslib.as_array(
            (ctypes.c_uint8 * nbytes).from_address(local_address + into)
        )
        assert np.array_equal(arrived, expected[offset : offset + nbytes]), "not prefill's bytes"
    return seconds


# --- the handoff at ISL 1024 ----------------------------------------------------------------


def tiny_worker(role: str, kv_transport: str) -> dict[str, Any]:
    engine_config = {"kind": "torch", "model": "tiny-random", "dtype": "float32"}
    return {"role": role, "kv_transport": kv_transport, "engine": engine_config}


async def first_two_tokens(http: httpx.AsyncClient, prompt: list[int]) -> tuple[float, float]:
    """Seconds to the first and to the second token of one streamed completion."""
    body = {
        "model": "tiny-random",
        "prompt": prompt,
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    answer = await stream_completion(http, body)
    assert answer.status == 200, answer.body
    assert len(answer.arrivals) >= 2, answer.arrivals
    return answer.arrivals[0] - answer.started, answer.arrivals[1] - answer.started


async def handoff(
    procs: Processes, label: str, roles: tuple[str, ...], kv_transport: str, requests: int
) -> tuple[dict[str, Any], list[Service]]:
    started = [procs.start_worker(tiny_worker(role, kv_transport)) for role in roles]
    workers = [await trio.to_thread.run_sync(procs.wait_ready, p) for p in started]
    config = write_router_config(
        Path(tempfile.mkdtemp()) / f"{label}.toml",
        [(w.ready["role"], w.url) for w in workers],
    )
    router = await trio.to_thread.run_sync(procs.router, config)
    prompt = [(7 + 31 * i) % 200 + 10 for i in range(ISL)]
    first: list[float] = []
    second: list[float] = []
    async with httpx.AsyncClient(base_url=router.url, timeout=60) as http:
        for index in range(requests + 2):
            ttft, tt2t = await first_two_tokens(http, [index % 50 + 10, *prompt[1:]])
            if index >= 2:  # two to warm up
                first.append(ttft)
                second.append(tt2t)
        row: dict[str, Any] = {
            "setup": label,
            "ttft_ms": 1e3 * percentile(first, 50),
            "second_token_ms": 1e3 * percentile(second, 50),
        }
        decode = [w for w in workers if w.ready["role"] in ("decode", "both")][0]
        info = (await http.get(f"{decode.url}/pd/info")).json()["kv_transport"]
    pulls = sum(info["pulls"].values())
    row["pull_ms"] = 1e3 * sum(info["pull_seconds"].values()) / pulls if pulls else 0.0
    row["pulled_over"] = ",".join(name for name, count in info["pulls"].items() if count)
    return row, workers


def idle_cpu_percent(services: list[Service], seconds: float) -> list[float]:
    """Each process's CPU over ``seconds`` of doing nothing, in % of one core."""
    before = [cpu_seconds([s.pid]) for s in services]
    time.sleep(seconds)
    after = [cpu_seconds([s.pid]) for s in services]
    return [100 * (b - a) / seconds for a, b in zip(before, after, strict=True)]


async def run(quick: bool) -> dict[str, Any]:
    reps, requests, idle_s = (2, 5, 3.0) if quick else (5, 20, 5.0)
    result: dict[str, Any] = {}
    with Processes(stop_grace_s=10) as procs:
        result["bandwidth"] = await bandwidth(procs, reps)
    rows = []
    idle: dict[str, float] = {}
    for label, roles, kv_transport in (
        ("nixl", ("prefill", "decode"), "nixl"),
        ("tcp", ("prefill", "decode"), "tcp"),
        ("colocated", ("both",), "tcp"),
    ):
        with Processes(stop_grace_s=10) as procs:
            row, workers = await handoff(procs, label, roles, kv_transport, requests)
            rows.append(row)
            if label != "colocated":
                await trio.sleep(1.0)  # what the requests left behind settles
                usage = await trio.to_thread.run_sync(idle_cpu_percent, workers, idle_s)
                for worker, percent in zip(workers, usage, strict=True):
                    idle[f"{label} {worker.ready['role']}"] = percent
    colocated = rows[-1]["second_token_ms"]
    for row in rows:
        row["handoff_adds_ms"] = row["second_token_ms"] - colocated
    result["handoff"] = rows
    result["idle_cpu_percent"] = idle
    return result


READ_GOAL = 0.70  # of the in-process copy, from 16 MiB up


def read_goal(bandwidth: list[dict[str, Any]]) -> list[str]:
    """The goal per size, and where it sits below the kernel's own copy (READ's floor)."""
    lines = []
    for row in bandwidth:
        if row["size_mib"] < 16:
            continue
        size, ratio, floor = row["size_mib"], row["read_vs_copy"], row["kernel_vs_copy"]
        verdict = "PASS" if ratio >= READ_GOAL else "FAIL"
        line = f"{size} MiB: READ {ratio:.0%} of the copy (goal ≥ {READ_GOAL:.0%}): {verdict}"
        if verdict == "FAIL" and floor < READ_GOAL:
            line += (
                f"; below the floor: the kernel's copy, which READ runs on, is itself"
                f" {floor:.0%} of the copy, and READ is {row['read_vs_kernel']:.0%} of it"
            )
        lines.append(line)
    return lines


def print_tables(result: dict[str, Any]) -> None:
    print("KV pull bandwidth, GB/s (median; every pull's bytes verified)")
    header = [
        "size",
        "blocks",
        "NIXL READ",
        "NIXL pull",
        "TCP pull",
        "copy cold",
        "copy hot",
        "kernel copy",
        "READ/copy",
        "pull/copy",
        "kernel/copy",
        "READ/kernel",
    ]
    rows = [
        [
            f"{row['size_mib']} MiB",
            str(row["blocks"]),
            f"{row['nixl_read_gbps']:.2f}",
            f"{row['nixl_pull_gbps']:.2f}",
            f"{row['tcp_pull_gbps']:.2f}",
            f"{row['copy_cold_gbps']:.2f}",
            f"{row['copy_hot_gbps']:.2f}",
            f"{row['kernel_copy_gbps']:.2f}",
            f"{row['read_vs_copy']:.0%}",
            f"{row['pull_vs_copy']:.0%}",
            f"{row['kernel_vs_copy']:.0%}",
            f"{row['read_vs_kernel']:.0%}",
        ]
        for row in result["bandwidth"]
    ]
    print(aligned_table(header, rows, align="r" * len(header)))
    print(
        "  (READ: the NIXL transfer alone; pull: grant, READ and bookkeeping, as decode waits"
        " for it; copy: the cold in-process copy; kernel: process_vm_readv from prefill's"
        " cache, what UCX's cma transport does under a READ)"
    )
    for line in read_goal(result["bandwidth"]):
        print(f"  {line}")
    print()
    print(f"The handoff at ISL {ISL}, tiny-random (p50)")
    header = ["setup", "TTFT ms", "2nd token ms", "handoff adds ms", "decode pull ms"]
    rows = [
        [
            row["setup"],
            f"{row['ttft_ms']:.2f}",
            f"{row['second_token_ms']:.2f}",
            f"{row['handoff_adds_ms']:.2f}",
            f"{row['pull_ms']:.3f}",
        ]
        for row in result["handoff"]
    ]
    print(aligned_table(header, rows, align="r" * len(header)))
    print()
    print("Idle worker CPU, % of one core")
    rows = [[name, f"{percent:.2f}"] for name, percent in result["idle_cpu_percent"].items()]
    print(aligned_table(["worker", "%"], rows, align="rr"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and requests")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--serve-prefill", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_prefill:
        try:
            trio.run(serve_prefill)
        except* KeyboardInterrupt:
            pass  # the harness's SIGINT, as stdin's closing already stops it: a clean stop
        return
    result = trio.run(run, args.quick)
    print_tables(result)
    result["kv_digest"] = trio.run(kv_digest.run, args.quick)
    print()
    kv_digest.print_tables(result["kv_digest"])
    write_json(args.json, result)


if __name__ == "__main__":
    main()
