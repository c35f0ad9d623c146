"""A failing prefill is retried elsewhere, a client error is not; a decode failure is a 502;
a body that never arrives is a 408."""

from __future__ import annotations

from typing import Any

import trio

from pdtrio.config import RouterConfig
from pdtrio.engine.api import EngineError
from pdtrio.engine.synthetic import SyntheticEngine
from pdtrio.worker.server import Worker
from tests.cluster import (
    client,
    running_cluster,
    synthetic_worker,
    wait_for_stats,
    wait_until_idle,
    worker_backend,
)


class _FailingPrefill(SyntheticEngine):
    """Every prefill fails as a broken engine would (the worker answers 500)."""

    calls = 0

    async def prefill(self, request_id: str, *args: Any, **kwargs: Any) -> Any:
        type(self).calls += 1
        raise EngineError("the engine broke")


def _one_broken_prefill(prefills: list[Worker]) -> Any:
    def make(role: str) -> Worker:
        worker = synthetic_worker(role)
        if role == "prefill":
            prefills.append(worker)
            if len(prefills) == 1:
                worker.engine.__class__ = _FailingPrefill
        return worker

    return make


async def test_a_prefill_that_fails_is_retried_on_another_and_a_client_error_is_not() -> None:
    _FailingPrefill.calls = 0
    async with running_cluster(
        roles=("prefill", "prefill", "decode"), make_worker=_one_broken_prefill([])
    ) as cluster:
        async with client(cluster) as http:
            for index in range(6):
                body = {"model": "synthetic", "prompt": f"p{index}", "max_tokens": 3}
                response = await http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
            assert _FailingPrefill.calls > 0  # the broken one was tried, and its requests moved
            # a client error (a prompt over the context) is the client's: not retried
            calls = _FailingPrefill.calls
            long = {"model": "synthetic", "prompt": [5] * 8000, "max_tokens": 500}
            response = await http.post("/v1/completions", json=long)
            assert response.status_code == 400, response.text
            assert _FailingPrefill.calls - calls <= 1
        await wait_until_idle(cluster)


async def test_every_prefill_failing_is_a_502_with_the_workers_reason() -> None:
    _FailingPrefill.calls = 0

    def broken(role: str) -> Worker:
        worker = synthetic_worker(role)
        if role == "prefill":
            worker.engine.__class__ = _FailingPrefill
        return worker

    async with running_cluster(
        roles=("prefill", "prefill", "decode"), make_worker=broken
    ) as cluster:
        async with client(cluster) as http:
            body = {"model": "synthetic", "prompt": "x", "max_tokens": 3}
            response = await http.post("/v1/completions", json=body)
        assert response.status_code == 502
        assert "the engine broke" in response.json()["error"]["message"]
        assert _FailingPrefill.calls == 2  # each instance once, then no one is left
        await wait_until_idle(cluster)


async def test_decode_dying_mid_request_is_a_502_for_a_non_streaming_client() -> None:
    decode_scope = trio.CancelScope()

    def make(role: str) -> Worker:
        worker = synthetic_worker(role, decode_step_s=0.01)
        if role == "decode":
            run = worker.run

            async def run_until_stopped(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                with decode_scope:
                    await run(task_status=task_status)

            worker.run = run_until_stopped  # type: ignore[method-assign]
        return worker

    # (no wait for another decode to come: the one there is is gone for good)
    router = RouterConfig(decode_reconnect_wait_s=0.2)
    async with running_cluster(make_worker=make, router=router) as cluster:
        decode = cluster.workers[1]
        async with client(cluster) as http:
            async with trio.open_nursery() as nursery:

                async def stop_decode_once_it_decodes() -> None:
                    await wait_for_stats(lambda: decode.stats()["running_requests"] > 0)
                    decode_scope.cancel()

                nursery.start_soon(stop_decode_once_it_decodes)
                body = {"model": "synthetic", "prompt": "x", "max_tokens": 2000}
                response = await http.post("/v1/completions", json=body)
        assert response.status_code == 502, response.text
        assert response.json()["error"]["code"] == "decode_failed"


async def test_a_body_that_never_arrives_is_a_408() -> None:
    async with running_cluster(router=RouterConfig(body_read_timeout_s=0.3)) as cluster:
        host, port = cluster.url.removeprefix("http://").split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b'content-length: 100\r\n\r\n{"model": '
            )
            received = b""
            with trio.fail_after(10):  # liveness bound, not a timing assertion
                while b"\r\n\r\n" not in received or b"}}" not in received:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    received += chunk
        assert received.startswith(b"HTTP/1.1 408"), received
        assert b"request_timeout" in received


