"""The token path: decode worker -> router -> SSE, measured three ways.

    python -m benchmarks.token_path [--quick] [--json PATH] [--only ingest,e2e,latency]
                                    [--profile DIR] [--e2e-step-ms 10] [--latency-rate 200]

1. **ingest** -- what one router core absorbs.  A producer process (pinned to
   the second core) serves a websocket on loopback and blasts pre-encoded
   msgpack token frames as fast as the socket takes them; the router process
   (pinned to the first core) runs the real ``DecodeLink`` against it, with
   one consumer per stream (64 streams) running the pipeline's own
   ``_stream_tokens`` loop (``StreamBuffer`` take, ``StreamShaper`` chunk) into
   a null ASGI send.  tokens/s and frames/s are normalised to one full core:
   tokens / router CPU seconds (``getrusage`` of the router process).  A frame
   of K tokens is K entries of one token each, for K distinct streams (the hard
   case: per-entry cost); one extra row sends one entry of 16 tokens.
   "tok/SSE chunk" shows how much the stream buffers merged per delivery.
   ``--profile DIR`` adds two runs under py-spy (raw folded stacks in DIR) and
   prints their top functions.
2. **e2e** -- real ``hypercorn -k trio pdtrio.app:app`` pinned to the first
   core, synthetic prefill and decode workers (one token per step, a step
   every ``--e2e-step-ms``), and 64 / 256 raw-socket SSE clients in one
   process (all of the load on the second core), each streaming 256-token
   completions back to back.  After a warm-up, over a fixed window: tokens/s
   delivered (counted in the bytes: a synthetic token's text is " t<id>"),
   router CPU per token (its process tree, from /proc), the decode worker's own
   CPU per token in the same window as a baseline, the load core's use, and
   the inter-token gap a client sees: the time between successive socket
   reads that carried at least one SSE event (per client p50/p99, then the
   median and the worst over clients).
3. **latency** -- light load: one stream at ``--latency-rate`` tokens/s
   through the router, with the decode worker's coalescing on and off, while a
   second request on the same decode worker is read straight from its
   websocket by the same client process.  Both advance one token per engine
   step, so each step is seen twice; "added" is the router client's arrival
   time minus the direct reader's, per step (it can be negative: the router
   has a core of its own, the direct reader shares one with the workers).
   ITL is the gap between tokens as each reader sees them.

Every process runs on loopback, is started by this module and is killed by
its PID (with its descendants) when the run ends; each phase has a deadline.
The machine is small and shared: read the ratios (router vs decode worker in
the same run, coalescing on vs off vs direct) more than the absolute figures.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import resource
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------
# processes


# the CPUs this run may use, read once at import (before the parent pins itself)
_ALL_CPUS = sorted(os.sched_getaffinity(0))


def _cpus() -> tuple[int, int]:
    """(the router's core, the load's core)."""
    return _ALL_CPUS[0], _ALL_CPUS[-1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


def _tree(pid: int) -> list[int]:
    out = [pid]
    for child in _children(pid):
        out.extend(_tree(child))
    return out


def _cpu_seconds(pids: list[int]) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def _core_busy_ticks(cpu: int) -> tuple[int, int]:
    """(busy, total) jiffies of one core so far, from /proc/stat."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{cpu} "):
            values = [int(v) for v in line.split()[1:]]
            idle = values[3] + values[4]
            return sum(values) - idle, sum(values)
    return 0, 0


def _pin(pids: list[int], cpu: int) -> None:
    for pid in pids:
        try:
            os.sched_setaffinity(pid, {cpu})
        except OSError:
            pass


