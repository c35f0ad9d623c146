"""The soak on a multi-host bed (``python -m benchmarks.soak --hosts``): a network's faults,
one class at a time, each judged on its own requests.

The router, two prefills, two decodes and etcd each on an address of their own in a
network namespace (:class:`pdtrio.testing.netns.Bed`; root), workers registered in etcd, KV
moved by NIXL over UCX's TCP transport between hosts; the clients (the soak's, see
:mod:`benchmarks.soak`) in a host of their own.  The soak runs in phases, each with the
same clients for its share of ``--seconds``, every fault cleared and the cluster checked
between them:

1. **clean**: no fault; its streams' TTFT and TPOT are the baseline.
2. **KV path**: a third decode (``decode3``) joins with the ``kv_transfer_corrupt`` hook on,
   so each handoff to it must be refused by decode's digest check and go on elsewhere, and
   leaves (stdin closed) at the phase's end; meanwhile one prefill's KV port at a time (its
   NIXL session: grants and notifications) is stalled (sometimes past the KV lease), refuses
   new connections, resets each after a few bytes (the fault proxy in its namespace), or is
   cut off silently (an nftables drop of that port alone; its router link lives).
3. **partitions**: a worker's or etcd's host cut off silently (its switch port down,
   blackhole routes, or an nftables drop rule), or its link flapping (down 0.3 s of every
   second for 2-4 s); several at once.
4. **latency/loss**: 50 ms on both prefills' HTTP and KV ports (the fault proxy: this
   kernel has no netem, and UCX's own data connections cannot be reached that way) and 2 %
   random loss on every link (nftables in the switch), the whole phase.
5. **clean again**: no fault; the cluster must serve as it did at first.  TTFT and TPOT of
   every phase are given against both clean phases' streams.

After each phase: every fault cleared, the router healthy again, every worker's
``/pd/stats`` back to nothing held (``leaked``: what still is, after the KV lease could
expire).  Throughout, ``/health`` is sampled and judged against the bed's record of cuts
(:func:`benchmarks.soak_goals.health_lies`).  Then the disconnect probes, the processes
stopped, the per-phase and per-fault tables and issue 53's goals.
"""

from __future__ import annotations

import random
import re
import tempfile
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from benchmarks import soak_goals
from benchmarks.kit import percentile
from benchmarks.soak import (
    DECODE_STEP_S,
    KV_LEASE_S,
    LINK_TIMEOUT_S,
    Settings,
    Tally,
    _client,
    _digest_figures,
    _leaks,
    _one_request,
    _probe,
    _rss_mb,
    _stats,
    _stop_all,
    _unexplained,
)
from benchmarks.soak import _accounting as soak_accounting
from benchmarks.soak_goals import Cut, FaultSpan, HealthSample, Presence
from pdtrio.testing import (
    Processes,
    Service,
    router_command,
    synthetic_worker_config,
    worker_command,
)
from pdtrio.testing.netns import (
    Bed,
    BedProxy,
    Partition,
    bed_unavailable,
    list_namespaces,
    nft_unavailable,
)

HOST_PORT, HOST_KV_PORT = 8100, 8200
"""Where each worker binds in its namespace; a prefill advertises the fault proxies' ports
(one more), in front of these."""
ROUTER_PORT, ETCD_PORT = 8000, 2379
HOST_LEASE_TTL_S = 2
LOSS_PERCENT = 2.0
LATENCY_MS = 50
PREFILL_HOSTS = ("prefill", "prefill2")
DECODE_HOSTS = ("decode", "decode2")
CORRUPTING_HOST = "decode3"
CUTS: dict[str, Partition] = {"cut_link": "link", "cut_blackhole": "blackhole", "cut_drop": "drop"}
NFT_FAULTS = frozenset({"cut_drop", "kv_cut"})
PARTITION_FAULTS = (*CUTS, "flap")
KV_FAULTS = ("kv_stall", "kv_refuse", "kv_reset_after", "kv_cut")
CLEAN_AGAIN = "clean again"
HEALTH_EVERY_S = 0.2
HEALTH_DOWN_AFTER_S = LINK_TIMEOUT_S + 1.5
"""A worker cut off this long must be out of ``/health``'s count: the link timeout, and a
heartbeat's and a sample's slack."""
HEALTH_UP_AFTER_S = 5.0
"""A worker untouched this long must be in it: a link retried every 0.5 s, and a
registration that expired during the cut made anew (lease TTL 2 s, then etcd's watch)."""


