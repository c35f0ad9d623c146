"""pdtrio's engine against vLLM CPU on the same machine, same model, same load, one run.

    python -m benchmarks.engine [--json PATH] [--plot PATH] [--quick]
                                [--concurrency 1,8,32] [--dtypes float32,bfloat16]

Servers, one at a time: pdtrio colocated (one ``both`` worker) and PD (one
prefill + one decode worker, the README's default), each in float32 and
bfloat16, and vLLM CPU when ``/work/vllm-ready`` (or ``--vllm-ready FILE``)
holds the shell command that starts it (started once; its ``/v1/models`` names
the model; "not installed" otherwise).  Load: streaming ``/v1/completions``,
ISL random token ids per prompt, OSL tokens, ``ignore_eos``, temperature 0;
``c`` clients each send requests back to back until ``requests`` of them
finished (the first ``c`` of them a warm-up, not counted).  Per row: TTFT p50
(send to the first token event), TPOT p50 ((last - first event) / (tokens - 1)
per request) and output tokens/s (tokens of the measured requests over the
time from the first measured send to the last finish).

The memory floor of one decode step at c=1: the bytes of the weights a step
reads (every parameter; tied embeddings are read whole as the output layer)
plus the prompt's KV, over the bandwidth torch reads memory at here, measured
in the same run (a sum over a large tensor, best of several).

``--quick`` (CI): the tiny-random model, c=1 and 4, no vLLM.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from benchmarks import plotting
from benchmarks.kit import StreamResult, markdown_table, percentile, stream_completion, write_json
from pdtrio.testing import Processes, write_router_config

SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny-random"
VLLM_READY = Path("/work/vllm-ready")
VLLM_START_TIMEOUT_S = 600.0


@attrs.frozen
class Plan:
    model: str
    isl: int
    osl: int
    concurrency: tuple[int, ...]
    dtypes: tuple[str, ...]
    # measured requests per concurrency level: max(min_requests, rounds * c)
    rounds: int
    min_requests: int
    vllm: bool

    def requests(self, concurrency: int) -> int:
        return max(self.min_requests, self.rounds * concurrency)


FULL = Plan(SMOLLM2, 256, 64, (1, 8, 32), ("float32", "bfloat16"), 1, 6, True)
QUICK = Plan(TINY, 64, 16, (1, 4), ("float32", "bfloat16"), 2, 4, False)


# --- the load -------------------------------------------------------------------------------


def prompts(plan: Plan, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # tiny-random's ids 3..258 are raw bytes: printable ASCII keeps every token visible text
    low, high = (0x20 + 3, 0x7E + 3) if plan.model == TINY else (100, 40000)
    return [[rng.randint(low, high) for _ in range(plan.isl)] for _ in range(count)]


async def _load(
    url: str, model: str, plan: Plan, concurrency: int, prompt_list: list[list[int]]
) -> tuple[list[StreamResult], float, float]:
    """Every prompt sent by ``concurrency`` clients back to back (see closed_loop)."""
    bodies = [
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": plan.osl,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for prompt in prompt_list
    ]
    return await closed_loop(url, concurrency, bodies)


async def closed_loop(
    url: str, concurrency: int, bodies: list[dict[str, Any]]
) -> tuple[list[StreamResult], float, float]:
    """Every body streamed to ``/v1/completions`` by ``concurrency`` clients back to back;
    the results in send order, and when the first measured request was sent (the
    warm-up ones are the first ``concurrency``) and when the last one finished."""
    results: list[StreamResult | None] = [None] * len(bodies)
    next_index = 0
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal next_index
        while next_index < len(bodies):
            index = next_index
            next_index += 1
            results[index] = await stream_completion(http, bodies[index], f"{url}/v1/completions")

    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(client, http)
    done = [r for r in results if r is not None]
    assert len(done) == len(bodies)
    measured = done[concurrency:]
    first_send = min(r.started for r in measured)
    last_finish = max(r.finished or r.started for r in measured)
    return done, first_send, last_finish


def _failure(result: StreamResult, osl: int) -> str | None:
    """Why a request does not count (None: it does)."""
    if not result.ok:
        error = result.error or {}
        return f"{result.status} {error.get('code') or error.get('message', '')}".strip()
    generated = int((result.usage or {}).get("completion_tokens", 0))
    if generated != osl or len(result.arrivals) < 2:
        return f"{generated} tokens, expected {osl}"
    return None


def measure(url: str, model: str, plan: Plan, concurrency: int, seed: int) -> dict[str, Any]:
    """One server at one concurrency: TTFT p50, TPOT p50 and output tokens/s."""
    count = concurrency + plan.requests(concurrency)
    prompt_list = prompts(plan, count, seed)
    done, first_send, last_finish = trio.run(_load, url, model, plan, concurrency, prompt_list)
    measured = done[concurrency:]
    ttfts, tpots, tokens = [], [], 0
    failures: dict[str, int] = {}
    for r in measured:
        failure = _failure(r, plan.osl)
        if failure is not None:
            failures[failure] = failures.get(failure, 0) + 1
            continue
        tokens += plan.osl
        ttfts.append((r.arrivals[0] - r.started) * 1e3)
        tpots.append((r.arrivals[-1] - r.arrivals[0]) / (plan.osl - 1) * 1e3)
    return {
        "concurrency": concurrency,
        "requests": len(measured),
        "failed": sum(failures.values()),
        "failures": failures,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "tpot_p50_ms": percentile(tpots, 50),
        "output_tokens_per_s": tokens / (last_finish - first_send),
        "ttfts_ms": ttfts,
    }


# --- servers --------------------------------------------------------------------------------


INT4_SUFFIX = "+int4"  # a dtype row whose decode steps read 4-bit weights (engine.int4_weights)


def _worker_config(role: str, model: str, dtype: str) -> dict[str, Any]:
    # the defaults otherwise: what a user of the README gets; but a row is the dtype it
    # names, so a plain one keeps its weights wide (4 bits is engine.int4_weights' default)
    engine: dict[str, Any] = {
        "kind": "torch",
        "model": model,
        "dtype": dtype.removesuffix(INT4_SUFFIX),
        "int4_weights": "on" if dtype.endswith(INT4_SUFFIX) else "off",
    }
    return {"role": role, "engine": engine}


@contextmanager
def pdtrio_servers(model: str, dtype: str) -> Iterator[dict[str, str]]:
    """Routers for ``colocated`` (one both worker) and ``pd`` (one prefill, one decode)."""
    with tempfile.TemporaryDirectory() as tmp, Processes() as procs:
        starting = {
            role: procs.start_worker(_worker_config(role, model, dtype))
            for role in ("prefill", "decode", "both")
        }
        prefill, decode, both = (procs.wait_ready(p) for p in starting.values())
        pd = procs.router(
            write_router_config(
                Path(tmp) / "pd.toml", [("prefill", prefill.url), ("decode", decode.url)]
            )
        )
        colocated = procs.router(
            write_router_config(Path(tmp) / "colocated.toml", [("both", both.url)])
        )
        yield {"colocated": colocated.url, "pd": pd.url}


def vllm_on_every_cpu(command: str) -> str:
    """The command with vLLM's OpenMP threads bound to every CPU here, as pdtrio's run on
    (``VLLM_CPU_OMP_THREADS_BIND``; a ready file may name fewer)."""
    every = f"VLLM_CPU_OMP_THREADS_BIND=0-{(os.cpu_count() or 1) - 1}"
    if "VLLM_CPU_OMP_THREADS_BIND=" in command:
        return re.sub(r"VLLM_CPU_OMP_THREADS_BIND=\S+", every, command)
    return f"{every} {command}"


def vllm_dtype(command: str) -> str:
    """The ``--dtype`` of vLLM's start command (its default, ``auto``, is the checkpoint's:
    bfloat16 for SmolLM2)."""
    found = re.search(r"--dtype[= ](\w+)", command)
    return found.group(1) if found and found.group(1) != "auto" else "bfloat16"


def vllm_port(command: str) -> int:
    """The ``--port`` of vLLM's start command (its default: 8000)."""
    found = re.search(r"--port[= ](\d+)", command)
    return int(found.group(1)) if found else 8000


