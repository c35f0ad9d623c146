"""Configuration: frozen attrs classes, loaded by cattrs from TOML.

``PDTRIO_CONFIG=path`` names a TOML file; no file means the embedded default
(one prefill and one decode worker started by the router on loopback).
"""

from __future__ import annotations

import json
import logging
import os
import tomllib
import traceback
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, final

import attrs
import cattrs
from cattrs.v import format_exception, transform_error

from pdtrio.protocol.placement.scheduling import SchedulingPolicy
from pdtrio.protocol.tokens.flush import FlushConfig

Role = Literal["prefill", "decode", "both"]
EngineKind = Literal["synthetic", "torch"]
OmpWaitPolicy = Literal["brief", "passive", "active", ""]
Int4Weights = Literal["auto", "on", "off"]
# what an [[instances]] entry is: a pdtrio worker, or an engine the router fronts
InstanceKind = Literal["pdtrio", "vllm", "sglang"]
ENGINE_KINDS = frozenset({"vllm", "sglang"})
_KIND_NAMES = {"pdtrio": "pdtrio", "vllm": "vLLM", "sglang": "SGLang"}
# how decode pulls KV from prefill: "auto" takes NIXL where it imports and works, else TCP
KvTransportChoice = Literal["nixl", "tcp", "auto"]
# which bytes of each KV block prefill digests and decode checks (pdtrio.kv.digest)
KvDigestCoverage = Literal["sampled", "full", "off"]

# addresses that accept connections on every interface: nobody can dial them
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "", "[::]", "*"})

DEFAULT_MODEL = "smollm2-135m-instruct"


class ConfigError(Exception):
    """The configuration is invalid; the message names the key and the problem."""


