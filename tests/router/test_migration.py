"""A decode lost mid-stream: the request continues on another decode, unbroken (issue #28).

In-process clusters: a prefill and decodes on loopback, each decode behind a
``FaultProxy`` on the router's link to it, so a test can cut that link
(``reset_all``: the link is lost, as when the worker is killed) or hang it
(``stall``: nothing arrives, as when it is SIGSTOPped) while streams run.
The synthetic engine's tokens are deterministic, so each answer is compared
with the same request's on an undisturbed cluster.  The SIGKILL of a real
decode process is in tests/e2e/test_worker_faults_e2e.py.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast, final

import attrs
import httpx
import pytest
import trio

from pdtrio.config import InstanceConfig, PdtrioConfig, RouterConfig
from pdtrio.engine.api import Engine, EngineOutput, StepFailed
from pdtrio.engine.synthetic import SyntheticEngine
from pdtrio.faults import FaultProxy
from pdtrio.router.app import RouterApp
from pdtrio.testing import LOOPBACK
from pdtrio.worker.server import Worker
from tests.cluster import (
    Cluster,
    serve_app,
    synthetic_worker,
    wait_for_answer,
    wait_for_stats,
    wait_until_idle,
    worker_backend,
)
from tests.metrics import by_labels, value

# generous: these bound liveness, they do not measure it
LIVENESS_S = 20.0
ROUTER = RouterConfig(link_timeout_s=0.5, link_heartbeat_s=0.1, decode_policy="round_robin")
CLIENTS = 6
MAX_TOKENS = 60


@attrs.define
class Proxied:
    cluster: Cluster
    proxies: list[FaultProxy]  # one per decode, in order


@final
class FailsAStep:
    """A synthetic engine whose ``fail_at``-th step with output fails instead (once): its
    requests end there (blocks freed) and the worker tells the router ``DecodeFailed``."""

    def __init__(self, engine: SyntheticEngine, fail_at: int) -> None:
        self._engine = engine
        self._fail_at = fail_at

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def run(
        self,
        outputs: trio.MemorySendChannel[EngineOutput],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        send, receive = trio.open_memory_channel[EngineOutput](0)
        async with trio.open_nursery() as nursery, outputs:
            await nursery.start(self._engine.run, send)
            task_status.started()
            steps = 0
            async for step in receive:
                if not isinstance(step, list):  # (a step's logprobs, or a failure)
                    await outputs.send(step)
                    continue
                steps += 1
                if steps == self._fail_at:
                    lost = tuple(entry.request_id for entry in step)
                    for request_id in lost:
                        self._engine.abort(request_id)
                    step = StepFailed(lost, "decode step failed: injected")
                await outputs.send(step)


@asynccontextmanager
async def proxied_cluster(
    router: RouterConfig = ROUTER,
    *,
    decodes: int = 2,
    first_fails_step: int = 0,
    kv_lease_s: float | None = None,
) -> AsyncIterator[Proxied]:
    """A prefill and ``decodes`` decodes, the router's link to each decode through a proxy
    (``first_fails_step``: the first decode's engine fails that step; ``kv_lease_s``:
    prefill's KV lease)."""
    leases = {} if kv_lease_s is None else {"kv_lease_s": kv_lease_s}
    workers = [synthetic_worker("prefill", worker_overrides=leases)]
    workers += [synthetic_worker("decode", decode_step_s=0.02) for _ in range(decodes)]
    if first_fails_step:
        first = workers[1]
        assert isinstance(first.engine, SyntheticEngine)
        engine = cast(Engine, FailsAStep(first.engine, first_fails_step))
        workers[1] = Worker(first.config, engine)
    async with trio.open_nursery() as nursery:
        ready = [await nursery.start(worker.run) for worker in workers]
        proxies = []
        instances = [InstanceConfig(role="prefill", url=ready[0]["url"])]
        for decode in ready[1:]:
            proxy = FaultProxy(LOOPBACK, 0, LOOPBACK, decode["http_port"])
            port = await nursery.start(proxy.run)
            proxies.append(proxy)
            instances.append(InstanceConfig(role="decode", url=f"http://{LOOPBACK}:{port}"))
        app = RouterApp(PdtrioConfig(router=router, instances=tuple(instances)))
        url = await serve_app(app, nursery)
        cluster = Cluster(url=url, workers=workers, router_app=app)
        async with httpx.AsyncClient(base_url=url, timeout=LIVENESS_S) as http:
            await wait_for_answer(
                lambda: http.get("/health"),
                lambda health: health.json().get("decode_instances") == decodes,
                LIVENESS_S,
            )
        yield Proxied(cluster, proxies)
        nursery.cancel_scope.cancel()


def _chat(index: int, *, stream: bool = True, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": f"tell me story number {index}"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
        **extra,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@attrs.define
class Answer:
    """What a streaming client saw, read as a user would."""

    ids: set[str]
    roles: int
    content: str
    finish_reasons: list[str]
    usage: dict[str, Any] | None
    errors: list[dict[str, Any]]
    done: bool
    # the chunks' logprobs entries, in order (a request that asked for them)
    logprobs: list[dict[str, Any]] = attrs.field(factory=list)


def _read(events: list[str]) -> Answer:
    answer = Answer(set(), 0, "", [], None, [], events[-1:] == ["data: [DONE]"])
    for event in events:
        if event == "data: [DONE]":
            continue
        chunk = json.loads(event.removeprefix("data: "))
        if "error" in chunk:
            answer.errors.append(chunk["error"])
            continue
        answer.ids.add(chunk["id"])
        if chunk.get("usage"):
            answer.usage = chunk["usage"]
        for choice in chunk["choices"]:
            delta = choice["delta"]
            answer.roles += "role" in delta
            answer.content += delta.get("content") or ""
            if choice.get("logprobs"):
                answer.logprobs += choice["logprobs"]["content"]
            if choice["finish_reason"] is not None:
                answer.finish_reasons.append(choice["finish_reason"])
    return answer


@attrs.define
class Progress:
    """Set once ``clients`` streams have each had three events: mid-stream, all of them."""

    clients: int
    mid_stream: trio.Event = attrs.field(factory=trio.Event)

    def three_events_in(self) -> None:
        self.clients -= 1
        if self.clients == 0:
            self.mid_stream.set()


async def _stream(
    http: httpx.AsyncClient, body: dict[str, Any], progress: Progress | None = None
) -> list[str]:
    """The stream's events, told to ``progress`` once three are in."""
    events: list[str] = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line:
                events.append(line)
                if progress is not None and len(events) == 3:
                    progress.three_events_in()
    return events


async def _undisturbed(bodies: list[dict[str, Any]]) -> list[Answer]:
    async with (
        proxied_cluster() as proxied,
        httpx.AsyncClient(base_url=proxied.cluster.url, timeout=LIVENESS_S) as http,
    ):
        return [_read(await _stream(http, body)) for body in bodies]


async def _streams_under_fault(proxied: Proxied, fault: str) -> list[Answer]:
    """CLIENTS streams at once; once every one has had three events, ``fault`` hits the
    first decode's link (``reset``: lost; ``refuse``: lost, and no reconnecting until the
    end; ``stall``: hung past the link timeout)."""
    results: list[list[str]] = [[] for _ in range(CLIENTS)]
    progress = Progress(CLIENTS)
    async with httpx.AsyncClient(base_url=proxied.cluster.url, timeout=LIVENESS_S) as http:

        async def one(index: int) -> None:
            results[index] = await _stream(http, _chat(index), progress)

        with trio.fail_after(LIVENESS_S):
            async with trio.open_nursery() as nursery:
                for index in range(CLIENTS):
                    nursery.start_soon(one, index)
                await progress.mid_stream.wait()
                proxy = proxied.proxies[0]
                if fault == "reset":
                    proxy.reset_all()
                elif fault == "refuse":
                    proxy.update(refuse=True)
                    proxy.reset_all()
                else:
                    proxy.update(stall=True)
            proxied.proxies[0].update(stall=False, refuse=False)
    return [_read(events) for events in results]


async def _serving(proxied: Proxied, exclude: int | None = None) -> int:
    """Which decode (an index into ``proxies``) runs the one request, once one does."""
    decodes = proxied.cluster.workers[1:]

    def running() -> list[int]:
        return [i for i, w in enumerate(decodes) if i != exclude and w.stats()["decode_requests"]]

    await wait_for_stats(lambda: bool(running()), LIVENESS_S)
    (index,) = running()
    return index


async def _tokens_come(proxied: Proxied, on: int, tokens: int = 3) -> None:
    """Until the router holds ``tokens`` tokens of its one stream from decode ``on``.

    Past decode's first token: a loss now is a migration, not a retry before it.
    """
    router = proxied.cluster.router_app.router
    assert router is not None
    link = worker_backend(router).instances[proxied.cluster.workers[1 + on].instance_id].link
    assert link is not None

    def pushed() -> int:
        # (the link's table of streams is its own; each stream's buffer statistics are
        # the contract)
        streams = link._streams.running.values()
        return max((stream.buffer.statistics().tokens_pushed for stream in streams), default=0)

    await wait_for_stats(lambda: pushed() >= tokens, LIVENESS_S)


async def _holds_nothing(cluster: Cluster) -> None:
    await wait_until_idle(cluster, LIVENESS_S)
    for stats in cluster.stats():
        for key in ("kv_blocks_in_use", "kv_leases", "running_requests", "decode_requests"):
            assert stats[key] == 0, (key, stats)
        assert stats["prefills_in_progress"] == 0, stats


async def _metrics(cluster: Cluster) -> str:
    async with httpx.AsyncClient(base_url=cluster.url, timeout=LIVENESS_S) as http:
        return (await http.get("/metrics")).text


@pytest.mark.parametrize(("fault", "reason"), [("reset", "link_lost"), ("stall", "link_timeout")])
async def test_streams_on_a_decode_lost_mid_stream_finish_unbroken_on_the_other(
    fault: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    expected = await _undisturbed([_chat(index) for index in range(CLIENTS)])
    assert all(not e.errors and e.finish_reasons == ["length"] for e in expected)
    caplog.set_level(logging.INFO, logger="pdtrio.access")
    async with proxied_cluster() as proxied:
        answers = await _streams_under_fault(proxied, fault)
        for answer, undisturbed in zip(answers, expected, strict=True):
            assert answer.errors == [] and answer.done
            assert len(answer.ids) == 1 and answer.roles == 1
            # the same text, token for token: no gap, no token twice
            assert answer.content == undisturbed.content
            assert answer.finish_reasons == ["length"]
            assert answer.usage == undisturbed.usage
            assert answer.usage is not None and answer.usage["completion_tokens"] == MAX_TOKENS
        metrics = await _metrics(proxied.cluster)
        # round robin: half the streams were on the first decode
        assert by_labels(metrics, "pdtrio_migrations_total", "reason") == {(reason,): CLIENTS // 2}
        assert value(metrics, "pdtrio_requests_total", outcome="ok") == CLIENTS
        await _holds_nothing(proxied.cluster)
    lines = [r.getMessage() for r in caplog.records if r.name == "pdtrio.access"]
    migrated = [line for line in lines if f"migrations={reason}" in line]
    assert len(migrated) == CLIENTS // 2, lines
    assert all("status=200" in line and "outcome=ok" in line for line in migrated)


async def test_a_stop_string_and_min_tokens_carry_over_a_migration() -> None:
    plain = (await _undisturbed([_chat(0)]))[0]
    # a stop string that begins in one token and ends in the next, well after the cut
    words = plain.content.split(" ")
    stop = f"{words[30][-1:]} {words[31][:2]}"
    body = _chat(0, stop=[stop], min_tokens=20)
    (expected,) = await _undisturbed([body])
    assert expected.finish_reasons == ["stop"] and len(expected.content) < len(plain.content)
    async with (
        proxied_cluster() as proxied,
        httpx.AsyncClient(base_url=proxied.cluster.url, timeout=LIVENESS_S) as http,
    ):
        progress = Progress(1)
        events: list[str] = []

        async def run() -> None:
            nonlocal events
            events = await _stream(http, body, progress)

        with trio.fail_after(LIVENESS_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                await progress.mid_stream.wait()
                proxied.proxies[await _serving(proxied)].reset_all()
        answer = _read(events)
        assert answer.errors == [] and answer.roles == 1
        assert (answer.content, answer.finish_reasons, answer.usage) == (
            expected.content,
            expected.finish_reasons,
            expected.usage,
        )
        metrics = await _metrics(proxied.cluster)
        assert value(metrics, "pdtrio_migrations_total", reason="link_lost") == 1
        await _holds_nothing(proxied.cluster)


@pytest.mark.parametrize("fault", ["reset", "stall"])
async def test_a_non_streaming_request_is_continued_the_same_way(fault: str) -> None:
    (expected,) = await _undisturbed([_chat(0)])
    async with (
        proxied_cluster() as proxied,
        httpx.AsyncClient(base_url=proxied.cluster.url, timeout=LIVENESS_S) as http,
    ):
        with trio.fail_after(LIVENESS_S):
            async with trio.open_nursery() as nursery:
                answer: list[httpx.Response] = []

                async def run() -> None:
                    answer.append(
                        await http.post("/v1/chat/completions", json=_chat(0, stream=False))
                    )

                nursery.start_soon(run)
                # no byte comes before the end: the decode's own count says it is under way
                on = await _serving(proxied)
                await _tokens_come(proxied, on)  # some tokens in
                if fault == "reset":
                    proxied.proxies[on].reset_all()
                else:
                    proxied.proxies[on].update(stall=True)
        proxied.proxies[on].update(stall=False)
        (response,) = answer
        assert response.status_code == 200, response.text
        payload = response.json()
        assert payload["choices"][0]["message"]["content"] == expected.content
        assert payload["choices"][0]["finish_reason"] == "length"
        assert payload["usage"] == expected.usage
        metrics = await _metrics(proxied.cluster)
        assert value(metrics, "pdtrio_migrations_total") == 1
        await _holds_nothing(proxied.cluster)


@pytest.mark.parametrize("decodes", [1, 2])
async def test_with_migration_off_or_no_other_decode_the_stream_ends_as_before(
    decodes: int,
) -> None:
    # the only decode lost for good (its proxy refuses): past decode_reconnect_wait_s.
    # Both losses are resets, seen at once: a link timeout long enough that a starved
    # machine does not drop a healthy prefill's link (CI saw 503s from that)
    router = (
        attrs.evolve(ROUTER, migration_limit=0, link_timeout_s=5.0)
        if decodes == 2
        else attrs.evolve(ROUTER, decode_reconnect_wait_s=0.3, link_timeout_s=5.0)
    )
    async with proxied_cluster(router, decodes=decodes) as proxied:
        answers = await _streams_under_fault(proxied, "reset" if decodes == 2 else "refuse")
        lost = [a for a in answers if a.errors]
        assert len(lost) == (CLIENTS // 2 if decodes == 2 else CLIENTS)
        for answer in lost:
            # well-formed: one error event, then [DONE]; the answer is cut
            assert answer.done and len(answer.errors) == 1 and answer.finish_reasons == []
            assert answer.errors[0]["code"] == "decode_failed", answer.errors
            assert answer.errors[0]["message"].startswith("decode failed: ")
        for answer in answers:
            if not answer.errors:
                assert answer.finish_reasons == ["length"]
        metrics = await _metrics(proxied.cluster)
        assert value(metrics, "pdtrio_migrations_total") == 0
        await _holds_nothing(proxied.cluster)


async def test_the_only_decode_takes_its_streams_back_once_it_has_reconnected(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A link reset (or a worker back from a stop) is not a lost worker: the worker ended
    every request of the old connection, so a continuation may go to it again."""
    expected = await _undisturbed([_chat(index) for index in range(CLIENTS)])
    async with proxied_cluster(decodes=1) as proxied:
        answers = await _streams_under_fault(proxied, "reset")
        for answer, undisturbed in zip(answers, expected, strict=True):
            assert answer.errors == [] and answer.done and answer.roles == 1
            assert (answer.content, answer.usage) == (undisturbed.content, undisturbed.usage)
        metrics = await _metrics(proxied.cluster)
        assert by_labels(metrics, "pdtrio_migrations_total", "reason") == {("link_lost",): CLIENTS}
        await _holds_nothing(proxied.cluster)


async def test_migrations_are_bounded_by_the_limit() -> None:
    router = attrs.evolve(ROUTER, migration_limit=1)
    async with (
        proxied_cluster(router, decodes=3) as proxied,
        httpx.AsyncClient(base_url=proxied.cluster.url, timeout=LIVENESS_S) as http,
    ):
        events: list[str] = []
        progress = Progress(1)

        async def run() -> None:
            nonlocal events
            events = await _stream(http, _chat(0), progress)

        with trio.fail_after(LIVENESS_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                await progress.mid_stream.wait()
                first = await _serving(proxied)
                proxied.proxies[first].reset_all()
                # it migrates to another; lose that one too
                second = await _serving(proxied, exclude=first)
                await _tokens_come(proxied, second)
                proxied.proxies[second].reset_all()
        answer = _read(events)
        assert len(answer.errors) == 1 and answer.done and answer.finish_reasons == []
        metrics = await _metrics(proxied.cluster)
        assert value(metrics, "pdtrio_migrations_total", reason="link_lost") == 1
        await _holds_nothing(proxied.cluster)


async def test_a_decode_step_failing_mid_stream_is_continued_on_the_other() -> None:
    (expected,) = await _undisturbed([_chat(0)])
    async with (
        proxied_cluster(first_fails_step=5) as proxied,
        httpx.AsyncClient(base_url=proxied.cluster.url, timeout=LIVENESS_S) as http,
    ):
        # round robin: whichever decode takes the first, the faulty one gets one of two
        with trio.fail_after(LIVENESS_S):
            answers = [_read(await _stream(http, _chat(0))) for _ in range(2)]
        for answer in answers:
            assert answer.errors == [] and answer.roles == 1 and len(answer.ids) == 1
            assert (answer.content, answer.usage) == (expected.content, expected.usage)
        metrics = await _metrics(proxied.cluster)
        assert by_labels(metrics, "pdtrio_migrations_total", "reason") == {("decode_failed",): 1}
        await _holds_nothing(proxied.cluster)


async def test_a_migrated_stream_keeps_one_logprob_per_token_the_same_as_undisturbed() -> None:
    body = _chat(0, logprobs=True, top_logprobs=2)
    (expected,) = await _undisturbed([body])
    assert len(expected.logprobs) == MAX_TOKENS
    async with (
        proxied_cluster(first_fails_step=5) as proxied,
        httpx.AsyncClient(base_url=proxied.cluster.url, timeout=LIVENESS_S) as http,
    ):
        with trio.fail_after(LIVENESS_S):
            answers = [_read(await _stream(http, body)) for _ in range(2)]
        for answer in answers:
            assert answer.errors == [] and answer.content == expected.content
            # the tokens decode had sent, not delivered, before it failed are not doubled
            assert answer.logprobs == expected.logprobs
        metrics = await _metrics(proxied.cluster)
        assert by_labels(metrics, "pdtrio_migrations_total", "reason") == {("decode_failed",): 1}
        await _holds_nothing(proxied.cluster)


async def test_kv_no_decode_can_pull_in_time_is_freed_and_the_request_goes_on_from_a_new_prefill() -> (
    None
):
    """The first decode fails the request before its first token; the other is down past
    prefill's KV lease, then back: the request does not end, it goes on from a new
    prefill of its prompt and the token delivered, as a migration."""
    (expected,) = await _undisturbed([_chat(0)])
    async with (
        proxied_cluster(first_fails_step=1, kv_lease_s=1.5) as proxied,
        httpx.AsyncClient(base_url=proxied.cluster.url, timeout=LIVENESS_S) as http,
    ):
        down = proxied.proxies[1]
        down.update(refuse=True)
        down.reset_all()
        router = proxied.cluster.router_app.router
        assert router is not None
        await wait_for_stats(
            lambda: len(worker_backend(router).instances.decode_links()) == 1, LIVENESS_S
        )
        events: list[str] = []

        async def run() -> None:
            nonlocal events
            events = await _stream(http, _chat(0))

        with trio.fail_after(LIVENESS_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                # past the lease (less the router's margin) the KV is given up: then back
                # (the lease's time waited out is the thing tested)
                await trio.sleep(1.5)
                down.update(refuse=False)
        answer = _read(events)
        assert answer.errors == [] and answer.roles == 1 and len(answer.ids) == 1
        assert (answer.content, answer.usage) == (expected.content, expected.usage)
        metrics = await _metrics(proxied.cluster)
        assert by_labels(metrics, "pdtrio_migrations_total", "reason") == {("decode_failed",): 1}
        await _holds_nothing(proxied.cluster)
