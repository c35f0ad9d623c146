"""The router's lifespan: starts everything, reports failure so hypercorn exits.

Shutdown (see README, "Shutdown and supervisors"): a SIGTERM, however it reaches
us, drains the router (new requests get 503, running ones get ``router.drain_s``
to finish, then an error event) before hypercorn stops and the workers go.
Under hypercorn's master (``-w N``) we also exit, workers and all, when the
master dies.  Under ``-w N`` with N > 1 every process runs its own router over
the same static instances; the embedded cluster is refused there (it would be
started once per process).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import httpx
import trio

from pdtrio.asgi import Receive, Scope, Send
from pdtrio.config import ConfigError, PdtrioConfig, load_config_from_env
from pdtrio.logs import (
    ACCESS_LOG_FLUSH_INTERVAL_S,
    LogSettingError,
    adopt_hypercorn_error_log,
    configure_logging,
    flush_access_log,
    settings_from_env,
)
from pdtrio.router.core import Router, RouterStartFailed, open_router
from pdtrio.router.workers.cluster import WorkerStartFailed
from pdtrio.router.workers.link import LINK_ERRORS

log = logging.getLogger("pdtrio.router")

_STARTUP_ERRORS = (ConfigError, WorkerStartFailed, RouterStartFailed, httpx.HTTPError, *LINK_ERRORS)
_STARTUP_FAILED_STATUS = 3
# how long a SIGTERM under hypercorn's master waits for the master to start stopping by
# itself (a signal to the whole process group reaches it too) before we forward it
MASTER_SIGNAL_GRACE_S = 1.0


async def run_lifespan(
    scope: Scope, receive: Receive, send: Send, config: PdtrioConfig | None = None
) -> None:
    """Called after lifespan.startup was received, on trio.

    ``config`` None: we are hypercorn's app (the configuration comes from the
    environment) and a known start-up failure ends the process with one line.
    """
    from_env = config is None
    started_at = time.monotonic()
    try:
        if config is None:
            # we own the process: its log lines (and hypercorn's) get our format
            level, fmt = settings_from_env(os.environ)
            configure_logging(level, fmt, "router")
            adopt_hypercorn_error_log()
            config = load_config_from_env()
    except (ConfigError, LogSettingError) as exc:
        await fail_startup(send, str(exc), exit_process=from_env)
        return
    workers = hypercorn_worker_count()
    if workers > 1 and config.uses_embedded_cluster:
        # each process would start a copy of the cluster: N times the workers and their memory
        await fail_startup(send, embedded_cluster_refusal(workers), exit_process=from_env)
        return
    failure: str | None = None
    started = False
    log.info(describe_start(config))
    try:
        async with open_router(config) as router:
            log.info(
                "router ready in %.1f s: %s",
                time.monotonic() - started_at,
                describe_instances(router),
            )
            scope.setdefault("state", {})["router"] = router
            await send({"type": "lifespan.startup.complete"})
            started = True
            async with trio.open_nursery() as watchers:
                _watch_for_shutdown(router, watchers)
                if from_env:  # our handler is installed (see pdtrio.logs)
                    watchers.start_soon(_flush_access_log_periodically)
                while (await receive())["type"] != "lifespan.shutdown":
                    pass
                log.info("router shutting down")
                # hypercorn let its connections finish first: this is quick unless a drain runs
                await router.requests.drain(config.router.drain_s)
                watchers.cancel_scope.cancel()
    except* Exception as group:
        # anything that breaks start-up must stop hypercorn, not leave it half-serving
        if started:
            raise
        leaves = _leaves(group)
        if not all(isinstance(e, _STARTUP_ERRORS) for e in leaves):
            log.error("router start-up crashed", exc_info=group)
        failure = "; ".join(str(e) or repr(e) for e in leaves)
    if failure is not None:
        await fail_startup(send, failure, exit_process=from_env)
        return
    await send({"type": "lifespan.shutdown.complete"})


async def _flush_access_log_periodically() -> None:
    try:
        while True:
            await trio.sleep(ACCESS_LOG_FLUSH_INTERVAL_S)
            flush_access_log()
    finally:
        flush_access_log()  # the last lines, when the router stops


def describe_start(config: PdtrioConfig) -> str:
    """What the router starts, or where its instances come from, in one line."""
    if config.uses_embedded_cluster:
        embedded = config.embedded
        counts = ", ".join(
            f"{count} {role}"
            for role, count in (
                ("prefill", embedded.prefill),
                ("decode", embedded.decode),
                ("both", embedded.both),
            )
            if count
        )
        engine = embedded.worker.engine
        model = "synthetic" if engine.kind == "synthetic" else engine.model
        return (
            f"starting the embedded cluster: {counts or 'no workers'} "
            f"(engine {engine.kind}, model {model}, device {engine.device})"
        )
    sources = []
    if config.instances:
        sources.append(f"{len(config.instances)} listed instances")
    if config.discovery.uses_etcd:
        sources.append(
            f"instances registered in etcd ({', '.join(config.discovery.etcd_endpoints)})"
        )
    return "starting: routing to " + " and ".join(sources)


def describe_instances(router: Router) -> str:
    return router.backend.describe()


async def fail_startup(send: Send, message: str, *, exit_process: bool) -> None:
    """Report a known start-up failure in one line.

    hypercorn turns ``lifespan.startup.failed`` into an exception that leaves its
    process with a 40-line traceback; when we own the process we say it once and
    exit instead (everything we started is already stopped).
    """
    text = f"pdtrio start-up failed: {message}"
    if exit_process:
        _exit_now(text, _STARTUP_FAILED_STATUS)
    await send({"type": "lifespan.startup.failed", "message": text})


def _exit_now(line: str, status: int) -> NoReturn:
    print(line, file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(status)


# --- shutdown triggers ---------------------------------------------------------------


def _watch_for_shutdown(router: Router, nursery: trio.Nursery) -> None:
    drain_s = router.config.router.drain_s
    shutdown_event, graceful_timeout_s = _hypercorn_master()
    if graceful_timeout_s is not None:
        # hypercorn cuts connections silently at its graceful timeout: drain well before
        room = graceful_timeout_s - 2 * router.config.router.cleanup_grace_s - 0.5
        if drain_s > room:
            log.warning(
                "router.drain_s %gs does not fit in hypercorn's --graceful-timeout %gs: "
                "draining %gs",
                drain_s,
                graceful_timeout_s,
                max(room, 0.0),
            )
            drain_s = max(room, 0.0)
    master_stopping = trio.Event()
    if shutdown_event is not None:
        nursery.start_soon(
            _drain_when_master_stops, router, shutdown_event, drain_s, master_stopping
        )
        parent = multiprocessing.parent_process()
        if parent is not None:
            nursery.start_soon(_stop_when_master_dies, router, parent.sentinel, shutdown_event)
    if threading_is_main():
        nursery.start_soon(_on_sigterm, router, shutdown_event, drain_s, master_stopping)


def threading_is_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _hypercorn_worker_kwargs() -> dict[str, Any]:
    """What hypercorn's master passed this process, when it is one of its ``-w N`` workers.

    hypercorn tells the app nothing of it (its configuration, the shutdown event
    its master sets on SIGTERM), so we read it from the process's arguments.
    """
    kwargs = getattr(multiprocessing.current_process(), "_kwargs", None)
    return kwargs if isinstance(kwargs, dict) else {}


def hypercorn_worker_count() -> int:
    """N when we run in a worker process of ``hypercorn -w N``; 0 otherwise (``-w 0``, tests)."""
    workers = getattr(_hypercorn_worker_kwargs().get("config"), "workers", None)
    return workers if isinstance(workers, int) else 0


def embedded_cluster_refusal(workers: int) -> str:
    return (
        f"the embedded cluster runs under one hypercorn process, not `-w {workers}` (each "
        "process would start its own workers): use -w 1, or start the workers yourself and "
        "list them as [[instances]]"
    )


def _hypercorn_master() -> tuple[Any, float | None]:
    """hypercorn's shutdown event and graceful timeout, when we run in its ``-w N`` worker."""
    kwargs = _hypercorn_worker_kwargs()
    event = kwargs.get("shutdown_event")
    if event is None or not callable(getattr(event, "wait", None)):
        return None, None
    timeout = getattr(kwargs.get("config"), "graceful_timeout", None)
    return event, float(timeout) if isinstance(timeout, int | float) else None