def _positive(instance: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


def _non_negative(instance: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


def _cpus(instance: Any, attribute: attrs.Attribute[Any], value: tuple[int, ...]) -> None:
    if any(cpu < 0 for cpu in value):
        raise ValueError(f"{attribute.name} must list CPU numbers >= 0, got {list(value)!r}")


@final
@attrs.frozen(kw_only=True)
class SyntheticEngineConfig:
    """The torch-free engine: deterministic tokens at a configurable pace."""

    prefill_s_per_token: float = attrs.field(default=0.0, validator=_non_negative)
    decode_step_s: float = attrs.field(default=0.005, validator=_non_negative)
    tokens_per_step: int = attrs.field(default=1, validator=_positive)
    max_model_len: int = attrs.field(default=8192, validator=_positive)
    vocab_size: int = attrs.field(default=1000, validator=_positive)


@final
@attrs.frozen(kw_only=True)
class EngineConfig:
    kind: EngineKind = "torch"
    model: str = DEFAULT_MODEL
    # the name clients use in `model`; empty: the model's name (a .gguf path serves under
    # its file name without the extension)
    served_model_name: str = ""
    num_kv_blocks: int = attrs.field(default=1024, validator=_positive)
    block_size: int = attrs.field(default=16, validator=_positive)
    max_batch_size: int = attrs.field(default=32, validator=_positive)
    # tokens computed in one step, decode rows (one each) and prompt chunks together
    # (vLLM's max_num_batched_tokens): a step never grows past it, so running decodes wait
    # at most one such step for the prompts that share it.  512, not vLLM CPU's 2048: on a
    # few CPU cores a step's time grows in proportion with its prompt tokens from a few
    # dozen on, so a larger budget lengthens every decode's step without prefilling faster
    max_num_batched_tokens: int = attrs.field(default=512, validator=_positive)
    # a longer prompt is prefilled this many tokens a step: an abort (its client left) or
    # the running decodes wait one chunk, not the whole prompt.  256, not 128: a later chunk
    # attends over its earlier blocks gathered and masked, which cost more than one causal
    # chunk (SmolLM2, 2-core AVX2 EPYC, float32: a step of 16 second chunks of 128 tokens
    # 3.75 s against 3.35 s for 8 whole 256-token prompts and 3.43 s for 16 first chunks; a
    # 256-token prompt alone 473 ms in one chunk, 2 x 265 ms in two)
    prefill_chunk_tokens: int = attrs.field(default=256, validator=_positive)
    # reuse the KV of full blocks of earlier prompts (pdtrio.engine.prefix_cache): a prompt
    # that begins as an earlier one did computes only the rest (on by default, as in vLLM
    # v1; in bfloat16 a reused prefix's KV may differ in its last bits from a recomputed one)
    prefix_cache: bool = True
    # at most this many blocks cached at once; 0: as many as the KV cache has room for
    prefix_cache_max_blocks: int = attrs.field(default=0, validator=_non_negative)
    # the budget of a request without max_tokens (capped by the context); decode reserves it
    default_max_tokens: int = attrs.field(default=2048, validator=_positive)
    device: str = "cpu"
    # torch engine: the model's and KV cache's dtype; "auto": bfloat16 where the device has
    # fast kernels for it (a GPU, a CPU with AMX or AVX-512 BF16), else float32
    dtype: str = "auto"
    # torch engine on the CPU: every decode row reads 4-bit copies of the layer weights,
    # however many share its step, and a prompt's rows never do; "auto": where the model
    # file stores them in 4 bits (GGUF Q4_1: the copies hold the file's own codes), "on": any
    # model, "off": never
    int4_weights: Int4Weights = "auto"
    seed: int = 0
    # torch engine on the CPU: intra-op threads (0: torch's default, one per core)
    num_threads: int = attrs.field(default=0, validator=_non_negative)
    # how the worker's idle OpenMP threads wait, set before torch is imported (an
    # OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment is kept): "brief" spins 10,000
    # turns (~0.25 ms) then sleeps, "passive" sleeps at once (each of a step's parallel
    # regions then wakes it: slower), "active" spins, "" leaves libgomp's default (spin
    # 300,000 turns, ~5 ms, then sleep)
    omp_wait_policy: OmpWaitPolicy = "brief"
    # the CPUs the worker runs on (sched_setaffinity); empty: every CPU it may use
    cpu_affinity: tuple[int, ...] = attrs.field(default=(), validator=_cpus)
    synthetic: SyntheticEngineConfig = SyntheticEngineConfig()


def _error_status(instance: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if value and not 400 <= value <= 599:
        raise ValueError(f"{attribute.name} must be 0 (off) or 400..599, got {value!r}")


@final
@attrs.frozen(kw_only=True)
class WorkerFaultsConfig:
    """Fault hooks inside a worker (``[faults]``), for testing only: every one is off by default.

    See ``pdtrio.worker.fault_hooks``; the worker logs a WARNING at start when any is on.
    """

    # prefill answers every request with this HTTP status (e.g. 500); 0: off
    prefill_error_status: int = attrs.field(default=0, validator=_error_status)
    # prefill never answers (a release, or the caller giving up, still stops it)
    prefill_hang: bool = False
    # the process exits (os._exit, code 86) on its Nth prefill; 0: off
    prefill_exit_after: int = attrs.field(default=0, validator=_non_negative)
    # the process exits (code 86) when a decoding request reaches this many generated tokens
    decode_exit_at_token: int = attrs.field(default=0, validator=_non_negative)
    # once, at the first token frame: every link of the worker writes nothing, heartbeats
    # included, for this long
    decode_stall_s: float = attrs.field(default=0.0, validator=_non_negative)
    # the links send no heartbeats (an idle link looks hung to the router)
    heartbeats_off: bool = False
    # every KV pull on this (decode) instance fails
    kv_transfer_fail: bool = False
    # every KV pull on this (decode) instance stalls this long inside the pull's deadline
    kv_transfer_stall_s: float = attrs.field(default=0.0, validator=_non_negative)
    # after every KV pull on this (decode) instance, the first byte of each pulled block is
    # flipped: decode's check of what prefill wrote refuses the handoff
    kv_transfer_corrupt: bool = False
    # the worker reports a KV layout with another block size: prefill and decode are refused
    layout_mismatch: bool = False


def _etcd_endpoint(instance: Any, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    for endpoint in value:
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"{attribute.name}: {endpoint!r} is not an http:// or https:// URL")


@final
@attrs.frozen(kw_only=True)
class DiscoveryConfig:
    """Where instances are registered (``[discovery]``): etcd, or nothing (static lists).

    Workers register under ``prefix`` with a lease; routers watch the prefix.
    """

    # etcd's client URLs, e.g. ["http://10.0.0.5:2379"]; empty: no etcd
    etcd_endpoints: tuple[str, ...] = attrs.field(default=(), validator=_etcd_endpoint)
    # every key of a deployment lives under it: routers and workers must agree
    prefix: str = "/pdtrio/instances/"
    # a worker that stops keeping its lease alive leaves routing this long after
    lease_ttl_s: int = attrs.field(default=10, validator=_positive)
    # how long one etcd call may take before etcd counts as unreachable
    etcd_timeout_s: float = attrs.field(default=5.0, validator=_positive)
    # etcd's own authentication: a user (empty: none) and its password (PDTRIO_ETCD_PASSWORD,
    # or a file, over the value)
    etcd_username: str = ""
    etcd_password: str = attrs.field(default="", repr=False)
    etcd_password_file: str = ""
    # client TLS to https endpoints: the CA that signed etcd's certificate (empty: the
    # system's), and the certificate and key shown to an etcd with --client-cert-auth
    etcd_ca_file: str = ""
    etcd_cert_file: str = ""
    etcd_key_file: str = ""
    # the router's: what it finds under the prefix, pdtrio workers or the vLLM or SGLang
    # engines `pdtrio register` registers (a prefill's KV is read by a decode of its own
    # kind, so one router fronts one kind; entries of another are ignored)
    kind: InstanceKind = "pdtrio"

    @property
    def uses_etcd(self) -> bool:
        return bool(self.etcd_endpoints)


def _ratio(instance: Any, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be between 0 and 1, got {value}")


@final
@attrs.frozen(kw_only=True)
class TracingConfig:
    """OpenTelemetry traces (``[tracing]``, and a worker's ``[worker.tracing]``): off unless
    an endpoint is set here or in ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (see ``pdtrio.tracing``)."""

    # the collector's OTLP/HTTP address (http://collector:4318; /v1/traces is added unless
    # the path already ends so); "": the OTEL_* environment decides
    endpoint: str = ""
    # the share of new traces kept (a client's sampled traceparent is always followed);
    # None: OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG, else every trace
    sampler_ratio: float | None = attrs.field(default=None, validator=_ratio)
    # "": OTEL_SERVICE_NAME, else pdtrio-router / pdtrio-worker
    service_name: str = ""


@final
@attrs.frozen(kw_only=True)
class WorkerConfig:
    role: Role = "both"
    # where the worker listens; a wildcard (0.0.0.0, ::) needs advertise_host
    host: str = "127.0.0.1"
    port: int = attrs.field(default=0, validator=_non_negative)
    transfer_port: int = attrs.field(default=0, validator=_non_negative)
    # what others dial: goes into the registration and every KV handle ("": host)
    advertise_host: str = ""
    # the advertised HTTP (control and link) and KV transfer ports (0: the bound ones)
    advertise_port: int = attrs.field(default=0, validator=_non_negative)
    advertise_transfer_port: int = attrs.field(default=0, validator=_non_negative)
    instance_id: str = ""
    kv_lease_s: float = attrs.field(default=30.0, validator=_positive)
    kv_transport: KvTransportChoice = "auto"
    # prefill: what it records of each KV block it writes, for decode to check after the pull
    # ("sampled": a sample of every block's bytes, "full": every byte, "off": nothing)
    kv_digest: KvDigestCoverage = "sampled"
    # on SIGTERM: deregister, refuse new work, let running requests finish this long, exit
    drain_s: float = attrs.field(default=30.0, validator=_non_negative)
    engine: EngineConfig = EngineConfig()
    flush: FlushConfig = FlushConfig()
    faults: WorkerFaultsConfig = WorkerFaultsConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    # the embedded workers take the router's [tracing] when theirs sets no endpoint
    tracing: TracingConfig = TracingConfig()
    # the credential routers and other workers must present (PDTRIO_WORKER_SECRET, or a
    # file); empty: none asked (loopback-only deployments)
    secret: str = attrs.field(default="", repr=False)
    secret_file: str = ""
    # a bearer token for GET /metrics alone (a scraper cannot answer challenges; it can
    # read metrics, nothing else); PDTRIO_METRICS_TOKEN, or a file; empty: the secret's proof
    metrics_token: str = attrs.field(default="", repr=False)
    metrics_token_file: str = ""
    # TLS: the worker serves HTTPS, WSS and its KV port with this certificate (its advertised
    # host must be in it); tls_ca_file verifies the KV ports it pulls from (empty: plain TCP)
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    # open HTTP connections: those on which no request has shown the secret yet (each is
    # closed after 5 s idle), and those on which one has (router links, probes, workers)
    max_unauthenticated_connections: int = attrs.field(default=256, validator=_positive)
    max_authenticated_connections: int = attrs.field(default=512, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.discovery.kind != "pdtrio":
            raise ValueError(
                "discovery.backend is the router's (what it finds in etcd): a pdtrio worker "
                "registers as a pdtrio worker"
            )
        if self.host in WILDCARD_HOSTS and self.advertise_host in ("", *WILDCARD_HOSTS):
            raise ValueError(
                f"host {self.host!r} listens on every interface, so it cannot be dialed: "
                "set advertise_host (--advertise-host, PDTRIO_ADVERTISE_HOST) to the address "
                "routers and other workers reach this worker at"
            )
        if self.advertise_host in WILDCARD_HOSTS - {""}:
            raise ValueError(f"advertise_host {self.advertise_host!r} is a wildcard address")

    @property
    def advertised_host(self) -> str:
        return self.advertise_host or self.host


@final
@attrs.frozen(kw_only=True)
class InstanceConfig:
    """An instance the router talks to, given by its HTTP base URL.

    ``kind`` (``backend`` in a file) says what it is: a pdtrio worker (asked for
    ``/pd/info``, one link),
    or an engine the router fronts over its own HTTP PD protocol (vLLM's KV
    connector protocol, SGLang's bootstrap protocol).
    """

    role: Role
    url: str
    kind: InstanceKind = "pdtrio"
    # an engine's served model name ("": the first of its /v1/models); pdtrio workers say
    # theirs in /pd/info
    model: str = ""
    # the bearer token the engine asks for (vLLM's and SGLang's --api-key); "": none
    api_key: str = attrs.field(default="", repr=False)
    # an SGLang prefill's --disaggregation-bootstrap-port (decode dials it for the KV)
    bootstrap_port: int = attrs.field(default=0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.kind == "pdtrio" and (self.model or self.api_key):
            raise ValueError(
                f'instance {self.url}: model and api_key are for engines (backend "vllm" or '
                '"sglang"); a pdtrio worker reports its model and takes the worker secret'
            )
        if self.bootstrap_port and self.kind != "sglang":
            raise ValueError(f'instance {self.url}: bootstrap_port is SGLang\'s (backend "sglang")')
        if self.kind == "sglang" and self.role != "decode" and not self.bootstrap_port:
            raise ValueError(
                f"instance {self.url}: an SGLang prefill needs bootstrap_port (its "
                "--disaggregation-bootstrap-port, which decode dials for the KV)"
            )


@final
@attrs.frozen(kw_only=True)
class EmbeddedClusterConfig:
    """Workers the router starts itself as child processes on loopback."""

    prefill: int = attrs.field(default=1, validator=_non_negative)
    decode: int = attrs.field(default=1, validator=_non_negative)
    both: int = attrs.field(default=0, validator=_non_negative)
    ready_timeout_s: float = attrs.field(default=300.0, validator=_positive)
    restart_backoff_s: float = attrs.field(default=1.0, validator=_non_negative)
    worker: WorkerConfig = WorkerConfig()


@final
@attrs.frozen(kw_only=True)
class RouterConfig:
    request_timeout_s: float = attrs.field(default=600.0, validator=_positive)
    prefill_timeout_s: float = attrs.field(default=120.0, validator=_positive)
    cleanup_grace_s: float = attrs.field(default=2.0, validator=_positive)
    # a write to a client that has not read for this long (its buffers full) is given up:
    # the router hangs up on the client and the request ends
    client_write_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    max_tokens_limit: int = attrs.field(default=1_000_000, validator=_positive)
    stream_buffer_tokens: int = attrs.field(default=65536, validator=_positive)
    max_request_bytes: int = attrs.field(default=16 * 1024 * 1024, validator=_positive)
    connect_timeout_s: float = attrs.field(default=10.0, validator=_positive)
    # on SIGTERM: how long running requests may finish before they are cut (keep it
    # under hypercorn's --graceful-timeout, which cuts connections without a word)
    drain_s: float = attrs.field(default=10.0, validator=_non_negative)
    # requests waiting for decode KV room (prefilled, no byte sent); beyond it: 429
    admission_queue_limit: int = attrs.field(default=256, validator=_non_negative)
    # load-adaptive egress: under load, each stream's SSE events are spaced by up to
    # this much so one event carries several tokens; 0 sends every token at once
    egress_max_delay_s: float = attrs.field(default=0.05, validator=_non_negative)
    # a prefill instance that fails a request with a 5xx leaves rotation this long (doubling
    # while it keeps failing, up to 30 s); the next request after that tries it again
    instance_backoff_s: float = attrs.field(default=1.0, validator=_positive)
    # a decode request that gets no answer or token for this long (its link alive) is
    # ended with an error: an engine that forgot it; 0 turns it off
    stream_idle_timeout_s: float = attrs.field(default=120.0, validator=_non_negative)
    # a request whose decode is lost after its first token (link lost or timed out, worker
    # dead, DecodeFailed, stalled) continues on another decode, from a new prefill of its
    # prompt and the tokens delivered: at most this many times; 0: it ends with an error
    migration_limit: int = attrs.field(default=3, validator=_non_negative)
    # a request whose decode was lost (before or after its first token) and that finds no
    # other decode connected waits this long for one to connect (a link reset, a worker back
    # from a stop or a restart) before it goes on without (a new prefill, or an error); 0: no wait
    decode_reconnect_wait_s: float = attrs.field(default=5.0, validator=_non_negative)
    # a handoff that no decode could take (every pull failed, or no room within prefill's
    # lease) goes again from a new prefill, before decode's first token: at most this many
    # prefill rounds in all (the first among them); 1: the first failed round ends it
    handoff_attempts: int = attrs.field(default=3, validator=_positive)
    # a request that finds no prefill instance up waits this long for one to connect before
    # its 503; 0: refused at once
    prefill_wait_s: float = attrs.field(default=5.0, validator=_non_negative)
    # a request whose body has not fully arrived this long after its headers gets a 408
    body_read_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    # worker link liveness: a link that brings no frame for link_timeout_s is dropped (its
    # streams fail, the instance leaves rotation until it reconnects); the router asks
    # each worker for a heartbeat every link_heartbeat_s of silence
    link_timeout_s: float = attrs.field(default=1.5, validator=_positive)
    link_heartbeat_s: float = attrs.field(default=0.5, validator=_positive)
    # engine instances (vLLM, SGLang) report no cached blocks: the router remembers which
    # prompt prefixes it sent to each (its approximate prefix index) and weighs them with
    # prefill_cache_weight; an entry older than this counts as evicted on the engine
    engine_prefix_index_ttl_s: float = attrs.field(default=300.0, validator=_positive)
    # an engine whose /health and /metrics do not answer within connect_timeout_s this many
    # reads in a row leaves rotation (busy is not down: a starved API server answers late);
    # a refused connection or a /health other than 200 takes it out at once
    engine_slow_probes_before_down: int = attrs.field(default=3, validator=_positive)
    # at most this many (instance, prefix) entries, the least recently recorded out; 0: off
    engine_prefix_index_max_entries: int = attrs.field(default=65536, validator=_non_negative)
    # which instance gets the next prefill, and which decode (among those with room)
    prefill_policy: SchedulingPolicy = "least_loaded"
    decode_policy: SchedulingPolicy = "least_loaded"
    # cache-aware prefill: with workers' prefix caches on, the instance holding the longest
    # cached prefix of the prompt is chosen while it has fewer than this many prefills in
    # flight more than another (a shorter prefix earns its share); 0: the policy alone
    prefill_cache_weight: float = attrs.field(default=2.0, validator=_non_negative)
    # cache-aware decode: the same trade-off among the decodes with room, by how much of the
    # prompt each holds cached (what it need not pull); 0: the policy alone
    decode_cache_weight: float = attrs.field(default=2.0, validator=_non_negative)
    # conditional disaggregation: when about this many prompt tokens or fewer are not cached
    # on the decode a request would go to (or a `both` instance), that instance prefills it
    # itself and the prefill hop is skipped; 0: always a prefill instance
    local_prefill_max_tokens: int = attrs.field(default=0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.link_heartbeat_s >= self.link_timeout_s:
            raise ValueError(
                f"link_heartbeat_s ({self.link_heartbeat_s!r}) must be below "
                f"link_timeout_s ({self.link_timeout_s!r})"
            )


@final
@attrs.frozen(kw_only=True)
class SecurityConfig:
    """Who may use the router, and the credential it shares with its workers (``[security]``).

    Secrets never appear in logs or reprs; files hold one secret (or one API key
    per line); the environment (``PDTRIO_API_KEYS``, ``PDTRIO_WORKER_SECRET``)
    overrides both.
    """

    # clients must send ``Authorization: Bearer <one of these>``; none: no key asked
    api_keys: tuple[str, ...] = attrs.field(default=(), repr=False)
    api_keys_file: str = ""
    # whether /health and /metrics need a key too (when keys are set)
    protect_health: bool = False
    protect_metrics: bool = False
    # requests running at once: per API key, and in all; beyond: 429 with Retry-After (0: no limit)
    max_concurrent_requests_per_key: int = attrs.field(default=0, validator=_non_negative)
    max_concurrent_requests: int = attrs.field(default=0, validator=_non_negative)
    # the credential every worker endpoint asks for; the embedded cluster makes one per
    # start when none is set
    worker_secret: str = attrs.field(default="", repr=False)
    worker_secret_file: str = ""
    # the CA that signed the workers' certificates: the router then dials them over TLS
    # (https and wss); empty: plain HTTP
    worker_tls_ca_file: str = ""
    # the bearer token the router sends to the vLLM or SGLang engines it finds in etcd
    # (PDTRIO_ENGINE_API_KEY, or a file, over the value; etcd never holds it); "": none
    engine_api_key: str = attrs.field(default="", repr=False)
    engine_api_key_file: str = ""


@final
@attrs.frozen(kw_only=True)
class PdtrioConfig:
    router: RouterConfig = RouterConfig()
    # With ``instances`` empty and no etcd, the router starts the embedded cluster.
    instances: tuple[InstanceConfig, ...] = ()
    embedded: EmbeddedClusterConfig = EmbeddedClusterConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    security: SecurityConfig = SecurityConfig()
    tracing: TracingConfig = TracingConfig()

    def __attrs_post_init__(self) -> None:
        kinds = sorted({instance.kind for instance in self.instances})
        if len(kinds) > 1:
            # KV prefilled by one kind is read only by the same kind: a vLLM prefill's
            # blocks are not in a pdtrio decode's layout, nor in SGLang's
            listed = "; ".join(
                f"{_KIND_NAMES[kind]}: "
                + ", ".join(f"{i.role} {i.url}" for i in self.instances if i.kind == kind)
                for kind in kinds
            )
            raise ValueError(
                f"[[instances]] mixes kinds that cannot pair ({listed}): a prefill's KV is "
                "read only by a decode of its own kind, so one router fronts one kind"
            )
        if kinds and self.discovery.uses_etcd and kinds[0] != self.discovery.kind:
            raise ValueError(
                f"[[instances]] lists {_KIND_NAMES[kinds[0]]} instances but [discovery] backend "
                f"is {self.discovery.kind!r}: the listed instances and those in etcd pair with "
                f'each other, so they are of one backend (set backend = "{kinds[0]}")'
            )
        if kinds and kinds[0] in ENGINE_KINDS and not self.discovery.uses_etcd:
            # (with etcd the missing role may register later: /health says until then)
            name = _KIND_NAMES[kinds[0]]
            if not any(i.role in ("prefill", "both") for i in self.instances):
                raise ValueError(f"[[instances]] lists no {name} prefill (role prefill or both)")
            if not any(i.role in ("decode", "both") for i in self.instances):
                raise ValueError(f"[[instances]] lists no {name} decode (role decode or both)")

    @property
    def uses_embedded_cluster(self) -> bool:
        return not self.instances and not self.discovery.uses_etcd

    @property
    def engine_kind(self) -> InstanceKind | None:
        """The engine kind the router fronts (vLLM, SGLang), or None: pdtrio workers."""
        if self.instances:
            kind = self.instances[0].kind
        else:
            kind = self.discovery.kind if self.discovery.uses_etcd else "pdtrio"
        return kind if kind in ENGINE_KINDS else None


def _converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    return converter


def config_from_dict(
    raw: dict[str, Any], cls: type[Any] = PdtrioConfig, *, file_keys: bool = False
) -> Any:
    """The configuration ``raw`` describes, in the classes' names (the form pdtrio's own
    processes hand each other); ``file_keys``: a problem names its key as a file writes it
    (``worker.worker_secret``, not ``embedded.worker.secret``)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"invalid configuration: expected a table of keys, not {raw!r:.80}")
    try:
        return _converter().structure(raw, cls)
    except cattrs.BaseValidationError as exc:
        if any(_raised_by_our_code(leaf) for leaf in _leaves(exc)):
            raise  # a bug in a class check, not a bad key: every leaf's traceback goes along
        messages = transform_error(exc, path="config", format_exception=_format_exception)
        problems = "; ".join(_describe(m, cls if file_keys else None) for m in messages)
        # the keys and what is wrong with each are all there is to say
        raise ConfigError(f"invalid configuration: {problems}") from None
    except (ValueError, TypeError) as exc:
        if _raised_by_our_code(exc):
            raise
        raise ConfigError(f"invalid configuration: {exc}") from exc


_PACKAGE_DIR = str(Path(__file__).resolve().parent)


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found


def _raised_by_our_code(exc: BaseException) -> bool:
    """Whether pdtrio's own code raised it, other than a check's ValueError (what every
    validator and ``__attrs_post_init__`` raises for a bad value): a TypeError, an
    AttributeError... from a class check is a bug, never the operator's bad key. What
    cattrs and attrs raise for a value of the wrong type comes from their generated code."""
    if isinstance(exc, ValueError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_PACKAGE_DIR)


def _format_exception(exc: BaseException, type_: type | None) -> str:
    # a validator's or a class check's ValueError says what is wrong: keep its words
    if isinstance(exc, ValueError) and type_ is None and str(exc):
        return str(exc)
    return format_exception(exc, type_)


def _describe(message: str, file_keys_of: type[Any] | None = None) -> str:
    # cattrs says "... @ config.engine.port"; turn the path into a key name
    text, _, path = message.partition(" @ ")
    key = path.removeprefix("config.").removeprefix("config") or "(top level)"
    key = key.replace("['", ".").replace("']", "")
    if file_keys_of is not None and key != "(top level)":
        key = _file_key(key, file_keys_of)
    return f"key '{key}': {text}"


def _file_key(key: str, cls: type[Any]) -> str:
    """``embedded.worker.secret`` as a file writes it: ``worker.worker_secret``."""
    written: list[str] = []
    attributes: list[str] = []
    current: type[Any] | None = cls
    for part in key.split("."):
        name, bracket, index = part.partition("[")
        attributes.append(name)
        written.append(file_name(current, name) + bracket + index if current else part)
        current = _nested_class(current, name) if current else None
    if cls is PdtrioConfig and attributes[:2] == ["embedded", "worker"]:
        written = [WORKER_TABLE, *written[2:]]
    return ".".join(written)


def load_config_file(path: str | Path) -> PdtrioConfig:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    config: PdtrioConfig = config_from_dict(from_router_file(raw, str(path)), file_keys=True)
    return config


# --- the names a file writes ------------------------------------------------------------
# One name for one thing across the files, the flags and the environment.  The classes
# keep the previous release's attribute names (pdtrio's own processes hand each other
# the classes' form), and a file written with them still loads for one release, with a
# WARNING naming the new key; a file that gives both is refused.

# attribute -> the key a file writes, per class
FILE_NAMES: dict[type[Any], dict[str, str]] = {
    # what serves: pdtrio workers, vLLM or SGLang (pdtrio serve --backend); `kind` is
    # left to the engine (engine.kind: torch or synthetic)
    DiscoveryConfig: {"kind": "backend"},
    InstanceConfig: {"kind": "backend"},
    # the names [security] gives the same settings on the router's side
    WorkerConfig: {
        "secret": "worker_secret",
        "secret_file": "worker_secret_file",
        "tls_ca_file": "worker_tls_ca_file",
    },
}
# The workers' table: [worker] in the router's file (its embedded workers; the classes'
# embedded.worker) and in the file `pdtrio worker --config` reads.
WORKER_TABLE = "worker"
_OLD_WORKER_TABLE = "embedded.worker"

config_log = logging.getLogger("pdtrio.config")


def _warn(message: str) -> None:
    config_log.warning("%s", message)


def file_name(cls: type[Any], attribute: str) -> str:
    """The key a file writes for ``cls``'s ``attribute``."""
    return FILE_NAMES.get(cls, {}).get(attribute, attribute)


def file_section(path: tuple[str, ...]) -> tuple[str, ...]:
    """Where a file writes the classes' section at ``path`` (PdtrioConfig's attributes)."""
    if path[:2] == ("embedded", "worker"):
        return (WORKER_TABLE, *path[2:])
    return path


def _nested_class(cls: type[Any], attribute: str) -> type[Any] | None:
    """The attrs class of ``cls``'s section ``attribute`` (or of its array's tables)."""
    if not (isinstance(cls, type) and attrs.has(cls)):
        return None
    hint = typing.get_type_hints(cls).get(attribute)
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        hint = args[0]
    return hint if isinstance(hint, type) and attrs.has(hint) else None


def _from_file(table: Any, cls: type[Any], where: str, warn: Callable[[str], None]) -> Any:
    """A file's table in ``cls``'s names: a new key taken, an old one taken with a warning,
    both refused.  Anything not a table is left for the structuring to name."""
    if not isinstance(table, dict):
        return table
    out = dict(table)
    for attribute, name in FILE_NAMES.get(cls, {}).items():
        if attribute in out and name in out:
            raise ConfigError(
                f"invalid configuration: {where}{attribute} and {where}{name} are one "
                f"setting ({where}{attribute} is its old name): keep {where}{name} only"
            )
        if attribute in out:
            warn(f"config key {where}{attribute} is deprecated: use {where}{name}")
        elif name in out:
            out[attribute] = out.pop(name)
    for key, value in out.items():
        nested = _nested_class(cls, key)
        if nested is None:
            continue
        written = file_name(cls, key)
        if isinstance(value, list):
            out[key] = [
                _from_file(item, nested, f"{where}{written}[{i}].", warn)
                for i, item in enumerate(value)
            ]
        else:
            out[key] = _from_file(value, nested, f"{where}{written}.", warn)
    return out


def from_router_file(
    raw: Any, source: str = "the file", warn: Callable[[str], None] = _warn
) -> Any:
    """A router's file (``PDTRIO_CONFIG``, ``--config``) in the classes' names: its
    ``[worker]`` table is the embedded workers' (``embedded.worker``)."""
    if not isinstance(raw, dict):
        return raw
    raw = dict(raw)
    embedded = raw.get("embedded")
    if isinstance(embedded, dict) and "worker" in embedded:
        if WORKER_TABLE in raw:
            raise ConfigError(
                f"invalid configuration: {source} has both [{_OLD_WORKER_TABLE}] and "
                f"[{WORKER_TABLE}], one table ([{_OLD_WORKER_TABLE}] is its old name): keep "
                f"[{WORKER_TABLE}] only"
            )
        warn(
            f"config table [{_OLD_WORKER_TABLE}] in {source} is deprecated: use "
            f"[{WORKER_TABLE}] (the table `pdtrio worker --config` reads too)"
        )
        embedded = dict(embedded)
        raw[WORKER_TABLE] = embedded.pop("worker")
        raw["embedded"] = embedded
    worker = raw.pop(WORKER_TABLE, None)
    converted = _from_file(raw, PdtrioConfig, "", warn)
    if worker is not None:
        embedded = converted.get("embedded", {})
        if isinstance(embedded, dict):
            converted["embedded"] = {
                **embedded,
                "worker": _from_file(worker, WorkerConfig, f"{WORKER_TABLE}.", warn),
            }
    return converted


def from_worker_file(
    raw: dict[str, Any], source: str = "the file", warn: Callable[[str], None] = _warn
) -> dict[str, Any]:
    """The file ``pdtrio worker --config`` reads, in WorkerConfig's names: its ``[worker]``
    table, the same table as in a router's file (the router's own sections, should the
    file be one deployment's whole configuration, are the router's and not read here).
    A file of the previous release, with the worker's keys at its top level, still loads
    for one release, with a warning."""
    if WORKER_TABLE in raw:
        router_sections = {field.name for field in attrs.fields(PdtrioConfig)}
        stray = sorted(key for key in raw if key != WORKER_TABLE and key not in router_sections)
        if stray:
            raise ConfigError(
                f"invalid configuration: {source} has [{WORKER_TABLE}] and also "
                f"{', '.join(stray)} outside it: the worker's keys go under [{WORKER_TABLE}]"
            )
        table = raw[WORKER_TABLE]
        if not isinstance(table, dict):
            raise ConfigError(f"invalid configuration: [{WORKER_TABLE}] in {source} is not a table")
    else:
        table = raw
        if raw:
            warn(
                f"the worker's keys at the top level of {source} are deprecated: put them "
                f"under [{WORKER_TABLE}] (the table a router's file gives its embedded workers)"
            )
    converted: dict[str, Any] = _from_file(table, WorkerConfig, f"{WORKER_TABLE}.", warn)
    return converted


# the whole configuration as JSON: how ``pdtrio serve`` hands its processes what it
# resolved from --config, its flags and the environment (no file to re-read, no pickle)
CONFIG_JSON_ENV = "PDTRIO_CONFIG_JSON"


def config_to_json(config: PdtrioConfig) -> str:
    return json.dumps(_converter().unstructure(config))


def config_from_json(text: str) -> PdtrioConfig:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{CONFIG_JSON_ENV} is not valid JSON: {exc}") from None
    config: PdtrioConfig = config_from_dict(raw)
    return config


def load_config_from_env(environ: dict[str, str] | None = None) -> PdtrioConfig:
    """The router's configuration: ``PDTRIO_CONFIG``'s file (else the default), then
    ``PDTRIO_ETCD_ENDPOINTS`` (comma-separated URLs) over its ``discovery.etcd_endpoints``.

    ``PDTRIO_CONFIG_JSON`` (set by ``pdtrio serve``) is the whole resolved configuration
    and comes before both: nothing else applies over it."""
    environ = dict(os.environ) if environ is None else environ
    inline = environ.get(CONFIG_JSON_ENV)
    if inline:
        return config_from_json(inline)
    path = environ.get("PDTRIO_CONFIG")
    config = load_config_file(path) if path else PdtrioConfig()
    endpoints = etcd_endpoints_from(environ)
    if endpoints:
        try:
            discovery = attrs.evolve(config.discovery, etcd_endpoints=endpoints)
        except ValueError as exc:
            # (a validator's own words: its traceback is the validator's)
            raise ConfigError(f"PDTRIO_ETCD_ENDPOINTS: {exc}") from None
        config = attrs.evolve(config, discovery=discovery)
    return config


def etcd_endpoints_from(environ: dict[str, str]) -> tuple[str, ...]:
    """``PDTRIO_ETCD_ENDPOINTS``: comma-separated etcd client URLs (empty: none)."""
    raw = environ.get("PDTRIO_ETCD_ENDPOINTS", "")
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def worker_config_to_dict(config: WorkerConfig) -> dict[str, Any]:
    unstructured: dict[str, Any] = _converter().unstructure(config)
    return unstructured