class Processes:
    """Every process a phase starts; ``close`` kills them all, descendants first, by PID."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self, command: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        kwargs.setdefault("cwd", ROOT)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        kwargs.setdefault("stderr", subprocess.DEVNULL)
        proc = subprocess.Popen(command, **kwargs)
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        doomed: list[int] = []
        for proc in self._procs:
            if proc.poll() is None:
                doomed.extend(reversed(_tree(proc.pid)))
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        self._procs.clear()


@contextmanager
def _processes() -> Iterator[Processes]:
    procs = Processes()
    try:
        yield procs
    finally:
        procs.close()


_PENDING_OUTPUT: dict[int, bytes] = {}


def _read_line(proc: subprocess.Popen[bytes], prefix: bytes, timeout: float) -> bytes:
    """The next stdout line starting with ``prefix`` (rest of it), within ``timeout``.

    Lines read past it are kept for the next call on the same process.
    """
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    buf = _PENDING_OUTPUT.pop(proc.pid, b"")
    try:
        while True:
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.startswith(prefix):
                    return line[len(prefix) :]
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise RuntimeError(f"no {prefix!r} line within {timeout}s")
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"process exited ({proc.wait()}) before printing {prefix!r}")
            buf += chunk
    finally:
        if buf:
            _PENDING_OUTPUT[proc.pid] = buf
        sel.close()


def _start_role(procs: Processes, role: str, spec: dict[str, Any]) -> subprocess.Popen[bytes]:
    return procs.start(
        [sys.executable, "-m", "benchmarks.token_path", "--role", role, "--spec", json.dumps(spec)],
        stdout=subprocess.PIPE,
    )


def _start_worker(procs: Processes, config: dict[str, Any]) -> subprocess.Popen[bytes]:
    return procs.start(
        [sys.executable, "-m", "pdtrio", "worker", "--config-json", json.dumps(config), "--exit-with-stdin"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _worker_ready(proc: subprocess.Popen[bytes], cpu: int) -> tuple[str, int]:
    ready = json.loads(_read_line(proc, b"PDTRIO_READY ", 120))
    _pin([proc.pid], cpu)
    return f"http://127.0.0.1:{ready['http_port']}", proc.pid


def _start_router(procs: Processes, instances: list[tuple[str, str]], tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    lines = []
    for role, url in instances:
        lines += ["[[instances]]", f'role = "{role}"', f'url = "{url}"']
    port = _free_port()
    config = tmp / f"router-{port}.toml"
    config.write_text("\n".join(lines) + "\n")
    proc = procs.start(
        [sys.executable, "-m", "hypercorn", "-k", "trio", "-b", f"127.0.0.1:{port}", "pdtrio.app:app"],
        env={**os.environ, "PDTRIO_CONFIG": str(config)},
        stdout=subprocess.DEVNULL,
    )
    return proc, f"127.0.0.1:{port}"


def _router_ready(proc: subprocess.Popen[bytes], address: str, cpu: int, timeout: float = 60) -> list[int]:
    """Wait for /health; pin the hypercorn process tree; return its PIDs."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError("router exited during start-up")
        try:
            with socket.create_connection((host, int(port)), timeout=1) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                if sock.recv(64).startswith(b"HTTP/1.1 200"):
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("router not healthy in time")
        time.sleep(0.05)
    pids = _tree(proc.pid)
    _pin(pids, cpu)
    return pids


# ---------------------------------------------------------------------------
# 1. ingest


def _ingest_payloads(entries: int, tokens: int, streams: int) -> list[bytes]:
    import msgpack

    payloads = []
    for frame in range(streams):
        batch = []
        for i in range(entries):
            stream = (frame * entries + i) % streams
            ids = [300 + (frame * 7 + i + t) % 700 for t in range(tokens)]
            batch.append([f"r{stream}", ids, "".join(f" t{x}" for x in ids), None, None])
        payloads.append(msgpack.packb([5, batch], use_bin_type=True))
    return payloads


def role_producer(spec: dict[str, Any]) -> None:
    """Serve one websocket and blast token frames into it until it breaks or time runs out."""
    import wsproto
    from wsproto.events import AcceptConnection, BytesMessage, Request

    os.sched_setaffinity(0, {spec["cpu"]})
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(spec["max_s"])
    print(f"PORT {listener.getsockname()[1]}", flush=True)
    sock, _ = listener.accept()
    listener.close()
    sock.settimeout(5)
    conn = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
    accepted = False
    while not accepted:
        data = sock.recv(65536)
        if not data:
            return
        conn.receive_data(data)
        for event in conn.events():
            if isinstance(event, Request):
                sock.sendall(conn.send(AcceptConnection()))
                accepted = True
    payloads = _ingest_payloads(spec["entries"], spec["tokens"], spec["streams"])
    blob = b"".join(conn.send(BytesMessage(data=p)) for p in payloads)
    while len(blob) < 256 * 1024:
        blob += blob
    end = time.monotonic() + spec["max_s"]
    try:
        while time.monotonic() < end:
            sock.sendall(blob)
    except OSError:
        pass


