"""pdtrio's router in front of a real vLLM PD pair (NixlConnector, KV in CPU memory).

Not in the default suite: ``nox -s vllm`` installs vLLM in its own interpreter, exports
SmolLM2 as an HF checkpoint and runs this file (PDTRIO_VLLM_PYTHON, PDTRIO_VLLM_MODEL).
One pair for the module: it takes 1-3 minutes to start on two cores.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import openai
import pytest
import trio

from pdtrio.config import InstanceConfig, PdtrioConfig, TracingConfig
from pdtrio.faults.plan import Fault
from pdtrio.faults.proxy import FaultProxy
from pdtrio.router.app import RouterApp
from pdtrio.testing.vllm import (
    NIXL_LEASED_KV_CONFIG,
    SERVED_MODEL,
    VllmServer,
    kv_usage,
    vllm_pd_pair,
)
from tests.cluster import serve_app, wait_for_stats
from tests.router.test_openai_choices import streamed_choices
from tests.tracing_receiver import TraceReceiver, trace_receiver

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def vllm_traces() -> Iterator[TraceReceiver]:
    """Where the pair sends its spans (vLLM's --otlp-traces-endpoint)."""
    with trace_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory, vllm_traces: TraceReceiver
) -> Iterator[tuple[VllmServer, VllmServer]]:
    with vllm_pd_pair(
        tmp_path_factory.mktemp("vllm"),
        kv_config=NIXL_LEASED_KV_CONFIG,
        otlp_traces_endpoint=f"{vllm_traces.url}/v1/traces",
    ) as servers:
        yield servers


@attrs.define
class Front:
    url: str
    prefill: VllmServer
    decode_proxy: FaultProxy


@asynccontextmanager
async def front(
    pair: tuple[VllmServer, VllmServer], tracing: TracingConfig | None = None
) -> AsyncIterator[Front]:
    """The router over the pair, decode behind a fault proxy (to hold it between the legs)."""
    prefill, decode = pair
    async with trio.open_nursery() as nursery:
        proxy = FaultProxy("127.0.0.1", 0, "127.0.0.1", int(decode.url.rsplit(":", 1)[1]))
        port = await nursery.start(proxy.run)
        config = PdtrioConfig(
            instances=(
                InstanceConfig(role="prefill", url=prefill.url, kind="vllm"),
                InstanceConfig(role="decode", url=f"http://127.0.0.1:{port}", kind="vllm"),
            ),
            tracing=tracing or TracingConfig(),
        )
        yield Front(await serve_app(RouterApp(config), nursery), prefill, proxy)
        nursery.cancel_scope.cancel()


async def _kv(url: str) -> float:
    return await trio.to_thread.run_sync(kv_usage, url)


def _logs(*servers: VllmServer) -> str:
    """What the servers last logged (for a failure's message)."""
    return "".join(
        f"\n--- {server.role}'s log, its end:\n{server.log_tail()}" for server in servers
    )


async def _kv_becomes(
    server: VllmServer, held: bool, within_s: float, logs_of: tuple[VllmServer, ...] = ()
) -> float:
    """Poll the instance's KV usage (its /metrics is all there is to watch) until it is
    non-zero (``held``) or zero, for at most ``within_s`` seconds; how long that took.

    A /metrics that times out (a vLLM busy on two cores answers it late) is asked again
    until the time is up; the failure then carries the logs of ``logs_of`` (or the
    server's)."""
    started = trio.current_time()
    deadline = started + within_s
    last_error: Exception | None = None
    while trio.current_time() < deadline:
        try:
            if (await _kv(server.url) > 0.0) == held:
                return trio.current_time() - started
        except httpx.TransportError as exc:
            last_error = exc
        await trio.sleep(0.1)
    raise AssertionError(
        f"{server.url}: KV usage not {'> 0' if held else '0'} in {within_s:g}s"
        + (f" (last /metrics error: {last_error!r})" if last_error is not None else "")
        + _logs(*(logs_of or (server,)))
    )


