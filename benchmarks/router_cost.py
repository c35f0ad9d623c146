"""Router cost: what pdtrio's router spends per request and per token, beside a trivial SSE app.

    python -m benchmarks.router_cost [--quick] [--json PATH] [--plot PATH]
    python -m benchmarks.router_cost --tracing [--quick] [--json PATH]

Each server runs under ``hypercorn -k trio`` pinned to one core (the first this
process may use); everything else (the synthetic prefill and decode workers,
the load generator, this driver) shares the other core.  Two servers take the
same loads, one after the other, in the same run:

- **pdtrio**: ``pdtrio.app:app`` with a static config over a synthetic prefill
  and decode worker (one token per step; a step every 10 ms for the paced
  loads, back to back for the others), ``router.egress_max_delay_s`` at its
  default ("egress on") or 0 ("egress off");
- **trivial app**: ``benchmarks.trivial_sse_app``: the same SSE bytes for the
  same request (headers, chunks, ``[DONE]`` in the last write), the same number
  of tokens, paced on the same 10 ms clock (one ticker task for every stream),
  and nothing else: hypercorn's cost.

The rows:

1. N concurrent requests of 2 tokens, in rounds (all N sent at once, the next
   round when all have ended), on kept-alive connections, then with a new
   connection per request: router CPU per request, TTFT; then N requests of 1
   token (prefill's token is the whole answer: one worker exchange, the least
   a request can cost pdtrio's router); beside each of the kept-alive rows, the
   **link floor**: the same requests' link exchange alone (below), and the
   trivial app's cost plus it as a share of the trivial app's: what pdtrio's
   ratio would be if its router added nothing but the link work to hypercorn's;
2. 128 and 512 streams of 128 tokens, decode paced at 10 ms per token, each
   client sending its next request when one ends, egress on and off: router
   CPU per token, ITL, TTFT, tokens delivered against those offered; then the
   512 streams against the trivial app sending 5 tokens an event (what pdtrio's
   egress sends at its 50 ms cap): what that many SSE events cost hypercorn;
3. 64 streams of 256 tokens, decode as fast as it can (pdtrio only);
4. the 512-stream row with two router processes (``hypercorn -w 2``, the same
   config; each process has its own links to the workers), both pinned to the
   router core: the CPU of both summed.  On two cores this shows what a
   second process costs, not what it buys (that needs a core of its own).

The load (``benchmarks.token_path.sse_clients.closed_loop``): raw-socket
clients in this process on one epoll (streams start spread over the first
second), a streamed ``/v1/completions`` of a 16-token prompt with
``ignore_eos``.  After a warm-up, over a fixed window (10 s; ``--quick`` runs
a tiny version of every row, for CI, whose figures mean nothing):

- **router CPU**: user + system time of the server's process tree from /proc
  over the window, per request (requests ended in the window) or per token
  (tokens received in the window); "router / load core": that CPU as a share
  of one core, and how busy the load core was (from /proc/stat);
- **TTFT**: request sent (connect started, for new connections) -> first token;
- **ITL**: the gap between two socket reads of one response that carried
  tokens, pooled over all streams.  "Per read" is what a user sees stall (a
  read of k tokens is one gap); "per token" spreads each gap over its k tokens
  (k gaps of gap/k).  A response's first gap (prefill's token -> the first
  decode token, the KV handoff included) counts;
- **decode's own ITL**: in paced pdtrio runs one more request, from another
  process on the load core, reads the decode worker's websocket directly (as
  the router does; ``token_path.light_load``) over the same window: the gaps
  between its frames.  "Router's added p99" is pdtrio's per-read ITL p99
  minus that p99;
- **delivered / offered**: tokens/s received against what the streams would
  get if each were always decoding at 100 tok/s (a response's first token is
  prefill's and comes at once: N x 128 / 1.27 s); the shortfall is each
  request's time to first token.  **Pace**: for the responses ended in the
  window, the tokens after each one's second read over the time they took,
  against the decode worker's own time per token (100%: every token decode
  offered went out as fast as decode made it);
- **failures**: a status other than 200, an error event, a connection closed
  mid-response (warm-up included), and responses of another token count;
- **link floor**: a process of its own on the servers' core (``--role
  floor``) drives the short loads' requests straight over two ``WorkerLink``s
  to the same workers, as the router's legs do (the prefill call, then decode's
  start, its tokens and the release of prefill's KV at the first of them), in
  rounds of as many at once, with no HTTP and no request pipeline: its CPU from
  /proc over the same warm-up and window, per request ended in the window.  It
  bounds from below what pdtrio's router can cost beyond hypercorn's own work.

``--plot PATH`` draws, as a PNG, the TTFT and per-read ITL CDFs of each paced
load for pdtrio (egress on, off), the trivial app and decode's own, tokens/s
against the number of streams, and the short requests' TTFT CDFs.

Goals (issue 9) are evaluated on the default configuration (egress on) and
printed PASS/FAIL under the table, never as an error; beside them, what the
trivial app itself does at each goal's load (its cost with one exchange less
than the least pdtrio makes, its own TTFT, its cost per token at pdtrio's
event rate).  The machine is small
and shared: notes list the runs where other processes took the router's core,
or the load core was saturated, or decode itself could not keep 10 ms.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, Literal

import trio

from benchmarks import plotting
from benchmarks.kit import markdown_table, percentile, write_json
from benchmarks.token_path.measure import core_busy_ticks, router_and_load_cpus
from benchmarks.token_path.sse_clients import closed_loop, completion_request
from pdtrio.config import RouterConfig
from pdtrio.testing import (
    LOOPBACK,
    ProcessError,
    Processes,
    Service,
    cpu_seconds,
    free_port,
    pin,
    router_command,
    synthetic_worker_config,
    write_router_config,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CAP_S = RouterConfig().egress_max_delay_s
PACED_STEP_S = 0.01
# the tokens an event carries when egress spaces a paced stream's sends by the cap
GROUPED_TOKENS = max(1, round(DEFAULT_CAP_S / PACED_STEP_S))
# the goal for a short request's router CPU, as a multiple of the trivial app's
_SHORT_COST_GOAL = 1.3
# the synthetic engine's context is 8192 tokens: a direct request of at most this many
_DIRECT_MAX_TOKENS = 8000
_KV_BLOCKS = 16384  # 512 streams x 9 blocks, the direct reader's 501, and room to spare


# --- what runs -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sizes:
    short_clients: int
    short_tokens: int
    paced_streams: tuple[int, int]
    paced_tokens: int
    fast_streams: int
    fast_tokens: int
    warmup_s: float
    measure_s: float
    ramp_s: float


FULL = Sizes(32, 2, (128, 512), 128, 64, 256, warmup_s=3.0, measure_s=10.0, ramp_s=1.0)
QUICK = Sizes(4, 2, (8, 16), 16, 4, 32, warmup_s=0.3, measure_s=0.4, ramp_s=0.1)


@dataclasses.dataclass(frozen=True)
class Server:
    key: str
    app: Literal["pdtrio", "trivial"]
    step_s: float  # the decode step (pdtrio) or the pace (trivial)
    egress_s: float | None = None  # pdtrio's router.egress_max_delay_s; None: its default
    processes: int = 1  # hypercorn -w
    tokens_per_event: int = 1  # the trivial app's grouping of paced tokens

    @property
    def cap_s(self) -> float | None:
        if self.app != "pdtrio":
            return None
        return DEFAULT_CAP_S if self.egress_s is None else self.egress_s


@dataclasses.dataclass(frozen=True)
class Load:
    key: str
    clients: int
    max_tokens: int
    step_s: float
    keepalive: bool = True
    rounds: bool = False  # all clients at once, the next round when all have ended


def _short_loads(sizes: Sizes) -> tuple[Load, Load]:
    """The short requests on kept-alive connections: of ``short_tokens``, and of one token
    (prefill's token is the whole answer: one worker exchange, the least a request can cost)."""
    short = Load("short", sizes.short_clients, sizes.short_tokens, 0.0, rounds=True)
    return short, dataclasses.replace(short, key="short_one", max_tokens=1)


def floor_loads(sizes: Sizes) -> list[Load]:
    """The loads whose link exchange alone is measured too (the link floor)."""
    return list(_short_loads(sizes))


def plan(sizes: Sizes) -> list[tuple[Server, list[Load]]]:
    """Every server, and the loads it takes, in the order they run."""
    small, large = sizes.paced_streams
    short, short_one = _short_loads(sizes)
    short_new = dataclasses.replace(short, key="short_new_conn", keepalive=False)
    paced_small = Load("paced_small", small, sizes.paced_tokens, PACED_STEP_S)
    paced_large = Load("paced_large", large, sizes.paced_tokens, PACED_STEP_S)
    fast = Load("fast", sizes.fast_streams, sizes.fast_tokens, 0.0)
    return [
        (Server("pdtrio_fast", "pdtrio", 0.0), [short, short_new, short_one, fast]),
        (Server("trivial_fast", "trivial", 0.0), [short, short_new, short_one]),
        (Server("pdtrio_fast_off", "pdtrio", 0.0, egress_s=0.0), [fast]),
        (Server("pdtrio_on", "pdtrio", PACED_STEP_S), [paced_small, paced_large]),
        (Server("pdtrio_off", "pdtrio", PACED_STEP_S, egress_s=0.0), [paced_small, paced_large]),
        (Server("trivial_paced", "trivial", PACED_STEP_S), [paced_small, paced_large]),
        # as many events as pdtrio's router sends with its egress at the cap
        (
            Server("trivial_grouped", "trivial", PACED_STEP_S, tokens_per_event=GROUPED_TOKENS),
            [paced_large],
        ),
        (Server("pdtrio_two", "pdtrio", PACED_STEP_S, processes=2), [paced_large]),
        (Server("trivial_two", "trivial", PACED_STEP_S, processes=2), [paced_large]),
    ]


# --- processes -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workers:
    prefill: Service
    decode: Service


def _env(tree: Path = ROOT) -> dict[str, str | None]:
    # the servers import this checkout (benchmarks.trivial_sse_app, pdtrio), wherever we run
    # from; or another tree's pdtrio (benchmarks.router_cost_versus)
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(tree) if not path else f"{tree}{os.pathsep}{path}"}


