"""The link supervisor: what registries say becomes instances with links, kept open.

It is the registries' listener (``pdtrio.discovery.registry.RegistryListener``):
an instance listed or registered is put in the instance table and gets a
websocket link (``pdtrio.router.workers.link``), reconnected whenever it breaks;
one deregistered or replaced takes no new work, and its link is closed once
nothing runs on it (woken by the instance's own reports, never polled).  It also
refuses registrations that point at a router, and warns of instances nothing can
pair with.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, final

import attrs
import httpx
import trio

from pdtrio.config import InstanceConfig, PdtrioConfig, Role
from pdtrio.discovery.registry import static_registration
from pdtrio.peer_auth import PeerAuthenticationError, link_authorization
from pdtrio.protocol.link.registration import (
    REJECTED_ROUTER_URL,
    ROUTER_HEADER,
    Registration,
    RegistrationError,
    is_own_url,
    registration_key,
)
from pdtrio.router.workers.instances import Instance, InstanceTable
from pdtrio.router.workers.kv_leases import LeaseClock
from pdtrio.router.workers.link import LINK_ERRORS, PeerRefused, WorkerLink
from pdtrio.security import PeerCredentials

log = logging.getLogger("pdtrio.router")

# the longest wait between links asked of an instance that keeps failing to prove itself
_REFUSED_RETRY_MAX_S = 30.0
# how long after a registration an instance nothing can pair with is warned about
_PAIRING_GRACE_S = 2.0


class RouterStartFailed(Exception):
    """The router cannot serve with what it was given (instances, configuration)."""


@final
@attrs.frozen
class LinkStatistics:
    """A snapshot of the links (trio's ``statistics()`` habit: no live counters)."""

    links: int
    connected: int
    reconnects: int  # connections made after each link's first
    hangs: int  # links dropped for silence
    ignored_registrations: int


@final
class LinkSupervisor:
    """Opens, keeps and retires the links to the instances of ``table``.

    ``capacity_changed``: told whenever a link reports capacity, connects or goes;
    ``registration_rejected(key, reason)``: counts a refused registration.
    """

    def __init__(
        self,
        table: InstanceTable,
        config: PdtrioConfig,
        nursery: trio.Nursery,
        http: httpx.AsyncClient,
        credentials: PeerCredentials,
        *,
        capacity_changed: Callable[[], None],
        registration_rejected: Callable[[str, str], None],
        leases: LeaseClock,
    ) -> None:
        self._table = table
        self._leases = leases  # handed to every link: a prefill's link and its decode's
        self._config = config
        self._nursery = nursery
        self._http = http
        self._credentials = credentials
        self._capacity_changed = capacity_changed
        self._count_rejected = registration_rejected
        # registry keys that are not usable, and why (for /health)
        self.ignored_registrations: dict[str, str] = {}
        # the (host, port) pairs the router was reached at: a registration naming one is
        # the router itself; and the registrations found to point at a router
        self.own_addresses: set[tuple[str, int]] = set()
        self._router_registrations: dict[str, Registration] = {}

    def statistics(self) -> LinkStatistics:
        links = [i.link for i in self._table.values() if i.link is not None]
        return LinkStatistics(
            links=len(links),
            connected=sum(1 for link in links if link.connected),
            reconnects=sum(max(link.connects - 1, 0) for link in links),
            hangs=sum(link.statistics().hangs for link in links),
            ignored_registrations=len(self.ignored_registrations),
        )

    # --- what registries say ----------------------------------------------------------

    async def add_instance(self, role: Role, url: str, instance_id: str) -> None:
        """An embedded worker is ready: learn it from its /pd/info and connect its link.

        ``instance_id`` is the id the router gave the worker; the worker must say the same.
        """
        try:
            registration = await static_registration(
                self._http,
                InstanceConfig(role=role, url=url),
                timeout_s=self._config.router.connect_timeout_s,
                credentials=self._credentials,
                expected_instance=instance_id,
            )
        except (RegistrationError, PeerAuthenticationError) as exc:
            raise RouterStartFailed(str(exc)) from exc
        if instance_id != registration.instance_id:
            raise RouterStartFailed(
                f"the worker at {url} says it is {registration.instance_id!r}, but was "
                f"started as {instance_id!r}"
            )
        await self.instance_listed(registration)

    async def instance_listed(self, registration: Registration) -> None:
        """A listed instance (static, embedded): learn it and connect (which must work)."""
        instance = self._replace_instance(registration)
        await self._nursery.start(self._keep_link, instance, True)

    def instance_registered(self, registration: Registration) -> None:
        """A registry says the instance exists: learn it, or its change (never blocks)."""
        old = self._table.get(registration.instance_id)
        if old is not None and old.registered and _same(old, registration):
            return  # a lease renewal or a re-registration of the same worker
        if self._router_registrations.get(registration.instance_id) == registration:
            return  # listed again: already found to be a router, and reported
        self._router_registrations.pop(registration.instance_id, None)
        if is_own_url(registration.url, self.own_addresses):
            self.instance_deregistered(registration.instance_id)
            self._points_at_a_router(registration, "this router's own address")
            return
        instance = self._replace_instance(registration)
        log.info(
            "instance %s (%s, model %s) registered at %s",
            instance.instance_id,
            instance.role,
            instance.model,
            instance.url,
        )
        self._nursery.start_soon(self._keep_link, instance, False)
        self._nursery.start_soon(self._refuse_if_a_router, instance, registration)
        self._nursery.start_soon(self._report_unpaired, instance)

    def instance_deregistered(self, instance_id: str) -> None:
        """A registry says the instance left: no new work; its link goes once it is idle."""
        instance = self._table.get(instance_id)
        if instance is None or not instance.registered:
            return
        instance.registered = False
        log.info("instance %s deregistered: finishing what it runs", instance_id)
        self._capacity_changed()  # waiters may have to look elsewhere
        self._nursery.start_soon(self._retire, instance)

    def registration_ignored(self, key: str, reason: str | None) -> None:
        if reason is None:
            self.ignored_registrations.pop(key, None)
        else:
            self.ignored_registrations[key] = reason

    def registration_rejected(self, key: str, reason: str) -> None:
        self._count_rejected(key, reason)

    def serving_at(self, server: Any) -> None:
        """A request reached the router at ``server`` (ASGI's [host, port])."""
        host, port = server[0], server[1]
        if isinstance(host, str) and isinstance(port, int):
            self.own_addresses.add((host.lower(), port))

    def lose_instance(self, instance_id: str) -> None:
        """Stop routing to an embedded worker that died; its restart registers it anew.

        (A static instance needs nothing of the kind: its link's state is its health.)
        """
        instance = self._table.get(instance_id)
        if instance is not None:
            instance.healthy = False

    async def refresh_transfer_endpoint(self, instance: Instance) -> None:
        """Ask the instance (at its registered URL) where its KV port is now: a worker
        restarted behind the same URL serves a new one."""
        listed = InstanceConfig(role=instance.role, url=instance.url)
        timeout_s = self._config.router.connect_timeout_s
        try:
            with trio.move_on_after(timeout_s):
                current = await static_registration(
                    self._http,
                    listed,
                    timeout_s=timeout_s,
                    credentials=self._credentials,
                    expected_instance=instance.instance_id,
                )
                if current.instance_id == instance.instance_id:
                    instance.transfer_endpoint = (current.transfer_host, current.transfer_port)
        except (httpx.HTTPError, RegistrationError, PeerAuthenticationError) as exc:
            log.warning("cannot ask %s where its KV port is: %s", instance.instance_id, exc)

    # --- refusals and warnings --------------------------------------------------------

    async def _refuse_if_a_router(self, instance: Instance, registration: Registration) -> None:
        """Ask a newly registered instance's URL who answers (no credential shown): a
        pdtrio router (this one, or another) is no worker, and its registration is
        refused. (Its link could not open anyway: a router refuses websockets.)"""
        timeout_s = self._config.router.connect_timeout_s
        try:
            with trio.move_on_after(timeout_s):
                response = await self._http.get(f"{instance.url}/pd/info", timeout=timeout_s)
                if ROUTER_HEADER not in response.headers:
                    return
                if self._table.get(instance.instance_id) is instance and instance.registered:
                    self.instance_deregistered(instance.instance_id)
                    self._points_at_a_router(registration, "a pdtrio router answers there")
        except httpx.HTTPError:
            return  # not up yet, or not HTTP: its link says what it is

    def _points_at_a_router(self, registration: Registration, why: str) -> None:
        key = registration_key(self._config.discovery.prefix, registration.instance_id)
        reason = f"its url {registration.url} is not a worker: {why}"
        log.warning("ignoring the registration at %s (%s): %s", key, REJECTED_ROUTER_URL, reason)
        self._router_registrations[registration.instance_id] = registration
        self.registration_ignored(key, reason)
        self.registration_rejected(key, REJECTED_ROUTER_URL)

    async def _report_unpaired(self, instance: Instance) -> None:
        """Warn about an instance nothing can pair with, once its peers had time to come
        (a listing registers them one at a time)."""
        await trio.sleep(_PAIRING_GRACE_S)
        if self._table.get(instance.instance_id) is not instance or not instance.registered:
            return
        if not self._table.pairs_with_any(instance):
            log.warning(
                "%s; it is not routed to until one comes", self._table.unpaired_reason(instance)
            )

    # --- the links --------------------------------------------------------------------

    def _replace_instance(self, registration: Registration) -> Instance:
        """The instance for a registration; one it replaces stops taking work and goes."""
        instance = Instance(
            instance_id=registration.instance_id,
            role=registration.role,
            url=registration.url,
            model=registration.model,
            layout=registration.layout,
            max_model_len=registration.max_model_len,
            transfer_endpoint=(registration.transfer_host, registration.transfer_port),
        )
        old = self._table.put(instance)
        if old is not None:
            old.registered = False
            self._nursery.start_soon(self._retire, old)
        return instance

    async def _retire(self, instance: Instance) -> None:
        """Close a deregistered or replaced instance's link once nothing runs on it."""
        while instance.still_used:
            await instance.quieter.park()  # woken by what ends on it
        if instance.link_scope is not None:
            instance.link_scope.cancel()
        self._table.remove(instance)

    async def _keep_link(
        self,
        instance: Instance,
        must_connect: bool,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Hold the websocket to an instance open, reconnecting when it breaks.

        With ``must_connect`` the first connection must succeed (start-up fails
        otherwise); a registered instance is retried until it deregisters.
        """
        router_config = self._config.router
        ws_url = "ws" + instance.url.removeprefix("http") + "/pd/link"  # (https: wss)
        link = WorkerLink(
            instance.instance_id,
            ws_url,
            max_pending_tokens=router_config.stream_buffer_tokens,
            on_capacity=self._capacity_changed,
            on_quieter=instance.did_less,
            link_timeout_s=router_config.link_timeout_s,
            heartbeat_s=router_config.link_heartbeat_s,
            stream_idle_timeout_s=router_config.stream_idle_timeout_s,
            connect_timeout_s=router_config.connect_timeout_s,
            authorize=functools.partial(
                link_authorization,
                self._http,
                instance.url,
                self._credentials,
                instance.instance_id,
            ),
            ssl_context=self._credentials.client_tls,
            leases=self._leases,
        )
        instance.link = link
        status = task_status
        with trio.CancelScope() as scope:
            instance.link_scope = scope
            refusals = 0  # in a row: an instance that cannot prove itself is asked less often
            while True:
                try:
                    await link.run(task_status=status)
                except PeerRefused as exc:
                    if must_connect and not link.ever_connected:
                        raise
                    if refusals == 0:
                        log.warning("not linking to %s: %s", instance.instance_id, exc)
                    refusals += 1
                except LINK_ERRORS as exc:
                    if must_connect and not link.ever_connected:
                        raise
                    refusals = 0
                    if link.ever_connected:
                        log.warning("the link to %s is down: %r", instance.instance_id, exc)
                    else:
                        log.warning(
                            "cannot reach %s at %s: %r", instance.instance_id, instance.url, exc
                        )
                status = trio.TASK_STATUS_IGNORED
                await trio.sleep(min(0.5 * 2.0 ** min(refusals, 6), _REFUSED_RETRY_MAX_S))


def _same(instance: Instance, registration: Registration) -> bool:
    """Whether a registration says nothing new about an instance (a renewal)."""
    return (
        instance.role == registration.role
        and instance.url == registration.url
        and instance.model == registration.model
        and instance.layout == registration.layout
        and instance.max_model_len == registration.max_model_len
        and instance.transfer_endpoint == (registration.transfer_host, registration.transfer_port)
    )
