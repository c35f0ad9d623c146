"""A real model served disaggregated says exactly what it says colocated."""

from __future__ import annotations

import importlib.util
import json
import random
import threading
from functools import partial

import attrs
import httpx
import pytest
import trio
import trio.testing

pytest.importorskip("torch")

from pdtrio.config import EngineConfig, RouterConfig, WorkerConfig, WorkerFaultsConfig  # noqa: E402
from pdtrio.engine.api import StepObserver  # noqa: E402
from pdtrio.engine.torch.engine import TorchEngine  # noqa: E402
from pdtrio.worker.server import Worker  # noqa: E402
from tests.cluster import (  # noqa: E402
    Cluster,
    client,
    raw_post_then_hang_up,
    running_cluster,
    wait_for_answer,
    wait_for_stats,
    wait_until_idle,
)
from tests.metrics import value  # noqa: E402

NIXL = importlib.util.find_spec("nixl") is not None

TINY = EngineConfig(
    kind="torch", model="tiny-random", dtype="float64", num_kv_blocks=512, max_batch_size=16
)


# These compare outputs, not liveness: a starved CI machine has held an in-process model's
# step past the default 1.5 s link timeout, failing a request these tests are not about.
ROUTER = RouterConfig(link_timeout_s=30.0)


def tiny_worker(role: str, engine: EngineConfig = TINY, kv_transport: str = "auto") -> Worker:
    config = WorkerConfig(role=role, engine=engine, kv_transport=kv_transport)  # type: ignore[arg-type]
    return Worker(config, TorchEngine.from_config(engine))  # type: ignore[arg-type]


# the equivalence tests run over each KV transport; "nixl" is skipped where NIXL is not installed
TRANSPORTS = [
    pytest.param("nixl", marks=pytest.mark.skipif(not NIXL, reason="NIXL is not installed")),
    "tcp",
]


def assert_pulled_with(cluster: Cluster, kv_transport: str) -> None:
    """Every pull of the disaggregated run went over ``kv_transport``."""
    (decode,) = [w for w in cluster.workers if w.config.role == "decode"]
    pulls = decode.transport.info()["pulls"]
    assert pulls[kv_transport] > 0 and sum(pulls.values()) == pulls[kv_transport], pulls


def _prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["pd", "trio", "kv", "cache", "héllo", "日本", "decode", "prefill", "🙂", "block"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 40))) for _ in range(count)]


async def _complete_all(url_cluster, bodies: list[dict], stagger: float) -> list[dict]:
    results: list[dict] = [{}] * len(bodies)
    async with client(url_cluster) as http:
        async with trio.open_nursery() as nursery:
            for index, body in enumerate(bodies):

                async def one(index: int = index, body: dict = body) -> None:
                    await trio.sleep(stagger * index)  # requests join a running batch
                    response = await http.post("/v1/completions", json=body)
                    assert response.status_code == 200, response.text
                    results[index] = response.json()

                nursery.start_soon(one)
    return results


