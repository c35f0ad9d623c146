"""Where the router learns its instances: a static list, or etcd.

Both registries tell a :class:`RegistryListener` (the router) which instances
exist; the router keeps links, rotation and pairing.  The etcd registry lists
the prefix once, then watches it from the next revision; a lost watch is
re-established from the last revision it saw, so no change is missed, and an
etcd outage leaves the router on its last known view (``/health`` says so).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol, final

import attrs
import httpx
import msgspec
import trio

from pdtrio.config import DiscoveryConfig, InstanceConfig, Role
from pdtrio.discovery.etcd import (
    EtcdClient,
    EtcdCompacted,
    EtcdError,
    KeyValue,
    WatchEvent,
    etcd_client,
)
from pdtrio.peer_auth import WorkerAuth
from pdtrio.protocol.link.registration import (
    KIND_NAMES,
    REJECTED_INTERNAL,
    REJECTED_KIND,
    REJECTED_ROUTER_URL,
    REJECTED_WRONG_KEY,
    ROUTER_HEADER,
    EngineRegistration,
    Registration,
    RegistrationError,
    check_registration,
    decode_entry,
    instance_id_from_key,
    verify_registration,
)
from pdtrio.security import PeerCredentials

log = logging.getLogger("pdtrio.router.discovery")

# how often a watching router checks that etcd still answers
_PROBE_S = 2.0
# how long the registry waits before trying an unreachable etcd again (doubling)
_RETRY_FIRST_S = 0.2
_RETRY_MOST_S = 5.0


class Registry(Protocol):
    """Where instances come from: a static list or etcd."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Tell the listener every instance, until cancelled; started once the first
        view is known (or, for etcd, found out of reach)."""


class RegistryListener(Protocol):
    """What a registry tells: the router."""

    async def instance_listed(self, registration: Registration) -> None:
        """A listed instance: learn it and connect its link (start-up fails if it cannot)."""

    def instance_registered(self, registration: Registration) -> None:
        """An instance appeared or changed (never blocks: links open in the background)."""

    def instance_deregistered(self, instance_id: str) -> None:
        """An instance left: no new work; what runs on it finishes."""

    def registration_ignored(self, key: str, reason: str | None) -> None:
        """A key under the prefix is not a usable registration (None: no longer)."""

    def registration_rejected(self, key: str, reason: str) -> None:
        """Count one refused entry (once per change of the key) by ``reason``, a
        ``REJECTED_*`` of :mod:`pdtrio.protocol.link.registration`."""


class EngineListener(Protocol):
    """Who learns the engines (vLLM, SGLang) registered in etcd: the router's engine pool."""

    def engine_registered(self, registration: EngineRegistration) -> None:
        """An engine appeared or changed."""

    def engine_deregistered(self, instance_id: str) -> None:
        """An engine left: no new legs on it."""


@final
@attrs.define
class DiscoveryState:
    """What ``/health`` says about where instances come from."""

    source: str  # "embedded", "static" or "etcd"
    connected: bool = True
    # when the registry was last in touch with its source (wall clock), and what failed
    last_contact: float = attrs.field(factory=time.time)
    problem: str = ""
    revision: int = 0
    # the registry no longer runs: nothing it reports is current any more
    stopped: bool = False

    def in_touch(self, revision: int) -> None:
        if self.stopped:
            return
        if not self.connected:
            log.info("etcd is reachable again: watching from revision %d", revision + 1)
        self.connected = True
        self.problem = ""
        self.last_contact = time.time()
        self.revision = revision

    def lost(self, problem: str) -> None:
        if self.connected:
            log.warning("etcd is unreachable (%s): routing on the last known view", problem)
        self.connected = False
        self.problem = problem

    def ended(self, problem: str) -> None:
        """The registry stopped (it never does on its own): the view is frozen for good."""
        self.stopped = True
        self.connected = False
        self.problem = f"discovery stopped: {problem}"

    def report(self) -> dict[str, Any]:
        report: dict[str, Any] = {"source": self.source, "connected": self.connected}
        if self.stopped:
            report["stopped"] = True
        if self.source == "etcd":
            report["revision"] = self.revision
            report["last_contact_s_ago"] = round(time.time() - self.last_contact, 3)
            if self.problem:
                report["problem"] = self.problem
        return report


@final
class StaticRegistry:
    """The configuration's ``[[instances]]``: each asked for its ``/pd/info`` once."""

    def __init__(
        self,
        instances: Sequence[InstanceConfig],
        listener: RegistryListener,
        http: httpx.AsyncClient,
        *,
        timeout_s: float,
        credentials: PeerCredentials | None = None,
    ) -> None:
        self._instances = instances
        self._credentials = credentials
        self._listener = listener
        self._http = http
        self._timeout_s = timeout_s

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        for instance in self._instances:
            registration = await static_registration(
                self._http, instance, timeout_s=self._timeout_s, credentials=self._credentials
            )
            await self._listener.instance_listed(registration)
        task_status.started()