class _NullRouter:
    """What ``RequestPipeline._stream_tokens`` / ``_deliver`` touch of the router."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()


def role_ingest_router(spec: dict[str, Any]) -> None:
    import trio

    os.sched_setaffinity(0, {spec["cpu"]})
    result = trio.run(_ingest_router, spec)
    print("RESULT " + json.dumps(result), flush=True)


async def _ingest_router(spec: dict[str, Any]) -> dict[str, Any]:
    import trio

    from pdtrio.protocol.openai import OpenAIError, parse_completion_request
    from pdtrio.router.decode_link import DecodeLink
    from pdtrio.router.pipeline import RequestPipeline

    router = _NullRouter()
    sends = 0

    async def null_send(message: Any) -> None:
        nonlocal sends
        sends += 1

    async def null_receive() -> Any:
        raise AssertionError("not used")

    body = json.dumps(
        {"model": "synthetic", "prompt": [1, 2, 3], "max_tokens": 1_000_000, "stream": True}
    ).encode()
    request = parse_completion_request(body, served_models=["synthetic"], max_tokens_limit=10**9)
    link = DecodeLink("ingest", spec["url"], max_pending_tokens=65536)
    overflows = 0

    async def consume(request_id: str) -> None:
        nonlocal overflows
        stream = link.open_stream(request_id)
        pipeline = RequestPipeline(router, request, "completion", null_receive, null_send)  # type: ignore[arg-type]
        try:
            await pipeline._stream_tokens(stream)
        except OpenAIError:
            overflows += 1

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    async with trio.open_nursery() as nursery:
        for i in range(spec["streams"]):
            nursery.start_soon(consume, f"r{i}")
        await nursery.start(link.run)
        await trio.sleep(spec["warmup_s"])
        t0, c0, k0, f0, s0 = time.perf_counter(), cpu(), router.counters["tokens"], link.frames_received, sends
        print("MEASURING", flush=True)
        await trio.sleep(spec["duration_s"])
        t1, c1, k1, f1, s1 = time.perf_counter(), cpu(), router.counters["tokens"], link.frames_received, sends
        nursery.cancel_scope.cancel()
    return {
        "wall_s": t1 - t0,
        "cpu_s": c1 - c0,
        "tokens": k1 - k0,
        "frames": f1 - f0,
        "sse_chunks": s1 - s0,
        "overflows": overflows,
    }


INGEST_CASES = [(1, 1), (4, 1), (16, 1), (64, 1), (1, 16)]  # (entries per frame, tokens per entry)


def run_ingest(quick: bool, profile_dir: Path | None) -> list[dict[str, Any]]:
    router_cpu, other_cpu = _cpus()
    warmup, duration = (0.5, 1.5) if quick else (1.0, 4.0)
    rows = []
    cases: list[tuple[int, int, bool]] = [(e, t, False) for e, t in INGEST_CASES]
    if profile_dir is not None:
        cases += [(1, 1, True), (16, 1, True)]
    for entries, tokens, profiled in cases:
        streams = max(64, entries)
        duration = max(duration, 3.0) if profiled else duration
        with _processes() as procs:
            producer = _start_role(
                procs, "producer",
                {"cpu": other_cpu, "entries": entries, "tokens": tokens, "streams": streams,
                 "max_s": warmup + duration + 30},
            )
            port = int(_read_line(producer, b"PORT ", 30))
            router = _start_role(
                procs, "ingest-router",
                {"cpu": router_cpu, "url": f"ws://127.0.0.1:{port}/pd/decode", "streams": streams,
                 "warmup_s": warmup, "duration_s": duration},
            )
            spy = None
            if profiled:
                assert profile_dir is not None
                _read_line(router, b"MEASURING", 60)
                out = profile_dir / f"ingest_{entries}x{tokens}.txt"
                spy = procs.start(
                    [str(Path(sys.executable).parent / "py-spy"), "record", "-f", "raw", "-r", "500",
                     "--function", "-d", str(int(duration)), "-o", str(out), "--pid", str(router.pid)],
                    stdout=subprocess.DEVNULL,
                )
                _pin([spy.pid], other_cpu)
            result = json.loads(_read_line(router, b"RESULT ", warmup + duration + 60))
            if spy is not None:
                spy.wait(timeout=30)
        cpu_s = result["cpu_s"] or 1e-9
        row = {
            "entries_per_frame": entries,
            "tokens_per_entry": tokens,
            "tokens_per_frame": entries * tokens,
            "tokens_per_cpu_s": result["tokens"] / cpu_s,
            "frames_per_cpu_s": result["frames"] / cpu_s,
            "us_per_token": cpu_s / max(1, result["tokens"]) * 1e6,
            "router_util": result["cpu_s"] / result["wall_s"],
            "tokens_per_sse_chunk": result["tokens"] / max(1, result["sse_chunks"]),
            "overflows": result["overflows"],
            "profiled": profiled,
        }
        if profiled:
            assert profile_dir is not None
            row["profile"] = str(profile_dir / f"ingest_{entries}x{tokens}.txt")
            row["profile_top"] = _profile_top(Path(row["profile"]))
        rows.append(row)
    return rows


def _profile_top(path: Path, n: int = 15) -> dict[str, list[tuple[str, float]]]:
    """Self and inclusive shares of the top functions in a py-spy raw (folded) profile."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    try:
        text = path.read_text()
    except OSError:
        return {}
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        total += samples
        frames = stack.split(";")
        own[frames[-1]] += samples
        for frame in set(frames):
            incl[frame] += samples
    if not total:
        return {}
    return {
        "self": [(f, round(c / total * 100, 1)) for f, c in own.most_common(n)],
        # the frames every sample shares (module, trio.run) say nothing: left out
        "inclusive": [(f, round(c / total * 100, 1)) for f, c in incl.most_common() if c < 0.98 * total][:n],
    }


