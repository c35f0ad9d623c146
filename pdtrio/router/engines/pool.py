"""The router in front of engines (vLLM) instead of pdtrio workers: the pool.

An engine is known by its ``[[instances]]`` entry (``kind = "vllm"``), or by
its registration in etcd (``pdtrio register`` beside it; ``[discovery] kind``),
learnt and forgotten as the registry reports: its
model and context length come from its ``/v1/models``, its health from
``/health`` and its load from ``/metrics`` (waiting and running requests, KV
cache usage), scraped once per ``_SCRAPE_INTERVAL_S`` however many requests
run.  Placement is the router's scheduling policies over that load plus the
requests this router has out on it, cache-aware: an engine reports no cached blocks,
so the router remembers which prompt prefixes each instance served
(``pdtrio.protocol.placement.approx_prefix``) and favours the instance that served the longest
prefix of a request, weighed against load by ``prefill_cache_weight`` for prefill and
``decode_cache_weight`` for decode (an engine's decode caches the prompt too).  An instance failing with a 5xx or
unreachable is out of rotation for a while (doubling, capped), as pdtrio
workers are; a 4xx is the client's and never counts against it.

A request on them runs through the shared pipeline with the engines' HTTP legs
(``pdtrio.router.engines.legs``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, final

import attrs
import httpx
import trio

from pdtrio.config import InstanceConfig, PdtrioConfig
from pdtrio.protocol.engines.vllm import EngineLoad, parse_engine_metrics
from pdtrio.protocol.link.registration import EngineRegistration
from pdtrio.protocol.link.wire import Prompt
from pdtrio.protocol.openai import listed_models
from pdtrio.protocol.placement.approx_prefix import ApproxPrefixIndex, approx_prompt_keys
from pdtrio.protocol.placement.scheduling import Candidate, Scheduler
from pdtrio.router.backend import BackendLost, BackendUnreachable
from pdtrio.router.suspension import reinstate, suspend
from pdtrio.security import ENGINE_API_KEY_ENV, resolve_secret

if TYPE_CHECKING:
    from pdtrio.discovery.registry import DiscoveryState

log = logging.getLogger("pdtrio.router.engines")

# how often each engine's /health is read, and its /metrics while its load matters
_SCRAPE_INTERVAL_S = 1.0
# placement wants loads this long after its last pick; then only an engine that is still
# busy has its /metrics read (parsing them is most of an idle router's work)
_LOAD_WANTED_S = 5.0
_KV_SCALE = 1000  # KV usage as "free blocks" for the scheduler: thousandths left


@attrs.define(eq=False)
class EngineInstance:
    config: InstanceConfig
    model: str = ""  # "" until its /v1/models answered
    max_model_len: int = 0
    healthy: bool = False
    load: EngineLoad | None = None
    in_flight: int = 0  # this router's legs out on it now
    suspended_until: float = 0.0
    failures_in_a_row: int = 0
    slow_probes_in_a_row: int = 0  # health reads that timed out, since the last answer
    last_error: str = ""
    # its name in etcd ("": listed in [[instances]], known by its URL)
    registered_as: str = ""

    @property
    def instance_id(self) -> str:
        return self.registered_as or self.config.url

    @property
    def url(self) -> str:
        return self.config.url.rstrip("/")

    @property
    def serves_prefill(self) -> bool:
        return self.config.role in ("prefill", "both")

    @property
    def serves_decode(self) -> bool:
        return self.config.role in ("decode", "both")

    @property
    def usable(self) -> bool:
        return self.healthy and bool(self.model)

    def headers(self, request_id: str | None = None, traceparent: str = "") -> dict[str, str]:
        """What a call to the engine carries: its key, the leg's id, and (``traceparent``:
        the router's span of the leg) the trace context its own spans join."""
        headers = {}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        if request_id is not None:
            headers["X-Request-Id"] = request_id
        if traceparent:
            headers["traceparent"] = traceparent
        return headers

    def candidate(self, now: float, allow_suspended: bool, cached_prefix: int = 0) -> Candidate:
        load = self.load
        queued = 0 if load is None else load.waiting
        free = None if load is None else round((1.0 - load.kv_usage) * _KV_SCALE)
        return Candidate(
            self.instance_id,
            self.in_flight + queued,
            self.usable and (allow_suspended or self.suspended_until <= now),
            free,
            cached_prefix,
        )


