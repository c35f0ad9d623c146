"""``pdtrio register``: a vLLM or SGLang engine in etcd, for as long as its ``/health`` answers.

It runs beside an engine that does not speak etcd, so routers that watch the
deployment's prefix (``[discovery] kind = "vllm"``) find it as they find pdtrio
workers: it waits until the engine's ``/health`` answers 200, learns the served
model from ``/v1/models`` (unless ``--model`` names it), then registers an
:class:`~pdtrio.protocol.link.registration.EngineRegistration` under a lease and
keeps the lease alive (``pdtrio.discovery.worker_registration``, as a worker
does).  It keeps probing ``/health``: after ``--health-failures`` failures in a
row it deregisters (revokes the lease, so the key goes at once) until the engine
answers again.  SIGTERM or SIGINT: deregister, exit 0.  If it is killed, the key
goes when the lease expires.

With the deployment's worker secret the entry is signed, as a worker's is
(routers with the secret use only signed entries).  The engine's API key only
opens its ``/v1/models`` here; it is never written to etcd: routers send the key
of their own configuration (``[security] engine_api_key``).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn, cast, final
from urllib.parse import urlsplit

import attrs
import httpx
import trio

from pdtrio.config import ConfigError, DiscoveryConfig, Role, etcd_endpoints_from
from pdtrio.discovery.etcd import ETCD_PASSWORD_ENV, etcd_tls_context, resolve_etcd_password
from pdtrio.discovery.worker_registration import keep_registered
from pdtrio.logs import (
    DEFAULT_LOG_FORMAT,
    DEFAULT_LOG_LEVEL,
    LOG_FORMAT_ENV,
    LOG_FORMATS,
    LOG_LEVEL_ENV,
    LOG_LEVELS,
    LogSettingError,
    configure_logging,
    parse_format,
    parse_level,
)
from pdtrio.protocol.link.registration import (
    EngineKind,
    EngineRegistration,
    RegistrationError,
    check_base_url,
    registration_key,
)
from pdtrio.protocol.openai import listed_models
from pdtrio.security import (
    ENGINE_API_KEY_ENV,
    WORKER_SECRET_ENV,
    derive_key,
    resolve_secret,
    resolve_worker_secret,
    system_tls_context,
)

log = logging.getLogger("pdtrio.register")

_DISCOVERY_DEFAULTS = DiscoveryConfig()
_NAME_MAX = 256


@final
@attrs.frozen(kw_only=True)
class EngineToRegister:
    """The engine, where to register it, and how to watch it."""

    kind: EngineKind
    role: Role
    url: str
    instance_id: str
    model: str  # "": the first of its /v1/models
    bootstrap_port: int
    api_key: str = attrs.field(repr=False)
    signing_key: bytes | None = attrs.field(repr=False)
    discovery: DiscoveryConfig
    health_interval_s: float
    health_failures: int
    health_timeout_s: float

    @property
    def key(self) -> str:
        return registration_key(self.discovery.prefix, self.instance_id)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def registration(self, model: str) -> EngineRegistration:
        return EngineRegistration(
            instance_id=self.instance_id,
            kind=self.kind,
            role=self.role,
            url=self.url,
            model=model,
            bootstrap_port=self.bootstrap_port,
        )


# --- the command line -------------------------------------------------------------------


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port (1..65535), got {text}")
    return value


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdtrio register",
        description=(
            "Register a vLLM or SGLang engine in etcd while its /health answers, so pdtrio "
            "routers with etcd discovery ([discovery] kind = the engine's kind) front it. "
            "Run one beside each engine; SIGTERM or SIGINT deregisters it and exits."
        ),
    )
    add = parser.add_argument
    add("--kind", required=True, choices=("vllm", "sglang"), help="the engine (required)")
    add(
        "--role",
        required=True,
        choices=("prefill", "decode", "both"),
        help="what routers use it for (required)",
    )
    add(
        "--url",
        required=True,
        help="the engine's HTTP base URL as routers reach it, e.g. http://10.0.0.5:8100 (required)",
    )
    add(
        "--etcd",
        metavar="ENDPOINTS",
        help="etcd client URLs, comma-separated (env PDTRIO_ETCD_ENDPOINTS; required)",
    )
    add(
        "--prefix",
        default=_DISCOVERY_DEFAULTS.prefix,
        help="the deployment's key prefix, as the routers' [discovery] prefix "
        f"(default: {_DISCOVERY_DEFAULTS.prefix})",
    )
    add(
        "--instance-id",
        default="",
        help="its name in etcd; the key is the prefix and this (default: kind-role-host-port)",
    )
    add(
        "--model",
        default="",
        help="the served model name clients ask for (default: the first of its /v1/models)",
    )
    add(
        "--bootstrap-port",
        type=_port,
        default=0,
        help="an SGLang prefill's --disaggregation-bootstrap-port (required for an SGLang "
        "prefill or both; default: none)",
    )
    add(
        "--api-key",
        default="",
        help=f"the engine's --api-key, to read its /v1/models; never written to etcd (routers "
        f"have theirs: [security] engine_api_key); prefer env {ENGINE_API_KEY_ENV} or "
        "--api-key-file: a flag shows in ps (default: none)",
    )
    add("--api-key-file", default="", help="a file holding the engine's API key (default: none)")
    add(
        "--worker-secret",
        default="",
        help=f"the deployment's worker secret: the entry is signed with a key derived from it, "
        f"as workers' are; prefer env {WORKER_SECRET_ENV} or --worker-secret-file "
        "(default: none, unsigned)",
    )
    add(
        "--worker-secret-file",
        default="",
        help="a file holding the worker secret (default: none)",
    )
    add(
        "--health-interval-s",
        type=_positive_float,
        default=2.0,
        help="how often the engine's /health is asked (default: 2.0)",
    )
    add(
        "--health-failures",
        type=_positive_int,
        default=3,
        help="failed /health probes in a row that deregister it until it answers again "
        "(default: 3)",
    )
    add(
        "--health-timeout-s",
        type=_positive_float,
        default=5.0,
        help="how long one /health probe may take (default: 5.0)",
    )
    add(
        "--lease-ttl-s",
        type=_positive_int,
        default=_DISCOVERY_DEFAULTS.lease_ttl_s,
        help="the registration's lease: killed without deregistering, the engine leaves "
        f"routing this long after (default: {_DISCOVERY_DEFAULTS.lease_ttl_s})",
    )
    add("--etcd-username", default="", help="etcd's own authentication: the user (default: none)")
    add(
        "--etcd-password-file",
        default="",
        help=f"a file holding that user's password (or env {ETCD_PASSWORD_ENV}; default: none)",
    )
    add("--etcd-ca-file", default="", help="the CA of https etcd endpoints (default: the system's)")
    add("--etcd-cert-file", default="", help="a client certificate for etcd (default: none)")
    add("--etcd-key-file", default="", help="its private key (default: none)")
    add(
        "--log-level",
        choices=LOG_LEVELS,
        type=str.upper,
        default=None,
        help=f"log lines at this level and above (env {LOG_LEVEL_ENV}; "
        f"default: {DEFAULT_LOG_LEVEL})",
    )
    add(
        "--log-format",
        choices=LOG_FORMATS,
        default=None,
        help=f"text, or json (env {LOG_FORMAT_ENV}; default: {DEFAULT_LOG_FORMAT})",
    )
    return parser


def engine_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> EngineToRegister:
    """What the flags (and environment) say; ConfigError for what cannot be right."""
    endpoints = (
        etcd_endpoints_from({"PDTRIO_ETCD_ENDPOINTS": args.etcd})
        if args.etcd is not None
        else etcd_endpoints_from(dict(environ))
    )
    if not endpoints:
        raise ConfigError("no etcd to register at: give --etcd or set PDTRIO_ETCD_ENDPOINTS")
    url = args.url.rstrip("/")
    try:
        check_base_url(url)
    except RegistrationError as exc:
        raise ConfigError(f"--url: {exc}") from None
    if args.kind == "sglang" and args.role != "decode" and not args.bootstrap_port:
        raise ConfigError(
            "an SGLang prefill needs --bootstrap-port (its --disaggregation-bootstrap-port, "
            "which decode dials for the KV)"
        )
    if args.kind != "sglang" and args.bootstrap_port:
        raise ConfigError("--bootstrap-port is SGLang's (--kind sglang)")
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    instance_id = args.instance_id or f"{args.kind}-{args.role}-{parts.hostname}-{port}"
    if len(instance_id) > _NAME_MAX or not instance_id.isprintable():
        raise ConfigError(f"--instance-id {instance_id[:40]!r}: printable, at most 256 characters")
    if len(args.model) > _NAME_MAX or not args.model.isprintable():
        raise ConfigError("--model: printable, at most 256 characters")
    try:
        discovery = DiscoveryConfig(
            etcd_endpoints=endpoints,
            prefix=args.prefix,
            lease_ttl_s=args.lease_ttl_s,
            etcd_username=args.etcd_username,
            etcd_password_file=args.etcd_password_file,
            etcd_ca_file=args.etcd_ca_file,
            etcd_cert_file=args.etcd_cert_file,
            etcd_key_file=args.etcd_key_file,
        )
    except ValueError as exc:
        # (a validator's own words: its traceback is the validator's)
        raise ConfigError(f"--etcd: {exc}") from None
    # what the etcd client reads when it starts, read now: a file that cannot be is said here
    resolve_etcd_password("", args.etcd_password_file, environ)
    etcd_tls_context(args.etcd_ca_file, args.etcd_cert_file, args.etcd_key_file)
    secret = resolve_worker_secret(args.worker_secret, args.worker_secret_file, environ)
    return EngineToRegister(
        kind=args.kind,
        role=cast(Role, args.role),  # (argparse's choices)
        url=url,
        instance_id=instance_id,
        model=args.model,
        bootstrap_port=args.bootstrap_port,
        api_key=resolve_secret(
            args.api_key,
            args.api_key_file,
            env_name=ENGINE_API_KEY_ENV,
            what="engine API key",
            environ=environ,
        ),
        signing_key=derive_key(secret, "registration") if secret else None,
        discovery=discovery,
        health_interval_s=args.health_interval_s,
        health_failures=args.health_failures,
        health_timeout_s=args.health_timeout_s,
    )


# --- watching the engine ------------------------------------------------------------------


class _NotServing(Exception):
    """The engine answered, but not as one that serves."""


async def _health_problem(http: httpx.AsyncClient, engine: EngineToRegister) -> str:
    """Why the engine's /health does not answer 200 ("": it does)."""
    try:
        response = await http.get(
            engine.url + "/health", headers=engine.headers(), timeout=engine.health_timeout_s
        )
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if response.status_code != 200:
        return f"/health answered {response.status_code}"
    return ""