# ---------------------------------------------------------------------------
# 2. end to end


class _SseClient:
    __slots__ = ("sock", "start_at", "request_start", "last_event", "gaps", "ttfts", "tail", "requests")

    def __init__(self, start_at: float) -> None:
        self.sock: socket.socket | None = None
        self.start_at = start_at
        self.request_start = 0.0
        self.last_event: float | None = None
        self.gaps: list[float] = []
        self.ttfts: list[float] = []
        self.tail = b""
        self.requests = 0


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def role_sse_clients(spec: dict[str, Any]) -> None:
    """``clients`` raw-socket SSE readers, each streaming completions back to back.

    Clients start spread over the first second; from ``warmup_s`` on, for
    ``measure_s``, tokens, events, bytes and inter-event gaps are counted (the
    lines "MARK start" / "MARK end" let the parent read CPU counters at the
    same moments); then every socket is closed.  Tokens are counted in the
    bytes: each synthetic token's text is " t<id>", and nothing else in a
    compact OpenAI chunk has a space before a "t".
    """
    os.sched_setaffinity(0, {spec["cpu"]})
    host, port = spec["address"].rsplit(":", 1)
    body = json.dumps({
        "model": "synthetic", "prompt": list(range(1, 17)), "max_tokens": spec["max_tokens"],
        "ignore_eos": True, "stream": True,
    }).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body
    sel = selectors.DefaultSelector()
    t0 = time.perf_counter()
    window_start = t0 + spec["warmup_s"]
    window_end = window_start + spec["measure_s"]
    clients = [_SseClient(t0 + i / spec["clients"]) for i in range(spec["clients"])]
    waiting = sorted(clients, key=lambda c: c.start_at, reverse=True)
    counted = {"tokens": 0, "events": 0, "bytes": 0, "requests_done": 0}
    failures: Counter[str] = Counter()
    connect_times: list[float] = []
    measuring = False

    def begin(client: _SseClient) -> None:
        # non-blocking connect: a slow accept delays this client only
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        sock.connect_ex((host, int(port)))
        client.sock = sock
        client.request_start = time.perf_counter()
        client.last_event = None
        client.tail = b""
        sel.register(sock, selectors.EVENT_WRITE, client)

    def connected(client: _SseClient) -> None:
        assert client.sock is not None
        error = client.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            failures[f"connect: {os.strerror(error)}"] += 1
            end(client)
            return
        client.sock.send(request)  # a few hundred bytes into an empty socket buffer
        connect_times.append(time.perf_counter() - client.request_start)
        sel.modify(client.sock, selectors.EVENT_READ, client)

    def end(client: _SseClient) -> None:
        assert client.sock is not None
        sel.unregister(client.sock)
        client.sock.close()
        client.sock = None
        client.requests += 1
        begin(client)

    while True:
        now = time.perf_counter()
        while waiting and waiting[-1].start_at <= now:
            begin(waiting.pop())
        if not measuring and now >= window_start:
            measuring = True
            print("MARK start", flush=True)
        if now >= window_end:
            print("MARK end", flush=True)
            break
        timeout = min(window_end, window_start if not measuring else window_end) - now
        if waiting:
            timeout = min(timeout, waiting[-1].start_at - now)
        for key, mask in sel.select(max(0.0, timeout)):
            client = key.data
            if mask & selectors.EVENT_WRITE:
                connected(client)
                continue
            data = client.sock.recv(262144)
            now = time.perf_counter()
            if not data:
                failures["closed before [DONE]"] += 1
                end(client)
                continue
            window = client.tail + data
            events = window.count(b"\n\n") - client.tail.count(b"\n\n")
            if measuring:
                counted["bytes"] += len(data)
                counted["tokens"] += window.count(b" t") - client.tail.count(b" t")
                counted["events"] += events
            if events:
                if client.last_event is None:
                    if measuring:
                        client.ttfts.append(now - client.request_start)
                elif measuring:
                    client.gaps.append(now - client.last_event)
                client.last_event = now
            client.tail = window[-64:]
            if b"data: [DONE]" in client.tail:
                counted["requests_done"] += measuring
                end(client)
            elif window.startswith(b"HTTP/1.1 ") and not window.startswith(b"HTTP/1.1 200"):
                failures[window.split(b"\r\n", 1)[0].decode(errors="replace")] += 1
                end(client)
    sel.close()
    for client in clients:
        if client.sock is not None:
            client.sock.close()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    per_client = [(_percentile(c.gaps, 50), _percentile(c.gaps, 99)) for c in clients if c.gaps]
    ttfts = [t for c in clients for t in c.ttfts]
    result = {
        **counted,
        "measure_s": spec["measure_s"],
        "failures": failures,
        "client_p50s": [p for p, _ in per_client],
        "client_p99s": [p for _, p in per_client],
        "ttft_p50": _percentile(ttfts, 50),
        "ttft_p99": _percentile(ttfts, 99),
        "connect_p99": _percentile(connect_times, 99),
        "connect_max": max(connect_times, default=float("nan")),
        "cpu_s": usage.ru_utime + usage.ru_stime,
    }
    print("RESULT " + json.dumps(result), flush=True)