@attrs.frozen
class HostTarget:
    """A host the faults may hit (``name``: its role)."""

    name: str
    host: str
    kinds: tuple[str, ...]
    proxies: tuple[BedProxy, ...] = ()
    """The fault proxies in front of its HTTP and KV ports (prefills only)."""


@attrs.define
class Record:
    """What the phases saw, besides the clients' tally."""

    cuts: list[Cut] = attrs.field(factory=list)
    roster: list[Presence] = attrs.field(factory=list)
    health: list[HealthSample] = attrs.field(factory=list)
    health_errors: int = 0
    phases: list[dict[str, Any]] = attrs.field(factory=list)


# --- faults -----------------------------------------------------------------------------


def _kinds(*names: str) -> tuple[str, ...]:
    nft = nft_unavailable() is None
    return tuple(name for name in names if nft or name not in NFT_FAULTS)


async def _hold(apply: Callable[[], Any], clear: Callable[[], Any], hold: float) -> None:
    """``apply`` (in a thread), ``hold`` seconds, then ``clear``, also when cancelled."""
    await trio.to_thread.run_sync(apply)
    try:
        await trio.sleep(hold)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(clear)


async def _host_fault(
    kind: str, rng: random.Random, bed: Bed, target: HostTarget, record: Record
) -> None:
    """One fault on ``target``, held a while, then cleared (also when cancelled)."""
    host = target.host
    hold = rng.uniform(0.5, 3.0)  # a cut past link_timeout_s, or not
    began = trio.current_time()
    try:
        if kind in CUTS:
            await _hold(lambda: bed.partition(host, CUTS[kind]), lambda: bed.heal(host), hold)
        elif kind == "flap":
            until = trio.current_time() + rng.uniform(2.0, 4.0)
            while trio.current_time() < until:
                await _hold(lambda: bed.partition(host, "link"), lambda: bed.heal(host), 0.3)
                await trio.sleep(0.7)
        elif kind == "kv_cut":
            port = HOST_KV_PORT + 1  # what decode dials: the proxy's
            await _hold(lambda: bed.cut_port(host, port), lambda: bed.heal_port(host), hold)
        else:
            kv_proxy = target.proxies[1]
            if kind == "kv_stall" and rng.random() < 0.25:
                hold = KV_LEASE_S + 1.0  # the pull it held finds its lease gone
            command = {
                "kv_stall": "stall on",
                "kv_refuse": "refuse on",
                "kv_reset_after": f"reset-after {rng.randint(1, 400)}",
            }[kind]
            await _hold(lambda: kv_proxy.control(command), lambda: kv_proxy.control("clear"), hold)
    finally:
        if kind in CUTS or kind == "flap":
            # only a host cut off counts against /health (a KV port's cut leaves its link)
            record.cuts.append(Cut(host, began, trio.current_time(), steady=kind != "flap"))


