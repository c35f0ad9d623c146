"""``pdtrio serve``: the router, served by hypercorn's trio worker, as an operator runs it.

The configuration is ``--config``'s TOML file (else ``PDTRIO_CONFIG``'s, else the
embedded default), with the flags over it; it reaches the router as
``PDTRIO_CONFIG_JSON``, whole. ``--workers 1`` runs the router in this process
(what ``hypercorn -k trio -w 0`` does: a crash is this process's non-zero exit,
never a master's 0); ``--workers N`` supervises N processes (``supervisor``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, Final

import attrs

from pdtrio.config import (
    CONFIG_JSON_ENV,
    ENGINE_KINDS,
    ConfigError,
    PdtrioConfig,
    config_from_dict,
    config_to_json,
    etcd_endpoints_from,
    load_config_file,
)
from pdtrio.discovery.etcd import ETCD_PASSWORD_ENV
from pdtrio.logs import (
    DEFAULT_LOG_FORMAT,
    DEFAULT_LOG_LEVEL,
    LOG_FORMAT_ENV,
    LOG_FORMATS,
    LOG_LEVEL_ENV,
    LOG_LEVELS,
    LogFormat,
    LogSettingError,
    configure_logging,
    parse_format,
    parse_level,
)
from pdtrio.metrics import MULTIPROC_DIR_ENV
from pdtrio.security import (
    API_KEYS_ENV,
    ENGINE_API_KEY_ENV,
    METRICS_TOKEN_ENV,
    WORKER_SECRET_ENV,
    resolve_secret,
)
from pdtrio.serving.server import (
    GRACEFUL_MARGIN_S,
    ServerSettings,
    graceful_timeout_for,
    open_sockets,
    serve_here,
)
from pdtrio.serving.supervisor import STOP_MARGIN_S, supervise

log = logging.getLogger("pdtrio.serve")

CONFIG_ENV: Final = "PDTRIO_CONFIG"
ETCD_ENDPOINTS_ENV: Final = "PDTRIO_ETCD_ENDPOINTS"
_DEFAULTS = ServerSettings()

ENVIRONMENT = f"""\
environment (a flag wins over its variable):
  {CONFIG_ENV:<25} the TOML configuration file, when --config is not given
                            (every key: docs/configuration.md)
  {ETCD_ENDPOINTS_ENV:<25} etcd client URLs, comma-separated, when --etcd is not given
  {ETCD_PASSWORD_ENV:<25} the etcd user's password (over discovery.etcd_password_file)
  {API_KEYS_ENV:<25} API keys clients must send, comma-separated (over
                            --api-key-file and security.api_keys)
  {WORKER_SECRET_ENV:<25} the secret shared with the workers (over
                            --worker-secret-file); the embedded cluster makes one
  {ENGINE_API_KEY_ENV:<25} the --api-key of the vLLM or SGLang engines (over
                            --engine-api-key-file)
  {METRICS_TOKEN_ENV:<25} the embedded workers' /metrics bearer token
  {LOG_LEVEL_ENV:<25} when --log-level is not given
  {LOG_FORMAT_ENV:<25} when --log-format is not given
  {MULTIPROC_DIR_ENV:<25} with --workers N > 1: where the processes' metrics meet
                            (emptied at start; default: a temporary directory)
  OMP_WAIT_POLICY, GOMP_SPINCOUNT
                            kept by the embedded torch workers (else engine.omp_wait_policy)
  {CONFIG_JSON_ENV:<25} set by pdtrio serve for the router it runs: the whole
                            resolved configuration (do not set it yourself)