def _synthetic_worker(role: str, step_s: float, *, coalesce: bool = True, blocks: int = 16384) -> dict[str, Any]:
    return {
        "role": role,
        "engine": {
            "kind": "synthetic",
            "num_kv_blocks": blocks,
            "synthetic": {"decode_step_s": step_s, "tokens_per_step": 1},
        },
        "flush": {"coalesce": coalesce},
    }


def run_e2e(quick: bool, step_s: float) -> list[dict[str, Any]]:
    router_cpu, other_cpu = _cpus()
    warmup, measure = (2.0, 3.0) if quick else (3.0, 10.0)
    rows = []
    with _processes() as procs, tempfile.TemporaryDirectory() as tmp:
        prefill_proc = _start_worker(procs, _synthetic_worker("prefill", step_s))
        decode_proc = _start_worker(procs, _synthetic_worker("decode", step_s))
        prefill_url, prefill_pid = _worker_ready(prefill_proc, other_cpu)
        decode_url, decode_pid = _worker_ready(decode_proc, other_cpu)
        router_proc, address = _start_router(procs, [("prefill", prefill_url), ("decode", decode_url)], Path(tmp))
        router_pids = _router_ready(router_proc, address, router_cpu)
        for clients in (64, 256):
            spec = {"cpu": other_cpu, "address": address, "clients": clients, "max_tokens": 256,
                    "warmup_s": warmup, "measure_s": measure}
            proc = _start_role(procs, "sse-clients", spec)

            def sample(clients_pid: int = proc.pid) -> tuple[float, ...]:
                return (_cpu_seconds(router_pids), _cpu_seconds([decode_pid]), _cpu_seconds([prefill_pid]),
                        _cpu_seconds([clients_pid]), *_core_busy_ticks(router_cpu))

            _read_line(proc, b"MARK start", warmup + 60)
            before, wall0 = sample(), time.perf_counter()
            _read_line(proc, b"MARK end", measure + 60)
            after, wall = sample(), time.perf_counter() - wall0
            result = json.loads(_read_line(proc, b"RESULT ", 60))
            proc.wait(timeout=30)
            router_s, decode_s, prefill_s, clients_s, core_busy, core_total = (
                a - b for a, b in zip(after, before, strict=True)
            )
            tokens = max(1, result["tokens"])
            rows.append({
                "clients": clients,
                "decode_step_ms": step_s * 1e3,
                "offered_tokens_per_s": clients / step_s,
                "tokens": result["tokens"],
                "requests_done": result["requests_done"],
                "tokens_per_s": result["tokens"] / result["measure_s"],
                "tokens_per_event": result["tokens"] / max(1, result["events"]),
                "router_us_per_token": router_s / tokens * 1e6,
                "router_util": router_s / wall,
                "router_core_busy": core_busy / max(1, core_total),
                "decode_us_per_token": decode_s / tokens * 1e6,
                "router_over_decode": router_s / max(decode_s, 1e-9),
                "load_core_util": (decode_s + prefill_s + clients_s) / wall,
                "itl_p50_ms": statistics.median(result["client_p50s"]) * 1e3 if result["client_p50s"] else None,
                "itl_p99_ms": statistics.median(result["client_p99s"]) * 1e3 if result["client_p99s"] else None,
                "itl_p99_worst_ms": max(result["client_p99s"]) * 1e3 if result["client_p99s"] else None,
                "ttft_p50_ms": result["ttft_p50"] * 1e3,
                "ttft_p99_ms": result["ttft_p99"] * 1e3,
                "connect_p99_ms": result["connect_p99"] * 1e3,
                "connect_max_ms": result["connect_max"] * 1e3,
                "failures": result["failures"],
            })
    return rows