@pytest.mark.parametrize("kv_transport", TRANSPORTS)
@pytest.mark.parametrize("concurrency", [1, 3, 8])
async def test_disaggregated_equals_colocated_on_tiny_random(
    concurrency: int, kv_transport: str
) -> None:
    prompts = _prompts(8, seed=concurrency)
    bodies = []
    for index, prompt in enumerate(prompts):
        body = {"model": "tiny-random", "prompt": prompt, "max_tokens": 12, "ignore_eos": True}
        if index % 2:
            body |= {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": index}
        else:
            body |= {"temperature": 0}
        bodies.append(body)
    outputs = {}
    make = partial(tiny_worker, kv_transport=kv_transport)
    for roles in (("prefill", "decode"), ("both",)):
        async with running_cluster(roles=roles, make_worker=make, router=ROUTER) as cluster:
            replies = []
            for start in range(0, len(bodies), concurrency):
                replies += await _complete_all(cluster, bodies[start : start + concurrency], 0.01)
            await wait_until_idle(cluster)
            if roles == ("prefill", "decode"):
                assert_pulled_with(cluster, kv_transport)
        outputs[roles] = [r["choices"][0]["text"] for r in replies]
        assert all(r["usage"]["completion_tokens"] == 12 for r in replies)
    assert outputs[("prefill", "decode")] == outputs[("both",)]


@pytest.mark.parametrize("kv_transport", TRANSPORTS)
async def test_stop_strings_and_min_tokens_agree_between_modes(kv_transport: str) -> None:
    base = {"model": "tiny-random", "prompt": "stop here", "temperature": 0, "max_tokens": 30}
    outputs = {}
    make = partial(tiny_worker, kv_transport=kv_transport)
    for roles in (("prefill", "decode"), ("both",)):
        async with running_cluster(roles=roles, make_worker=make, router=ROUTER) as cluster:
            async with client(cluster) as http:
                whole = (await http.post("/v1/completions", json=base)).json()["choices"][0]
                text = whole["text"]
                assert len(text) > 8, text  # 30 greedy tokens: room for a stop string inside
                stop = text[len(text) // 4 : len(text) // 4 + 2]
                cut = (await http.post("/v1/completions", json={**base, "stop": [stop]})).json()
                # min_tokens past the whole output: the stop string may not end it early
                held = (
                    await http.post(
                        "/v1/completions", json={**base, "stop": [stop], "min_tokens": 30}
                    )
                ).json()
                outputs[roles] = (text, cut["choices"][0], cut["usage"], held["choices"][0])
            await wait_until_idle(cluster)
            if roles == ("prefill", "decode"):
                assert_pulled_with(cluster, kv_transport)
    assert outputs[("prefill", "decode")] == outputs[("both",)]
    text, cut, cut_usage, held = outputs[("both",)]
    assert cut["finish_reason"] == "stop"
    assert text.startswith(cut["text"]) and len(cut["text"]) < len(text)
    # decode's count includes the tokens the stop string cut from the text
    assert 1 <= cut_usage["completion_tokens"] < 30
    assert held["finish_reason"] == "length"
    assert held["text"] == text


async def test_random_disconnects_leave_no_blocks_with_the_torch_engine() -> None:
    rng = random.Random(7)
    async with running_cluster(make_worker=tiny_worker, router=ROUTER) as cluster:
        async with trio.open_nursery() as nursery:
            for _ in range(12):
                body = json.dumps(
                    {
                        "model": "tiny-random",
                        "prompt": "x " * rng.randint(1, 60),
                        "max_tokens": 200,
                        "stream": True,
                        "ignore_eos": True,
                    }
                ).encode()
                nursery.start_soon(
                    partial(
                        raw_post_then_hang_up,
                        cluster.url,
                        "/v1/completions",
                        body,
                        events=rng.randint(0, 30),
                    )
                )
        await wait_until_idle(cluster, deadline_s=30)


class StepGate:
    """A step observer that, while shut, holds the engine thread after each step: a test
    acts while a request is between steps, then lets the engine go on."""

    def __init__(self, observer: StepObserver) -> None:
        self._observer = observer
        self._open = threading.Event()
        self._open.set()
        self.holding = threading.Event()  # the engine thread waits at the gate

    def __call__(self, seconds: float, batch: int, tokens: int) -> None:
        self._observer(seconds, batch, tokens)
        if not self._open.is_set():
            self.holding.set()
            self._open.wait()

    def shut(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()


async def test_a_decode_aborted_mid_stream_is_free_again_in_the_routers_view_by_itself() -> None:
    # the engine frees a running request's blocks between steps, after the abort (and the
    # capacity report it marked) are done: the router must hear of the room without
    # another request coming to that decode
    gates: list[StepGate] = []

    def make(role: str) -> Worker:
        worker = tiny_worker(role)
        if role == "decode":
            gates.append(StepGate(worker.metrics.step))
            worker.engine.observe_steps(gates[-1])
        return worker

    async with running_cluster(make_worker=make, router=ROUTER) as cluster:
        (gate,) = gates
        (decode,) = [w for w in cluster.workers if w.config.role == "decode"]
        total = decode.engine.statistics().kv_blocks_total

        async def routers_free_blocks(http: httpx.AsyncClient) -> float:
            metrics = (await http.get("/metrics")).text
            return value(metrics, "pdtrio_instance_kv_free_blocks", role="decode")

        body = {"model": "tiny-random", "prompt": "hang up", "max_tokens": 200, "stream": True}
        async with client(cluster) as http:
            await wait_for_answer(
                partial(routers_free_blocks, http),
                lambda free: free == total,
                what="decode's first capacity report",
            )
            gate.shut()
            try:
                async with trio.open_nursery() as nursery:
                    # a client that never reads to the end
                    hang_up_later = partial(
                        raw_post_then_hang_up,
                        cluster.url,
                        "/v1/completions",
                        json.dumps(body | {"ignore_eos": True}).encode(),
                        events=10**6,
                    )
                    nursery.start_soon(hang_up_later)
                    # decode runs the request: its engine waits after the request's step
                    await wait_for_stats(gate.holding.is_set, 30, what="a decode step")
                    nursery.cancel_scope.cancel()  # the connection closes
                # the router aborted it on decode, whose link forgot it and marked its
                # capacity while the engine still held the blocks
                await wait_for_stats(lambda: decode.stats()["decode_requests"] == 0, 10)
                await trio.testing.wait_all_tasks_blocked()  # that report went out
                assert await routers_free_blocks(http) < total
            finally:
                gate.open()
            # nothing more is sent: the engine's freeing alone must reach the router
            await wait_for_answer(
                partial(routers_free_blocks, http),
                lambda free: free == total,
                deadline_s=20,
                what="the aborted request's blocks free in the router's view",
            )
        await wait_until_idle(cluster)


async def test_a_request_queued_behind_an_aborted_one_starts_when_the_engine_frees_its_blocks() -> (
    None
):
    # decode holds one request at a time; a second waits in the router's queue.  The first
    # is aborted while the engine is held between steps: only the engine's freeing of its
    # blocks, later, can place the second (nothing else starts or finishes on that decode)
    gates: list[StepGate] = []

    def make(role: str) -> Worker:
        if role != "decode":
            return tiny_worker(role)
        worker = tiny_worker(role, attrs.evolve(TINY, num_kv_blocks=16))
        gates.append(StepGate(worker.metrics.step))
        worker.engine.observe_steps(gates[-1])
        return worker

    # 200 tokens and a short prompt: 13 blocks of 16, so two never fit together
    body = {"model": "tiny-random", "prompt": "hang up", "max_tokens": 200, "ignore_eos": True}
    async with running_cluster(make_worker=make, router=ROUTER) as cluster:
        (gate,) = gates
        prefill, decode = cluster.workers
        gate.shut()
        try:
            async with client(cluster) as http, trio.open_nursery() as nursery:
                hang_up_later = partial(
                    raw_post_then_hang_up,
                    cluster.url,
                    "/v1/completions",
                    json.dumps(body | {"stream": True}).encode(),
                    events=10**6,
                )
                answers: list[httpx.Response] = []

                async def queued() -> None:
                    answers.append(await http.post("/v1/completions", json=body))

                async with trio.open_nursery() as first:
                    first.start_soon(hang_up_later)
                    await wait_for_stats(gate.holding.is_set, 30, what="a decode step")
                    nursery.start_soon(queued)
                    await wait_for_stats(lambda: prefill.stats()["served_prefills"] == 2, 30)
                    await trio.testing.wait_all_tasks_blocked()
                    assert decode.stats()["decode_requests"] == 1  # the second waits for room
                    first.cancel_scope.cancel()  # the first client's connection closes
                await wait_for_stats(lambda: decode.stats()["decode_requests"] == 0, 10)
                await trio.testing.wait_all_tasks_blocked()
                # the abort's own report went out while the engine still held the blocks
                assert decode.stats()["decode_requests"] == 0
                gate.open()
                with trio.fail_after(20):  # far inside the prefill lease
                    await wait_for_stats(lambda: bool(answers), 20)
        finally:
            gate.open()
        (answer,) = answers
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] == "length"
        await wait_until_idle(cluster)


@pytest.mark.parametrize("kv_transport", TRANSPORTS)
async def test_layout_mismatch_is_a_clear_error_naming_both_sides(kv_transport: str) -> None:
    other = EngineConfig(kind="torch", model="tiny-random", dtype="float32", num_kv_blocks=512)

    def make(role: str) -> Worker:
        return tiny_worker(role, TINY if role == "prefill" else other, kv_transport)

    async with running_cluster(make_worker=make, router=ROUTER) as cluster:
        async with client(cluster) as http:
            response = await http.post(
                "/v1/completions", json={"model": "tiny-random", "prompt": "hello", "max_tokens": 5}
            )
        await wait_until_idle(cluster)
    # the router pairs only matching layouts: refused before any prefill runs
    assert response.status_code == 503
    message = response.json()["error"]["message"]
    assert (
        "cannot be paired" in message
        and "dtype" in message
        and "float64" in message
        and "float32" in message
    )
    assert "prefill has" in message and "decode has" in message


async def test_prompt_beyond_context_is_rejected_before_prefill_runs() -> None:
    async with running_cluster(make_worker=tiny_worker, router=ROUTER) as cluster:
        async with client(cluster) as http:
            response = await http.post(
                "/v1/completions", json={"model": "tiny-random", "prompt": "word " * 3000}
            )
        assert cluster.workers[0].prefill.served_prefills == 0
    assert response.status_code == 400
    assert "maximum context length" in response.json()["error"]["message"]


async def test_no_room_on_one_decode_goes_to_another() -> None:
    small = EngineConfig(kind="torch", model="tiny-random", dtype="float64", num_kv_blocks=2)
    configs = iter([TINY, small, TINY])  # prefill, a decode with no room, a decode with room

    def make(role: str) -> Worker:
        return tiny_worker(role, next(configs))

    async with running_cluster(
        roles=("prefill", "decode", "decode"), make_worker=make, router=ROUTER
    ) as cluster:
        async with client(cluster) as http:
            for _ in range(4):
                response = await http.post(
                    "/v1/completions",
                    json={
                        "model": "tiny-random",
                        "prompt": "y " * 40,
                        "max_tokens": 40,
                        "temperature": 0,
                    },
                )
                assert response.status_code == 200, response.text
        await wait_until_idle(cluster)


def _digest_counts(worker: Worker) -> tuple[float, float]:
    text = worker.metrics.render().decode()
    return (
        value(text, "pdtrio_worker_kv_digest_checks_total"),
        value(text, "pdtrio_worker_kv_digest_mismatches_total"),
    )


@pytest.mark.parametrize("kv_transport", TRANSPORTS)
async def test_checked_handoffs_answer_as_unchecked_and_a_damaged_one_moves_to_another_decode(
    kv_transport: str,
) -> None:
    # the verified handoff on a real model's KV (float64 blocks of 16 tokens, big enough to be
    # sampled): every coverage answers as no check does; a decode whose pulls land damaged
    # (kv_transfer_corrupt) refuses each, and the request is answered by the other, unchanged
    bodies = [
        {"model": "tiny-random", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        for prompt in _prompts(3, seed=53)
    ]

    def worker(role: str, digest: str, corrupt: bool = False) -> Worker:
        config = WorkerConfig(
            role=role,  # type: ignore[arg-type]
            engine=TINY,
            kv_transport=kv_transport,  # type: ignore[arg-type]
            kv_digest=digest,  # type: ignore[arg-type]
            faults=WorkerFaultsConfig(kv_transfer_corrupt=corrupt),
        )
        return Worker(config, TorchEngine.from_config(TINY))  # type: ignore[arg-type]

    answers = {}
    for digest in ("off", "sampled", "full"):
        make = partial(worker, digest=digest)
        async with running_cluster(make_worker=make, router=ROUTER) as cluster:
            replies = await _complete_all(cluster, bodies, 0.0)
            await wait_until_idle(cluster)
            assert_pulled_with(cluster, kv_transport)
            expected = (0.0, 0.0) if digest == "off" else (float(len(bodies)), 0.0)
            assert _digest_counts(cluster.workers[1]) == expected
        answers[digest] = [r["choices"][0]["text"] for r in replies]
    assert answers["sampled"] == answers["off"] == answers["full"]

    workers = iter(
        [
            worker("prefill", "sampled"),
            worker("decode", "sampled", True),
            worker("decode", "sampled"),
        ]
    )
    async with running_cluster(
        roles=("prefill", "decode", "decode"), make_worker=lambda role: next(workers), router=ROUTER
    ) as cluster:
        async with client(cluster) as http:
            texts = []
            for body in bodies:
                response = await http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                texts.append(response.json()["choices"][0]["text"])
        await wait_until_idle(cluster)
        _, damaged, healthy = cluster.workers
        checks, mismatches = _digest_counts(damaged)
        assert checks == mismatches > 0
        assert _digest_counts(healthy) == (float(len(bodies)), 0.0)
    assert texts == answers["off"]