def start_workers(procs: Processes, cpu: int) -> dict[float, Workers]:
    """A prefill and a decode worker for each decode step, all on ``cpu``."""
    starting: dict[tuple[float, str], subprocess.Popen[bytes]] = {}
    for step in (0.0, PACED_STEP_S):
        for role in ("prefill", "decode"):
            config = synthetic_worker_config(role, decode_step_s=step, num_kv_blocks=_KV_BLOCKS)
            config["engine"]["max_batch_size"] = 1024
            starting[step, role] = procs.start_worker(config, cpus={cpu})
    ready = {key: procs.wait_ready(process, timeout=120) for key, process in starting.items()}
    return {
        step: Workers(ready[step, "prefill"], ready[step, "decode"]) for step in (0.0, PACED_STEP_S)
    }


def start_server(
    procs: Processes,
    server: Server,
    workers: Workers,
    cpus: set[int],
    tmp: Path,
    tree: Path = ROOT,
    environment: Mapping[str, str] | None = None,
) -> Service:
    """``server`` under ``hypercorn -k trio`` on ``cpus``, healthy (``tree``: the checkout
    whose pdtrio it imports; ``environment``: more of the server's environment)."""
    port = free_port()
    env = {**_env(tree), **(environment or {})}
    if server.app == "pdtrio":
        config = write_router_config(
            tmp / f"{server.key}-{port}.toml",
            [("prefill", workers.prefill.url), ("decode", workers.decode.url)],
            router=None if server.egress_s is None else {"egress_max_delay_s": server.egress_s},
        )
        command = router_command(f"{LOOPBACK}:{port}")
        env["PDTRIO_CONFIG"] = str(config)
    else:
        command = router_command(f"{LOOPBACK}:{port}", app="benchmarks.trivial_sse_app:app")
        env["TRIVIAL_SSE_STEP_S"] = repr(server.step_s)
        env["TRIVIAL_SSE_TOKENS_PER_EVENT"] = str(server.tokens_per_event)
    # a listen backlog that takes 512 connections at once; -w: hypercorn's app processes
    command[-1:-1] = ["--backlog", "4096", "-w", str(server.processes)]
    process = procs.start(command, env=env, output="capture", cpus=cpus)
    service = Service(process, f"http://{LOOPBACK}:{port}")
    procs.wait_healthy(service, timeout=60)
    pin(service.tree(), cpus)
    return service


def start_direct_reader(
    procs: Processes, workers: Workers, step_s: float, until: float, cpu: int
) -> subprocess.Popen[bytes]:
    """The ``--role direct`` process (below), on ``cpu``, reading until ``until``."""
    spec = {
        "prefill": workers.prefill.url,
        "decode": workers.decode.url,
        "step_s": step_s,
        "until": until,
    }
    command = [sys.executable, "-m", "benchmarks.router_cost", "--role", "direct"]
    return procs.start(
        [*command, "--spec", json.dumps(spec)], env=_env(), output="lines", cpus={cpu}
    )