async def _random_faults(
    rng: random.Random,
    settings: Settings,
    bed: Bed,
    targets: list[HostTarget],
    until: float,
    tally: Tally,
    record: Record,
    at_once: int,
) -> None:
    """Faults on ``targets`` at random moments until ``until``, at most ``at_once`` at a time."""
    busy: set[int] = set()

    async def apply(kind: str, index: int) -> None:
        began = trio.current_time()
        target = targets[index]
        try:
            await _host_fault(kind, rng, bed, target, record)
        finally:
            busy.discard(index)
            tally.fault_windows.setdefault(index, []).append((began, trio.current_time()))
            target_name = "prefill KV" if kind.startswith("kv_") else target.name
            label = f"{target.host} {kind}"
            kind_class = soak_goals.fault_kind(target_name, kind)
            tally.spans.append(FaultSpan(label, kind_class, began, trio.current_time()))

    async with trio.open_nursery() as nursery:
        while True:
            await trio.sleep(rng.uniform(*settings.fault_gap_s))
            if trio.current_time() >= until:
                break
            free = [i for i in range(len(targets)) if i not in busy]
            if not free or len(busy) >= at_once:
                continue
            index = rng.choice(free)
            kind = rng.choice(targets[index].kinds)
            busy.add(index)
            tally.faults[f"{kind} {targets[index].host}"] += 1
            nursery.start_soon(apply, kind, index)


# --- the cluster's state ------------------------------------------------------------------


async def _health_sampler(http: httpx.AsyncClient, router: Service, record: Record) -> None:
    while True:
        try:
            health = (await http.get(f"{router.url}/health", timeout=2.0)).json()
            record.health.append(
                HealthSample(
                    trio.current_time(),
                    health["prefill_instances"],
                    health["decode_instances"],
                    bool(health["discovery"]["connected"]),
                )
            )
        except (httpx.HTTPError, ValueError, KeyError):
            record.health_errors += 1
        await trio.sleep(HEALTH_EVERY_S)


async def _wait_for(
    http: httpx.AsyncClient, router: Service, within_s: float, prefills: int, decodes: int
) -> bool:
    with trio.move_on_after(within_s):
        while True:
            try:
                health = (await http.get(f"{router.url}/health")).json()
                if (
                    health["prefill_instances"] == prefills
                    and health["decode_instances"] == decodes
                    and health["active_requests"] == 0
                ):
                    return True
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            await trio.sleep(0.1)
    return False


# --- the phases ---------------------------------------------------------------------------


@attrs.frozen
class Phase:
    """One phase: ``faults`` runs beside the clients until the phase's end."""

    name: str
    faults: Callable[[float], Awaitable[None]]


async def _run_phase(
    phase: Phase,
    settings: Settings,
    rng: random.Random,
    address: tuple[str, int],
    tally: Tally,
    length_s: float,
) -> tuple[float, float]:
    """The clients and the phase's faults for ``length_s``; its start and end."""
    started = trio.current_time()
    until = started + length_s
    with trio.CancelScope(deadline=until + settings.hang_bound_s):
        async with trio.open_nursery() as load:
            load.start_soon(phase.faults, until)
            for _ in range(settings.clients):
                seed = rng.randrange(2**32)
                load.start_soon(_client, address, random.Random(seed), settings, until, tally)
    return started, trio.current_time()


async def _steady(bed: Bed, proxies: list[BedProxy], tally: Tally, until: float) -> None:
    """50 ms on every prefill's HTTP and KV port and 2 % loss on every link, until ``until``."""
    began = trio.current_time()
    loss = nft_unavailable() is None
    try:
        for proxy in proxies:
            await trio.to_thread.run_sync(proxy.control, f"latency {LATENCY_MS}")
        if loss:
            await trio.to_thread.run_sync(bed.set_loss, LOSS_PERCENT)
        await trio.sleep_until(until)
    finally:
        with trio.CancelScope(shield=True):
            for proxy in proxies:
                await trio.to_thread.run_sync(proxy.control, "clear")
            await trio.to_thread.run_sync(bed.set_loss, 0)
            ended = trio.current_time()
            tally.faults["latency prefills"] += 1
            tally.spans.append(FaultSpan("prefills latency 50ms", soak_goals.SLOW, began, ended))
            if loss:
                tally.faults["loss switch"] += 1
                tally.spans.append(FaultSpan("network loss 2%", soak_goals.SLOW, began, ended))


@attrs.frozen
class Cluster:
    procs: Processes
    bed: Bed
    router: Service
    workers: list[Service]
    proxies: dict[str, tuple[BedProxy, ...]]
    tmp: Path


