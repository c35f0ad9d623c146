"""A real cluster for tests: hypercorn-served router and workers on loopback, in-process."""

from __future__ import annotations

import inspect
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import attrs
import httpx
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from pdtrio.config import (
    EngineConfig,
    InstanceConfig,
    PdtrioConfig,
    RouterConfig,
    SecurityConfig,
    SyntheticEngineConfig,
    WorkerConfig,
    WorkerFaultsConfig,
)
from pdtrio.engine.synthetic import SyntheticEngine
from pdtrio.protocol.tokens.flush import FlushConfig
from pdtrio.router.app import RouterApp
from pdtrio.router.core import Router
from pdtrio.router.workers.backend import WorkerBackend
from pdtrio.security import system_tls_context
from pdtrio.worker.server import Worker

T = TypeVar("T")


def worker_backend(router: Router | None) -> WorkerBackend:
    """The router's pdtrio backend, for a test that looks at its parts (its instance
    table, links, decode-room queue, lease clock)."""
    assert router is not None
    backend = router.backend
    assert isinstance(backend, WorkerBackend)
    return backend


@attrs.define
class Cluster:
    url: str
    workers: list[Worker]
    router_app: RouterApp

    def stats(self) -> list[dict[str, Any]]:
        return [w.stats() for w in self.workers]

    def blocks_in_use(self) -> int:
        return sum(w.engine.statistics().kv_blocks_in_use for w in self.workers)

    def busy(self) -> bool:
        return any(
            s["kv_blocks_in_use"] or s["running_requests"] or s["kv_leases"] or s["decode_requests"]
            for s in self.stats()
        )


def synthetic_worker(
    role: str,
    *,
    flush: FlushConfig | None = None,
    faults: WorkerFaultsConfig | None = None,
    secret: str = "",
    worker_overrides: dict[str, Any] | None = None,
    **engine_overrides: Any,
) -> Worker:
    synthetic = SyntheticEngineConfig(
        **{
            k: v
            for k, v in engine_overrides.items()
            if k in attrs.fields_dict(SyntheticEngineConfig)
        }
    )
    engine_config = EngineConfig(
        kind="synthetic",
        num_kv_blocks=engine_overrides.get("num_kv_blocks", 4096),
        prefix_cache=engine_overrides.get("prefix_cache", False),
        synthetic=synthetic,
    )
    config = WorkerConfig(
        role=role,  # type: ignore[arg-type]
        engine=engine_config,
        flush=flush or FlushConfig(),
        faults=faults or WorkerFaultsConfig(),
        secret=secret,
    )
    if worker_overrides:
        config = attrs.evolve(config, **worker_overrides)
    engine = SyntheticEngine(
        synthetic,
        num_blocks=engine_config.num_kv_blocks,
        block_size=engine_config.block_size,
        default_max_tokens=engine_config.default_max_tokens,
        prefix_cache=engine_config.prefix_cache,
    )
    return Worker(config, engine)


async def serve_app(app: Any, nursery: trio.Nursery) -> str:
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.graceful_timeout = 1
    binds = await nursery.start(serve, app, config)
    return str(binds[0])


@asynccontextmanager
async def running_cluster(
    *,
    roles: tuple[str, ...] = ("prefill", "decode"),
    router: RouterConfig | None = None,
    make_worker: Callable[[str], Worker] | None = None,
    security: SecurityConfig | None = None,
    **engine_overrides: Any,
) -> AsyncIterator[Cluster]:
    """A router over workers on loopback; ``security.worker_secret`` is the workers' too."""
    security = security or SecurityConfig()
    workers = [
        make_worker(role)
        if make_worker
        else synthetic_worker(role, secret=security.worker_secret, **engine_overrides)
        for role in roles
    ]
    async with trio.open_nursery() as nursery:
        instances = []
        for worker in workers:
            ready = await nursery.start(worker.run)
            instances.append(InstanceConfig(role=worker.config.role, url=ready["url"]))
        config = PdtrioConfig(
            router=router or RouterConfig(), instances=tuple(instances), security=security
        )
        app = RouterApp(config)
        url = await serve_app(app, nursery)
        yield Cluster(url=url, workers=workers, router_app=app)
        nursery.cancel_scope.cancel()