async def test_a_failed_kv_pull_is_retried_on_another_decode() -> None:
    from pdtrio.kv.api import KvTransferError
    from pdtrio.kv.tcp import TcpKvTransport

    class FailingPull(TcpKvTransport):
        pulls = 0

        async def pull(self, *args: Any, **kwargs: Any) -> None:
            type(self).pulls += 1
            raise KvTransferError("the transfer broke")

    decodes_made = 0

    def one_broken_decode(role: str) -> Worker:
        nonlocal decodes_made
        worker = synthetic_worker(role)
        if role == "decode":
            decodes_made += 1
            if decodes_made == 1:
                worker.transport = FailingPull()
        return worker

    async with running_cluster(
        roles=("prefill", "decode", "decode"), make_worker=one_broken_decode
    ) as cluster:
        async with client(cluster) as http:
            for index in range(6):
                body = {"model": "synthetic", "prompt": f"p{index}", "max_tokens": 3}
                response = await http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
        assert FailingPull.pulls > 0  # the broken decode was tried, and its requests moved
        await wait_until_idle(cluster)


async def test_a_prefill_failing_with_5xx_leaves_rotation() -> None:
    _FailingPrefill.calls = 0
    prefills: list[Worker] = []
    async with running_cluster(
        roles=("prefill", "prefill", "decode"),
        make_worker=_one_broken_prefill(prefills),
        router=RouterConfig(instance_backoff_s=30.0),
    ) as cluster:
        async with client(cluster) as http:
            body = {"model": "synthetic", "prompt": "p", "max_tokens": 3}
            for _ in range(8):
                assert (await http.post("/v1/completions", json=body)).status_code == 200
        # tried once, then out of rotation: no other request waited on it
        assert _FailingPrefill.calls == 1
        await wait_until_idle(cluster)


async def test_a_mended_prefill_returns_to_rotation_after_its_wait() -> None:
    _FailingPrefill.calls = 0
    prefills: list[Worker] = []
    async with running_cluster(
        roles=("prefill", "prefill", "decode"),
        make_worker=_one_broken_prefill(prefills),
        router=RouterConfig(instance_backoff_s=0.2),
    ) as cluster:
        async with client(cluster) as http:
            body = {"model": "synthetic", "prompt": "p", "max_tokens": 3}
            while not _FailingPrefill.calls:
                assert (await http.post("/v1/completions", json=body)).status_code == 200
            prefills[0].engine.__class__ = SyntheticEngine  # mended
            router = cluster.router_app.router
            assert router is not None
            suspended = worker_backend(router).instances[prefills[0].instance_id]
            assert suspended.suspended_until > 0.0  # out of rotation
            await trio.sleep_until(suspended.suspended_until)  # its time out of it is over
            for _ in range(6):
                assert (await http.post("/v1/completions", json=body)).status_code == 200
        assert prefills[0].stats()["served_prefills"] > 0
        await wait_until_idle(cluster)


class _ForgetsSeedThirteen(SyntheticEngine):
    """Decode loses every request whose seed is 13: it keeps running, and never says a word."""

    def _step(self) -> Any:
        forgotten = {r for r, state in self._running.items() if state.seed == 13}
        for request_id in forgotten:
            self.free_request(request_id)
        return super()._step()


async def test_a_stream_decode_forgot_is_ended_while_its_link_lives_on() -> None:
    def make(role: str) -> Worker:
        worker = synthetic_worker(role, decode_step_s=0.01)
        if role == "decode":
            worker.engine.__class__ = _ForgetsSeedThirteen
        return worker

    router = RouterConfig(stream_idle_timeout_s=0.5, decode_reconnect_wait_s=0.5)
    async with running_cluster(make_worker=make, router=router) as cluster:
        async with client(cluster) as http:
            with trio.fail_after(20):  # liveness bound, not a timing assertion
                body = {"model": "synthetic", "prompt": "x", "max_tokens": 50, "seed": 13}
                forgotten = await http.post("/v1/completions", json=body)
                body["seed"] = 1
                served = await http.post("/v1/completions", json=body)
        assert forgotten.status_code == 502, forgotten.text
        assert "sent nothing" in forgotten.json()["error"]["message"]
        assert served.status_code == 200  # the link and the other requests go on
        await wait_until_idle(cluster)