async def _start_corrupting_decode(cluster: Cluster) -> Service:
    def start() -> Service:
        bed = cluster.bed
        process = cluster.procs.start(
            bed.command(CORRUPTING_HOST, worker_command(_host_worker_config(bed, CORRUPTING_HOST))),
            env={"UCX_TLS": "tcp"},
            stdin=True,
            output="lines",
        )
        return cluster.procs.wait_ready(process, host=bed.address(CORRUPTING_HOST))

    return await trio.to_thread.run_sync(start)


async def _phases(
    cluster: Cluster, settings: Settings, http: httpx.AsyncClient, tally: Tally, record: Record
) -> dict[str, Any]:
    """Each phase, then its checks; what the whole soak needs to know of them."""
    rng = random.Random(settings.seed)
    bed, router = cluster.bed, cluster.router
    address = (bed.address("router"), ROUTER_PORT)
    length_s = settings.seconds / 2
    prefill_targets = [
        HostTarget("prefill", host, _kinds(*PARTITION_FAULTS), cluster.proxies[host])
        for host in PREFILL_HOSTS
    ]
    partition_targets = [
        *prefill_targets,
        *(HostTarget("decode", host, _kinds(*PARTITION_FAULTS)) for host in DECODE_HOSTS),
        HostTarget("etcd", "etcd", _kinds(*CUTS)),
    ]
    kv_targets = [attrs.evolve(t, kinds=_kinds(*KV_FAULTS)) for t in prefill_targets]
    every_proxy = [p for group in cluster.proxies.values() for p in group]
    extra: dict[str, Any] = {"corrupting_decode": None}

    def random_faults(
        targets: list[HostTarget], at_once: int
    ) -> Callable[[float], Awaitable[None]]:
        async def run(until: float) -> None:
            await _random_faults(rng, settings, bed, targets, until, tally, record, at_once)

        return run

    async def nothing(until: float) -> None:
        await trio.sleep_until(until)

    async def steady(until: float) -> None:
        await _steady(
            bed, [*cluster.proxies["prefill"], *cluster.proxies["prefill2"]], tally, until
        )

    phases = [
        Phase("clean", nothing),
        Phase(soak_goals.KV_PATH, random_faults(kv_targets, at_once=1)),
        Phase(
            soak_goals.PARTITION, random_faults(partition_targets, at_once=len(partition_targets))
        ),
        Phase(soak_goals.SLOW, steady),
        Phase(CLEAN_AGAIN, nothing),
    ]
    for phase in phases:
        decodes = 2
        corrupting: Service | None = None
        if phase.name == soak_goals.KV_PATH:
            # in the roster from its start: the router may count it as soon as it registers
            joined = trio.current_time()
            record.roster.append(Presence(CORRUPTING_HOST, "decode", joined, 0.0, faulty=True))
            corrupting = await _start_corrupting_decode(cluster)
            decodes = 3
            if not await _wait_for(http, router, 30, 2, decodes):
                raise RuntimeError("the router never saw decode3")
        started, ended = await _run_phase(phase, settings, rng, address, tally, length_s)
        if corrupting is not None:
            tally.spans.append(
                FaultSpan(f"{CORRUPTING_HOST} corrupt", soak_goals.KV_PATH, started, ended)
            )
            extra["kv_digest"] = await _digest_figures(http, [corrupting, *_decodes(cluster)])
            stopped = await trio.to_thread.run_sync(_stop_all, cluster.procs, [corrupting])
            # gone once its process has exited (it drains, still registered, until then)
            record.roster[-1] = attrs.evolve(record.roster[-1], ended=trio.current_time())
            extra["corrupting_decode"] = stopped
        with trio.CancelScope(shield=True):  # every fault cleared, whatever happened
            await trio.to_thread.run_sync(bed.heal_all)
            for proxy in every_proxy:
                await trio.to_thread.run_sync(proxy.control, "clear")
        healthy = await _wait_for(http, router, 30, 2, 2)
        leaks = await _leaks(http, router, cluster.workers, KV_LEASE_S * 2 + 10)
        record.phases.append(
            {
                "phase": phase.name,
                "began": started,
                "ended": ended,
                "healthy_after": healthy,
                "leaks": leaks,
                "leaked_blocks": sum(
                    held.get("kv_blocks_in_use", 0)
                    for held in leaks.values()
                    if isinstance(held, dict)
                ),
            }
        )
    return extra