# ---------------------------------------------------------------------------
# 3. latency at light load


async def _direct_reader(prefill_url: str, decode_url: str, tokens: int, started: Any, times: list[float]) -> None:
    import httpx
    import trio_websocket

    from pdtrio import codec
    from pdtrio.protocol.sampling import SamplingParams
    from pdtrio.protocol.wire import (
        DecodeStart,
        MessageKind,
        PrefillReply,
        PrefillRequest,
        TokenPrompt,
    )

    request_id = f"direct-{os.getpid()}-{time.monotonic_ns()}"
    sampling = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    request = PrefillRequest(request_id, TokenPrompt(tuple(range(1, 17))), sampling)
    headers = {"content-type": codec.MSGPACK_CONTENT_TYPE}
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{prefill_url}/pd/prefill", content=codec.pack(request.to_wire()), headers=headers)
        response.raise_for_status()
    reply = PrefillReply.from_wire(codec.unpack(response.content))
    assert reply.kv_handle is not None
    start = DecodeStart(
        request_id=request_id, prompt_token_ids=reply.prompt_token_ids, first_token_id=reply.first_token_id,
        sampling=sampling, remaining_tokens=reply.remaining_tokens, cached_tokens=reply.cached_tokens,
        kv_handle=reply.kv_handle,
    )
    ws_url = decode_url.replace("http://", "ws://", 1) + "/pd/decode"
    async with trio_websocket.open_websocket_url(ws_url) as ws:
        await ws.send_message(codec.pack(start.to_wire()))
        while True:
            message = codec.unpack(await ws.get_message())
            now = time.perf_counter()
            if message[0] != MessageKind.TOKENS:
                continue
            for entry in message[1]:
                if entry[0] == request_id:
                    times.extend([now] * len(entry[1]))
                    if not started.is_set():
                        started.set()
                    if entry[3] is not None:
                        return


async def _router_reader(address: str, tokens: int, times: list[float]) -> None:
    import trio

    host, port = address.rsplit(":", 1)
    body = json.dumps({
        "model": "synthetic", "prompt": list(range(1, 17)), "max_tokens": tokens, "ignore_eos": True,
        "stream": True,
    }).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(head + body)
        tail = b""
        while b"data: [DONE]" not in tail:
            data = await stream.receive_some(65536)
            if not data:
                raise RuntimeError("router closed the stream early")
            now = time.perf_counter()
            window = tail + data
            # one time per token: each synthetic token's text is " t<id>"
            times.extend([now] * (window.count(b" t") - tail.count(b" t")))
            tail = window[-64:]


async def _latency_pair(prefill_url: str, decode_url: str, address: str, tokens: int) -> dict[str, list[float]]:
    import trio

    direct: list[float] = []
    routed: list[float] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            started = trio.Event()
            nursery.start_soon(_direct_reader, prefill_url, decode_url, tokens + 200, started, direct)
            await started.wait()
            await _router_reader(address, tokens, routed)
    return {"direct": direct, "routed": routed}


