"""The watch on a client leaving starts once its request has run a while: a short answer
never pays for the task, a long one is cut when its client leaves (the watch is a task
of the request's nursery)."""

from __future__ import annotations

import json

import trio
import trio.testing

from pdtrio.router.request.running_requests import CLIENT_WATCH_AFTER_S, RunningRequests
from tests.cluster import client, raw_post_then_hang_up, running_cluster, wait_until_idle


class _Request:
    def __init__(self, name: str, watched: list[tuple[str, float]]) -> None:
        self.name = name
        self._watched = watched

    def hang_up_if_stalled(self, now: float, write_timeout: float, cut_grace: float) -> None:
        pass

    def watch_client(self) -> None:
        self._watched.append((self.name, trio.current_time()))


async def test_each_request_is_watched_once_after_its_time_in_start_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    watched: list[tuple[str, float]] = []
    requests = RunningRequests(lambda _: None, 30.0, 1.0, watch_after_s=0.05)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(requests.watch_lasting_requests)
        await trio.sleep(1)  # the sweep parks with nothing to watch
        t0 = trio.current_time()
        requests.started(trio.CancelScope(), _Request("a", watched), t0)
        requests.started(trio.CancelScope(), _Request("b", watched), t0)
        await trio.sleep(0.03)
        requests.started(trio.CancelScope(), _Request("c", watched), trio.current_time())
        await trio.sleep(0.049)
        assert [name for name, _ in watched] == ["a", "b"]
        await trio.sleep(0.5)
        assert [(name, round(at - t0, 3)) for name, at in watched] == [
            ("a", 0.05),
            ("b", 0.05),
            ("c", 0.08),
        ]
        nursery.cancel_scope.cancel()


async def test_requests_starting_close_together_are_watched_in_one_wake_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # the sweep wakes no sooner than half the wait after its last taking: a request due
    # meanwhile waits for the next, with the others due by then
    watched: list[tuple[str, float]] = []
    requests = RunningRequests(lambda _: None, 30.0, 1.0, watch_after_s=0.05)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(requests.watch_lasting_requests)
        await trio.sleep(1)
        t0 = trio.current_time()
        for name in "abcd":
            requests.started(trio.CancelScope(), _Request(name, watched), trio.current_time())
            await trio.sleep(0.01)
        await trio.sleep(0.5)
        assert [(name, round(at - t0, 3)) for name, at in watched] == [
            ("a", 0.05),
            ("b", 0.075),
            ("c", 0.075),
            ("d", 0.1),
        ]
        nursery.cancel_scope.cancel()


async def test_no_wait_watches_at_the_start(autojump_clock: trio.testing.MockClock) -> None:
    watched: list[tuple[str, float]] = []
    requests = RunningRequests(lambda _: None, 30.0, 1.0, watch_after_s=0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(requests.watch_lasting_requests)
        await trio.sleep(1)
        t0 = trio.current_time()
        requests.started(trio.CancelScope(), _Request("a", watched), t0)
        await trio.testing.wait_all_tasks_blocked()
        assert watched == [("a", t0)]
        nursery.cancel_scope.cancel()


class _WatchTasks(trio.abc.Instrument):
    """Counts the tasks spawned to watch a client."""

    def __init__(self) -> None:
        self.spawned = 0
        self.exited = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith("watch_disconnect"):
            self.spawned += 1

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith("watch_disconnect"):
            self.exited += 1


def _completion(max_tokens: int, *, stream: bool = True) -> dict[str, object]:
    return {
        "model": "synthetic",
        "prompt": "hello",
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": True,
    }


async def test_a_short_answer_spawns_no_watch_and_a_long_one_does() -> None:
    watches = _WatchTasks()
    trio.lowlevel.add_instrument(watches)
    try:
        # a token each 20 ms: 30 tokens run well past the watch's time
        async with running_cluster(decode_step_s=0.02) as cluster:
            async with client(cluster) as http:
                for _ in range(3):
                    response = await http.post("/v1/completions", json=_completion(1))
                    assert response.status_code == 200
                assert watches.spawned == 0
                started = trio.current_time()
                response = await http.post("/v1/completions", json=_completion(30, stream=False))
                assert response.status_code == 200
                assert trio.current_time() - started > CLIENT_WATCH_AFTER_S
                assert watches.spawned == 1
                # the watch is a task of the request's nursery: none outlives its request
                # (the client is still connected, kept alive)
                await trio.testing.wait_all_tasks_blocked()
                assert watches.exited == 1
    finally:
        trio.lowlevel.remove_instrument(watches)


async def test_a_client_leaving_a_long_stream_cuts_it_once_watched() -> None:
    async with running_cluster(decode_step_s=0.02) as cluster:
        body = json.dumps(_completion(500)).encode()
        # leaves after 3 events (~40 ms: before the watch starts); the stream would run 10 s
        await raw_post_then_hang_up(cluster.url, "/v1/completions", body, events=3)
        await wait_until_idle(cluster, deadline_s=5.0)
        decode = cluster.stats()[1]
        assert decode["kv_blocks_in_use"] == 0
        assert decode["decode_requests"] == 0


async def test_requests_ending_as_their_watch_is_due_leave_the_router_serving() -> None:
    # rounds of answers whose ends spread over the watch's time: some end as the sweep
    # comes for them (a request's nursery is closed to new tasks once its body is done)
    async with running_cluster(decode_step_s=0.0) as cluster:
        async with client(cluster) as http:
            statuses: list[int] = []

            async def one(max_tokens: int) -> None:
                response = await http.post("/v1/completions", json=_completion(max_tokens))
                statuses.append(response.status_code)

            for _ in range(20):
                async with trio.open_nursery() as nursery:
                    for _ in range(32):
                        nursery.start_soon(one, 2)
            assert statuses == [200] * len(statuses) and len(statuses) == 20 * 32