def _decodes(cluster: Cluster) -> list[Service]:
    return [w for w in cluster.workers if w.ready["role"] == "decode"]


async def _soak_hosts(cluster: Cluster, settings: Settings) -> dict[str, Any]:
    """The soak's phases, probes and checks, from the client host (this thread is in it)."""
    tally, record = Tally(), Record()
    result: dict[str, Any] = {}
    router = cluster.router
    limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
    async with httpx.AsyncClient(timeout=30, limits=limits, trust_env=False) as http:
        if not await _wait_for(http, router, 60, 2, 2):
            raise RuntimeError("the router never saw all four workers in etcd")
        address = (cluster.bed.address("router"), ROUTER_PORT)
        async with trio.open_nursery() as warmup:
            for i in range(16):
                warmup.start_soon(_one_request, address, random.Random(i), settings, Tally())
        result["router_rss_start_mb"] = _rss_mb(router)
        began = trio.current_time()
        record.roster += [
            Presence(host, host.rstrip("0123456789"), began, float("inf"))
            for host in (*PREFILL_HOSTS, *DECODE_HOSTS)
        ]
        async with trio.open_nursery() as watching:
            watching.start_soon(_health_sampler, http, router, record)
            result.update(await _phases(cluster, settings, http, tally, record))
            watching.cancel_scope.cancel()
        result["soak_s"] = trio.current_time() - began
        result["healthy_again"] = all(phase["healthy_after"] for phase in record.phases)
        times, probe_failures = [], 0
        for _ in range(settings.probes):
            probe = None
            with trio.move_on_after(15.0):
                probe = await _probe(http, address, _decodes(cluster))
            if probe is None:
                probe_failures += 1
            else:
                times.append(probe)
        result["leaks"] = await _leaks(http, router, cluster.workers, KV_LEASE_S * 2 + 10)
        for phase in record.phases:
            result["leaks"].update(
                {f"after {phase['phase']}: {k}": v for k, v in phase["leaks"].items()}
            )
        prefills = [w for w in cluster.workers if w.ready["role"] == "prefill"]
        result["kv_leases_expired"] = sum(
            [(await _stats(http, p)).get("kv_leases_expired", 0) for p in prefills]
        )
        pulls: Counter[str] = Counter()
        for decode in _decodes(cluster):
            info = (await http.get(f"{decode.url}/pd/info")).json()
            pulls.update(info["kv_transport"]["pulls"])
        result["kv_pulls"] = dict(pulls)
    result["router_rss_end_mb"] = _rss_mb(router)
    result["processes"] = await trio.to_thread.run_sync(
        lambda: _stop_all(cluster.procs, [router, *cluster.workers])
    )
    router_output = cluster.procs.output(router.process)
    if result.get("corrupting_decode"):
        processes, corrupting = result["processes"], result.pop("corrupting_decode")
        processes["exit_statuses"].update(corrupting["exit_statuses"])
        processes["left_behind"] += corrupting["left_behind"]
    result.update(
        outcomes=dict(tally.outcomes),
        unexplained_outcomes=_unexplained(tally.outcomes),
        requests=sum(tally.outcomes.values()),
        faults=dict(sorted(tally.faults.items())),
        faults_total=sum(tally.faults.values()),
        hung=tally.hung,
        longest_request_s=tally.longest_s,
        samples=tally.samples,
        causes=dict(tally.causes.most_common()),
        **_accounting(tally, record, router_output, result),
        router_warnings=_warnings(router_output),
        probes=len(times),
        probe_failures=probe_failures,
        disconnect_to_free_p50_ms=percentile(times, 50) * 1000,
        disconnect_to_free_p99_ms=percentile(times, 99) * 1000,
        disconnect_to_free_max_ms=max(times, default=float("nan")) * 1000,
    )
    return result