@contextmanager
def vllm_server(command: str) -> Iterator[tuple[str, str]]:
    """vLLM started by ``command`` (a shell line); its URL and served model name."""
    url = f"http://127.0.0.1:{vllm_port(command)}"
    with Processes(stop_grace_s=30) as procs:
        process = procs.start(["bash", "-c", command], new_session=True, output="capture")
        deadline = time.monotonic() + VLLM_START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited with status {process.returncode} while starting")
            try:
                answer = httpx.get(f"{url}/v1/models", timeout=2)
                if answer.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not answer within {VLLM_START_TIMEOUT_S:g} s")
            time.sleep(1)
        yield url, str(answer.json()["data"][0]["id"])


# --- the memory floor -----------------------------------------------------------------------


def read_bandwidth_gbps() -> float:
    """GB/s torch reads memory at here (its default threads): a sum over 512 MB, best of 5."""
    import torch

    data = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    best = float("inf")
    for _ in range(6):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * data.element_size() / best / 1e9


def decode_bytes(model: str, dtype: str, context: int) -> dict[str, int]:
    """Bytes one decode step of one sequence reads: the weights and ``context`` tokens' KV."""
    import torch

    from pdtrio.config import EngineConfig
    from pdtrio.engine.torch.engine import load_model

    wide = dtype.removesuffix(INT4_SUFFIX)
    int4 = dtype.endswith(INT4_SUFFIX)
    loaded = load_model(EngineConfig(model=model, dtype=wide, int4_weights="on" if int4 else "off"))
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    for weight, copy in loaded.model.int4_weights():  # a 4-bit copy is read instead
        if copy is not None:
            weights -= weight.numel() * weight.element_size()
            for part in (copy.packed, copy.scales_and_zeros):
                weights += part.numel() * part.element_size()
    config = loaded.config
    element = torch.empty((), dtype=getattr(torch, wide)).element_size()
    kv = context * config.num_layers * 2 * config.num_kv_heads * config.head_dim * element
    return {"weights": weights, "kv": kv}