def run_latency(quick: bool, rate: float) -> list[dict[str, Any]]:
    import trio

    router_cpu, other_cpu = _cpus()
    step = 1.0 / rate
    tokens = int(rate * 1.0)  # one second per stream
    rounds = 2 if quick else 6
    samples: dict[str, dict[str, list[float]]] = {
        mode: {"itl_routed": [], "itl_direct": [], "added": []} for mode in ("on", "off")
    }
    mismatched = Counter[str]()
    with _processes() as procs, tempfile.TemporaryDirectory() as tmp:
        prefill_proc = _start_worker(procs, _synthetic_worker("prefill", step, blocks=4096))
        decode_procs = {
            mode: _start_worker(procs, _synthetic_worker("decode", step, coalesce=mode == "on", blocks=4096))
            for mode in ("on", "off")
        }
        prefill_url, _ = _worker_ready(prefill_proc, other_cpu)
        decode_urls = {mode: _worker_ready(proc, other_cpu)[0] for mode, proc in decode_procs.items()}
        routers = {
            mode: _start_router(procs, [("prefill", prefill_url), ("decode", decode_urls[mode])], Path(tmp))
            for mode in ("on", "off")
        }
        addresses = {}
        for mode, (proc, address) in routers.items():
            _router_ready(proc, address, router_cpu)
            addresses[mode] = address
        for round_ in range(rounds + 1):  # round 0 warms up
            for mode in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
                got = trio.run(_latency_pair, prefill_url, decode_urls[mode], addresses[mode], tokens)
                if round_ == 0:
                    continue
                direct, routed = got["direct"], got["routed"]
                # per-token arrival times; the router's first token is prefill's, the rest are decode steps
                decode_tokens = routed[1:]
                samples[mode]["itl_routed"] += [b - a for a, b in zip(decode_tokens, decode_tokens[1:], strict=False)]
                # both requests advance one token per engine step: find the step offset
                # between the two lists, then compare each step's two arrival times
                shifts: Counter[int] = Counter()
                for i, t in enumerate(decode_tokens):
                    j = bisect.bisect_left(direct, t)
                    if j == len(direct) or (j > 0 and t - direct[j - 1] < direct[j] - t):
                        j -= 1
                    shifts[j - i] += 1
                if not shifts:
                    continue
                shift, agreeing = shifts.most_common(1)[0]
                mismatched[mode] += len(decode_tokens) - agreeing
                pairs = [(t, direct[i + shift]) for i, t in enumerate(decode_tokens) if 0 <= i + shift < len(direct)]
                samples[mode]["added"] += [t - d for t, d in pairs]
                same_steps = [d for _, d in pairs]
                samples[mode]["itl_direct"] += [b - a for a, b in zip(same_steps, same_steps[1:], strict=False)]
    rows = []
    for mode in ("on", "off"):
        s = samples[mode]
        rows.append({
            "coalesce": mode == "on",
            "tokens_per_s": rate,
            "samples": len(s["added"]),
            "itl_router_p50_ms": _percentile(s["itl_routed"], 50) * 1e3,
            "itl_router_p99_ms": _percentile(s["itl_routed"], 99) * 1e3,
            "itl_direct_p50_ms": _percentile(s["itl_direct"], 50) * 1e3,
            "itl_direct_p99_ms": _percentile(s["itl_direct"], 99) * 1e3,
            "added_p50_us": _percentile(s["added"], 50) * 1e6,
            "added_p99_us": _percentile(s["added"], 99) * 1e6,
            "added_mean_us": statistics.fmean(s["added"]) * 1e6 if s["added"] else float("nan"),
            "mismatched_steps": mismatched[mode],
        })
    return rows


# ---------------------------------------------------------------------------
# report