async def static_registration(
    http: httpx.AsyncClient,
    instance: InstanceConfig,
    *,
    timeout_s: float,
    credentials: PeerCredentials | None = None,
    expected_instance: str | None = None,
) -> Registration:
    """A listed instance's registration, from its ``/pd/info`` (asked with our proof of
    the secret, once it proved it holds it too, as ``expected_instance`` when given)."""
    auth = None if credentials is None else WorkerAuth(credentials, expected_instance)
    response = await http.get(f"{instance.url}/pd/info", timeout=timeout_s, auth=auth)
    if ROUTER_HEADER in response.headers:
        raise RegistrationError(
            f"{instance.url} is a pdtrio router, not a worker", REJECTED_ROUTER_URL
        )
    response.raise_for_status()
    return registration_from_info(response.json(), instance.role, instance.url)


def registration_from_info(info: dict[str, Any], role: Role, url: str) -> Registration:
    """The registration a worker's ``/pd/info`` carries, under the ``role`` and ``url`` it
    was listed with."""
    try:
        registration = msgspec.convert(info["registration"], Registration)
    except (KeyError, TypeError, msgspec.ValidationError) as exc:
        # the worker's answer is at fault (no dict, no key, wrong types), never our code:
        # the repr says which
        raise RegistrationError(f"the worker at {url} gave unusable /pd/info: {exc!r}") from None
    registration = msgspec.structs.replace(registration, role=role, url=url)
    try:
        check_registration(registration)
    except RegistrationError as exc:
        raise RegistrationError(f"the worker at {url} gave unusable /pd/info: {exc}") from None
    return registration