async def _until_healthy(http: httpx.AsyncClient, engine: EngineToRegister) -> None:
    said = ""
    while problem := await _health_problem(http, engine):
        if problem != said:  # once per change, not per probe
            log.info("waiting for the engine at %s to answer /health: %s", engine.url, problem)
            said = problem
        await trio.sleep(engine.health_interval_s)


async def _until_unhealthy(http: httpx.AsyncClient, engine: EngineToRegister) -> str:
    """Probe until ``health_failures`` probes in a row fail; the last failure."""
    failures = 0
    while True:
        await trio.sleep(engine.health_interval_s)
        problem = await _health_problem(http, engine)
        if not problem:
            if failures:
                log.info("the engine at %s answers /health again", engine.url)
            failures = 0
            continue
        failures += 1
        if failures >= engine.health_failures:
            return problem
        log.warning(
            "the engine at %s failed /health (%d of %d in a row): %s",
            engine.url,
            failures,
            engine.health_failures,
            problem,
        )


async def _served_model(http: httpx.AsyncClient, engine: EngineToRegister) -> str:
    """The first model of the engine's /v1/models."""
    try:
        response = await http.get(
            engine.url + "/v1/models", headers=engine.headers(), timeout=engine.health_timeout_s
        )
    except httpx.HTTPError as exc:
        raise _NotServing(f"/v1/models: {type(exc).__name__}: {exc}") from exc
    if response.status_code in (401, 403):
        raise _NotServing(
            f"/v1/models answered {response.status_code}: give the engine's --api-key "
            f"({ENGINE_API_KEY_ENV}), or --model"
        )
    if response.status_code != 200:
        raise _NotServing(f"/v1/models answered {response.status_code}")
    try:
        listed = listed_models(response.json())
    except ValueError as exc:
        raise _NotServing(f"/v1/models: {exc}") from exc
    if not listed:
        raise _NotServing(f"/v1/models lists no model: {response.text[:200]!r}")
    return listed[0][0]