def _table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def _fmt(value: Any, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value != value:
        return "nan"
    return format(value, spec)


def render(report: dict[str, Any]) -> str:
    out = [f"token path benchmark ({'quick' if report['quick'] else 'full'}), {report['machine']}"]
    if report.get("ingest"):
        out.append(_table(
            "\n1. ingest: one router core absorbing token frames (K entries x T tokens per frame)",
            ["KxT", "tok/frame", "tokens/s/core", "frames/s/core", "us/token", "router util", "tok/SSE chunk", "profiled"],
            [[f"{r['entries_per_frame']}x{r['tokens_per_entry']}", str(r["tokens_per_frame"]),
              _fmt(r["tokens_per_cpu_s"], ",.0f"), _fmt(r["frames_per_cpu_s"], ",.0f"),
              _fmt(r["us_per_token"], ".2f"), _fmt(r["router_util"] * 100, ".0f") + "%",
              _fmt(r["tokens_per_sse_chunk"], ".1f"), "yes" if r["profiled"] else ""]
             for r in report["ingest"]],
        ))
        for r in report["ingest"]:
            if r.get("profile_top"):
                out.append(f"\n  py-spy {r['entries_per_frame']}x{r['tokens_per_entry']} ({r['profile']}), self %:")
                out += [f"    {pct:5.1f}  {frame}" for frame, pct in r["profile_top"]["self"][:15]]
                out.append("  inclusive %:")
                out += [f"    {pct:5.1f}  {frame}" for frame, pct in r["profile_top"]["inclusive"][:20]]
    if report.get("e2e"):
        out.append(_table(
            "\n2. end to end: hypercorn router on one core, synthetic workers, raw SSE clients",
            ["clients", "offered tok/s", "tokens/s", "tok/event", "router us/tok", "router util",
             "decode us/tok", "router/decode", "load core", "ITL p50 ms", "ITL p99 ms", "worst p99",
             "TTFT p50 ms", "failures"],
            [[str(r["clients"]), _fmt(r["offered_tokens_per_s"], ",.0f"), _fmt(r["tokens_per_s"], ",.0f"),
              _fmt(r["tokens_per_event"], ".2f"), _fmt(r["router_us_per_token"]),
              _fmt(r["router_util"] * 100, ".0f") + "%", _fmt(r["decode_us_per_token"]),
              _fmt(r["router_over_decode"], ".2f"), _fmt(r["load_core_util"] * 100, ".0f") + "%",
              _fmt(r["itl_p50_ms"], ".2f"), _fmt(r["itl_p99_ms"], ".2f"),
              _fmt(r["itl_p99_worst_ms"], ".2f"), _fmt(r["ttft_p50_ms"], ".1f"),
              str(sum(r["failures"].values()))]
             for r in report["e2e"]],
        ))
    if report.get("latency"):
        out.append(_table(
            "\n3. light load: one stream; added = router client arrival - direct websocket arrival, same engine step",
            ["coalesce", "tok/s", "steps", "ITL router p50/p99 ms", "ITL direct p50/p99 ms",
             "added p50 us", "added p99 us", "added mean us", "mismatched"],
            [["on" if r["coalesce"] else "off", _fmt(r["tokens_per_s"], ".0f"), str(r["samples"]),
              f"{_fmt(r['itl_router_p50_ms'], '.2f')} / {_fmt(r['itl_router_p99_ms'], '.2f')}",
              f"{_fmt(r['itl_direct_p50_ms'], '.2f')} / {_fmt(r['itl_direct_p99_ms'], '.2f')}",
              _fmt(r["added_p50_us"], ".0f"), _fmt(r["added_p99_us"], ".0f"), _fmt(r["added_mean_us"], ".0f"),
              str(r["mismatched_steps"])]
             for r in report["latency"]],
        ))
    return "\n".join(out)


ROLES = {
    "producer": role_producer,
    "ingest-router": role_ingest_router,
    "sse-clients": role_sse_clients,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.token_path", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs (under a minute in all)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--only", default="ingest,e2e,latency", help="comma-separated phases")
    parser.add_argument("--profile", type=Path, default=None,
                        help="also py-spy the ingest router (1x1 and 16x1) into this folder")
    parser.add_argument("--e2e-step-ms", type=float, default=10.0, help="decode step of the e2e load")
    parser.add_argument("--latency-rate", type=float, default=200.0, help="tokens/s of the light-load stream")
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        ROLES[args.role](json.loads(args.spec))
        return 0
    phases = {p.strip() for p in args.only.split(",") if p.strip()}
    router_cpu, other_cpu = _cpus()
    if router_cpu == other_cpu:
        print("warning: one CPU only; router and load share it", file=sys.stderr)
    os.sched_setaffinity(0, {other_cpu})
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "quick": args.quick,
        "machine": f"{os.cpu_count()} cpus, router on cpu {router_cpu}, load on cpu {other_cpu}",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    started = time.perf_counter()
    if "ingest" in phases:
        report["ingest"] = run_ingest(args.quick, args.profile)
    if "e2e" in phases:
        report["e2e"] = run_e2e(args.quick, args.e2e_step_ms / 1e3)
    if "latency" in phases:
        report["latency"] = run_latency(args.quick, args.latency_rate)
    report["elapsed_s"] = time.perf_counter() - started
    print(render(report))
    print(f"\n({report['elapsed_s']:.0f}s)")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
