"""Decode migration: what the loss of a decode costs the streams it was serving.

Real processes on loopback: a router (``hypercorn -k trio``, static config,
``decode_policy = "round_robin"``) over one prefill and two decode workers (the
synthetic engine, one token per ``--step-ms``).  Each trial starts
``--streams`` streaming completions at once (temperature 0, ``ignore_eos``),
half on each decode, and once every stream has had ``--fault-after`` tokens one
decode is faulted:

- ``kill``: SIGKILL (its link closes: ``link_lost``); the worker is started again
  on the same port after the trial;
- ``stop``: SIGSTOP until the trial ends (its link goes silent: ``link_timeout``,
  after ``router.link_timeout_s``), then SIGCONT.

Every stream must still end complete and equal to the undisturbed run's, token
for token, and the router must count one migration per stream on the faulted
decode.  What is measured, per client event (``perf_counter`` as the client
reads it):

- the undisturbed inter-token latency (ITL), in a baseline trial of the same run;
- for each migrated stream, the gap between its last event before the fault and
  the first after it (the ITL at the fault), and what it adds to a normal ITL;
- the floor of a continuation: it is a new prefill of the prompt and the tokens
  delivered so far, which samples the next token, so its cost is at least the
  TTFT of a fresh request that long on the idle cluster (measured here too); a
  ``stop`` adds the detection time, ``link_timeout_s``, on top.

``python -m benchmarks.migration [--quick] [--trials N] [--streams N] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.kit import markdown_table, percentile, write_json
from pdtrio.testing import Processes, Service, free_port, synthetic_worker_config
from pdtrio.testing.processes import write_router_config

LINK_TIMEOUT_S = 1.5
PROMPT_TOKENS = 64


@attrs.define
class Settings:
    trials: int
    streams: int
    max_tokens: int
    fault_after: int
    step_ms: float


@attrs.define
class Stream:
    """What one client saw: when each content event came, and its text."""

    times: list[float] = attrs.field(factory=list)
    text: str = ""
    finish_reason: str | None = None
    errors: int = 0
    done: bool = False


def _body(index: int, max_tokens: int, *, stream: bool = True) -> dict[str, Any]:
    return {
        "model": "synthetic",
        "prompt": [1 + (index * 31 + i * 7) % 900 for i in range(PROMPT_TOKENS)],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


@attrs.define
class Flowing:
    """Set once ``streams`` streams have each had ``events`` content events."""

    streams: int
    events: int
    all_in: trio.Event = attrs.field(factory=trio.Event)

    def saw(self, count: int) -> None:
        if count == self.events:
            self.streams -= 1
            if self.streams == 0:
                self.all_in.set()


async def _stream(
    http: httpx.AsyncClient, index: int, max_tokens: int, into: Stream, flowing: Flowing
) -> None:
    async with http.stream("POST", "/v1/completions", json=_body(index, max_tokens)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                into.done = True
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                into.errors += 1
                continue
            for choice in chunk["choices"]:
                if choice.get("text"):
                    into.times.append(time.perf_counter())
                    into.text += choice["text"]
                    flowing.saw(len(into.times))
                if choice.get("finish_reason"):
                    into.finish_reason = choice["finish_reason"]


@attrs.define
class Trial:
    streams: list[Stream]
    faulted_at: float | None = None
    closed_after_s: float | None = None
    """From the fault to the victim's sockets closing, as an idle TCP client of its
    HTTP port sees it: how soon anyone could know (None: they did not close)."""


async def _eof_after(address: str, opened: trio.Event, trial: Trial) -> None:
    host, port = address.rsplit(":", 1)
    connection = await trio.open_tcp_stream(host, int(port))
    opened.set()
    with trio.move_on_after(LINK_TIMEOUT_S * 2):
        try:
            while await connection.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
        assert trial.faulted_at is not None
        trial.closed_after_s = time.perf_counter() - trial.faulted_at
    await connection.aclose()


async def _trial(
    router: Service, settings: Settings, fault: Any | None = None, victim: str = ""
) -> Trial:
    """``settings.streams`` streams at once; once each has ``fault_after`` events, call
    ``fault()`` (when given) on the worker at ``victim`` (host:port)."""
    trial = Trial([Stream() for _ in range(settings.streams)])
    flowing = Flowing(settings.streams, settings.fault_after)
    async with httpx.AsyncClient(base_url=router.url, timeout=120) as http:
        async with trio.open_nursery() as nursery:
            if fault is not None:
                opened = trio.Event()
                nursery.start_soon(_eof_after, victim, opened, trial)
                await opened.wait()
            for index, stream in enumerate(trial.streams):
                nursery.start_soon(_stream, http, index, settings.max_tokens, stream, flowing)
            if fault is not None:
                await flowing.all_in.wait()
                trial.faulted_at = time.perf_counter()
                fault()
    return trial


def _gaps(stream: Stream) -> list[float]:
    return [b - a for a, b in zip(stream.times, stream.times[1:], strict=False)]


def _gap_at(stream: Stream, at: float) -> float:
    """The gap between the last event before ``at`` and the first after it."""
    before = [t for t in stream.times if t <= at]
    after = [t for t in stream.times if t > at]
    return (after[0] if after else float("nan")) - (before[-1] if before else float("nan"))


def _migrations(router: Service) -> float:
    """The router's ``pdtrio_migrations_total``, every reason."""
    text = httpx.get(f"{router.url}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pdtrio_migrations_total"
    )