_NUMBERS = re.compile(r"[0-9]+(?:\.[0-9]+)?")
_IDS = re.compile(r"\b(?:chat)?cmpl-[0-9a-f]+(?:-m[0-9]+)?")


def _warnings(router_output: bytes) -> dict[str, int]:
    """The router's WARNING and ERROR lines by message (numbers and request ids elided)."""
    found: Counter[str] = Counter()
    for line in router_output.decode(errors="replace").splitlines():
        for level in (" WARNING ", " ERROR "):
            if level in line:
                message = line.split(level, 1)[1]
                found[level.strip() + " " + _NUMBERS.sub("N", _IDS.sub("<request>", message))] += 1
    return dict(found.most_common(20))


def _in_phase(tally: Tally, phase: dict[str, Any]) -> list[soak_goals.RequestRecord]:
    return [r for r in tally.records if phase["began"] <= r.began <= phase["ended"]]


def _accounting(
    tally: Tally, record: Record, router_output: bytes, result: dict[str, Any]
) -> dict[str, Any]:
    """The per-phase and per-fault tables, /health's truth, and the goals, each met or not."""
    migrated = soak_goals.migrated_request_ids(router_output)
    phases = []
    # the baseline: both clean phases (the first meets every peer for the first time)
    clean = [
        r for p in record.phases if p["phase"].startswith("clean") for r in _in_phase(tally, p)
    ]
    leaked_by_label: dict[str, int] = {}
    for phase in record.phases:
        records = _in_phase(tally, phase)
        row = soak_goals.Row()
        for request in records:
            row.add(request, request.request_id in migrated)
        phases.append(
            {
                "phase": phase["phase"],
                **attrs.asdict(row),
                "leaked": phase["leaked_blocks"],
                **soak_goals.latency_against(records, clean),
            }
        )
        for span in tally.spans:
            if phase["began"] <= span.began <= phase["ended"]:
                leaked_by_label[span.label] = phase["leaked_blocks"]
    lies = soak_goals.health_lies(
        record.health,
        record.roster,
        record.cuts,
        down_after_s=HEALTH_DOWN_AFTER_S,
        up_after_s=HEALTH_UP_AFTER_S,
    )
    accounted = soak_accounting(
        tally,
        router_output,
        result,
        judged=(soak_goals.KV_PATH, soak_goals.PARTITION, soak_goals.SLOW),
    )
    accounted["goals"].append(
        {
            "goal": f"/health tells the truth ({len(lies)} of {len(record.health)} samples "
            f"wrong, {record.health_errors} unanswered)",
            "met": not lies and not record.health_errors,
        }
    )
    return {
        **accounted,
        "per_fault_leaked": leaked_by_label,
        "per_phase": phases,
        "health": {"samples": len(record.health), "lies": lies[:20], "lies_total": len(lies)},
    }


def _host_worker_config(bed: Bed, host: str) -> dict[str, Any]:
    role = host.rstrip("0123456789")
    config: dict[str, Any] = {
        **synthetic_worker_config(role, decode_step_s=DECODE_STEP_S),
        "instance_id": host,
        "host": bed.address(host),
        "port": HOST_PORT,
        "transfer_port": HOST_KV_PORT,
        "kv_lease_s": KV_LEASE_S,
        # NIXL, over UCX's TCP transport (UCX_TLS=tcp below): KV crosses the bed's links
        "kv_transport": "nixl",
        "discovery": {
            "etcd_endpoints": [f"http://{bed.address('etcd')}:{ETCD_PORT}"],
            "lease_ttl_s": HOST_LEASE_TTL_S,
            "etcd_timeout_s": 1.0,
        },
    }
    if host == CORRUPTING_HOST:
        config["faults"] = {"kv_transfer_corrupt": True}
    if role == "prefill":
        config["advertise_port"] = HOST_PORT + 1
        config["advertise_transfer_port"] = HOST_KV_PORT + 1
    return config