def direct_reader(spec: dict[str, Any]) -> None:
    """The ``--role direct`` process: decode's own token times until ``until`` (perf_counter).

    Requests follow one another straight through the workers (prefill, then
    the decode worker's websocket, as the router speaks to them); prints
    ``RESULT {"runs": [[arrival time of each token of one request], ...],
    "error": ...}`` (a frame of k tokens: its time k times).
    """
    from benchmarks.token_path.light_load import _direct_reader  # trio-websocket: here only

    runs: list[list[float]] = []
    error = None

    async def main() -> None:
        until = spec["until"]
        while (left := until - time.perf_counter()) > 0:
            times: list[float] = []
            runs.append(times)
            tokens = min(_DIRECT_MAX_TOKENS, int(left / spec["step_s"]) + 50)
            with trio.move_on_after(left + 0.2):
                await _direct_reader(spec["prefill"], spec["decode"], tokens, trio.Event(), times)

    try:
        trio.run(main)
    except Exception as exc:  # reported, not raised: the run goes on without this figure
        error = repr(exc)
    print("RESULT " + json.dumps({"runs": runs, "error": error}), flush=True)


def start_link_floor(
    procs: Processes, workers: Workers, load: Load, sizes: Sizes, cpu: int
) -> subprocess.Popen[bytes]:
    """The ``--role floor`` process (below), on ``cpu``, driving ``load``'s requests."""
    spec = {
        "prefill": workers.prefill.url,
        "decode": workers.decode.url,
        "clients": load.clients,
        "max_tokens": load.max_tokens,
        "warmup_s": sizes.warmup_s,
        "measure_s": sizes.measure_s,
    }
    command = [sys.executable, "-m", "benchmarks.router_cost", "--role", "floor"]
    return procs.start(
        [*command, "--spec", json.dumps(spec)], env=_env(), output="lines", cpus={cpu}
    )


def link_floor(spec: dict[str, Any]) -> None:
    """The ``--role floor`` process: the link exchange of a short load's requests, alone.

    Each request goes straight over two ``WorkerLink``s, as the router's legs
    make it (the router's request, parsed once from the load's body; its id,
    release token, decode start and block count), and nothing else: no HTTP,
    no request pipeline, no metrics.  Rounds of ``clients`` requests at once,
    the next when all have ended, as the load sends them.  Once both links are
    up it prints ``WINDOW <start> <end>`` (perf_counter: the warm-up, then the
    window), and after the window ``RESULT {"requests": ..., "failures": ...}``
    for the requests that ended in it; the driver reads its CPU from /proc.
    """
    from benchmarks.token_path.sse_clients import completion_request
    from pdtrio.protocol.kv_layout import choice_blocks_needed
    from pdtrio.protocol.link import wire
    from pdtrio.protocol.openai import parse_completion_request
    from pdtrio.router.stream_outcome import StreamFailed, StreamRejected
    from pdtrio.router.workers.kv_leases import LeaseClock
    from pdtrio.router.workers.link import WorkerLink

    config = RouterConfig()
    body = completion_request(LOOPBACK, spec["max_tokens"]).split(b"\r\n\r\n", 1)[1]
    request = parse_completion_request(
        body, served_models={"synthetic"}, max_tokens_limit=config.max_tokens_limit
    )
    numbers = itertools.count()
    prefix = f"floor-{os.getpid()}-"
    clients = spec["clients"]
    counted = {"requests": 0, "failures": 0}
    window = (0.0, 0.0)
    leases = LeaseClock()  # the router's, handed to every link

    def link(instance_id: str, url: str, on_capacity: Callable[[], None]) -> WorkerLink:
        ws_url = "ws" + url.removeprefix("http") + "/pd/link"
        return WorkerLink(
            instance_id,
            ws_url,
            max_pending_tokens=config.stream_buffer_tokens,
            on_capacity=on_capacity,
            link_timeout_s=config.link_timeout_s,
            heartbeat_s=config.link_heartbeat_s,
            stream_idle_timeout_s=config.stream_idle_timeout_s,
            leases=leases,
        )

    async def exchange(prefill: WorkerLink, decode: WorkerLink) -> bool:
        """One request's link work; whether it ended well."""
        request_id = f"{prefix}{next(numbers):x}"
        reply = await prefill.prefill(
            wire.PrefillRequest(
                request_id,
                request.prompt,
                request.sampling,
                request.max_tokens,
                leases.release_token(request_id),
            )
        )
        if not isinstance(reply, wire.PrefillReply):
            return False
        handle = reply.kv_handle
        if handle is None:
            return reply.finish_reason is not None  # prefill's token was the answer
        start = wire.DecodeStart(
            request_id=request_id,
            prompt_token_ids=reply.prompt_token_ids,
            first_token_id=reply.first_token_id,
            sampling=request.sampling,
            token_budget=reply.token_budget,
            tokens_generated=1,
            cached_tokens=reply.cached_tokens,
            kv_handle=handle,
        )
        assert decode.capacity is not None
        blocks = choice_blocks_needed(
            reply.prompt_tokens,
            reply.prompt_tokens + reply.token_budget,
            1,
            decode.capacity.block_size,
        )
        stream = await decode.start(start, blocks)
        released = False
        while True:
            ended = isinstance(stream.outcome, StreamFailed | StreamRejected)
            delta = stream.buffer.take()
            if delta is not None:
                if delta.num_tokens and not released:
                    # the router frees prefill's KV at decode's first tokens
                    prefill.release(request_id, handle.access_token)
                    released = True
                if delta.finish_reason is not None:
                    return True
            if ended:
                if not released:
                    prefill.release(request_id, handle.access_token)
                return False
            await stream.wait_update()

    async def one(prefill: WorkerLink, decode: WorkerLink) -> None:
        ended_well = await exchange(prefill, decode)
        if window[0] <= time.perf_counter() <= window[1]:
            counted["requests" if ended_well else "failures"] += 1

    async def main() -> None:
        nonlocal window
        reported = trio.Event()
        prefill = link("prefill", spec["prefill"], lambda: None)
        decode = link("decode", spec["decode"], reported.set)
        async with trio.open_nursery() as links:
            await links.start(prefill.run)
            await links.start(decode.run)
            await reported.wait()  # the router places nothing on decode before its report
            start = time.perf_counter() + spec["warmup_s"]
            window = (start, start + spec["measure_s"])
            print(f"WINDOW {window[0]!r} {window[1]!r}", flush=True)
            while time.perf_counter() < window[1]:
                async with trio.open_nursery() as round_:
                    for _ in range(clients):
                        round_.start_soon(one, prefill, decode)
            links.cancel_scope.cancel()

    trio.run(main)
    print("RESULT " + json.dumps(counted), flush=True)


# --- one run ---------------------------------------------------------------------------


@dataclasses.dataclass
class Sample:
    at: float
    router: dict[int, float]
    decode: float
    prefill: float
    router_core: tuple[int, int]
    load_core: tuple[int, int]