def _wait_decodes(router: Service, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{router.url}/health", timeout=10).json().get("decode_instances") != count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router did not see {count} decode instances")
        time.sleep(0.05)


def _ttft_floor(router: Service, settings: Settings, tokens: int, samples: int = 10) -> list[float]:
    """TTFT of fresh streams as long as a continuation's prompt, one at a time."""
    body = _body(0, 1)
    body["prompt"] = [1 + (i * 13) % 900 for i in range(tokens)]
    times = []
    with httpx.Client(base_url=router.url, timeout=60) as http:
        for _ in range(samples):
            started = time.perf_counter()
            with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                for line in lines:
                    if line.startswith("data: ") and '"text"' in line:
                        times.append(time.perf_counter() - started)
                        break
                for _ in lines:
                    pass
    return times


def run(settings: Settings) -> dict[str, Any]:
    step_s = settings.step_ms / 1000
    with tempfile.TemporaryDirectory() as tmp, Processes(stop_grace_s=30) as procs:
        prefill = procs.worker(synthetic_worker_config("prefill", decode_step_s=step_s))
        ports = [free_port(), free_port()]

        def decode_config(port: int) -> dict[str, Any]:
            return {**synthetic_worker_config("decode", decode_step_s=step_s), "port": port}

        decodes = [procs.worker(decode_config(port)) for port in ports]
        config = write_router_config(
            Path(tmp) / "router.toml",
            [("prefill", prefill.url), *(("decode", d.url) for d in decodes)],
            # round robin alone (no cache weight: the workers' prefix caches would steer
            # some streams): half the streams on each decode, the victim's are known
            router={
                "decode_policy": "round_robin",
                "decode_cache_weight": 0,
                "link_timeout_s": LINK_TIMEOUT_S,
            },
        )
        router = procs.router(config)
        _wait_decodes(router, 2)
        baseline = trio.run(_trial, router, settings).streams
        expected = [s.text for s in baseline]
        bad = [s for s in baseline if s.errors or not s.done or s.finish_reason != "length"]
        if bad:
            raise RuntimeError(f"{len(bad)} undisturbed streams did not complete")
        itl = [gap for s in baseline for gap in _gaps(s)]
        results: dict[str, Any] = {}
        for kind in ("kill", "stop"):
            at_fault: list[float] = []
            closed_after: list[float] = []
            wrong = 0
            migrations = 0.0
            for trial in range(settings.trials):
                victim_index = trial % 2
                victim = decodes[victim_index]
                before = _migrations(router)

                def fault(victim: Service = victim, kind: str = kind) -> None:
                    os.kill(victim.pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)

                try:
                    trial_run = trio.run(_trial, router, settings, fault, victim.address)
                finally:
                    if kind == "stop":
                        os.kill(victim.pid, signal.SIGCONT)
                streams, faulted_at = trial_run.streams, trial_run.faulted_at
                assert faulted_at is not None
                if trial_run.closed_after_s is not None:
                    closed_after.append(trial_run.closed_after_s)
                if kind == "kill":
                    victim.process.wait(30)  # reaped: the harness saw its status
                    decodes[victim_index] = procs.worker(decode_config(ports[victim_index]))
                _wait_decodes(router, 2)
                migrations += _migrations(router) - before
                wrong += sum(
                    s.errors > 0 or not s.done or s.text != text
                    for s, text in zip(streams, expected, strict=True)
                )
                # round robin: the faulted decode had half the streams, the largest gaps
                gaps = sorted((_gap_at(s, faulted_at) for s in streams), reverse=True)
                at_fault += gaps[: settings.streams // 2]
            itl_p50 = percentile(itl, 50)
            results[kind] = {
                "migrated_streams": len(at_fault),
                # kill: how soon the kernel closed its sockets (the floor of detection);
                # stop: nothing closes, the router's link_timeout_s is the detection
                "sockets_closed_p50_ms": percentile(closed_after, 50) * 1000,
                "migrations_counted": migrations,
                "streams_not_equal_to_undisturbed": wrong,
                "gap_at_fault_p50_ms": percentile(at_fault, 50) * 1000,
                "gap_at_fault_p99_ms": percentile(at_fault, 99) * 1000,
                "added_p50_ms": (percentile(at_fault, 50) - itl_p50) * 1000,
                "added_p99_ms": (percentile(at_fault, 99) - itl_p50) * 1000,
            }
        floor = _ttft_floor(router, settings, PROMPT_TOKENS + settings.fault_after)
    return {
        "settings": attrs.asdict(settings),
        "link_timeout_s": LINK_TIMEOUT_S,
        "itl_p50_ms": percentile(itl, 50) * 1000,
        "itl_p99_ms": percentile(itl, 99) * 1000,
        "continuation_ttft_floor_p50_ms": percentile(floor, 50) * 1000,
        "continuation_ttft_floor_p99_ms": percentile(floor, 99) * 1000,
        "faults": results,
    }


def render(r: dict[str, Any]) -> str:
    s = r["settings"]
    lines = [
        f"decode migration: {s['streams']} streams x {s['trials']} trials per fault, "
        f"{s['max_tokens']} tokens at {s['step_ms']:g} ms/step, fault after {s['fault_after']}",
        f"  undisturbed ITL            p50 {r['itl_p50_ms']:7.1f} ms   p99 {r['itl_p99_ms']:7.1f} ms",
        f"  floor: fresh TTFT ({PROMPT_TOKENS + s['fault_after']} tok) "
        f"p50 {r['continuation_ttft_floor_p50_ms']:7.1f} ms   "
        f"p99 {r['continuation_ttft_floor_p99_ms']:7.1f} ms",
        "",
    ]
    header = [
        "fault",
        "migrated streams",
        "migrations counted",
        "wrong or failed",
        "sockets closed p50",
        "ITL at fault p50",
        "p99",
        "added p50",
        "added p99",
    ]
    rows = [
        [
            kind,
            str(f["migrated_streams"]),
            f"{f['migrations_counted']:.0f}",
            str(f["streams_not_equal_to_undisturbed"]),
            *(
                "none close" if math.isnan(f[key]) else f"{f[key]:.1f} ms"
                for key in (
                    "sockets_closed_p50_ms",
                    "gap_at_fault_p50_ms",
                    "gap_at_fault_p99_ms",
                    "added_p50_ms",
                    "added_p99_ms",
                )
            ),
        ]
        for kind, f in r["faults"].items()
    ]
    lines.append(markdown_table(header, rows, align="lrrrrrrrr"))
    lines.append(
        "(added: ITL at the fault less the undisturbed ITL p50. kill: the victim's sockets "
        "close only once the kernel has torn the process down, the floor of any detection; "
        f"stop: nothing closes, detection is router.link_timeout_s = "
        f"{r['link_timeout_s'] * 1000:.0f} ms)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="CI-sized: one trial per fault")
    parser.add_argument("--trials", type=int, default=None)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    settings = Settings(
        trials=args.trials if args.trials is not None else (1 if args.quick else 6),
        streams=args.streams,
        max_tokens=80 if args.quick else 200,
        fault_after=20,
        step_ms=20.0,
    )
    result = run(settings)
    print(render(result))
    write_json(args.json, result)
    failed = any(
        f["streams_not_equal_to_undisturbed"] or f["migrations_counted"] != f["migrated_streams"]
        for f in result["faults"].values()
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
