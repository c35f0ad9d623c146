"""The instance table: the pdtrio instances the router knows, their state, and placement.

Each :class:`Instance` is what the router knows of one worker (its registration,
whether new work may go to it, its failures in a row) and holds the link to it.
The :class:`InstanceTable` answers the request path's questions (which prefill,
which decode with room, why none, is this KV handle from where it should be),
choosing by the policies of ``pdtrio.protocol.placement.scheduling`` with the time passed
in.  Links are opened, kept and retired by ``pdtrio.router.workers.supervisor``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterator, Mapping, ValuesView
from typing import cast, final

import attrs
import trio

from pdtrio.config import Role
from pdtrio.protocol.errors import Reason, is_clients_fault
from pdtrio.protocol.kv_layout import KvLayout, blocks_needed, layout_mismatch
from pdtrio.protocol.link.wire import DRAINING_ERROR_TYPE, KvHandle, PrefillFailed, Prompt
from pdtrio.protocol.placement.prefix_index import (
    MAX_HASHED_TOKENS,
    PromptBlocks,
    PromptChains,
    layout_block_hashes,
)
from pdtrio.protocol.placement.scheduling import Candidate, Scheduler, SchedulingPolicy
from pdtrio.router.suspension import reinstate, suspend
from pdtrio.router.workers.link import WorkerLink

log = logging.getLogger("pdtrio.router")


Connection = tuple[WorkerLink, int]
"""A decode link and which of its connections (``WorkerLink.connects``) a request was on."""


@attrs.define(eq=False)
class Instance:
    instance_id: str
    role: Role
    url: str
    model: str
    layout: KvLayout
    max_model_len: int
    # where its KV is pulled from, as registered: a KV handle naming another is refused
    transfer_endpoint: tuple[str, int] = ("", 0)
    healthy: bool = True
    # still registered (etcd): once deregistered it takes no new work, then goes
    registered: bool = True
    # it said it is stopping (a prefill refused as draining): no new work
    draining: bool = False
    active_prefills: int = 0
    # requests it prefilled that have not ended: each still owes it a release of its KV
    leases_out: int = 0
    # out of rotation until then (trio clock) after failing requests with a 5xx: the
    # next request after it probes the instance; each failure in a row doubles the wait
    suspended_until: float = 0.0
    failures_in_a_row: int = 0
    link: WorkerLink | None = None
    link_scope: trio.CancelScope | None = None
    # woken whenever it does less (a request ends on it, a lease comes back, its link
    # drops): what its retirement waits on
    quieter: trio.lowlevel.ParkingLot = attrs.field(factory=trio.lowlevel.ParkingLot)

    @property
    def serves_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def serves_decode(self) -> bool:
        return self.role in ("decode", "both")

    @property
    def usable(self) -> bool:
        """Whether new work may go to it now (suspension aside)."""
        return (
            self.healthy
            and self.registered
            and not self.draining
            and self.link is not None
            and self.link.connected
        )

    @property
    def still_used(self) -> bool:
        """Whether requests still run on, or owe a release to, the instance over its link."""
        link = self.link
        if link is None or not link.connected:
            return False
        return link.busy or bool(self.active_prefills or self.leases_out)

    def pairs_with(self, other: Instance) -> bool:
        """Whether KV prefilled on one of the two can be decoded on the other."""
        return self.model == other.model and self.layout == other.layout

    def did_less(self) -> None:
        """Something on it ended: its retirement (if waiting) looks again."""
        if self.quieter:
            self.quieter.unpark_all()

    def prefill_started(self) -> None:
        self.active_prefills += 1

    def prefill_ended(self) -> None:
        self.active_prefills -= 1
        self.did_less()

    def lease_taken(self) -> None:
        """A request holds KV it prefilled: its link stays until the request ends."""
        self.leases_out += 1

    def lease_returned(self) -> None:
        self.leases_out -= 1
        self.did_less()


@final
@attrs.frozen
class InstanceStatistics:
    """A snapshot of the table (trio's ``statistics()`` habit: no live counters)."""

    instances: int
    prefill_usable: int
    decode_usable: int
    suspended: int  # out of rotation for failing requests
    draining: int
    active_prefills: int
    leases_out: int


@final
class InstanceTable(Mapping[str, Instance]):
    """The known instances by id, and placement on them.

    ``backoff_s``: how long an instance failing a request leaves rotation (doubling
    with each failure in a row, capped); ``prefill_cache_weight``: how many prefills in
    flight the longest cached prefix of a prompt is worth (``scheduling.cache_favoured``),
    ``decode_cache_weight`` the same in requests on a decode; ``local_prefill_max_tokens``:
    a request missing no more of its prompt than this from the cache of the decode it would
    go to is prefilled there (conditional disaggregation; 0: never).
    """

    def __init__(
        self,
        prefill_policy: SchedulingPolicy,
        decode_policy: SchedulingPolicy,
        *,
        backoff_s: float,
        prefill_cache_weight: float = 0.0,
        decode_cache_weight: float = 0.0,
        local_prefill_max_tokens: int = 0,
    ) -> None:
        self._instances: dict[str, Instance] = {}
        self._prefill_scheduler = Scheduler(prefill_policy, cache_weight=prefill_cache_weight)
        # the hash chains of earlier prompts, learned from prefill replies
        self._prompt_chains = PromptChains()
        self._decode_scheduler = Scheduler(decode_policy, cache_weight=decode_cache_weight)
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self._backoff_s = backoff_s
        # requests waiting for a decode link to (re)connect, woken by the links' reports
        # whoever waits for a link (a decode's, or a prefill's) to connect
        self._decode_link_waiters = trio.lowlevel.ParkingLot()

    # --- the mapping ----------------------------------------------------------------

    def __getitem__(self, instance_id: str) -> Instance:
        return self._instances[instance_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._instances)

    def __len__(self) -> int:
        return len(self._instances)

    # the dict's own (Mapping's mixins go through __iter__ and __getitem__ per item: dear
    # on the request path, which looks at every instance a few times)
    def values(self) -> ValuesView[Instance]:
        return self._instances.values()

    def get(self, instance_id: str, default: Instance | None = None) -> Instance | None:  # type: ignore[override]
        return self._instances.get(instance_id, default)

    def put(self, instance: Instance) -> Instance | None:
        """Add ``instance``; the one it replaces (same id), if any."""
        old = self._instances.get(instance.instance_id)
        self._instances[instance.instance_id] = instance
        return old

    def remove(self, instance: Instance) -> None:
        """Forget ``instance`` unless another has taken its id since."""
        if self._instances.get(instance.instance_id) is instance:
            del self._instances[instance.instance_id]

    def statistics(self) -> InstanceStatistics:
        instances = list(self._instances.values())
        now = trio.current_time()
        return InstanceStatistics(
            instances=len(instances),
            prefill_usable=sum(1 for i in instances if i.serves_prefill and i.usable),
            decode_usable=sum(1 for i in instances if i.serves_decode and i.usable),
            suspended=sum(1 for i in instances if i.suspended_until > now),
            draining=sum(1 for i in instances if i.draining),
            active_prefills=sum(i.active_prefills for i in instances),
            leases_out=sum(i.leases_out for i in instances),
        )

    # --- the prefix index -------------------------------------------------------------

    def prompt_blocks(self, prompt: Prompt) -> PromptBlocks | None:
        """What the prefix index knows of ``prompt``; None when no instance reports its
        prefix cache and no request may be prefilled on its decode (nothing to look up,
        nothing to learn: no hashing)."""
        if self.local_prefill_max_tokens <= 0 and not self._some_cache_reports():
            return None
        return PromptBlocks(prompt, self._prompt_chains)

    def _some_cache_reports(self) -> bool:
        for instance in self._instances.values():  # (a loop: no generator per request)
            link = instance.link
            if link is not None and link.cached_blocks.reporting:
                return True
        return False

    def learn_prompt(
        self, prompt: PromptBlocks, instance: Instance, prompt_token_ids: tuple[int, ...]
    ) -> None:
        """Prefill told the prompt's token ids: remember its chain for the prompts that
        begin with its messages (a conversation's next turn), once."""
        if not prompt.keys or self._prompt_chains.knows(prompt.keys[-1]):
            return
        chain = layout_block_hashes(prompt_token_ids[:MAX_HASHED_TOKENS], instance.layout)
        self._prompt_chains.learn(prompt.keys[-1], chain, len(prompt_token_ids), prompt.num_chars)

    def _cached_blocks(self, instance: Instance, prompt: PromptBlocks | None) -> int:
        link = instance.link
        if prompt is None or link is None or not link.cached_blocks.reporting:
            return 0
        return link.cached_blocks.prefix_blocks(prompt.hashes_for(instance.layout))

    # --- prefill --------------------------------------------------------------------

    def pick_prefill(
        self,
        model: str | None,
        now: float,
        exclude: frozenset[str] = frozenset(),
        prompt: PromptBlocks | None = None,
    ) -> Instance | None:
        """A usable prefill instance for ``model`` that some usable decode can pair with;
        suspended ones only when no other is left.  With ``prompt``, each candidate counts
        how much of it its prefix cache holds (the policy weighs that against load)."""
        instances = self._instances.values()
        decodes = [i for i in instances if i.serves_decode and i.usable]
        usable = [
            i
            for i in instances
            if i.serves_prefill
            and i.usable
            and (model is None or i.model == model)
            and any(i.pairs_with(d) for d in decodes)
        ]
        cached = {i.instance_id: self._cached_blocks(i, prompt) for i in usable}
        for allow_suspended in (False, True):
            candidates = [
                Candidate(
                    i.instance_id,
                    i.active_prefills,
                    allow_suspended or i.suspended_until <= now,
                    cached_blocks=cached[i.instance_id],
                )
                for i in usable
            ]
            chosen = self._prefill_scheduler.pick(candidates, exclude=exclude)
            if chosen is not None:
                return self._instances[chosen]
        return None

    def prefill_available(self, model: str | None, exclude: frozenset[str]) -> bool:
        """Whether :meth:`pick_prefill` would find an instance (suspended ones count)."""
        decodes = [i for i in self._instances.values() if i.serves_decode and i.usable]
        return any(
            i.serves_prefill
            and i.usable
            and i.instance_id not in exclude
            and (model is None or i.model == model)
            and any(i.pairs_with(d) for d in decodes)
            for i in self._instances.values()
        )

    async def wait_for_prefill(self, model: str | None, exclude: frozenset[str]) -> None:
        """Until a prefill instance not in ``exclude`` could take a request for ``model``
        (a link connected, an instance registered).  The caller bounds the wait."""
        while not self.prefill_available(model, exclude):
            await self._decode_link_waiters.park()

    def prefill_failed(self, instance: Instance, answer: PrefillFailed, now: float) -> None:
        """What prefill's failure says of the instance: a 5xx is its fault (a 4xx is the
        request's); a 503 is a busy one (no KV room), not suspended; draining, no new work."""
        if is_clients_fault(answer.status):
            return
        if answer.error_type == DRAINING_ERROR_TYPE:
            self.instance_draining(instance)
        elif answer.status != 503:
            self.instance_failed(instance, now)
        log.warning(
            "prefill on %s failed, trying another: %s", instance.instance_id, answer.message
        )

    def pick_local_prefill(
        self,
        model: str | None,
        now: float,
        exclude: frozenset[str] = frozenset(),
        prompt: PromptBlocks | None = None,
    ) -> Instance | None:
        """Conditional disaggregation: the decode (or ``both``) instance the request would
        decode on, when no more than ``local_prefill_max_tokens`` of its prompt are missing
        from that instance's prefix cache: it prefills the request itself, and decodes it
        (no prefill hop, no KV transfer).  None: a prefill instance prefills it.

        The decode is picked as decode placement would pick it (policy, load and cached
        prefix), among those in rotation with room for the prompt's KV now.
        """
        threshold = self.local_prefill_max_tokens
        if threshold <= 0 or prompt is None:
            return None
        estimated = prompt.estimated_tokens()
        candidates: list[Candidate] = []
        missing: dict[str, int] = {}
        for instance in self._instances.values():
            link = instance.link
            if (
                not instance.serves_decode
                or not instance.usable
                or link is None
                or link.capacity is None
                or instance.instance_id in exclude
                or instance.suspended_until > now
                or (model is not None and instance.model != model)
            ):
                continue
            block_size = link.capacity.block_size
            if link.available_blocks < blocks_needed(estimated, block_size):
                continue
            cached = self._cached_blocks(instance, prompt)
            missing[instance.instance_id] = estimated - cached * block_size
            candidates.append(
                Candidate(
                    instance.instance_id,
                    link.active_requests,
                    free_blocks=link.available_blocks,
                    cached_blocks=cached,
                )
            )
        chosen = self._decode_scheduler.pick(candidates)
        if chosen is None or missing[chosen] > threshold:
            return None
        return self._instances[chosen]

    # --- decode ---------------------------------------------------------------------

    def still_on(self, tried: Mapping[str, Hashable]) -> frozenset[str]:
        """The instances in ``tried`` (id -> :data:`Connection`) still on the connection
        they were tried on: one that has reconnected since (a reset link, a worker back
        from a stop) may be tried again, since the worker ended everything of the old one's."""
        excluded = set()
        for instance_id, connection in tried.items():
            link, connects = cast(Connection, connection)
            instance = self._instances.get(instance_id)
            if instance is not None and instance.link is link and link.connects == connects:
                excluded.add(instance_id)
        return frozenset(excluded)

    def decode_links(
        self, exclude: frozenset[str] = frozenset(), layout: KvLayout | None = None
    ) -> list[WorkerLink]:
        """The links of usable decode instances not in ``exclude`` (that take ``layout``)."""
        return [
            i.link
            for i in self._instances.values()
            if i.serves_decode
            and i.usable
            and i.link is not None
            and i.instance_id not in exclude
            and (layout is None or i.layout == layout)
        ]

    def links_changed(self) -> None:
        """A link reported capacity, connected or went: waiters for a link look again."""
        self._decode_link_waiters.unpark_all()

    async def wait_for_decode_link(
        self, exclude: Callable[[], frozenset[str]], layout: KvLayout | None = None
    ) -> None:
        """Until a usable decode link not in ``exclude()`` (asked anew at each change; it
        may shrink as instances reconnect) takes ``layout``.  The caller bounds the wait."""
        while not self.decode_links(exclude(), layout):
            await self._decode_link_waiters.park()

    def decode_with_room(
        self,
        num_tokens: int,
        now: float,
        exclude: frozenset[str] = frozenset(),
        layout: KvLayout | None = None,
        prompt: PromptBlocks | None = None,
        prefer: str | None = None,
    ) -> Instance | None:
        """A decode instance with room for ``num_tokens`` now, chosen by the decode policy
        (weighing how much of ``prompt`` each holds cached); one suspended for failing
        requests only when no other has room.  ``prefer``: that instance whenever it is
        one of them (it prefilled the request itself: the KV is there, no transfer)."""
        candidates: list[Candidate] = []
        for link in self.decode_links(exclude, layout):
            capacity = link.capacity
            if capacity is None:
                continue
            free = link.available_blocks
            if free >= blocks_needed(num_tokens, capacity.block_size):
                instance = self._instances[link.instance_id]
                in_rotation = instance.suspended_until <= now
                cached = self._cached_blocks(instance, prompt)
                candidates.append(
                    Candidate(link.instance_id, link.active_requests, in_rotation, free, cached)
                )
        if prefer is not None and any(c.instance_id == prefer for c in candidates):
            return self._instances[prefer]
        chosen = self._decode_scheduler.pick(candidates)
        if chosen is None and candidates:
            chosen = self._decode_scheduler.pick(
                [attrs.evolve(c, healthy=True) for c in candidates]
            )
        return None if chosen is None else self._instances[chosen]

    def decode_unplaceable(
        self,
        links: list[WorkerLink],
        exclude: frozenset[str],
        layout: KvLayout,
        kv_tokens: int,
        prompt_tokens: int,
        token_budget: int,
        last_reason: str,
    ) -> tuple[Reason, str, str | None] | None:
        """Why a request needing ``kv_tokens`` of KV can go to none of ``links`` (the
        usable decodes taking its ``layout``), waiting or not: (reason, message, param);
        None when one may take it once it has room."""
        if not links:
            if self.decode_links(exclude):
                last_reason = f"none takes prefill's KV layout [{layout.describe()}]"
            return (
                Reason.SERVICE_UNAVAILABLE,
                f"no decode instance could take the request: {last_reason}",
                None,
            )
        reports = [link.capacity for link in links if link.capacity is not None]
        if reports and all(
            blocks_needed(kv_tokens, c.block_size) > c.total_blocks for c in reports
        ):
            most = max(c.total_blocks * c.block_size for c in reports)
            return (
                Reason.CONTEXT_LENGTH_EXCEEDED,
                f"This request needs {kv_tokens} tokens of KV cache ({prompt_tokens} in "
                f"the prompt, {token_budget} for the completion), more than any "
                f"decode instance can hold ({most}). Please reduce max_tokens or the prompt.",
                "max_tokens",
            )
        return None

    # --- failures -------------------------------------------------------------------

    def instance_draining(self, instance: Instance) -> None:
        """It said it is stopping: no new work goes to it (a restart registers it anew)."""
        if not instance.draining:
            instance.draining = True
            log.info("instance %s is draining: no new work goes to it", instance.instance_id)

    def instance_failed(self, instance: Instance, now: float) -> None:
        """It failed a request (a prefill 5xx, a decode failing a stream): out of rotation
        for a while (doubling, capped); the next request after that probes it."""
        backoff = suspend(instance, now, self._backoff_s)
        log.warning(
            "instance %s failed %d request(s) in a row: out of rotation for %gs",
            instance.instance_id,
            instance.failures_in_a_row,
            backoff,
        )

    @staticmethod
    def instance_served(instance: Instance) -> None:
        """It served a request: back in full rotation."""
        reinstate(instance)

    # --- what is wrong, in words ----------------------------------------------------

    def kv_source_mismatch(self, handle: KvHandle, instance: Instance) -> bool:
        """Whether prefill's KV handle names another address (or instance) than where the
        instance registered its KV port: decode must never be sent there."""
        named = (handle.transfer_host, handle.transfer_port)
        return handle.instance_id != instance.instance_id or named != instance.transfer_endpoint

    def unpaired_reason(self, instance: Instance) -> str:
        wanted = "decode" if instance.role == "prefill" else "prefill"
        same_model = [
            other
            for other in self._instances.values()
            if other is not instance
            and other.registered
            and other.model == instance.model
            and (other.serves_decode if wanted == "decode" else other.serves_prefill)
        ]
        if not same_model:
            return (
                f"{instance.instance_id} cannot be paired: no {wanted} instance serves "
                f"{instance.model}"
            )
        other = same_model[0]
        prefill, decode = (instance, other) if wanted == "decode" else (other, instance)
        return (
            f"{instance.instance_id} cannot be paired with {other.instance_id}: "
            f"{layout_mismatch(prefill.layout, decode.layout)}"
        )

    def pairs_with_any(self, instance: Instance) -> bool:
        """Whether some counterpart (registered or not) can pair with ``instance``."""
        return any(
            instance.pairs_with(other)
            for other in self._instances.values()
            if (instance.serves_prefill and other.serves_decode)
            or (instance.serves_decode and other.serves_prefill)
        )

    def unpaired(self) -> dict[str, str]:
        """Registered instances no counterpart can pair with, and why (for /health)."""
        reasons: dict[str, str] = {}
        live = [i for i in self._instances.values() if i.registered]
        for instance in live:
            if instance.role == "both" and instance.pairs_with(instance):
                continue
            counterparts = [
                other
                for other in live
                if (instance.serves_prefill and other.serves_decode)
                or (instance.serves_decode and other.serves_prefill)
            ]
            if not any(instance.pairs_with(other) for other in counterparts):
                reasons[instance.instance_id] = self.unpaired_reason(instance)
        return reasons

    def no_instance_reason(self, model: str) -> str:
        """Why no instance pair takes a request: the role none is up for, or why none pair."""
        instances = self._instances.values()
        if not any(i.serves_prefill and i.usable and i.model == model for i in instances):
            role = "prefill"
        elif not any(i.serves_decode and i.usable for i in instances):
            role = "decode"  # (a decode restarting, say): prefill is up, but has no counterpart
        else:
            role = "prefill"  # both are up, but none pairs: the reasons below say why
        unpaired = [
            reason
            for instance_id, reason in self.unpaired().items()
            if self._instances[instance_id].serves_prefill
            and self._instances[instance_id].model == model
        ]
        if unpaired and role == "prefill":
            return "no prefill instance is available: " + "; ".join(unpaired)
        return f"no {role} instance is available"