def measure(
    procs: Processes,
    server: Server,
    service: Service,
    load: Load,
    workers: Workers,
    sizes: Sizes,
    cpus: tuple[int, int],
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """The run's row, and its raw latencies in ms (for ``--plot``): "ttft", "itl" (per
    read) and, where decode was read directly, "decode_itl" (its frames' gaps)."""
    router_cpu, load_cpu = cpus
    pids = service.tree()
    direct = None
    if server.app == "pdtrio" and load.step_s > 0:
        until = time.perf_counter() + sizes.warmup_s + sizes.measure_s + 0.2
        direct = start_direct_reader(procs, workers, load.step_s, until, load_cpu)
    samples: dict[str, Sample] = {}

    def on_window(edge: str) -> None:
        samples[edge] = Sample(
            time.perf_counter(),
            {pid: cpu_seconds([pid]) for pid in pids},
            cpu_seconds([workers.decode.pid]),
            cpu_seconds([workers.prefill.pid]),
            core_busy_ticks(router_cpu),
            core_busy_ticks(load_cpu),
        )

    result = closed_loop(
        service.address,
        completion_request(LOOPBACK, load.max_tokens),
        clients=load.clients,
        expected_tokens=load.max_tokens,
        warmup_s=sizes.warmup_s,
        measure_s=sizes.measure_s,
        keepalive=load.keepalive,
        rounds=load.rounds,
        ramp_s=sizes.ramp_s,
        on_window=on_window,
    )
    own_gaps: list[float] = []
    own_error = None
    if direct is not None:
        start, end = samples["start"].at, samples["end"].at
        try:
            own = json.loads(procs.read_line(direct, b"RESULT ", 30))
        except ProcessError as exc:
            own = {"runs": [], "error": str(exc)}
        own_error = own["error"]
        # per token (0 between two tokens of one frame); a gap counts where it ends, as
        # the clients' do
        own_gaps = [
            b - a
            for run in own["runs"]
            for a, b in zip(run, run[1:], strict=False)
            if start <= b <= end
        ]
        procs.stop(direct, grace_s=5)
    row = summarise(server, load, result, samples["start"], samples["end"], own_gaps)
    row["decode_own_error"] = own_error
    latencies = {
        "ttft": [_ms(t) for t in result["ttfts"]],
        "itl": [_ms(g) for g in result["gaps"]],
        "decode_itl": [_ms(g) for g in own_gaps if g > 0],
    }
    return row, latencies


def measure_link_floor(
    procs: Processes, workers: Workers, load: Load, sizes: Sizes, cpus: tuple[int, int]
) -> dict[str, Any]:
    """The link floor of ``load``: the ``--role floor`` process on the servers' core, its
    CPU from /proc over its window, as a server's is measured."""
    router_cpu, load_cpu = cpus
    process = start_link_floor(procs, workers, load, sizes, router_cpu)
    try:
        start, end = (float(t) for t in procs.read_line(process, b"WINDOW ", 60).split())
        edges = []
        for edge in (start, end):
            time.sleep(max(0.0, edge - time.perf_counter()))
            edges.append(
                (
                    time.perf_counter(),
                    cpu_seconds([process.pid]),
                    core_busy_ticks(router_cpu),
                    core_busy_ticks(load_cpu),
                )
            )
        counted = json.loads(procs.read_line(process, b"RESULT ", 30))
    finally:
        procs.stop(process, grace_s=5)
    (t0, cpu0, core0, load0), (t1, cpu1, core1, load1) = edges
    wall = t1 - t0
    cpu_s = cpu1 - cpu0
    requests = counted["requests"]
    core_busy = (core1[0] - core0[0]) / max(1, core1[1] - core0[1])
    return {
        "load": load.key,
        "clients": load.clients,
        "max_tokens": load.max_tokens,
        "window_s": wall,
        "requests": requests,
        "requests_per_s": requests / wall,
        "failures": counted["failures"],
        "cpu_s": cpu_s,
        "util": cpu_s / wall,
        "ms_per_request": _ratio(cpu_s * 1e3, requests),
        "core_others": max(0.0, core_busy - cpu_s / wall),
        "load_core_busy": (load1[0] - load0[0]) / max(1, load1[1] - load0[1]),
    }


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _ms(seconds: float) -> float:
    return seconds * 1e3


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def summarise(
    server: Server,
    load: Load,
    result: dict[str, Any],
    start: Sample,
    end: Sample,
    own_gaps: list[float],
) -> dict[str, Any]:
    wall = end.at - start.at
    by_process = {pid: end.router[pid] - start.router.get(pid, 0.0) for pid in end.router}
    router_s = sum(by_process.values())
    tokens, requests = result["tokens"], result["requests_done"]
    gaps, gap_tokens = result["gaps"], result["gap_tokens"]
    per_token = [g / k for g, k in zip(gaps, gap_tokens, strict=True) for _ in range(k)]
    # decode's own: its mean time per token, and the gaps between its frames (per read)
    own_step = statistics.fmean(own_gaps) if own_gaps else None
    own_frames = [g for g in own_gaps if g > 0]
    own_p99 = percentile(own_frames, 99)
    step_ref = own_step if own_step is not None else load.step_s
    streaming = result["streaming"]
    pace = None
    if load.step_s > 0 and streaming:
        taken = sum(duration for duration, _ in streaming)
        pace = _ratio(sum(n for _, n in streaming) * step_ref, taken)
    core_busy = (end.router_core[0] - start.router_core[0]) / max(
        1, end.router_core[1] - start.router_core[1]
    )
    load_busy = (end.load_core[0] - start.load_core[0]) / max(
        1, end.load_core[1] - start.load_core[1]
    )
    itl_p99 = percentile(gaps, 99)
    row = {
        "server": server.key,
        "app": server.app,
        "router_processes": server.processes,
        "egress_max_delay_s": server.cap_s,
        "tokens_per_event": server.tokens_per_event if server.app == "trivial" else None,
        "load": load.key,
        "clients": load.clients,
        "max_tokens": load.max_tokens,
        "step_ms": _ms(load.step_s),
        "keepalive": load.keepalive,
        "rounds": load.rounds,
        "window_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        # every stream always decoding, each response's first token prefill's (at once)
        "offered_tokens_per_s": (
            load.clients * load.max_tokens / ((load.max_tokens - 1) * load.step_s)
            if load.step_s
            else None
        ),
        "tokens_per_read": _ratio(tokens, result["arrivals"]),
        "requests": requests,
        "requests_per_s": requests / wall,
        "incomplete": result["incomplete"],
        "failures": result["failures"],
        "failures_total": result["failures_total"],
        "router_cpu_s": router_s,
        "router_cpu_by_process_s": sorted(
            (round(v, 4) for v in by_process.values() if v > 0), reverse=True
        ),
        "router_util": router_s / wall,
        "router_core_busy": core_busy,
        "router_core_others": max(0.0, core_busy - router_s / wall),
        "router_ms_per_request": _ratio(router_s * 1e3, requests),
        "router_us_per_token": _ratio(router_s * 1e6, tokens),
        "ttft_p50_ms": _ms(percentile(result["ttfts"], 50)),
        "ttft_p99_ms": _ms(percentile(result["ttfts"], 99)),
        "itl_p50_ms": _ms(percentile(gaps, 50)),
        "itl_p99_ms": _ms(itl_p99),
        "itl_token_p50_ms": _ms(percentile(per_token, 50)),
        "itl_token_p99_ms": _ms(percentile(per_token, 99)),
        "decode_own_itl_p50_ms": _ms(percentile(own_frames, 50)) if own_frames else None,
        "decode_own_itl_p99_ms": _ms(own_p99) if own_frames else None,
        "decode_own_step_ms": _ms(own_step) if own_step is not None else None,
        "decode_own_tokens_per_frame": _ratio(len(own_gaps), len(own_frames)),
        "decode_own_samples": len(own_frames),
        "added_itl_p99_ms": _ms(itl_p99 - own_p99) if own_frames else None,
        "pace": pace,
        "decode_us_per_token": _ratio((end.decode - start.decode) * 1e6, tokens)
        if server.app == "pdtrio"
        else None,
        "prefill_cpu_s": end.prefill - start.prefill,
        "load_cpu_s": result["load_cpu_s"],
        "load_core_busy": load_busy,
    }
    # nothing measured: None (JSON has no NaN)
    return {k: None if isinstance(v, float) and v != v else v for k, v in row.items()}


Latencies = dict[tuple[str, str], dict[str, list[float]]]  # (server, load) -> raw ms


def run(
    sizes: Sizes, progress: Callable[[str], None]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Latencies]:
    """The runs' rows, the link floor's rows (see :func:`measure_link_floor`), and each
    run's raw latencies (see :func:`measure`)."""
    router_cpu, load_cpu = router_and_load_cpus()
    steps = plan(sizes)
    floor = floor_loads(sizes)
    total = sum(len(loads) for _, loads in steps) + len(floor)
    runs: list[dict[str, Any]] = []
    floors: list[dict[str, Any]] = []
    latencies: Latencies = {}
    with Processes() as procs, tempfile.TemporaryDirectory() as tmp:
        workers = start_workers(procs, load_cpu)
        # first: next to the short rows, against the same (fast) workers
        for load in floor:
            started = time.perf_counter()
            floors.append(
                measure_link_floor(procs, workers[0.0], load, sizes, (router_cpu, load_cpu))
            )
            progress(
                f"[{len(floors)}/{total}] link floor {load.key}: "
                f"{time.perf_counter() - started:.1f}s"
            )
        for server, loads in steps:
            service = start_server(procs, server, workers[server.step_s], {router_cpu}, Path(tmp))
            for load in loads:
                started = time.perf_counter()
                row, latencies[server.key, load.key] = measure(
                    procs,
                    server,
                    service,
                    load,
                    workers[server.step_s],
                    sizes,
                    (router_cpu, load_cpu),
                )
                runs.append(row)
                progress(
                    f"[{len(floors) + len(runs)}/{total}] {server.key} {load.key}: "
                    f"{time.perf_counter() - started:.1f}s"
                )
            procs.stop(service.process)
    return runs, floors, latencies


# --- the report ------------------------------------------------------------------------


def _fmt(value: Any, spec: str = ".1f", unit: str = "") -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "—"
    return format(value, spec) + unit


def _pair(a: Any, b: Any, spec: str = ".1f", unit: str = " ms") -> str:
    if a is None and b is None:
        return "—"
    return f"{_fmt(a, spec)} / {_fmt(b, spec)}{unit}"


def _cost_ratio(p: dict[str, Any], t: dict[str, Any], key: str) -> float | None:
    return _ratio(p[key] or 0.0, t[key] or 0.0)


def _ms_per_request(r: dict[str, Any]) -> str:
    return _fmt(r["router_ms_per_request"], ".2f", " ms")


def _us_per_token(r: dict[str, Any]) -> str:
    return _fmt(r["router_us_per_token"], ".1f", " µs")


def _ttft(r: dict[str, Any]) -> str:
    return _pair(r["ttft_p50_ms"], r["ttft_p99_ms"])


def _itl_per_read(r: dict[str, Any]) -> str:
    return _pair(r["itl_p50_ms"], r["itl_p99_ms"])


def _itl_per_token(r: dict[str, Any]) -> str:
    return _pair(r["itl_token_p50_ms"], r["itl_token_p99_ms"])


def _request_load(r: dict[str, Any]) -> str:
    """Requests/s; failures; router / load core."""
    return f"{r['requests_per_s']:,.0f}; {_failures(r)}; {_cores(r)}"


def _stream_load(r: dict[str, Any]) -> str:
    """Failures; tokens per read; router / load core."""
    return f"{_failures(r)}; {_fmt(r['tokens_per_read'], '.2f')}; {_cores(r)}"


def _verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("PASS" if ok else "FAIL")


def _check(value: float | None, limit: float) -> bool | None:
    if value is None or value != value:
        return None
    return value <= limit


def _cores(r: dict[str, Any]) -> str:
    """The server's CPU over the window (of one core), and the load core's busy time."""
    return f"{r['router_util']:.0%} / {r['load_core_busy']:.0%}"


def _failures(r: dict[str, Any]) -> int:
    failures: dict[str, int] = r["failures_total"]
    incomplete: int = r["incomplete"]
    return sum(failures.values()) + incomplete


def _delivered(r: dict[str, Any]) -> str:
    offered = r["offered_tokens_per_s"]
    text = f"{r['tokens_per_s']:,.0f}"
    if offered:
        text += f" / {offered:,.0f} ({r['tokens_per_s'] / offered:.0%})"
    if r["pace"] is not None:
        text += f"; pace {r['pace']:.1%}"
    return text


def _all_delivered(r: dict[str, Any]) -> bool | None:
    """No failure, every response whole, and the streams kept decode's pace (within 2%)."""
    if r["pace"] is None:
        return None
    return _failures(r) == 0 and r["pace"] >= 0.98


def report(
    runs: list[dict[str, Any]],
    link_floors: list[dict[str, Any]],
    sizes: Sizes,
    cpus: tuple[int, int],
) -> dict[str, Any]:
    """The table's rows, the goals and the notes, from the runs and the link floor's."""
    by = {(r["server"], r["load"]): r for r in runs}
    floor_by = {f["load"]: f for f in link_floors}
    rows: list[list[str]] = []
    goals: list[dict[str, Any]] = []

    def goal(name: str, value: float | None, limit: float, text: str, ok: bool | None) -> str:
        goals.append({"goal": name, "value": value, "limit": limit, "pass": ok, "measured": text})
        return _verdict(ok)

    def row(load: str, what: str, pdtrio: str, trivial: str, vs: str = "", g: str = "") -> None:
        rows.append([load, what, pdtrio, trivial, vs, g])

    def floor_row(p: dict[str, Any], t: dict[str, Any], ratio: float | None) -> float | None:
        """The link floor of ``p``'s load beside pdtrio's cost; trivial + floor, of trivial."""
        floor_ms = floor_by[p["load"]]["ms_per_request"]
        trivial_ms = t["router_ms_per_request"]
        with_floor = None if floor_ms is None or trivial_ms is None else trivial_ms + floor_ms
        floor_ratio = None if with_floor is None else _ratio(with_floor, trivial_ms)
        row(
            "",
            "link floor (the link exchange alone); pdtrio above trivial + floor",
            f"{_fmt(floor_ms, '.2f', ' ms')}; "
            f"{_fmt(_minus(p['router_ms_per_request'], with_floor), '+.2f', ' ms')}",
            f"{_fmt(with_floor, '.2f', ' ms')} with the floor",
            f"{_fmt(floor_ratio, '.2f', '×')} (pdtrio {_fmt(ratio, '.2f', '×')})",
        )
        return floor_ratio

    # 1. short requests
    for key, label in (
        ("short", "kept-alive connections"),
        ("short_new_conn", "a new connection each"),
    ):
        p, t = by["pdtrio_fast", key], by["trivial_fast", key]
        name = (
            f"{p['clients']} concurrent requests of {p['max_tokens']} tokens "
            f"(rounds of {p['clients']} at once), {label}"
        )
        ratio = _cost_ratio(p, t, "router_ms_per_request")
        met = ""
        if key == "short":
            met = goal(
                f"router CPU per short request <= {_SHORT_COST_GOAL:g}x the trivial app's",
                ratio,
                _SHORT_COST_GOAL,
                f"{_fmt(ratio, '.2f')}x",
                _check(ratio, _SHORT_COST_GOAL),
            )
        row(
            name,
            "router CPU per request",
            _ms_per_request(p),
            _ms_per_request(t),
            _fmt(ratio, ".2f", "×"),
            (f"≤ {_SHORT_COST_GOAL:g}×: " + met) if met else "",
        )
        met = ""
        if key == "short":
            met = goal(
                f"TTFT p50, {p['clients']} concurrent {p['max_tokens']}-token requests <= 8 ms",
                p["ttft_p50_ms"],
                8.0,
                f"{_fmt(p['ttft_p50_ms'])} ms",
                _check(p["ttft_p50_ms"], 8.0),
            )
        row(
            "",
            "TTFT p50 / p99",
            _ttft(p),
            _ttft(t),
            "",
            ("p50 ≤ 8 ms: " + met) if met else "",
        )
        row(
            "",
            "requests/s; failures; router / load core",
            _request_load(p),
            _request_load(t),
        )
        if key == "short":
            short_floor_ratio = floor_row(p, t, ratio)

    # prefill's token alone: one worker exchange, the least a request can cost
    p, t = by["pdtrio_fast", "short_one"], by["trivial_fast", "short_one"]
    one_ratio = _cost_ratio(p, t, "router_ms_per_request")
    row(
        f"{p['clients']} concurrent requests of 1 token (prefill's token is the answer: "
        "one worker exchange, the least a request costs), kept-alive connections",
        "router CPU per request",
        _ms_per_request(p),
        _ms_per_request(t),
        _fmt(one_ratio, ".2f", "×"),
    )
    row(
        "",
        "TTFT p50 / p99",
        _ttft(p),
        _ttft(t),
    )
    row(
        "",
        "requests/s; failures; router / load core",
        _request_load(p),
        _request_load(t),
    )
    floor_row(p, t, one_ratio)
    short_trivial = by["trivial_fast", "short"]
    short_floor = floor_by["short"]
    below = (
        ": the goal sits below this floor"
        if short_floor_ratio is not None and short_floor_ratio > _SHORT_COST_GOAL
        else ""
    )
    floors = [
        f"the least a request costs (1 token, prefill's; one worker exchange): "
        f"{_fmt(p['router_ms_per_request'], '.2f', ' ms')} of router CPU, "
        f"{_fmt(one_ratio, '.2f', '×')} the trivial app's (the goal, for 2 tokens: "
        f"≤ {_SHORT_COST_GOAL:g}×)",
        f"the link exchange alone (the prefill call, decode's start and tokens, the release, "
        f"straight over two WorkerLinks: no HTTP, no pipeline) of a "
        f"{short_floor['max_tokens']}-token request: "
        f"{_fmt(short_floor['ms_per_request'], '.2f', ' ms')} of CPU; the trivial app's cost "
        f"plus it: {_fmt(short_floor_ratio, '.2f', '×')} the trivial app's (the goal for "
        f"pdtrio: ≤ {_SHORT_COST_GOAL:g}×{below})",
        f"the trivial app's own TTFT p50 for {short_trivial['clients']} concurrent "
        f"{short_trivial['max_tokens']}-token requests: "
        f"{_fmt(short_trivial['ttft_p50_ms'])} ms (the goal for pdtrio: ≤ 8 ms)",
    ]

    # 2. paced streams, egress on and off
    large = sizes.paced_streams[1]
    for load_key in ("paced_small", "paced_large"):
        t = by["trivial_paced", load_key]
        for server_key in ("pdtrio_on", "pdtrio_off"):
            p = by[server_key, load_key]
            cap = p["egress_max_delay_s"]
            egress = f"egress on (cap {cap:g} s)" if cap else "egress off"
            name = (
                f"{p['clients']} streams × {p['max_tokens']} tokens, "
                f"decode every {p['step_ms']:g} ms, {egress}"
            )
            goaled = server_key == "pdtrio_on"  # the goals are for the default configuration
            big = goaled and load_key == "paced_large"
            ratio = _cost_ratio(p, t, "router_us_per_token")
            met = ""
            if big:
                met = goal(
                    f"{large} streams: router CPU <= 15 us/token",
                    p["router_us_per_token"],
                    15.0,
                    f"{_fmt(p['router_us_per_token'])} us",
                    _check(p["router_us_per_token"], 15.0),
                )
            row(
                name,
                "router CPU per token",
                _us_per_token(p),
                _us_per_token(t),
                _fmt(ratio, ".2f", "×"),
                ("≤ 15 µs: " + met) if met else "",
            )
            met = ""
            if big:
                # the measure: the gap per token as a client sees it (an event of
                # k tokens counts k gaps of gap/k); the per-read gaps are shown beside it
                limit = _ms(cap or 0.0) + 10.0
                met = goal(
                    f"{large} streams: ITL p99 (per token) <= cap + 10 ms",
                    p["itl_token_p99_ms"],
                    limit,
                    f"{_fmt(p['itl_token_p99_ms'])} ms",
                    _check(p["itl_token_p99_ms"], limit),
                )
                met = f"p99 ≤ {limit:g} ms: {met}"
            row(
                "",
                "ITL p50 / p99, per read",
                _itl_per_read(p),
                _itl_per_read(t),
                f"p99 {_fmt(_minus(p['itl_p99_ms'], t['itl_p99_ms']), '+.1f')} ms",
            )
            row(
                "",
                "ITL p50 / p99, per token",
                _itl_per_token(p),
                _itl_per_token(t),
                "",
                met,
            )
            met = ""
            if goaled and load_key == "paced_small":
                met = goal(
                    f"{p['clients']} streams: router's added ITL p99 over decode's own <= 5 ms",
                    p["added_itl_p99_ms"],
                    5.0,
                    f"{_fmt(p['added_itl_p99_ms'], '+.1f')} ms",
                    _check(p["added_itl_p99_ms"], 5.0),
                )
                met = "added ≤ 5 ms: " + met
            row(
                "",
                "decode's own ITL p99; router's added p99",
                f"{_fmt(p['decode_own_itl_p99_ms'])} ms; {_fmt(p['added_itl_p99_ms'], '+.1f')} ms",
                "",
                "",
                met,
            )
            met = ""
            if big:
                met = goal(
                    f"{large} streams: TTFT p50 <= 50 ms",
                    p["ttft_p50_ms"],
                    50.0,
                    f"{_fmt(p['ttft_p50_ms'])} ms",
                    _check(p["ttft_p50_ms"], 50.0),
                )
                met = "p50 ≤ 50 ms: " + met
            row(
                "",
                "TTFT p50 / p99",
                _ttft(p),
                _ttft(t),
                "",
                met,
            )
            met = ""
            if big:
                met = goal(
                    f"{large} streams: every token decode offered delivered, at its pace "
                    "(no failure, pace >= 98%)",
                    p["pace"],
                    0.98,
                    _delivered(p),
                    _all_delivered(p),
                )
                met = "no failure, pace ≥ 98%: " + met
            row(
                "",
                "delivered / offered tok/s; pace",
                _delivered(p),
                _delivered(t),
                "",
                met,
            )
            met = ""
            if big:
                met = goal(
                    f"{large} streams: zero failures",
                    float(_failures(p)),
                    0.0,
                    str(_failures(p)),
                    _failures(p) == 0,
                )
                met = "none: " + met
            row(
                "",
                "failures; tok/read; router / load core",
                _stream_load(p),
                _stream_load(t),
                "",
                met,
            )

    # the same streams against the trivial app sending as many events as pdtrio's capped egress
    p, t = by["pdtrio_on", "paced_large"], by["trivial_grouped", "paced_large"]
    name = (
        f"{p['clients']} streams × {p['max_tokens']} tokens, decode every {p['step_ms']:g} ms, "
        f"egress on, against the trivial app sending {t['tokens_per_event']} tokens an event "
        "(the events pdtrio's egress sends at its cap)"
    )
    row(
        name,
        "router CPU per token",
        _us_per_token(p),
        _us_per_token(t),
        _fmt(_cost_ratio(p, t, "router_us_per_token"), ".2f", "×"),
    )
    row(
        "",
        "ITL p50 / p99, per token",
        _itl_per_token(p),
        _itl_per_token(t),
    )
    row(
        "",
        "TTFT p50 / p99",
        _ttft(p),
        _ttft(t),
    )
    row(
        "",
        "failures; tok/read; router / load core",
        _stream_load(p),
        _stream_load(t),
    )
    floors.append(
        f"the trivial app sending {t['tokens_per_event']} tokens an event to {t['clients']} "
        f"streams: {_fmt(t['router_us_per_token'], '.1f', ' µs')} of CPU per token "
        "(the goal for pdtrio: ≤ 15 µs)"
    )

    # 3. decode as fast as it can
    for server_key in ("pdtrio_fast", "pdtrio_fast_off"):
        p = by[server_key, "fast"]
        cap = p["egress_max_delay_s"]
        egress = f"egress on (cap {cap:g} s)" if cap else "egress off"
        name = (
            f"{p['clients']} streams × {p['max_tokens']} tokens, decode as fast as it can, {egress}"
        )
        row(name, "router CPU per token", _us_per_token(p), "—")
        row(
            "",
            "tok/s; tok/read; failures; router / load core",
            f"{p['tokens_per_s']:,.0f}; {_fmt(p['tokens_per_read'], '.2f')}; "
            f"{_failures(p)}; {_cores(p)}",
            "—",
        )

    # 4. two router processes
    p, t = by["pdtrio_two", "paced_large"], by["trivial_two", "paced_large"]
    one = by["pdtrio_on", "paced_large"]
    name = (
        f"two router processes (hypercorn -w 2, both on cpu {cpus[0]}): "
        f"{p['clients']} streams × {p['max_tokens']} tokens every {p['step_ms']:g} ms, egress on"
    )

    def split(r: dict[str, Any]) -> str:
        shares = r["router_cpu_by_process_s"]
        total = sum(shares) or 1.0
        return " + ".join(f"{s / total:.0%}" for s in shares)

    row(
        name,
        "router CPU per token, processes summed (split)",
        f"{_fmt(p['router_us_per_token'], '.1f', ' µs')} ({split(p)})",
        f"{_fmt(t['router_us_per_token'], '.1f', ' µs')} ({split(t)})",
        _fmt(_cost_ratio(p, t, "router_us_per_token"), ".2f", "×"),
        "vs one process: " + _fmt(_cost_ratio(p, one, "router_us_per_token"), ".2f", "×"),
    )
    row(
        "",
        "ITL p50 / p99, per read",
        _itl_per_read(p),
        _itl_per_read(t),
    )
    row(
        "",
        "TTFT p50 / p99",
        _ttft(p),
        _ttft(t),
    )
    row("", "delivered / offered tok/s; pace", _delivered(p), _delivered(t))
    row(
        "",
        "failures; tok/read; routers / load core",
        _stream_load(p),
        _stream_load(t),
    )
    return {
        "rows": rows,
        "goals": goals,
        "floors": floors,
        "notes": notes(runs, link_floors, large),
    }


def notes(runs: list[dict[str, Any]], link_floors: list[dict[str, Any]], large: int) -> list[str]:
    out = []
    for f in link_floors:
        if f["failures"]:
            out.append(f"link floor {f['load']}: {f['failures']} requests failed in the window")
        if f["core_others"] > 0.05:
            out.append(
                f"link floor {f['load']}: other processes used {f['core_others']:.0%} of "
                "the servers' core"
            )
    for r in runs:
        if r["load"] == "paced_large" and r["decode_own_step_ms"] is not None:
            if r["decode_own_step_ms"] > 1.02 * r["step_ms"]:
                per_stream = 1e3 / r["decode_own_step_ms"]
                out.append(
                    f"{r['server']} {large} streams: the load side offered only "
                    f"{per_stream * r['clients']:,.0f} tok/s ({per_stream:.0f} per stream: decode "
                    f"stepped every {r['decode_own_step_ms']:.1f} ms; load core "
                    f"{r['load_core_busy']:.0%} busy)"
                )
        if r["load_core_busy"] > 0.9:
            out.append(
                f"{r['server']} {r['load']}: the load core was {r['load_core_busy']:.0%} busy "
                "(workers, clients): the load side may be what limits this run"
            )
        if r["decode_own_error"]:
            out.append(
                f"{r['server']} {r['load']}: the direct reader failed: {r['decode_own_error']}"
            )
        if r["router_core_others"] > 0.05:
            out.append(
                f"{r['server']} {r['load']}: other processes used "
                f"{r['router_core_others']:.0%} of the router's core"
            )
    return out


def render(summary: dict[str, Any]) -> str:
    header = ["load", "measure", "pdtrio", "trivial app", "pdtrio vs trivial", "goal"]
    lines = [
        f"router cost ({'quick' if summary['quick'] else 'full'}): {summary['machine']}",
        "",
        markdown_table(header, summary["rows"]),
    ]
    lines += ["", "goals:"]
    lines += [f"  {_verdict(g['pass']):4}  {g['goal']}: {g['measured']}" for g in summary["goals"]]
    lines += ["", "what hypercorn-trio itself does here (beside the goals):"]
    lines += [f"  {floor}" for floor in summary["floors"]]
    if summary["notes"]:
        lines += ["", "notes:"] + [f"  {n}" for n in summary["notes"]]
    return "\n".join(lines)


# --- the figure ------------------------------------------------------------------------

_PACED_SERVERS = {
    "pdtrio_on": "pdtrio, egress on",
    "pdtrio_off": "pdtrio, egress off",
    "trivial_paced": "trivial app",
}


def plot(path: Path, runs: list[dict[str, Any]], latencies: Latencies, quick: bool) -> None:
    by = {(r["server"], r["load"]): r for r in runs}
    cdfs = plotting.latency_cdfs
    panels: list[plotting.Panel] = []
    for load in ("paced_small", "paced_large"):
        sample = by["pdtrio_on", load]
        what = (
            f"{sample['clients']} streams × {sample['max_tokens']} tokens, "
            f"decode every {sample['step_ms']:g} ms"
        )
        ttft = {label: latencies[key, load]["ttft"] for key, label in _PACED_SERVERS.items()}
        itl = {label: latencies[key, load]["itl"] for key, label in _PACED_SERVERS.items()}
        itl["decode's own (its websocket)"] = latencies["pdtrio_on", load]["decode_itl"]
        panels.append(partial(cdfs, series=ttft, xlabel="TTFT (ms)", title=f"{what}: TTFT"))
        panels.append(
            partial(
                cdfs, series=itl, xlabel="gap between reads (ms)", title=f"{what}: ITL, per read"
            )
        )
    loads = ("paced_small", "paced_large")
    panels.append(
        partial(
            plotting.throughput_vs_concurrency,
            series={
                label: [(by[key, load]["clients"], by[key, load]["tokens_per_s"]) for load in loads]
                for key, label in _PACED_SERVERS.items()
            },
            reference={
                "offered (every stream decoding)": [
                    (
                        by["pdtrio_on", load]["clients"],
                        by["pdtrio_on", load]["offered_tokens_per_s"],
                    )
                    for load in loads
                ]
            },
            title="paced streams: tokens/s against concurrency",
        )
    )
    short = by["pdtrio_fast", "short"]
    panels.append(
        partial(
            cdfs,
            series={
                f"{app}, {conn}": latencies[server, load]["ttft"]
                for server, app in (("pdtrio_fast", "pdtrio"), ("trivial_fast", "trivial app"))
                for load, conn in (("short", "kept alive"), ("short_new_conn", "new connection"))
            },
            xlabel="TTFT (ms)",
            title=f"short requests: rounds of {short['clients']} × {short['max_tokens']} tokens",
        )
    )
    plotting.save_figure(
        path,
        *panels,
        title=f"router_cost ({'quick: figures mean nothing' if quick else 'full'}): "
        "pdtrio's router beside a trivial SSE app, one core each",
        columns=2,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.router_cost",
        description="Router CPU per request and per token, and the latency it adds, "
        "beside a trivial hypercorn-trio SSE app.",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny version of every row (CI)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--plot", type=Path, default=None, help="draw the latency CDFs into this PNG (matplotlib)"
    )
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="only the tracing rows: tracing off, on at 1.0 and at 0.01, in alternated "
        "rounds, beside the OpenTelemetry SDK's own floor (benchmarks.router_cost_versus)",
    )
    parser.add_argument("--role", choices=["direct", "floor"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tracing:
        from benchmarks import router_cost_versus

        forwarded = ["--tracing", *(["--quick"] if args.quick else [])]
        return router_cost_versus.main(
            forwarded + ([] if args.json is None else ["--json", str(args.json)])
        )
    if args.role == "direct":
        direct_reader(json.loads(args.spec))
        return 0
    if args.role == "floor":
        link_floor(json.loads(args.spec))
        return 0
    if args.plot is not None:
        plotting.require_matplotlib()
    cpus = router_and_load_cpus()
    if cpus[0] == cpus[1]:
        print("warning: one CPU only; the servers and the load share it", file=sys.stderr)
    os.sched_setaffinity(0, {cpus[1]})
    sizes = QUICK if args.quick else FULL
    started = time.perf_counter()
    runs, link_floors, latencies = run(sizes, lambda line: print(line, file=sys.stderr, flush=True))
    summary: dict[str, Any] = {
        "quick": args.quick,
        "machine": (
            f"{os.cpu_count()} cpus; servers on cpu {cpus[0]}, workers and load on cpu {cpus[1]}; "
            f"{sizes.measure_s:g} s measured after {sizes.warmup_s:g} s of warm-up per run"
        ),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "sizes": dataclasses.asdict(sizes),
        "default_egress_max_delay_s": DEFAULT_CAP_S,
        **report(runs, link_floors, sizes, cpus),
        "runs": runs,
        "link_floor": link_floors,
    }
    summary["elapsed_s"] = time.perf_counter() - started
    print(render(summary))
    print(f"\n({summary['elapsed_s']:.0f}s)")
    write_json(args.json, summary)
    if args.plot is not None:
        plot(args.plot, runs, latencies, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