@final
class EnginePool:
    """The engines one router fronts, their health and load, and placement over them."""

    def __init__(self, config: PdtrioConfig, http: httpx.AsyncClient) -> None:
        self.config = config
        self.kind = config.engine_kind
        self.http = http
        # by instance id: a listed one's URL, a registered one's name in etcd
        self.instances = {i.url: EngineInstance(i) for i in config.instances}
        security = config.security
        self._registered_api_key = resolve_secret(
            security.engine_api_key,
            security.engine_api_key_file,
            env_name=ENGINE_API_KEY_ENV,
            what="engine API key",
        )
        router = config.router
        # one trade-off for both legs: a decode holding the prompt's prefix pulls (vLLM) or
        # fetches (SGLang) only the rest of its KV, as a prefill computes only the rest
        self._schedulers = {
            "prefill": Scheduler(router.prefill_policy, cache_weight=router.prefill_cache_weight),
            "decode": Scheduler(router.decode_policy, cache_weight=router.decode_cache_weight),
        }
        # which prompt prefixes each instance served, in place of the KV events engines lack
        self.prefixes = ApproxPrefixIndex(
            max_entries=router.engine_prefix_index_max_entries,
            ttl_s=router.engine_prefix_index_ttl_s,
        )
        self._timeout_s = config.router.connect_timeout_s
        self._slow_probes_before_down = config.router.engine_slow_probes_before_down
        # where background legs run (a release of a left client's prefill KV)
        self.nursery: trio.Nursery | None = None
        self._last_pick = -math.inf
        # set by the first pick after a quiet spell: the loads are read at once
        self._loads_wanted = trio.Event()
        # whoever waits for an engine to come up (a request that found none)
        self._came_up = trio.lowlevel.ParkingLot()

    # --- what the app asks ---------------------------------------------------------

    @property
    def models(self) -> list[str]:
        return sorted({i.model for i in self.instances.values() if i.model})

    def context_lengths(self) -> dict[str, int]:
        lengths: dict[str, int] = {}
        for instance in self.instances.values():
            if instance.model and instance.max_model_len and instance.serves_prefill:
                lengths[instance.model] = max(
                    lengths.get(instance.model, 0), instance.max_model_len
                )
        return lengths

    def health(
        self,
        active_requests: int,
        discovery: DiscoveryState | None = None,
        ignored: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """``/health``: the counts, each engine, and (``discovery``) where they come from
        with the registrations ``ignored`` (key: why)."""
        prefill = sum(1 for i in self.instances.values() if i.serves_prefill and i.usable)
        decode = sum(1 for i in self.instances.values() if i.serves_decode and i.usable)
        report: dict[str, Any] = {
            "status": "ok" if prefill and decode else "unavailable",
            "prefill_instances": prefill,
            "decode_instances": decode,
            "active_requests": active_requests,
            "engines": [
                {
                    **({"instance": i.registered_as} if i.registered_as else {}),
                    "url": i.config.url,
                    "kind": i.config.kind,
                    "role": i.config.role,
                    "model": i.model,
                    "healthy": i.healthy,
                    **({} if i.healthy else {"error": i.last_error}),
                    **(
                        {}
                        if i.load is None
                        else {
                            "waiting": i.load.waiting,
                            "running": i.load.running,
                            "kv_usage": i.load.kv_usage,
                        }
                    ),
                }
                for i in self.instances.values()
            ],
        }
        if self.prefixes.max_entries:
            report["prefix_index"] = attrs.asdict(self.prefixes.statistics())
        if discovery is not None and discovery.source == "etcd":
            report["discovery"] = discovery.report()
        if ignored:
            report["ignored"] = [{"key": key, "reason": why} for key, why in ignored.items()]
        return report

    def describe(self) -> str:
        if not self.instances:
            return "none yet (waiting for registrations in etcd)"
        return ", ".join(
            f"{i.config.kind} {i.config.role} {i.config.url}"
            + ("" if i.usable else f" (not up: {i.last_error or 'no answer yet'})")
            for i in self.instances.values()
        )

    # --- placement -------------------------------------------------------------------

    def prefix_keys(self, prompt: Prompt) -> list[bytes]:
        """The keys ``prompt`` is found by in the prefix index ([] with the index off)."""
        if self.prefixes.max_entries == 0:
            return []
        return approx_prompt_keys(prompt)

    def pick(
        self,
        role: str,
        model: str,
        exclude: frozenset[str] = frozenset(),
        prefix_keys: Sequence[bytes] = (),
    ) -> EngineInstance | None:
        """A usable instance for ``role`` serving ``model``; suspended ones only when no
        other is left.  With ``prefix_keys`` (the request's), the instance that served the
        longest prefix of them is favoured (``scheduling.cache_favoured``)."""
        serving = [
            i
            for i in self.instances.values()
            if (i.serves_prefill if role == "prefill" else i.serves_decode) and i.model == model
        ]
        now = trio.current_time()
        if now - self._last_pick >= _LOAD_WANTED_S:
            self._loads_wanted.set()  # (the loads it picks by now may be a quiet spell old)
        self._last_pick = now
        cached = {
            i.instance_id: self.prefixes.cached_prefix(i.instance_id, prefix_keys, now)
            for i in serving
        }
        scheduler = self._schedulers[role]
        for allow_suspended in (False, True):
            chosen = scheduler.pick(
                [i.candidate(now, allow_suspended, cached[i.instance_id]) for i in serving],
                exclude=exclude,
            )
            if chosen is not None:
                return self.instances[chosen]
        return None

    async def wait_for_instance(self, role: str, model: str, exclude: frozenset[str]) -> None:
        """Until a usable engine for ``role`` serving ``model``, not in ``exclude``, is up
        (its health read found it so).  The caller bounds the wait."""
        while not any(i.usable and i.instance_id not in exclude for i in self.all_of(role, model)):
            self._loads_wanted.set()  # (read the engines now, not at the next interval)
            await self._came_up.park()

    def served_prefix(self, instance: EngineInstance, prefix_keys: Sequence[bytes]) -> None:
        """``instance`` served a leg of a prompt of ``prefix_keys`` (prefill answered, decode
        sent a token): it probably holds the prompt's KV cached now."""
        if self.instances.get(instance.instance_id) is not instance or not instance.healthy:
            return  # (it left, or went down, while the leg ran: its cache is unknown)
        self.prefixes.record(instance.instance_id, prefix_keys, trio.current_time())

    def failed(self, instance: EngineInstance, why: str) -> None:
        """It failed a leg (a 5xx, unreachable, a broken stream): out of rotation a while."""
        backoff = suspend(instance, trio.current_time(), self.config.router.instance_backoff_s)
        instance.last_error = why
        # (it may be restarting: whatever it had cached may be gone)
        self.prefixes.forget(instance.instance_id)
        log.warning(
            "engine %s failed %d leg(s) in a row (%s): out of rotation for %gs",
            instance.instance_id,
            instance.failures_in_a_row,
            why,
            backoff,
        )

    @staticmethod
    def served(instance: EngineInstance) -> None:
        reinstate(instance)

    def all_of(self, role: str, model: str) -> Iterator[EngineInstance]:
        for instance in self.instances.values():
            if instance.model == model and (
                instance.serves_prefill if role == "prefill" else instance.serves_decode
            ):
                yield instance

    # --- what etcd says (pdtrio.discovery.registry.EngineListener) -----------------------

    def engine_registered(self, registration: EngineRegistration) -> None:
        """Learn (or update) an engine ``pdtrio register`` registered; it takes legs once
        its first scrape found it up."""
        config = InstanceConfig(
            role=registration.role,
            url=registration.url,
            kind=registration.kind,
            model=registration.model,
            api_key=self._registered_api_key,
            bootstrap_port=registration.bootstrap_port,
        )
        known = self.instances.get(registration.instance_id)
        if known is not None and known.config == config:
            return  # (listed again after etcd came back)
        instance = EngineInstance(config, registered_as=registration.instance_id)
        self.instances[registration.instance_id] = instance
        self.prefixes.forget(registration.instance_id)  # (a changed engine's cache is another)
        log.info(
            "engine %s %s: %s %s at %s, model %s",
            registration.instance_id,
            "changed" if known is not None else "registered",
            registration.kind,
            registration.role,
            registration.url,
            registration.model,
        )
        if self.nursery is not None:
            self.nursery.start_soon(self._scrape, instance)

    def engine_deregistered(self, instance_id: str) -> None:
        """Forget it: no new legs; the legs on it run to their end."""
        instance = self.instances.pop(instance_id, None)
        self.prefixes.forget(instance_id)
        if instance is not None:
            log.info("engine %s deregistered (%s)", instance_id, instance.config.url)

    # --- health and load -------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Ask every engine once (start-up waits for that), then keep reading them."""
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            await self._scrape_all()
            task_status.started()
            while True:
                with trio.move_on_after(_SCRAPE_INTERVAL_S):
                    await self._loads_wanted.wait()
                self._loads_wanted = trio.Event()
                await self._scrape_all()

    def _wants_load(self, instance: EngineInstance) -> bool:
        """Whether ``instance``'s /metrics are worth reading now: placement picked lately,
        or its last load showed work (it is read until it shows none)."""
        load = instance.load
        return (
            trio.current_time() - self._last_pick < _LOAD_WANTED_S
            or instance.in_flight > 0
            or load is None
            or not load.idle
        )

    async def _scrape_all(self) -> None:
        async with trio.open_nursery() as nursery:
            for instance in list(self.instances.values()):
                nursery.start_soon(self._scrape, instance)

    async def _scrape(self, instance: EngineInstance) -> None:
        was_healthy = instance.healthy
        try:
            with trio.fail_after(self._timeout_s):
                if not instance.model:
                    await self._learn_model(instance)
                health = await self._get(instance, "/health")
                if health.status_code != 200:
                    raise _NotUp(f"/health answered {health.status_code}")
                if self._wants_load(instance):
                    metrics = await self._get(instance, "/metrics")
                    if metrics.status_code == 200:
                        instance.load = parse_engine_metrics(metrics.text)
        except (httpx.HTTPError, OSError, trio.TooSlowError, _NotUp, ValueError) as exc:
            why = str(exc) or type(exc).__name__
            slow = isinstance(exc, (trio.TooSlowError, httpx.TimeoutException))
            instance.slow_probes_in_a_row = instance.slow_probes_in_a_row + 1 if slow else 0
            if was_healthy and 0 < instance.slow_probes_in_a_row < self._slow_probes_before_down:
                log.info(
                    "engine %s answered no health read within %gs (%d in a row): still in rotation",
                    instance.instance_id,
                    self._timeout_s,
                    instance.slow_probes_in_a_row,
                )
                return
            if was_healthy or why != instance.last_error:  # once per change, not per scrape
                log.warning("engine %s is not up: %s", instance.instance_id, why)
            instance.healthy = False
            instance.last_error = why
            # down (restarting, perhaps): its cache is unknown until it serves again
            self.prefixes.forget(instance.instance_id)
            return
        instance.slow_probes_in_a_row = 0
        instance.healthy = True
        if not was_healthy:
            self._came_up.unpark_all()
            log.info(
                "engine %s is up: %s %s, model %s (context %d)",
                instance.instance_id,
                instance.config.kind,
                instance.config.role,
                instance.model,
                instance.max_model_len,
            )

    async def _get(self, instance: EngineInstance, path: str) -> httpx.Response:
        """A GET of the engine's, asked again once on a connection it closed unanswered.

        A kept-alive connection the server closes (idle too long) as a request goes out on
        it fails with "Server disconnected without sending a response": not the engine's
        health, and a GET is safe to send twice.
        """
        url = f"{instance.url}{path}"
        try:
            return await self.http.get(url, headers=instance.headers())
        except httpx.RemoteProtocolError:
            return await self.http.get(url, headers=instance.headers())

    async def _learn_model(self, instance: EngineInstance) -> None:
        response = await self._get(instance, "/v1/models")
        if response.status_code != 200:
            raise _NotUp(f"/v1/models answered {response.status_code}")
        listed = listed_models(response.json())  # (ValueError: not a models list)
        wanted = instance.config.model
        entry = next((m for m in listed if not wanted or m[0] == wanted), None)
        if entry is None:
            names = ", ".join(model_id for model_id, _ in listed) or "none"
            raise _NotUp(f"it serves no model {wanted!r} (it serves {names})")
        instance.model, instance.max_model_len = entry


class _NotUp(Exception):
    """An engine answered, but not as one that can serve."""


def exception_text(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


@contextmanager
def transport_errors() -> Iterator[None]:
    """An engine call's transport failures (httpx's, and the OS's under it) as the
    backend's errors, their cause kept: a connection never made is
    :class:`BackendUnreachable` (the engine never saw the call: another may take it),
    any other :class:`BackendLost`."""
    try:
        yield
    except httpx.ConnectError as exc:
        raise BackendUnreachable(exception_text(exc)) from exc
    except (httpx.HTTPError, OSError) as exc:
        raise BackendLost(exception_text(exc)) from exc
