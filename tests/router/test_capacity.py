"""A busy decode makes requests wait (or refuses them up front), never 200-then-error."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from pdtrio.asgi import Receive, Scope, Send
from pdtrio.config import InstanceConfig, PdtrioConfig, RouterConfig
from pdtrio.engine.budget import token_budget
from pdtrio.router.app import RouterApp
from pdtrio.worker.server import Worker
from tests.cluster import (
    Cluster,
    client,
    running_cluster,
    serve_app,
    synthetic_worker,
    wait_for_stats,
    wait_until_idle,
    worker_backend,
)

# a 3-token prompt plus the default budget capped by the context: 64 tokens = 4 blocks,
# so decode's 32 blocks hold 8 default requests at once (prefill holds the prompts of those
# that wait: room for all of them)
_SMALL = {
    "max_model_len": 64,
    "tokens_per_step": 8,
    "decode_step_s": 0.002,
}


def _small_worker(role: str) -> Worker:
    return synthetic_worker(role, num_kv_blocks=32 if role == "decode" else 512, **_SMALL)


async def _offer(cluster: Cluster, count: int) -> list[httpx.Response]:
    responses: list[httpx.Response] = []
    limits = httpx.Limits(max_connections=count + 8, max_keepalive_connections=count + 8)
    async with client(cluster, limits=limits, timeout=60) as http:

        async def one() -> None:
            body = {"model": "synthetic", "prompt": "hi", "stream": True}
            responses.append(await http.post("/v1/completions", json=body))

        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(one)
    return responses


def _complete(response: httpx.Response) -> bool:
    text = response.text
    return (
        response.status_code == 200
        and '"error"' not in text
        and '"finish_reason":"length"' in text.replace(" ", "")
        and text.endswith("data: [DONE]\n\n")
    )


def test_an_unset_max_tokens_is_the_default_not_the_context() -> None:
    assert token_budget(10, None, max_model_len=100_000, kv_capacity_tokens=10**6) == 2048
    assert token_budget(10, None, max_model_len=100, kv_capacity_tokens=1000) == 90
    assert (
        token_budget(10, None, max_model_len=9000, kv_capacity_tokens=10**6, default_max_tokens=7)
        == 7
    )


async def test_excess_requests_wait_for_decode_room() -> None:
    async with running_cluster(make_worker=_small_worker) as cluster:
        responses = await _offer(cluster, 64)
        assert len(responses) == 64
        bad = [r for r in responses if not _complete(r)]
        assert not bad, (len(bad), bad[0].status_code, bad[0].text[-300:])
        await wait_until_idle(cluster)
        assert cluster.blocks_in_use() == 0


async def test_a_full_queue_answers_429_up_front() -> None:
    router = RouterConfig(admission_queue_limit=16)
    async with running_cluster(make_worker=_small_worker, router=router) as cluster:
        responses = await _offer(cluster, 100)
        complete = [r for r in responses if _complete(r)]
        refused = [r for r in responses if r.status_code == 429]
        assert len(complete) + len(refused) == 100, [
            (r.status_code, r.text[-200:]) for r in responses if r not in complete + refused
        ][:3]
        assert len(complete) >= 8 + 16 and refused
        for response in refused:
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "queue_full"
        await wait_until_idle(cluster)
        assert cluster.blocks_in_use() == 0


async def test_a_request_no_decode_can_hold_is_a_400_before_any_byte() -> None:
    def make(role: str) -> Worker:
        # prefill could hold it; decode never can (128 blocks of 16 tokens)
        blocks = 128 if role == "decode" else 1024
        return synthetic_worker(role, num_kv_blocks=blocks, max_model_len=8192)

    async with running_cluster(make_worker=make) as cluster:
        async with client(cluster) as http:
            response = await http.post(
                "/v1/completions",
                json={"model": "synthetic", "prompt": "hi", "max_tokens": 4000, "stream": True},
            )
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "max_tokens"
            assert error["code"] == "context_length_exceeded"
            # a request that fits still runs
            ok = await http.post(
                "/v1/completions", json={"model": "synthetic", "prompt": "hi", "max_tokens": 50}
            )
            assert ok.status_code == 200
        await wait_until_idle(cluster)
        assert cluster.blocks_in_use() == 0


class _SeesTheRouter:
    """The router app, and the router its lifespan made (to see its queue)."""

    def __init__(self, app: RouterApp) -> None:
        self.app = app
        self.router: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.router = scope["state"]["router"]
        await self.app(scope, receive, send)


async def _stream_until_cancelled(http: httpx.AsyncClient, body: dict[str, Any]) -> None:
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for _ in response.aiter_bytes():
            pass


async def test_a_request_arriving_at_a_full_queue_gets_429_without_a_prefill() -> None:
    # decode holds one request at a time (16 blocks of 16 tokens; each takes 13) and
    # decodes slowly; the queue takes two more: a fourth request finds it full
    prefill = synthetic_worker("prefill", num_kv_blocks=1024, max_model_len=256)
    decode = synthetic_worker("decode", num_kv_blocks=16, max_model_len=256, decode_step_s=0.05)
    body = {"model": "synthetic", "prompt": "hi", "max_tokens": 200, "stream": True}
    async with trio.open_nursery() as nursery:
        instances = []
        for worker in (prefill, decode):
            ready = await nursery.start(worker.run)
            url = f"http://127.0.0.1:{ready['http_port']}"
            instances.append(InstanceConfig(role=worker.config.role, url=url))
        config = PdtrioConfig(
            router=RouterConfig(admission_queue_limit=2), instances=tuple(instances)
        )
        app = _SeesTheRouter(RouterApp(config))
        url = await serve_app(app, nursery)
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as http:
            assert (await http.get("/health")).status_code == 200
            queue = worker_backend(app.router).decode_queue
            # one decoding first (a place is held from arrival, so three at once would
            # find the queue full), then two that wait
            nursery.start_soon(_stream_until_cancelled, http, body)
            await wait_for_stats(lambda: decode.stats()["running_requests"] >= 1, 20)
            for _ in range(2):
                nursery.start_soon(_stream_until_cancelled, http, body)
            # the queue is full from the two arrivals (their places are reserved before
            # prefill): wait for both to be prefilled too, not just for the places
            await wait_for_stats(lambda: queue.full and prefill.stats()["served_prefills"] == 3, 20)
            served = prefill.stats()["served_prefills"]
            assert served == 3  # one decoding, two prefilled and waiting

            response = await http.post("/v1/completions", json={**body, "stream": False})

            assert response.status_code == 429, response.text
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "queue_full"
            stats = prefill.stats()
            assert stats["served_prefills"] == served  # prefill never saw it
            assert stats["prefills_in_progress"] == 0
            assert len(queue) == 2  # the waiting ones wait on
            nursery.cancel_scope.cancel()


async def test_a_reserved_place_counts_against_the_limit_and_becomes_the_waiters() -> None:
    from pdtrio.router.request.capacity import CapacityQueue, QueueFull

    queue: CapacityQueue[str] = CapacityQueue(2)
    queue.reserve()
    queue.reserve()
    assert queue.full and len(queue) == 2
    try:
        queue.reserve()
        raise AssertionError("a third place was reserved")
    except QueueFull:
        pass
    room: list[str] = []
    async with trio.open_nursery() as nursery:

        async def wait_with_reserved_place() -> None:
            queue.unreserve()  # as the pipeline does, right before waiting
            room.append(await queue.wait_for(lambda: "room" if room == ["go"] else None))

        nursery.start_soon(wait_with_reserved_place)
        await trio.testing.wait_all_tasks_blocked()
        assert len(queue) == 2 and queue.full  # one waiting, one still reserved
        room.append("go")
        queue.changed()
    assert room == ["go", "room"] and len(queue) == 1


async def test_a_request_back_for_another_decode_is_not_refused_for_the_queues_limit() -> None:
    # it counted against the limit at the door; its first tokens may be out: refusing it
    # now would be an error after a 200
    from pdtrio.router.request.capacity import CapacityQueue, QueueFull

    queue: CapacityQueue[str] = CapacityQueue(1)
    queue.reserve()  # a newcomer took the last place meanwhile
    with pytest.raises(QueueFull):
        await queue.wait_for(lambda: "room")
    room: list[str] = []
    async with trio.open_nursery() as nursery:

        async def wait_as_admitted() -> None:
            room.append(await queue.wait_for(lambda: "room", admitted=True))

        nursery.start_soon(wait_as_admitted)
        await trio.testing.wait_all_tasks_blocked()
        assert len(queue) == 2  # over the limit, by the one admitted before
        queue.changed()
    assert room == ["room"] and len(queue) == 1


async def test_a_wait_for_decode_room_lasts_what_is_left_of_prefills_lease() -> None:
    # the lease comes as a TTL, counted from prefill's reply on the router's clock: the
    # wait for decode room ends that TTL (less the pull's margin) later, not at once
    lease_s = 2.5

    def make(role: str) -> Worker:
        return synthetic_worker(
            role,
            worker_overrides={"kv_lease_s": lease_s},
            max_model_len=256,
            num_kv_blocks=16,  # one default request (16 blocks) fills decode
            tokens_per_step=1,
            decode_step_s=0.05,  # for ~12 s
        )

    # (one round: a new prefill's lease would be another wait)
    router = RouterConfig(handoff_attempts=1)
    async with running_cluster(make_worker=make, router=router) as cluster:
        async with client(cluster, timeout=60) as http, trio.open_nursery() as nursery:
            decoding = trio.Event()

            async def hold_decode() -> None:
                body = {"model": "synthetic", "prompt": "hi", "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    async for _ in response.aiter_bytes():
                        decoding.set()

            nursery.start_soon(hold_decode)
            await decoding.wait()
            started = trio.current_time()
            waited = await http.post("/v1/completions", json={"model": "synthetic", "prompt": "hi"})
            elapsed = trio.current_time() - started
            nursery.cancel_scope.cancel()
        assert waited.status_code == 503, waited.text
        assert "no decode capacity came free within the prefill KV lease" in waited.text
        # the router's margin is 1 s: it waited the 1.5 s left, give or take the prefill
        assert 1.2 <= elapsed <= lease_s + 1.0, elapsed
        await wait_until_idle(cluster)
        assert cluster.blocks_in_use() == 0


async def test_room_found_as_the_lease_deadline_passes_still_starts_the_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The race the soak found: room comes free as the lease's deadline passes; the wait's
    # timer fires (its cancel pending) before the waiter runs, and placing disarms that
    # deadline.  The start must not be cut by it (it was, and read as a drain: "the
    # router is shutting down").  Blocking the loop right after room is announced puts
    # the clock past the deadline before the waiter runs, as a busy loop would.
    from pdtrio.router import core

    lease_s = 3.0
    # the router's deadline 1.5 s before the lease's end, decode's read needs 1 s left:
    # a start sent just past the router's deadline can still be pulled
    monkeypatch.setattr(core, "LEASE_MARGIN_S", 1.5)

    def make(role: str) -> Worker:
        return synthetic_worker(
            role,
            worker_overrides={"kv_lease_s": lease_s},
            max_model_len=256,
            num_kv_blocks=16,  # one default request (16 blocks) fills decode
            tokens_per_step=1,
            decode_step_s=0.05,
        )

    async with running_cluster(make_worker=make) as cluster:
        router = cluster.router_app.router
        assert router is not None
        queue = worker_backend(router).decode_queue
        announce = queue.changed
        blocked_until: list[float] = []

        def announce_late() -> None:
            waiting = [
                r
                for r in router.requests._running.values()
                if getattr(r, "machine", None) and r.machine.phase_name == "PLACING_DECODE"
            ]
            room = worker_backend(router).instances.decode_with_room(
                16 * 16, trio.current_time()
            )  # (what a default request needs)
            announce()
            if waiting and room is not None and queue._waiters and not blocked_until:
                armed = waiting[0].machine.next_deadline()
                assert armed is not None and armed[1].name == "KV_LEASE"
                blocked_until.append(armed[0] + 0.05)
                time.sleep(max(0.0, blocked_until[0] - trio.current_time()))

        queue.changed = announce_late  # type: ignore[method-assign]
        async with client(cluster, timeout=60) as http, trio.open_nursery() as nursery:
            decoding = trio.Event()
            holder = trio.CancelScope()

            async def hold_decode() -> None:
                body = {"model": "synthetic", "prompt": "hi", "stream": True}
                with holder:
                    async with http.stream("POST", "/v1/completions", json=body) as response:
                        async for _ in response.aiter_bytes():
                            decoding.set()

            nursery.start_soon(hold_decode)
            await decoding.wait()
            answers: list[httpx.Response] = []

            async def waiter() -> None:
                body = {"model": "synthetic", "prompt": "hi", "stream": True, "max_tokens": 4}
                answers.append(await http.post("/v1/completions", json=body))

            nursery.start_soon(waiter)
            with trio.fail_after(30):
                while not queue._waiters and not answers:  # noqa: ASYNC110 (no event for it)
                    await trio.sleep(0.01)
            assert not answers, f"the request did not wait for decode room: {answers[0].text}"
            holder.cancel()  # its room comes free: the announce blocks past the deadline
        assert blocked_until, "no waiter was woken"
        (response,) = answers
        assert _complete(response), response.text
        await wait_until_idle(cluster)
        assert cluster.blocks_in_use() == 0