def memory_floor(plan: Plan) -> dict[str, Any]:
    bandwidth = read_bandwidth_gbps()
    floors: dict[str, Any] = {"read_gbps": bandwidth}
    for dtype in plan.dtypes:
        read = decode_bytes(plan.model, dtype, plan.isl + plan.osl // 2)
        floors[dtype] = {
            **{f"{k}_bytes": v for k, v in read.items()},
            "c1_step_ms": (read["weights"] + read["kv"]) / (bandwidth * 1e9) * 1e3,
        }
    return floors


# --- the compute floor ----------------------------------------------------------------------


def matmul_gflops(rows: int, inner: int, outer: int, dtype: str = "float32") -> float:
    """GFLOPS of torch's fastest ``dtype`` product here for ``[rows, inner] x [inner,
    outer]`` (its own and oneDNN's on a packed weight, the engine's two; best of several),
    on its default threads."""
    import torch

    x = torch.randn(rows, inner).to(getattr(torch, dtype))
    weight = torch.randn(outer, inner).to(x.dtype)
    products: list[Callable[[], object]] = [lambda: torch.nn.functional.linear(x, weight)]
    if torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    best = float("inf")
    for product in products:
        product()
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(10):
                product()
            best = min(best, (time.perf_counter() - started) / 10)
    return 2 * rows * inner * outer / best / 1e9


def prefill_flops(model: str, isl: int) -> tuple[float, tuple[int, int]]:
    """Floating-point operations of one ``isl``-token prompt's prefill (every layer's matrix
    products over each token, causal attention's two products, the output layer over the
    last token; the embedding lookup reads, it does not multiply), and the model's
    (hidden, intermediate) sizes: its MLP product is a step's largest."""
    from pdtrio.config import EngineConfig
    from pdtrio.engine.torch.engine import load_model

    loaded = load_model(EngineConfig(model=model, dtype="float32"))
    config = loaded.config
    layer_weights = sum(
        p.numel()
        for name, p in loaded.model.named_parameters()
        if ".layers." in name and p.dim() == 2
    )
    attention = config.num_layers * 2 * 2 * config.num_heads * config.head_dim * isl * (isl + 1) / 2
    output_layer = 2 * config.vocab_size * config.hidden_size
    flops = 2 * layer_weights * isl + attention + output_layer
    return flops, (config.hidden_size, config.intermediate_size)


def compute_floor(plan: Plan) -> dict[str, Any]:
    """The least time a c=1 prefill of ``plan.isl`` tokens takes here: its operations at
    the rate of this machine's fastest product of the prompt's MLP shape, in float32 or,
    where the CPU has bf16 instructions (AVX-512 BF16, AMX), bfloat16 (without them a
    bfloat16 product is widened to float32, pdtrio's engine and vLLM's alike: no faster)."""
    import torch

    flops, (hidden, intermediate) = prefill_flops(plan.model, plan.isl)
    bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    rates = {
        dtype: matmul_gflops(plan.isl, hidden, intermediate, dtype)
        for dtype in (("float32", "bfloat16") if bf16 else ("float32",))
    }
    fastest = max(rates, key=rates.__getitem__)
    return {
        "prefill_gflop": flops / 1e9,
        "matmul_gflops": rates[fastest],
        "matmul_dtype": fastest,
        "matmul_gflops_by_dtype": rates,
        "prefill_ms": flops / rates[fastest] / 1e6,
        "bf16_instructions": bf16,
    }


# --- the run --------------------------------------------------------------------------------


def _progress(row: dict[str, Any]) -> None:
    print(
        f"    TTFT p50 {row['ttft_p50_ms']:.0f} ms, TPOT p50 {row['tpot_p50_ms']:.1f} ms, "
        f"{row['output_tokens_per_s']:.1f} tok/s, {row['failed']} failed {row['failures']}",
        file=sys.stderr,
        flush=True,
    )


def run(plan: Plan, vllm_command: str | None, vllm_absent: str) -> dict[str, Any]:
    """Every row; ``vllm_absent`` says why vLLM's are missing when ``vllm_command`` is None."""
    rows: list[dict[str, Any]] = []
    seed = 0
    for dtype in plan.dtypes:
        print(f"pdtrio {dtype}: starting workers ...", file=sys.stderr, flush=True)
        with pdtrio_servers(plan.model, dtype) as urls:
            for mode, url in urls.items():
                for c in plan.concurrency:
                    seed += 1
                    print(f"  {mode} {dtype} c={c} ...", file=sys.stderr, flush=True)
                    row = measure(url, plan.model, plan, c, seed)
                    rows.append({"server": f"pdtrio {mode}", "dtype": dtype, **row})
                    _progress(rows[-1])
    vllm: dict[str, Any] = {"status": vllm_absent}
    if vllm_command is not None:
        print("vLLM: starting (minutes) ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        with vllm_server(vllm_command) as (url, served):
            vllm = {"status": "ran", "command": vllm_command, "start_s": time.monotonic() - started}
            for c in plan.concurrency:
                seed += 1
                print(f"  vLLM c={c} ...", file=sys.stderr, flush=True)
                row = measure(url, served, plan, c, seed)
                rows.append({"server": "vLLM CPU", "dtype": vllm_dtype(vllm_command), **row})
                _progress(rows[-1])
    return {"rows": rows, "vllm": vllm}


def print_report(report: dict[str, Any]) -> None:
    plan = report["plan"]
    header = [
        "server",
        "dtype",
        "c",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TPOT p50 ms",
        "output tok/s",
        "failed",
    ]
    rows = [
        [
            r["server"],
            r["dtype"],
            str(r["concurrency"]),
            f"{r['ttft_p50_ms']:.0f}",
            f"{r['ttft_p99_ms']:.0f}",
            f"{r['tpot_p50_ms']:.1f}",
            f"{r['output_tokens_per_s']:.1f}",
            f"{r['failed']}/{r['requests']}",
        ]
        for r in report["rows"]
    ]
    print(
        f"{plan['model']}, ISL {plan['isl']}, OSL {plan['osl']}, streaming /v1/completions, "
        f"ignore_eos, temperature 0; {os.cpu_count()} CPUs\n"
    )
    print(markdown_table(header, rows, align="llrrrrrr"))
    print(f"\nvLLM: {report['vllm']['status']}")
    floor = report["memory_floor"]
    print(f"memory read bandwidth (torch, a sum over 512 MB): {floor['read_gbps']:.1f} GB/s")
    for dtype in plan["dtypes"]:
        f = floor[dtype]
        print(
            f"memory floor of one decode step at c=1, {dtype}: {f['c1_step_ms']:.2f} ms "
            f"({f['weights_bytes'] / 1e6:.1f} MB of weights + {f['kv_bytes'] / 1e6:.2f} MB KV)"
        )
    compute = report["compute_floor"]
    print(
        f"compute floor of a c=1 prefill of {plan['isl']} tokens (the least TTFT): "
        f"{compute['prefill_ms']:.0f} ms ({compute['prefill_gflop']:.1f} GFLOP at "
        f"{compute['matmul_gflops']:.0f} GFLOPS, this machine's fastest product of that shape, "
        f"in {compute['matmul_dtype']}; "
        + (
            f"float32's: {compute['matmul_gflops_by_dtype']['float32']:.0f} GFLOPS)"
            if compute["bf16_instructions"]
            else "this CPU has no bf16 instructions: a bfloat16 product is no faster)"
        )
    )


def plot(path: Path, report: dict[str, Any]) -> None:
    rows = report["rows"]
    names = sorted({f"{r['server']} {r['dtype']}" for r in rows})
    throughput = {
        name: [
            (r["concurrency"], r["output_tokens_per_s"])
            for r in rows
            if f"{r['server']} {r['dtype']}" == name
        ]
        for name in names
    }
    panels: list[plotting.Panel] = [
        partial(plotting.throughput_vs_concurrency, series=throughput, title="output tokens/s")
    ]
    for c in report["plan"]["concurrency"]:
        series = {
            f"{r['server']} {r['dtype']}": r["ttfts_ms"] for r in rows if r["concurrency"] == c
        }
        panels.append(
            partial(plotting.latency_cdfs, series=series, xlabel="TTFT (ms)", title=f"TTFT, c={c}")
        )
    plotting.save_figure(path, *panels, title=f"engine: {report['plan']['model']}", columns=2)


def _levels(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="draw the figures into this PNG")
    parser.add_argument("--quick", action="store_true", help="tiny-random, c=1 and 4, no vLLM")
    parser.add_argument("--concurrency", type=_levels, default=None, help="e.g. 1,8,32")
    parser.add_argument(
        "--dtypes",
        type=_names,
        default=None,
        help=f"e.g. float32,bfloat16; float32{INT4_SUFFIX}: decode in 4 bits (engine.int4_weights)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="measured requests per client")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM out")
    parser.add_argument(
        "--no-pdtrio",
        action="store_true",
        help="vLLM's rows only (another vLLM command beside an earlier run's rows)",
    )
    parser.add_argument(
        "--vllm-ready",
        type=Path,
        default=VLLM_READY,
        help="a file holding the shell command that starts vLLM",
    )
    args = parser.parse_args(argv)
    if args.plot is not None:
        plotting.require_matplotlib()
    plan = QUICK if args.quick else FULL
    if args.concurrency:
        plan = attrs.evolve(plan, concurrency=args.concurrency)
    if args.dtypes:
        plan = attrs.evolve(plan, dtypes=args.dtypes)
    if args.no_pdtrio:
        plan = attrs.evolve(plan, dtypes=())
    if args.rounds:
        plan = attrs.evolve(plan, rounds=args.rounds)
    if args.no_vllm:
        plan = attrs.evolve(plan, vllm=False)
    vllm_command = None
    if args.quick:
        vllm_absent = "not run (--quick)"
    elif args.no_vllm:
        vllm_absent = "not run (--no-vllm)"
    elif not args.vllm_ready.exists():
        vllm_absent = f"not installed (no {args.vllm_ready})"
    else:
        vllm_absent = ""
        vllm_command = vllm_on_every_cpu(args.vllm_ready.read_text().strip())
    report: dict[str, Any] = {"benchmark": "engine", "plan": attrs.asdict(plan)}
    report["memory_floor"] = memory_floor(plan)
    report["compute_floor"] = compute_floor(plan)
    report.update(run(plan, vllm_command, vllm_absent))
    print_report(report)
    write_json(args.json, report)
    if args.plot is not None:
        plot(args.plot, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