@contextmanager
def cluster_in_a_thread(**kwargs: Any) -> Iterator[Cluster]:
    """:func:`running_cluster` on a trio loop of its own, in a thread, for several tests.

    For a module of tests that only send requests and read answers: the cluster starts
    once, not once per test (each test's trio run ends with the test, so a cluster that
    several of them share cannot live in one).  A failure of the cluster's loop is
    raised when the block ends.
    """
    # the running cluster, or None: its loop ended (before it started, if that comes first)
    started: queue.Queue[tuple[Cluster, trio.lowlevel.TrioToken, trio.Event] | None]
    started = queue.Queue()
    failed: list[BaseException] = []

    async def serve() -> None:
        async with running_cluster(**kwargs) as cluster:
            stop = trio.Event()
            started.put((cluster, trio.lowlevel.current_trio_token(), stop))
            await stop.wait()

    def run() -> None:
        try:
            trio.run(serve)
        except BaseException as exc:  # reported by the test thread, below
            failed.append(exc)
        finally:
            started.put(None)

    thread = threading.Thread(target=run, name="cluster-in-a-thread", daemon=True)
    thread.start()
    running = started.get()
    if running is None:
        raise AssertionError("the shared cluster did not start") from (failed or [None])[0]
    cluster, token, stop = running
    try:
        yield cluster
    finally:
        trio.from_thread.run_sync(stop.set, trio_token=token)
        thread.join(30)
        assert not thread.is_alive(), "the shared cluster did not stop"
        if failed:
            raise AssertionError("the shared cluster's loop failed") from failed[0]


async def wait_until_idle(cluster: Cluster, deadline_s: float = 10.0) -> None:
    """Wait for every worker to hold nothing, as a user watching /pd/stats would."""
    await wait_for_stats(
        lambda: not cluster.busy(), deadline_s, what=lambda: f"every worker idle: {cluster.stats()}"
    )


async def wait_for_stats(
    condition: Callable[[], bool],
    deadline_s: float = 5.0,
    *,
    what: str | Callable[[], str] | None = None,
) -> None:
    """Wait until ``condition()`` holds; past ``deadline_s`` fail saying what was awaited.

    The one polling loop for in-process state (the tests' others wait on events): the
    statistics are the observable contract, and what they report is changed by the
    engine thread and the link tasks, which set no event a test could wait on.  ``what``
    (a text, or a function giving one when it fails, to show the state last seen)
    defaults to the condition's source line.
    """
    with trio.move_on_after(deadline_s):
        while not condition():  # noqa: ASYNC110 - see above
            await trio.sleep(_POLL_S)
        return
    raise AssertionError(f"waited {deadline_s} s, in vain, for {_describe(what, condition)}")


async def wait_for_answer(
    ask: Callable[[], Awaitable[T]],
    accept: Callable[[T], bool],
    deadline_s: float = 5.0,
    *,
    what: str | None = None,
) -> T:
    """Ask (``GET /health``, say) until the answer is accepted, as a load balancer would.

    Returns the accepted answer; past ``deadline_s`` fails showing the last one.
    """
    answer: T | None = None
    with trio.move_on_after(deadline_s):
        while not accept(answer := await ask()):  # noqa: ASYNC110 - asking is the contract
            await trio.sleep(_ASK_EVERY_S)
        return answer
    raise AssertionError(
        f"waited {deadline_s} s, in vain, for {_describe(what, accept)}; the last answer: "
        f"{answer!r}"
    )


def eventually(condition: Callable[[], bool], timeout: float) -> bool:
    """Whether ``condition`` holds within ``timeout`` s (for e2e tests watching other processes)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # another process: nothing here to wait on
    return True


_POLL_S = 0.005
_ASK_EVERY_S = 0.02  # a request each time: not as often as a look at statistics


def _describe(what: str | Callable[[], str] | None, condition: Callable[..., Any]) -> str:
    if callable(what):
        return what()
    if what:
        return what
    try:
        return inspect.getsource(condition).strip()
    except (OSError, TypeError):
        return repr(condition)


def client(cluster: Cluster, **kwargs: Any) -> httpx.AsyncClient:
    kwargs.setdefault("timeout", 30)
    kwargs.setdefault("verify", system_tls_context())  # not a CA bundle loaded per client
    return httpx.AsyncClient(base_url=cluster.url, **kwargs)


async def raw_post_then_hang_up(url: str, path: str, body: bytes, *, events: int) -> bytes:
    """POST over a bare socket, read ``events`` SSE events, then close the connection.

    A real client going away: no client library in between to drain or retry.
    """
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        await stream.send_all(head + body)
        received = b""
        while received.count(b"\n\n") < events and not _response_complete(received):
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            received += chunk
        return received


def _response_complete(received: bytes) -> bool:
    """The whole response is in (the connection stays open: HTTP/1.1 keep-alive)."""
    if b"data: [DONE]\n\n" in received:
        return True
    head, sep, body = received.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False