async def _model_once_up(http: httpx.AsyncClient, engine: EngineToRegister) -> str:
    if engine.model:
        return engine.model  # (routers check the engine serves it)
    said = ""
    while True:
        try:
            return await _served_model(http, engine)
        except _NotServing as exc:
            if str(exc) != said:
                log.warning("the engine at %s is up, but %s", engine.url, exc)
                said = str(exc)
        await trio.sleep(engine.health_interval_s)
        await _until_healthy(http, engine)


async def keep_engine_registered(http: httpx.AsyncClient, engine: EngineToRegister) -> NoReturn:
    """Registered while the engine answers /health, deregistered while it does not; until
    cancelled (the lease is revoked on the way out)."""
    while True:
        await _until_healthy(http, engine)
        model = await _model_once_up(http, engine)
        log.info(
            "the engine at %s is up (%s %s, model %s): registering it as %s%s",
            engine.url,
            engine.kind,
            engine.role,
            model,
            engine.key,
            "" if engine.signing_key is None else ", signed",
        )
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                functools.partial(
                    keep_registered,
                    engine.discovery,
                    engine.registration(model),
                    stop,
                    signing_key=engine.signing_key,
                    logger=log,
                )
            )
            problem = await _until_unhealthy(http, engine)
            log.warning(
                "the engine at %s failed /health %d times in a row (%s): deregistering it "
                "until it answers again",
                engine.url,
                engine.health_failures,
                problem,
            )
            stop.set()


async def _stop_on_signal(cancel_scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("%s received: deregistering and exiting", signal.Signals(signum).name)
            cancel_scope.cancel()
            return


async def serve(engine: EngineToRegister) -> None:
    """Until SIGTERM or SIGINT."""
    async with (
        httpx.AsyncClient(trust_env=False, verify=system_tls_context()) as http,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(_stop_on_signal, nursery.cancel_scope)
        await keep_engine_registered(http, engine)


def main(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    args: Any = argument_parser().parse_args(list(argv))  # (exits 2 on a bad flag)
    try:
        level = parse_level(args.log_level or environ.get(LOG_LEVEL_ENV) or DEFAULT_LOG_LEVEL)
        fmt = parse_format(args.log_format or environ.get(LOG_FORMAT_ENV) or DEFAULT_LOG_FORMAT)
        engine = engine_from_args(args, environ)
    except (ConfigError, LogSettingError) as exc:
        print(f"pdtrio register: {exc}", file=sys.stderr)
        return 2
    configure_logging(level, fmt, engine.instance_id)
    try:
        trio.run(serve, engine)
    except KeyboardInterrupt:  # (a SIGINT before the signal receiver opened)
        return 0
    return 0