async def test_completions_streamed_and_not_match_decode_alone(
    pair: tuple[VllmServer, VllmServer],
) -> None:
    prefill, decode = pair
    body: dict[str, Any] = {
        "model": SERVED_MODEL,
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "temperature": 0,
    }
    async with front(pair) as fronted, httpx.AsyncClient(timeout=120) as client:
        alone = (await client.post(f"{decode.url}/v1/completions", json=body)).json()
        plain = await client.post(f"{fronted.url}/v1/completions", json=body)
        streamed = await client.post(
            f"{fronted.url}/v1/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        )
    assert plain.status_code == 200, plain.text
    answer = plain.json()
    # KV from prefill, decoded on decode: the same greedy text as decode computing it all
    assert answer["choices"][0]["text"] == alone["choices"][0]["text"]
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 8
    assert answer["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]
    events = [
        line[len("data: ") :] for line in streamed.text.splitlines() if line.startswith("data: ")
    ]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == alone["choices"][0]["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert "cached_tokens" in chunks[-1]["usage"]["prompt_tokens_details"]
    assert await _kv(prefill.url) == 0.0  # decode pulled every block


async def test_logprobs_through_the_router_are_decodes_own(
    pair: tuple[VllmServer, VllmServer],
) -> None:
    _, decode = pair
    body: dict[str, Any] = {
        "model": SERVED_MODEL,
        "prompt": "The capital of France is",
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 2,
    }
    async with front(pair) as fronted, httpx.AsyncClient(timeout=120) as client:
        alone = (await client.post(f"{decode.url}/v1/completions", json=body)).json()
        plain = await client.post(f"{fronted.url}/v1/completions", json=body)
        streamed = await client.post(f"{fronted.url}/v1/completions", json={**body, "stream": True})
    assert plain.status_code == 200, plain.text
    want = alone["choices"][0]["logprobs"]
    got = plain.json()["choices"][0]["logprobs"]
    # the same greedy tokens; their logprobs computed from prefill's KV rather than decode's
    # own, so equal up to the float noise of another batch: in bfloat16 on a CPU with AMX
    # (oneDNN's products change their last bits with the batch's shape) up to 0.07 was seen
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=0.1)
    assert [set(top) for top in got["top_logprobs"]] == [set(top) for top in want["top_logprobs"]]
    chunks = [
        json.loads(line[len("data: ") :])
        for line in streamed.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    tokens = [t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == want["tokens"]


async def test_the_openai_client_streams_a_chat(pair: tuple[VllmServer, VllmServer]) -> None:
    """The openai client's stream through the router says what decode says on its own
    (greedy; what that is, is the model's business: vLLM's bfloat16 on this CPU answers
    "L'Étoile, ..." where pdtrio's float32 engine says "Paris")."""
    _, decode = pair
    body: dict[str, Any] = {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    async with front(pair) as fronted, httpx.AsyncClient(timeout=120) as client:
        alone = (await client.post(f"{decode.url}/v1/chat/completions", json=body)).json()

        def call() -> list[Any]:
            api = openai.OpenAI(base_url=f"{fronted.url}/v1", api_key="unused", max_retries=0)
            return list(
                api.chat.completions.create(
                    **body,
                    stream=True,
                    stream_options={"include_usage": True},
                    timeout=120,
                )
            )

        chunks = await trio.to_thread.run_sync(call)
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text and text == alone["choices"][0]["message"]["content"]
    assert content[-1].choices[0].finish_reason == alone["choices"][0]["finish_reason"]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == alone["usage"]["completion_tokens"]


async def test_the_openai_client_streams_a_response(pair: tuple[VllmServer, VllmServer]) -> None:
    """/v1/responses in front of the pair: the router sends both legs the chat request it
    stands for (``instructions`` a leading system message), and shapes decode's stream as
    Responses events; the text is what decode answers that chat request with on its own."""
    _, decode = pair
    question = "What is the capital of France?"
    instructions = "Answer in one short sentence."

    async def decode_alone(messages: list[dict[str, str]]) -> str:
        body = {"model": SERVED_MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}
        async with httpx.AsyncClient(timeout=120) as client:
            answer = (await client.post(f"{decode.url}/v1/chat/completions", json=body)).json()
        return str(answer["choices"][0]["message"]["content"])

    instructed = await decode_alone(
        [{"role": "system", "content": instructions}, {"role": "user", "content": question}]
    )
    plain = await decode_alone([{"role": "user", "content": question}])
    async with front(pair) as fronted:

        def call() -> tuple[list[Any], Any]:
            api = openai.OpenAI(base_url=f"{fronted.url}/v1", api_key="unused", max_retries=0)
            events = list(
                api.responses.create(
                    model=SERVED_MODEL,
                    instructions=instructions,
                    input=question,
                    max_output_tokens=12,
                    temperature=0,
                    stream=True,
                    timeout=120,
                )
            )
            whole = api.responses.create(
                model=SERVED_MODEL,
                input=question,
                max_output_tokens=12,
                temperature=0,
                timeout=120,
            )
            return events, whole

        events, whole = await trio.to_thread.run_sync(call)
        assert await _kv(fronted.prefill.url) == 0.0  # every leg's KV pulled and freed
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == instructed
    assert events[-1].response.usage.output_tokens > 0
    assert whole.status in ("completed", "incomplete") and whole.output_text == plain


async def test_n_choices_through_the_router_are_a_pd_flow_each_and_leave_no_kv(
    pair: tuple[VllmServer, VllmServer],
) -> None:
    async with front(pair) as fronted:

        def call() -> list[Any]:
            api = openai.OpenAI(base_url=f"{fronted.url}/v1", api_key="unused", max_retries=0)
            return list(
                api.chat.completions.create(
                    model=SERVED_MODEL,
                    messages=[{"role": "user", "content": "Name a fruit."}],
                    max_tokens=8,
                    n=2,
                    temperature=0.8,
                    seed=1,
                    stream=True,
                    stream_options={"include_usage": True},
                    timeout=120,
                )
            )

        chunks = await trio.to_thread.run_sync(call)
        # each choice's decode pulled its own prefill's blocks (vLLM's lease would keep an
        # unpulled one for 300 s here)
        await _kv_becomes(fronted.prefill, held=False, within_s=30, logs_of=pair)
    choices = streamed_choices(chunks)  # one role chunk and one finish each
    assert sorted(choices) == [0, 1]
    assert {finish for _, finish in choices.values()} <= {"stop", "length"}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert 2 <= usage.completion_tokens <= 16  # both choices' tokens


async def test_a_chat_with_tools_is_served_well_formed(pair: tuple[VllmServer, VllmServer]) -> None:
    # the pair runs no tool parser: vLLM 0.32 itself refuses tool_choice "auto" (the
    # default with tools) and a named function without one (a 400 naming
    # --tool-call-parser); "none" renders the tools into the prompt and answers text
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    fields: dict[str, Any] = {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": tools,
        "tool_choice": "none",
        "max_tokens": 48,
        "temperature": 0,
        "timeout": 120,
    }
    async with front(pair) as fronted:

        def call() -> tuple[Any, list[Any]]:
            api = openai.OpenAI(base_url=f"{fronted.url}/v1", api_key="unused", max_retries=0)
            whole = api.chat.completions.create(**fields)
            chunks = list(api.chat.completions.create(stream=True, **fields))
            return whole, chunks

        whole, chunks = await trio.to_thread.run_sync(call)
        await _kv_becomes(fronted.prefill, held=False, within_s=30, logs_of=pair)

    def well_formed(calls: list[Any], finish_reason: str) -> None:
        for call in calls:
            assert call.type == "function" and call.id
            assert call.function.name == "get_weather"
            if finish_reason != "length":  # (a call cut short has half its arguments)
                assert isinstance(json.loads(call.function.arguments), dict)
        assert finish_reason in (("tool_calls", "length") if calls else ("stop", "length"))

    [choice] = whole.choices
    well_formed(choice.message.tool_calls or [], choice.finish_reason)
    content = [c for c in chunks if c.choices]
    streamed = [call for c in content for call in c.choices[0].delta.tool_calls or []]
    assert [call.index for call in streamed] == list(range(len(streamed)))  # each call whole
    [finish] = [c.choices[0].finish_reason for c in content if c.choices[0].finish_reason]
    well_formed(streamed, finish)


async def test_a_client_gone_between_the_legs_leaves_no_kv_on_prefill(
    pair: tuple[VllmServer, VllmServer],
) -> None:
    async with front(pair) as fronted, httpx.AsyncClient(timeout=120) as client:
        assert await _kv(fronted.prefill.url) == 0.0
        fronted.decode_proxy.fault = Fault(stall=True)  # decode takes nothing for now
        with trio.move_on_after(60) as waited:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    functools.partial(
                        client.post,
                        f"{fronted.url}/v1/completions",
                        json={"model": SERVED_MODEL, "prompt": "hello " * 100, "max_tokens": 8},
                    )
                )
                await _kv_becomes(fronted.prefill, held=True, within_s=50, logs_of=pair)
                nursery.cancel_scope.cancel()  # the client leaves
        assert not waited.cancelled_caught, "prefill never held the prompt's KV" + _logs(*pair)
        fronted.decode_proxy.fault = Fault()
        # vLLM alone holds it for its lease (300 s here) with no decode to pull it
        freed_in = await _kv_becomes(fronted.prefill, held=False, within_s=60, logs_of=pair)
        print(f"prefill's KV freed {freed_in:.1f}s after the client left")


# a client's trace (W3C traceparent): the router's spans, and vLLM's, join it
_CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
_CLIENT_TRACEPARENT = f"00-{_CLIENT_TRACE}-b7ad6b7169203331-01"


async def test_vllm_joins_the_routers_trace_under_its_legs(
    pair: tuple[VllmServer, VllmServer], vllm_traces: TraceReceiver
) -> None:
    async with front(pair, TracingConfig(endpoint=vllm_traces.url)) as served:
        async with httpx.AsyncClient(timeout=120) as http:
            response = await http.post(
                f"{served.url}/v1/chat/completions",
                json={
                    "model": SERVED_MODEL,
                    "messages": [{"role": "user", "content": "Name a colour."}],
                    "max_tokens": 8,
                    "temperature": 0,
                },
                headers={"traceparent": _CLIENT_TRACEPARENT},
            )
            assert response.status_code == 200, response.text
    # (the router's spans are flushed as it stops; vLLM's go within its batch delay, 5 s)
    await wait_for_stats(
        lambda: len(_vllm_spans(vllm_traces)) >= 2, 30, what="vLLM's spans of the request"
    )
    spans = [s for s in vllm_traces.received() if s.trace_id == _CLIENT_TRACE]
    legs = {s.span_id: s.name for s in spans if s.service == "pdtrio-router"}
    assert {"prefill", "decode"} <= set(legs.values()), spans
    engines = _vllm_spans(vllm_traces)
    assert {(s.service, legs.get(s.parent_id)) for s in engines} == {
        ("vllm-prefill", "prefill"),
        ("vllm-decode", "decode"),
    }, (engines, _logs(*pair))


def _vllm_spans(receiver: TraceReceiver) -> list[Any]:
    return [
        s
        for s in receiver.received()
        if s.trace_id == _CLIENT_TRACE and s.service.startswith("vllm-")
    ]


# last: its storms leave the pair busy for a while
@pytest.mark.benchmark
def test_the_benchmark_runs_quick(pair: tuple[VllmServer, VllmServer], tmp_path: Path) -> None:
    # on this module's pair: a second pair's start took over 420 s once on two cores
    prefill, decode = pair
    out = tmp_path / "front_vllm.json"
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.front_vllm", "--quick", "--json", str(out)]
        + ["--prefill-url", prefill.url, "--decode-url", decode.url],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-8000:]
    report = json.loads(out.read_text())
    assert report["pdtrio"]["ttft_ms"] > 0
    # pdtrio frees the left clients' KV within the watch (vLLM's lease is 300 s here)
    storm = report["pdtrio"]["storm"]
    assert storm["reached_decode"] == storm["clients"]
    assert storm["kv_freed_after_s"] is not None
    # nox -s vllm installs vllm-router beside vLLM: it runs the same rows
    assert report["vllm_router"]["ttft_ms"] > 0