async def _drain_when_master_stops(
    router: Router, shutdown_event: Any, drain_s: float, master_stopping: trio.Event
) -> None:
    # a blocking wait on hypercorn's cross-process event, in a thread we can abandon
    await trio.to_thread.run_sync(_wait_until_set, shutdown_event, abandon_on_cancel=True)
    master_stopping.set()
    log.info("hypercorn is stopping: draining")
    await router.requests.drain(drain_s)


def _wait_until_set(event: Any) -> None:
    """Block until hypercorn's ``multiprocessing.Event`` is set, holding none of its locks.

    ``Event.wait()`` would make this thread a sleeper on the event's condition, and
    the master's ``Event.set()`` then waits, holding the event's lock, until this
    thread wakes in its own process: a second signal arriving meanwhile re-enters the
    master's handler, whose ``set()`` then deadlocks on that lock; and if this process
    died while waiting, the master's ``set()`` would wait for it forever. The event's
    flag semaphore is released by ``set()`` and only read elsewhere: waiting on it
    (taking it and giving it straight back) blocks nobody.
    """
    flag = getattr(event, "_flag", None)
    if flag is None or not callable(getattr(flag, "acquire", None)):
        event.wait()  # not the stdlib's Event: its own wait
        return
    flag.acquire()
    flag.release()