def run_on_hosts(settings: Settings) -> dict[str, Any]:
    """The soak with each process on its own address (a :class:`~pdtrio.testing.netns.Bed`):
    router, two prefills, two decodes (a third for the KV phase) and etcd; the clients on a
    host of their own."""
    reason = bed_unavailable()
    if reason is not None:
        raise SystemExit(f"--hosts: no multi-host bed here: {reason}")
    hosts = ("router", *PREFILL_HOSTS, *DECODE_HOSTS, CORRUPTING_HOST, "etcd", "client")
    with (
        tempfile.TemporaryDirectory() as tmp,
        Bed(hosts) as bed,
        Processes(stop_grace_s=30) as procs,
    ):
        made = bed.namespaces()
        bed.start_etcd(procs, "etcd", Path(tmp) / "etcd", port=ETCD_PORT)
        proxies = {
            host: tuple(
                bed.start_proxy(procs, host, port + 1, port, control_port=9000 + i)
                for i, port in enumerate((HOST_PORT, HOST_KV_PORT))
            )
            for host in PREFILL_HOSTS
        }
        started = {
            host: procs.start(
                bed.command(host, worker_command(_host_worker_config(bed, host))),
                env={"UCX_TLS": "tcp"},
                stdin=True,
                output="lines",
            )
            for host in (*PREFILL_HOSTS, *DECODE_HOSTS)
        }
        workers = [
            procs.wait_ready(process, host=bed.address(host)) for host, process in started.items()
        ]
        config = Path(tmp) / "router.toml"
        config.write_text(
            "[discovery]\n"
            f'etcd_endpoints = ["http://{bed.address("etcd")}:{ETCD_PORT}"]\n'
            "etcd_timeout_s = 1.0\n"
            "[router]\n"
            f"link_timeout_s = {LINK_TIMEOUT_S}\n"
            "link_heartbeat_s = 0.5\n"
            "request_timeout_s = 120.0\n"
        )
        bind = f"{bed.address('router')}:{ROUTER_PORT}"
        process = procs.start(
            bed.command("router", router_command(bind)),
            env={"PDTRIO_CONFIG": str(config)},
            output="capture",
        )
        router = Service(process, f"http://{bind}")
        cluster = Cluster(procs, bed, router, workers, proxies, Path(tmp))
        with bed.inside("client"):  # the clients' sockets, and trio's threads, are the client's
            result = trio.run(_soak_hosts, cluster, settings)
    result["bed"] = {
        "hosts": {host: bed.address(host) for host in hosts},
        "namespaces_left": sorted(set(made) & set(list_namespaces())),
        "nft": nft_unavailable() or "yes",
    }
    result["settings"] = attrs.asdict(settings)
    return result


def render_phases(r: dict[str, Any]) -> list[str]:
    head = (
        f"    {'phase':14} {'requests':>8} {'done':>6} {'migr':>5} {'failed':>6} {'cut':>4} "
        f"{'wrong':>5} {'leaked':>6}  {'TTFT p50':>9} {'(x clean)':>9}  {'TPOT p50':>9} {'(x clean)':>9}"
    )
    lines = ["  per phase (TTFT/TPOT: streams read at full speed)", head]
    for p in r["per_phase"]:
        lines.append(
            f"    {p['phase']:14} {p['requests']:8d} {p['completed']:6d} {p['migrated']:5d} "
            f"{p['failed']:6d} {p['cut']:4d} {p['wrong']:5d} {p['leaked']:6d}  "
            f"{p['ttft_p50_ms']:7.1f}ms {p['ttft_p50_ratio']:8.2f}x  "
            f"{p['tpot_p50_ms']:7.2f}ms {p['tpot_p50_ratio']:8.2f}x"
        )
    health = r["health"]
    lines.append(
        f"  /health              {health['samples']} samples, {health['lies_total']} untrue"
        + (f": {health['lies'][:3]}" if health["lies"] else "")
    )
    return lines