exit status: 0 after SIGTERM or SIGINT (the router drains first); 2 for a bad flag or
configuration; 3 when the router cannot start; 1 when it fails while serving.
Full reference: docs/operating.md.
"""


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdtrio serve",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Serve the OpenAI-compatible PD router with hypercorn's trio worker.\n"
            "With no configuration it starts and supervises an embedded cluster of one\n"
            "prefill and one decode worker (SmolLM2-135M-Instruct on the CPU). Flags\n"
            "override the configuration file (--config, else PDTRIO_CONFIG)."
        ),
        epilog=ENVIRONMENT,
    )
    where = parser.add_argument_group("configuration and instances")
    where.add_argument(
        "--config",
        metavar="FILE",
        help=f"the router's TOML configuration (env {CONFIG_ENV}; default: none, the "
        "embedded cluster)",
    )
    where.add_argument(
        "--backend",
        choices=("pdtrio", "vllm", "sglang"),
        help="what the instances given by --prefill/--decode/--both (or found in etcd) are "
        "(default: pdtrio workers)",
    )
    for role in ("prefill", "decode", "both"):
        where.add_argument(
            f"--{role}",
            action="append",
            metavar="URL",
            default=[],
            help=f"a {role} instance's base URL, repeatable; any of these replace the "
            "file's [[instances]] (default: none)",
        )
    where.add_argument(
        "--model",
        help="vLLM/SGLang: the served model name to send (default: the first of each "
        "engine's /v1/models); the embedded cluster: its model (built-in name, .gguf file "
        "or Hugging Face directory; default: smollm2-135m-instruct)",
    )
    where.add_argument(
        "--etcd",
        metavar="URLS",
        help=f"find instances in etcd at these client URLs, comma-separated "
        f"(env {ETCD_ENDPOINTS_ENV}; default: none)",
    )
    where.add_argument(
        "--drain-s",
        type=float,
        metavar="S",
        help="on SIGTERM, how long running requests may finish (router.drain_s; default: 10)",
    )
    server = parser.add_argument_group("HTTP server")
    server.add_argument("--host", help=f"address to listen on (default: {_DEFAULTS.host})")
    server.add_argument(
        "--port", type=int, help=f"port to listen on; 0: any free (default: {_DEFAULTS.port})"
    )
    server.add_argument(
        "--workers",
        type=int,
        metavar="N",
        default=1,
        help="router processes on the listening socket; N > 1 needs instances (not the "
        "embedded cluster), and one that dies is restarted (default: 1, in this process)",
    )
    server.add_argument(
        "--graceful-timeout",
        type=float,
        metavar="S",
        help="how long hypercorn lets connections finish once the router has drained "
        f"(default: drain_s + 2 x cleanup_grace_s + {GRACEFUL_MARGIN_S:g})",
    )
    server.add_argument(
        "--keep-alive-timeout",
        type=float,
        metavar="S",
        default=_DEFAULTS.keep_alive_timeout_s,
        help="an idle client connection is closed after this long "
        f"(default: {_DEFAULTS.keep_alive_timeout_s:g})",
    )
    server.add_argument(
        "--backlog",
        type=int,
        metavar="N",
        default=_DEFAULTS.backlog,
        help=f"connections the kernel queues before they are accepted "
        f"(default: {_DEFAULTS.backlog})",
    )
    tls = parser.add_argument_group("TLS and keys")
    tls.add_argument(
        "--certfile", metavar="FILE", help="serve HTTPS with this certificate (default: none)"
    )
    tls.add_argument(
        "--keyfile", metavar="FILE", help="the certificate's private key (default: none)"
    )
    tls.add_argument(
        "--ca-certs",
        metavar="FILE",
        help="require client certificates signed by this CA (mutual TLS; default: none)",
    )
    tls.add_argument(
        "--api-key-file",
        metavar="FILE",
        help=f"API keys clients must send, one a line (security.api_keys_file; or env "
        f"{API_KEYS_ENV}; default: none, no key asked)",
    )
    tls.add_argument(
        "--worker-secret-file",
        metavar="FILE",
        help=f"the secret shared with the workers (security.worker_secret_file; or env "
        f"{WORKER_SECRET_ENV}; default: none)",
    )
    tls.add_argument(
        "--worker-tls-ca-file",
        metavar="FILE",
        help="dial the workers over TLS, verified with this CA (default: plain HTTP)",
    )
    tls.add_argument(
        "--engine-api-key-file",
        metavar="FILE",
        help=f"the vLLM or SGLang engines' --api-key (or env {ENGINE_API_KEY_ENV}; default: none)",
    )
    logs = parser.add_argument_group("logs")
    logs.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        type=str.upper,
        help=f"log lines at this level and above; request content only at DEBUG "
        f"(env {LOG_LEVEL_ENV}; default: {DEFAULT_LOG_LEVEL})",
    )
    logs.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        help=f"text, or json for log collectors (env {LOG_FORMAT_ENV}; default: "
        f"{DEFAULT_LOG_FORMAT})",
    )
    return parser


@attrs.frozen
class ServePlan:
    """What ``pdtrio serve`` runs: the router's configuration and the server's settings."""

    config: PdtrioConfig
    settings: ServerSettings
    log_level: str
    log_format: LogFormat


def plan_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> ServePlan:
    """The flags over the file over the defaults; ConfigError naming what is wrong."""
    path = args.config or environ.get(CONFIG_ENV)
    base = load_config_file(path) if path else PdtrioConfig()
    raw: dict[str, Any] = _unstructure(base)
    instances = [
        (role, url) for role in ("prefill", "decode", "both") for url in getattr(args, role)
    ]
    backend = args.backend
    engine = backend in ENGINE_KINDS
    endpoints = (
        tuple(p.strip() for p in args.etcd.split(",") if p.strip())
        if args.etcd is not None
        else etcd_endpoints_from(dict(environ))
    )
    if endpoints:
        raw["discovery"]["etcd_endpoints"] = list(endpoints)
        if backend is not None:
            raw["discovery"]["kind"] = backend
    if instances:
        key = (
            resolve_secret(
                "",
                args.engine_api_key_file or "",
                env_name=ENGINE_API_KEY_ENV,
                what="engine API key",
                environ=environ,
            )
            if engine
            else ""
        )
        raw["instances"] = [
            {
                "role": role,
                "url": url,
                "kind": backend or "pdtrio",
                **({"model": args.model} if engine and args.model else {}),
                **({"api_key": key} if key else {}),
            }
            for role, url in instances
        ]
    elif engine and not endpoints and not base.instances:
        raise ConfigError(
            f"--backend {backend} needs its instances: --prefill URL and --decode URL "
            "(or --etcd, or [[instances]] in --config)"
        )
    elif backend is not None and not endpoints and base.instances:
        if base.instances[0].kind != backend:
            raise ConfigError(
                f"--backend {backend}: the [[instances]] of {path} are of kind "
                f"{base.instances[0].kind!r} (--backend names the kind of the instances "
                "given by --prefill/--decode/--both, or found with --etcd)"
            )
    if args.model:
        if instances and engine:
            pass  # on each instance, above
        elif not instances and not endpoints and not base.instances:
            raw["embedded"]["worker"]["engine"]["model"] = args.model
        else:
            raise ConfigError(
                "--model names the model of vLLM or SGLang instances given by --prefill/"
                "--decode/--both, or the embedded cluster's: pdtrio workers report their "
                "own, and instances in the file or in etcd carry theirs"
            )
    if args.drain_s is not None:
        raw["router"]["drain_s"] = args.drain_s
    for flag, key in (
        ("api_key_file", "api_keys_file"),
        ("worker_secret_file", "worker_secret_file"),
        ("worker_tls_ca_file", "worker_tls_ca_file"),
        ("engine_api_key_file", "engine_api_key_file"),
    ):
        value = getattr(args, flag)
        if value is not None:
            raw["security"][key] = value
    config: PdtrioConfig = config_from_dict(raw)
    if args.workers < 1:
        raise ConfigError(f"--workers must be 1 or more, got {args.workers}")
    if args.workers > 1 and config.uses_embedded_cluster:
        raise ConfigError(
            f"--workers {args.workers}: the embedded cluster runs under one router process "
            "(each would start its own workers): use --workers 1, or start the workers "
            "yourself and name them (--prefill URL --decode URL, or [[instances]])"
        )
    if bool(args.certfile) != bool(args.keyfile):
        raise ConfigError("--certfile and --keyfile go together")
    router = config.router
    graceful = (
        args.graceful_timeout
        if args.graceful_timeout is not None
        else graceful_timeout_for(router.drain_s, router.cleanup_grace_s)
    )
    settings = ServerSettings(
        host=args.host or _DEFAULTS.host,
        port=_DEFAULTS.port if args.port is None else args.port,
        workers=args.workers,
        certfile=args.certfile or "",
        keyfile=args.keyfile or "",
        ca_certs=args.ca_certs or "",
        graceful_timeout_s=graceful,
        keep_alive_timeout_s=args.keep_alive_timeout,
        backlog=args.backlog,
    )
    try:
        level = parse_level(args.log_level or environ.get(LOG_LEVEL_ENV) or DEFAULT_LOG_LEVEL)
        fmt = parse_format(args.log_format or environ.get(LOG_FORMAT_ENV) or DEFAULT_LOG_FORMAT)
    except LogSettingError as exc:
        raise ConfigError(str(exc)) from None
    return ServePlan(config, settings, level, fmt)


def _unstructure(config: PdtrioConfig) -> dict[str, Any]:
    raw: dict[str, Any] = json.loads(config_to_json(config))
    return raw


def main(argv: list[str]) -> int:
    args = argument_parser().parse_args(argv)
    try:
        plan = plan_from_args(args, os.environ)
    except ConfigError as exc:
        print(f"pdtrio serve: {exc}", file=sys.stderr)
        return 2
    # the router (this process, or each of --workers N) reads these as under hypercorn
    os.environ[CONFIG_JSON_ENV] = config_to_json(plan.config)
    os.environ[LOG_LEVEL_ENV] = plan.log_level
    os.environ[LOG_FORMAT_ENV] = plan.log_format
    settings = plan.settings
    try:
        sockets = open_sockets(settings)
    except OSError as exc:
        print(f"pdtrio serve: cannot listen on {settings.bind}: {exc}", file=sys.stderr)
        return 2
    if settings.workers > 1:
        configure_logging(plan.log_level, plan.log_format, "serve")
        stop_timeout_s = plan.config.router.drain_s + settings.graceful_timeout_s + STOP_MARGIN_S
        return supervise(settings, sockets, os.environ, stop_timeout_s)
    try:
        serve_here(settings, sockets, stop_when_stdin_closes=False)
    except KeyboardInterrupt:
        return 0  # a second Ctrl-C, during the drain: stopped at once
    except BaseExceptionGroup as group:
        if group.split(KeyboardInterrupt)[1] is None:
            return 0
        log.critical("the router failed", exc_info=group)
        return 1
    except Exception:
        log.critical("the router failed", exc_info=True)
        return 1
    return 0