async def _stop_when_master_dies(router: Router, sentinel: int, shutdown_event: Any) -> None:
    # the pipe from hypercorn's master turns readable (EOF) when it dies, however it dies
    await trio.lowlevel.wait_readable(sentinel)
    log.warning("hypercorn's master process died: stopping")
    # hypercorn's own stop path, now that nobody else will take it; requests end at once
    shutdown_event.set()
    await router.requests.drain(0)


async def _on_sigterm(
    router: Router, shutdown_event: Any, drain_s: float, master_stopping: trio.Event
) -> None:
    stops = [signal.SIGTERM]
    if shutdown_event is None and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        # hypercorn -w 0: a SIGINT (Ctrl-C) would be a KeyboardInterrupt in whichever task
        # runs, and one raised in a connection's task escapes hypercorn (exit 1, traceback):
        # take it like SIGTERM, and hand hypercorn its stop where it catches it
        stops.append(signal.SIGINT)
    with trio.open_signal_receiver(*stops) as signals:
        async for received in signals:
            if shutdown_event is None:
                log.info("%s received: draining", signal.Signals(received).name)
                break
            # a worker of hypercorn's master: the master stops every worker (and drains
            # us). A SIGTERM to the process group (systemd's default) reaches the master
            # at the same time, and its handler is not reentrant: a second SIGTERM from
            # us while it sets its event deadlocks it. So we forward only a SIGTERM the
            # master does not act on by itself: one sent to this process alone.
            with trio.move_on_after(MASTER_SIGNAL_GRACE_S):
                await master_stopping.wait()
            if master_stopping.is_set():
                continue
            parent = multiprocessing.parent_process()
            if parent is not None and parent.pid is not None and parent.is_alive():
                log.info("SIGTERM to this process alone: asking hypercorn's master to stop")
                os.kill(parent.pid, signal.SIGTERM)
            else:
                shutdown_event.set()
        else:
            return
        # hypercorn -w 0: we are its only process and it only stops on SIGINT. The
        # receiver stays open while draining: a second SIGTERM (also sent to the process
        # group, say) is taken and ignored, where a closed receiver would hand it to the
        # default action and end the process mid-drain; a second SIGINT (Ctrl-C twice)
        # cuts the drain short
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cut_drain_on_a_second_interrupt, router, signals)
            await router.requests.drain(drain_s)
            nursery.cancel_scope.cancel()
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # a shell that started us in the background made SIGINT ignored, so hypercorn
        # cannot be asked to stop: the drain is done; our workers are stopped as
        # hypercorn's stop would have them (left to our pipes closing, they would take
        # the router for dead)
        await router.backend.stop_processes()
        _exit_now("pdtrio: drained after SIGTERM; exiting (SIGINT is ignored here)", 0)
    _interrupt_hypercorn()


async def _cut_drain_on_a_second_interrupt(router: Router, signals: AsyncIterator[int]) -> None:
    async for received in signals:
        if received == signal.SIGINT:
            log.info("SIGINT received again: cutting the drain short")
            await router.requests.drain(0)
            return
        log.info("%s received again: already draining", signal.Signals(received).name)


@trio.lowlevel.enable_ki_protection
def _interrupt_hypercorn() -> None:
    # KI-protected: trio hands the KeyboardInterrupt to hypercorn's main task, its graceful stop
    signal.raise_signal(signal.SIGINT)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            leaves.extend(_leaves(exc))
        else:
            leaves.append(exc)
    return leaves