@final
class _OnStarted:
    """A ``task_status`` that calls back when the task says it started."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback = callback

    def started(self, value: None = None) -> None:
        self._callback()


@final
class EtcdRegistry:
    """Watches the deployment's prefix in etcd and tells the listener every change.

    With a ``signing_key`` (derived from the deployment's worker secret) only entries
    signed with it are used; every other entry is ignored and reported, never fatal.
    Only entries of ``config.kind`` are used: pdtrio workers go to ``listener``,
    engines (``kind`` vllm or sglang) to ``engines``; the listener hears of every
    ignored entry either way.
    """

    def __init__(
        self,
        config: DiscoveryConfig,
        listener: RegistryListener,
        state: DiscoveryState,
        *,
        signing_key: bytes | None = None,
        engines: EngineListener | None = None,
    ) -> None:
        if config.kind != "pdtrio" and engines is None:
            raise ValueError(f"discovering {config.kind} engines needs an engine listener")
        self._config = config
        self._prefix = config.prefix
        self._listener = listener
        self._engines = engines
        self.state = state
        self._signing_key = signing_key
        self._known: set[str] = set()  # instance ids the listener was told about
        self._revision = 0  # the last revision applied
        # the keys refused, and the revision refused (one warning and count per change)
        self._rejected: dict[str, int] = {}
        self._watched = False  # whether the last watch was created

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled. Reports started after the first listing, or the first failure.

        Every (re)connection lists the prefix first, then watches from the revision
        after that listing: the listing proves etcd answers (only then is it "in
        touch"), and reconciling it with what the router knows misses nothing,
        whatever happened meanwhile (even a compaction of the history). However it
        ends, the state says discovery stopped.
        """
        try:
            await self._run(task_status)
        except BaseException as exc:
            cancelled = isinstance(exc, trio.Cancelled) or (
                isinstance(exc, BaseExceptionGroup) and exc.split(trio.Cancelled)[1] is None
            )
            self.state.ended("cancelled" if cancelled else f"{type(exc).__name__}: {exc}")
            if not cancelled:
                log.error("etcd discovery stopped: routing on the last known view", exc_info=exc)
            raise

    async def _run(self, task_status: trio.TaskStatus[None]) -> None:
        started = False
        retry_s = _RETRY_FIRST_S
        async with etcd_client(self._config) as client:
            while True:
                try:
                    kvs, revision = await client.get_prefix(self._prefix)
                    self._reconcile(kvs, revision)
                    if not started:
                        started = True
                        task_status.started()
                    await self._watch_while_etcd_answers(client)
                except EtcdCompacted as exc:
                    # (rare: events came faster than we read them) list everything again
                    log.warning(
                        "etcd compacted past revision %d: listing again", exc.compact_revision
                    )
                except EtcdError as exc:
                    self.state.lost(str(exc) or type(exc).__name__)
                    if not started:
                        started = True
                        task_status.started()
                    # (a watch that ran resets it: one that keeps failing backs off)
                    retry_s = _RETRY_FIRST_S if self._watched else retry_s
                    self._watched = False
                    await trio.sleep(retry_s)
                    retry_s = min(retry_s * 2, _RETRY_MOST_S)

    async def _watch_while_etcd_answers(self, client: EtcdClient) -> NoReturn:
        """Watch from the last revision; raises when the watch breaks, or when etcd stops
        answering a probe (a frozen etcd keeps the watch's connection open, silent)."""
        failure: EtcdError = EtcdError("the watch ended")

        async def watch(cancel_scope: trio.CancelScope) -> None:
            nonlocal failure
            try:
                await client.watch_prefix(
                    self._prefix,
                    start_revision=self._revision + 1,
                    on_events=self._apply,
                    task_status=_OnStarted(self._watching),
                )
            except EtcdError as exc:
                failure = exc
            cancel_scope.cancel()

        async def probe(cancel_scope: trio.CancelScope) -> None:
            nonlocal failure
            while True:
                await trio.sleep(_PROBE_S)
                try:
                    await client.get(self._prefix)  # (bounded by the client's timeout)
                except EtcdError as exc:
                    failure = exc
                    cancel_scope.cancel()
                    return
                self.state.in_touch(self._revision)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, nursery.cancel_scope)
            nursery.start_soon(probe, nursery.cancel_scope)
        raise failure

    def _watching(self) -> None:
        """etcd created the watch: only now is discovery live (a listing that works
        under a watch that keeps failing is not)."""
        self._watched = True
        self.state.in_touch(self._revision)

    def _reconcile(self, kvs: Sequence[KeyValue], revision: int) -> None:
        """A full listing: register what is there, deregister what is no longer."""
        present: set[str] = set()
        for kv in kvs:
            instance_id = self._put_isolated(kv.key, kv.value, kv.mod_revision)
            if instance_id is not None:
                present.add(instance_id)
        for gone in self._known - present:
            self._deregistered(gone)
        for key in set(self._rejected) - {kv.key for kv in kvs}:
            self._forget(key)
        self._known = present
        self._revision = revision

    def _apply(self, events: list[WatchEvent]) -> None:
        for event in events:
            if event.kind == "put":
                instance_id = self._put_isolated(event.key, event.value, event.mod_revision)
                if instance_id is not None:
                    self._known.add(instance_id)
            else:
                self._forget(event.key)
                instance_id = instance_id_from_key(self._prefix, event.key)
                if instance_id is not None and instance_id in self._known:
                    self._known.discard(instance_id)
                    self._deregistered(instance_id)
            self._revision = max(self._revision, event.mod_revision)
        self.state.in_touch(self._revision)

    def _put_isolated(self, key: str, value: bytes, revision: int) -> str | None:
        """:meth:`_put`, which no entry may break: whatever fails handling one entry
        (a bug: decoding is total) leaves that entry ignored and discovery running."""
        try:
            return self._put(key, value, revision)
        except Exception as exc:  # (no await in here) one entry must not stop discovery
            log.error("could not handle the registry entry at %s", key, exc_info=exc)
            self._reject(key, revision, REJECTED_INTERNAL, f"could not be handled: {exc!r}")
            return None

    def _put(self, key: str, value: bytes, revision: int) -> str | None:
        """Tell the listener of one registration; the instance id, or None if unusable."""
        instance_id = instance_id_from_key(self._prefix, key)
        if instance_id is None:
            return None
        try:
            registration = decode_entry(value)
            if registration.instance_id != instance_id:
                raise RegistrationError(
                    f"registered under {instance_id!r} but says it is {registration.instance_id!r}",
                    REJECTED_WRONG_KEY,
                )
            if self._signing_key is not None:
                verify_registration(registration, key, self._signing_key)
            kind = "pdtrio" if isinstance(registration, Registration) else registration.kind
            if kind != self._config.kind:
                # a prefill's KV is read only by a decode of its own kind
                raise RegistrationError(
                    f"the registration of a {KIND_NAMES[kind]}; this router fronts "
                    f"{KIND_NAMES[self._config.kind]}s ([discovery] kind = "
                    f'"{self._config.kind}")',
                    REJECTED_KIND,
                )
        except RegistrationError as exc:
            self._reject(key, revision, exc.reason, str(exc))
            if instance_id in self._known:  # it was usable before: it is gone now
                self._known.discard(instance_id)
                self._deregistered(instance_id)
            return None
        self._forget(key)
        if isinstance(registration, Registration):
            self._listener.instance_registered(registration)
        else:
            assert self._engines is not None  # (the constructor's check: kind is an engine's)
            self._engines.engine_registered(registration)
        return instance_id

    def _deregistered(self, instance_id: str) -> None:
        """Tell whoever learnt it (every instance known is of the configured kind)."""
        if self._engines is not None and self._config.kind != "pdtrio":
            self._engines.engine_deregistered(instance_id)
        else:
            self._listener.instance_deregistered(instance_id)

    def _reject(self, key: str, revision: int, reason: str, message: str) -> None:
        """Ignore the entry; warn and count once per change of it."""
        self._listener.registration_ignored(key, message)
        if self._rejected.get(key) == revision:
            return  # (listed again after a reconnection: already reported)
        self._rejected[key] = revision
        log.warning("ignoring the registration at %s (%s): %s", key, reason, message)
        self._listener.registration_rejected(key, reason)

    def _forget(self, key: str) -> None:
        self._rejected.pop(key, None)
        self._listener.registration_ignored(key, None)
