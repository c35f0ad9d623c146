"""``pdtrio worker``: one worker process."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import tomllib
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import trio

from pdtrio.config import (
    ConfigError,
    EngineConfig,
    WorkerConfig,
    config_from_dict,
    from_worker_file,
)
from pdtrio.discovery.worker_registration import keep_registered
from pdtrio.engine.api import Engine, EngineError
from pdtrio.engine.config import UnsupportedModel
from pdtrio.kv.api import KvTransportUnavailable
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
from pdtrio.memory import freeze_startup_objects, trim_heap
from pdtrio.protocol.link.registration import Registration
from pdtrio.security import derive_key, resolve_worker_secret
from pdtrio.worker.launch import ready_line
from pdtrio.worker.server import Worker

log = logging.getLogger("pdtrio.worker")


def build_engine(config: EngineConfig) -> Engine:
    if config.kind == "synthetic":
        from pdtrio.engine.synthetic import SYNTHETIC_MODEL_NAME, SyntheticEngine

        return SyntheticEngine(
            config.synthetic,
            num_blocks=config.num_kv_blocks,
            block_size=config.block_size,
            model_name=config.served_model_name or SYNTHETIC_MODEL_NAME,
            default_max_tokens=config.default_max_tokens,
            prefix_cache=config.prefix_cache,
            prefix_cache_max_blocks=config.prefix_cache_max_blocks,
        )
    from pdtrio.engine.threads import prepare_process

    prepare_process(config)  # before torch is imported: OpenMP reads its settings then
    try:
        from pdtrio.engine.torch.engine import TorchEngine
    except ImportError as exc:
        if _names_our_module(exc):
            raise  # an import inside pdtrio itself is broken: a bug, its traceback says where
        raise ConfigError(
            f"engine.kind = 'torch' needs the worker extras (pip install 'pdtrio[worker]'): {exc}"
        ) from exc
    # (the torch engine is outside mypy's files, see pyproject: Any to it)
    engine: Engine = TorchEngine.from_config(config)
    return engine


def _names_our_module(exc: ImportError) -> bool:
    """Whether the import that failed is of a pdtrio module (a bug), not of an extra."""
    return (exc.name or "").partition(".")[0] == "pdtrio"


# What loading a model raises when the configuration or the model's files are wrong
# (missing or unreadable files, a checkpoint this engine cannot run, an unknown dtype or
# device): the operator's to fix, and the message says what. Anything else loading
# raises is pdtrio's own failure, a bug: it is logged with its traceback.
MODEL_CONFIG_ERRORS: tuple[type[Exception], ...] = (OSError, UnsupportedModel, EngineError)


class LoadCrashed(Exception):
    """Loading the model failed inside pdtrio (logged already, with its traceback)."""


@attrs.frozen
class _Option:
    """A worker flag: where it lands in the WorkerConfig and its environment variable."""

    flag: str
    path: tuple[str, ...]
    help: str
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    env_name: str = ""  # "": PDTRIO_ and the flag's name
    # the previous release's flag and variable: accepted for one release, with a warning
    old_flag: str = ""
    old_env: str = ""

    @property
    def env(self) -> str:
        return self.env_name or "PDTRIO_" + self.flag.removeprefix("--").replace("-", "_").upper()


def _endpoints(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


_DEFAULTS = WorkerConfig()
_OPTIONS = (
    _Option("--role", ("role",), "what the worker serves", choices=("prefill", "decode", "both")),
    _Option("--host", ("host",), "address to listen on (0.0.0.0: every interface)"),
    _Option("--port", ("port",), "HTTP port: control API and router links (0: any free)", int),
    _Option("--transfer-port", ("transfer_port",), "KV transfer port (0: any free)", int),
    _Option(
        "--advertise-host",
        ("advertise_host",),
        "address routers and decode workers dial (default: --host; required with a wildcard)",
    ),
    _Option("--advertise-port", ("advertise_port",), "advertised HTTP port (0: the bound)", int),
    _Option(
        "--advertise-transfer-port",
        ("advertise_transfer_port",),
        "advertised KV transfer port (0: the bound one)",
        int,
    ),
    _Option("--instance-id", ("instance_id",), "this worker's name (default: role@host:port)"),
    _Option(
        "--kv-transport",
        ("kv_transport",),
        "how decode pulls KV from prefill (auto: NIXL where it works, else TCP)",
        choices=("nixl", "tcp", "auto"),
    ),
    _Option("--drain-s", ("drain_s",), "on SIGTERM, how long running requests may finish", float),
    _Option(
        "--etcd",
        ("discovery", "etcd_endpoints"),
        "etcd client URLs, comma-separated: register there",
        _endpoints,
        env_name="PDTRIO_ETCD_ENDPOINTS",
    ),
    _Option(
        "--worker-secret-file",
        ("secret_file",),
        "a file holding the secret routers and workers share (or set PDTRIO_WORKER_SECRET); "
        "none: no peer is asked for one",
        old_flag="--secret-file",
    ),
    _Option(
        "--metrics-token-file",
        ("metrics_token_file",),
        "a file holding a bearer token that opens GET /metrics alone, for a scraper "
        "(or set PDTRIO_METRICS_TOKEN)",
    ),
    _Option("--tls-cert-file", ("tls_cert_file",), "serve HTTPS, WSS and the KV port over TLS"),
    _Option("--tls-key-file", ("tls_key_file",), "the TLS certificate's private key"),
    _Option(
        "--worker-tls-ca-file",
        ("tls_ca_file",),
        "the CA that signed the workers' certificates: pull KV from their ports over TLS",
        old_flag="--tls-ca-file",
        old_env="PDTRIO_TLS_CA_FILE",
    ),
    _Option(
        "--engine-kind",
        ("engine", "kind"),
        "the engine",
        choices=("synthetic", "torch"),
        old_flag="--engine",
        old_env="PDTRIO_ENGINE",
    ),
    _Option(
        "--model",
        ("engine", "model"),
        "a Hugging Face repo id (Org/Name, from huggingface_hub's cache or downloaded into "
        "it), a built-in model's name, a .gguf file or a checkpoint directory",
    ),
    _Option(
        "--served-model-name",
        ("engine", "served_model_name"),
        "the name clients put in `model` (none: the model's name; a .gguf path's "
        "file name without .gguf)",
    ),
    _Option("--device", ("engine", "device"), "torch device: cpu, cuda, cuda:1, ..."),
    _Option(
        "--dtype",
        ("engine", "dtype"),
        "torch dtype: auto (the default), float32, bfloat16, float16",
    ),
    _Option(
        "--num-kv-blocks",
        ("engine", "num_kv_blocks"),
        "KV cache blocks",
        int,
        old_flag="--kv-blocks",
        old_env="PDTRIO_KV_BLOCKS",
    ),
)


def _default_of(path: tuple[str, ...]) -> Any:
    value: Any = _DEFAULTS
    for key in path:
        value = getattr(value, key)
    if isinstance(value, tuple):
        return ",".join(value) or "none"
    return value if value != "" else "none"


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdtrio worker",
        description=(
            "Run one pdtrio worker: prefill, decode or both. Precedence: flag, then its "
            "environment variable, then --config, then the default."
        ),
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=os.environ.get("PDTRIO_WORKER_CONFIG"),
        help="a TOML file whose [worker] table configures the worker, the same table as "
        "in the router's file (env PDTRIO_WORKER_CONFIG; default: none)",
    )
    for option in _OPTIONS:
        parser.add_argument(
            option.flag,
            type=option.type,
            choices=option.choices,
            default=None,
            help=f"{option.help} (env {option.env}; default: {_default_of(option.path)})",
        )
        if option.old_flag:
            parser.add_argument(
                option.old_flag,
                dest=_old_dest(option),
                type=option.type,
                choices=option.choices,
                default=None,
                help=argparse.SUPPRESS,
            )
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        type=str.upper,
        default=None,
        help=f"log lines at this level and above (request content: only at DEBUG) "
        f"(env {LOG_LEVEL_ENV}; default: {DEFAULT_LOG_LEVEL})",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=None,
        help=f"text, or json (one object a line, for log collectors) "
        f"(env {LOG_FORMAT_ENV}; default: {DEFAULT_LOG_FORMAT})",
    )
    parser.add_argument(
        "--config-json",
        default=None,
        help="a whole WorkerConfig as JSON, in place of --config (how the router starts "
        "its embedded workers; default: none)",
    )
    parser.add_argument(
        "--exit-with-stdin",
        action="store_true",
        help="exit when stdin closes (the supervising router died; default: off)",
    )
    return parser


def parse_args(
    argv: list[str], environ: Mapping[str, str] | None = None
) -> tuple[WorkerConfig, bool]:
    environ = os.environ if environ is None else environ
    parser = argument_parser()
    args = parser.parse_args(argv)
    raw: dict[str, Any] = {}
    if args.config:
        raw = from_worker_file(_read_toml(args.config), args.config)
    if args.config_json:
        try:
            raw = json.loads(args.config_json)
        except json.JSONDecodeError as exc:
            # (the decoder's message says where: its traceback would add nothing)
            raise ConfigError(f"--config-json is not valid JSON: {exc}") from None
    for option in _OPTIONS:
        value = _flag_value(option, args)
        if value is None:
            value = _env_value(option, environ)
        if value is None:
            continue
        section = raw
        for key in option.path[:-1]:
            section = section.setdefault(key, {})
        section[option.path[-1]] = list(value) if isinstance(value, tuple) else value
    config: WorkerConfig = config_from_dict(raw, WorkerConfig, file_keys=True)
    return config, args.exit_with_stdin


def _old_dest(option: _Option) -> str:
    return "deprecated_" + _attribute_name(option.old_flag)


def _flag_value(option: _Option, args: argparse.Namespace) -> Any:
    value = getattr(args, _attribute_name(option.flag))
    if not option.old_flag:
        return value
    old = getattr(args, _old_dest(option))
    if old is None:
        return value
    if value is not None:
        raise ConfigError(
            f"{option.old_flag} and {option.flag} are one setting ({option.old_flag} is its "
            f"old name): give {option.flag} only"
        )
    log.warning("flag %s is deprecated: use %s", option.old_flag, option.flag)
    return old


def _env_value(option: _Option, environ: Mapping[str, str]) -> Any:
    name = option.env
    if option.old_env and option.old_env in environ:
        if name in environ:
            raise ConfigError(
                f"{option.old_env} and {name} are one setting ({option.old_env} is its old "
                f"name): set {name} only"
            )
        log.warning("environment variable %s is deprecated: use %s", option.old_env, name)
        name = option.old_env
    if name not in environ:
        return None
    try:
        value = option.type(environ[name])
    except ValueError:
        raise ConfigError(f"{name}={environ[name]!r} is not valid") from None
    if option.choices is not None and value not in option.choices:
        raise ConfigError(f"{name} must be one of {', '.join(option.choices)}")
    return value


def log_settings(
    argv: list[str], environ: Mapping[str, str] | None = None
) -> tuple[str, LogFormat]:
    """The log level and format: the flags, then PDTRIO_LOG_LEVEL and PDTRIO_LOG_FORMAT."""
    environ = os.environ if environ is None else environ
    args = argument_parser().parse_args(argv)
    try:
        level = parse_level(args.log_level or environ.get(LOG_LEVEL_ENV) or DEFAULT_LOG_LEVEL)
        fmt = parse_format(args.log_format or environ.get(LOG_FORMAT_ENV) or DEFAULT_LOG_FORMAT)
    except LogSettingError as exc:
        raise ConfigError(str(exc)) from None
    return level, fmt


def _attribute_name(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


async def _exit_when_stdin_closes(cancel_scope: trio.CancelScope) -> None:
    stdin = trio.lowlevel.FdStream(os.dup(0))
    async with stdin:
        while await stdin.receive_some(4096):
            pass
    logging.getLogger("pdtrio.worker").warning("supervisor went away; exiting")
    cancel_scope.cancel()


async def _on_signals(stop: trio.Event, cancel_scope: trio.CancelScope) -> None:
    """The first SIGINT or SIGTERM asks for a graceful stop (``stop``); a second one,
    or one before the worker serves, stops it at once.  Either way the exit status is 0."""
    log = logging.getLogger("pdtrio.worker")
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if stop.is_set():
                log.warning("%s received again: exiting now", name)
                cancel_scope.cancel()
                return
            log.info("%s received: stopping (send it again to exit at once)", name)
            stop.set()


def _describe_loading(config: EngineConfig) -> str:
    if config.kind == "synthetic":
        return "loading the synthetic engine (no weights; it counts prompt bytes as tokens)"
    return (
        f"loading model {config.model} (engine {config.kind}) on device {config.device}, "
        f"dtype {config.dtype}"
    )


def _describe_loaded(engine: Engine, seconds: float) -> str:
    stats = engine.statistics()
    layout = engine.layout
    mib = stats.kv_blocks_total * layout.block_nbytes / (1 << 20)
    return (
        f"model loaded in {seconds:.1f} s, served as {engine.model_name!r} (KV cache: "
        f"{stats.kv_blocks_total} blocks of {layout.block_size} tokens, {mib:.1f} MiB)"
    )


async def serve_worker(config: WorkerConfig, exit_with_stdin: bool = False) -> None:
    log.info(_describe_loading(config.engine))
    started_at = time.monotonic()
    try:
        engine = build_engine(config.engine)
    except ConfigError:
        raise
    except MODEL_CONFIG_ERRORS as exc:
        # a missing or unreadable model is the operator's to fix: say which, not where
        # (the cause stays chained for a debugger; main() prints this one line)
        raise ConfigError(f"cannot load model {config.engine.model!r}: {exc}") from exc
    except Exception as exc:
        if isinstance(exc, ImportError) and not _names_our_module(exc):
            # a loader's own import (gguf, safetensors, ...) is not installed
            raise ConfigError(
                f"cannot load model {config.engine.model!r}: the worker extras are missing "
                f"(pip install 'pdtrio[worker]'): {exc}"
            ) from exc
        # our code raised: not the operator's mistake, and the traceback is the only clue
        log.critical(
            "loading model %r failed inside pdtrio (a bug, not a configuration mistake)",
            config.engine.model,
            exc_info=True,
        )
        raise LoadCrashed(f"loading model {config.engine.model!r} failed: {exc!r}") from exc
    log.info(_describe_loaded(engine, time.monotonic() - started_at))
    try:
        worker = Worker(config, engine)
    except KvTransportUnavailable as exc:
        # the transport says why it is unavailable (NIXL missing, or failing its self-test)
        raise ConfigError(f"kv_transport = {config.kv_transport!r}: {exc}") from exc
    stop = trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_on_signals, stop, nursery.cancel_scope)
            if exit_with_stdin:
                nursery.start_soon(_exit_when_stdin_closes, nursery.cancel_scope)
            ready = await nursery.start(worker.run)
            ready["role"] = config.role
            ready["model"] = engine.model_name
            ready["kv_transport"] = worker.transport.name
            bound = f"http://{config.host}:{worker.http_port}"
            advertised = "" if ready["url"] == bound else f" (advertised as {ready['url']})"
            transfer = (
                f", KV transfer port {ready['transfer_port']}" if ready["transfer_port"] else ""
            )
            log.info("serving as %s on %s%s%s", ready["instance_id"], bound, advertised, transfer)
            # the supervisor reads this line to learn the ports
            print(ready_line(ready), flush=True)
            # what exists now lives as long as the process: the heap trimmer's collections
            # (after big messages) skip it, and take a fraction of a ms instead of ~50
            freeze_startup_objects()
            # what loading the model freed stays in glibc's heap under the worker's
            # thresholds (~80 MB of a SmolLM2 worker's resident set): given back once
            await trio.to_thread.run_sync(trim_heap)
            deregistered = trio.Event()
            if config.discovery.uses_etcd:
                nursery.start_soon(
                    _stay_registered, config, worker.registration(), stop, deregistered
                )
            else:
                deregistered.set()
            await stop.wait()
            worker.begin_drain()  # refused work is retried elsewhere by the routers
            # deregister first (routers stop sending work), then let running work finish
            with trio.move_on_after(config.discovery.etcd_timeout_s):
                await deregistered.wait()
            await worker.drain(config.drain_s)
            nursery.cancel_scope.cancel()
    except* KvTransportUnavailable as group:
        first = _first(group)
        raise ConfigError(f"kv_transport = {config.kv_transport!r}: {first}") from first


async def _stay_registered(
    config: WorkerConfig, registration: Registration, stop: trio.Event, done: trio.Event
) -> None:
    secret = resolve_worker_secret(config.secret, config.secret_file)
    signing_key = derive_key(secret, "registration") if secret else None
    try:
        await keep_registered(config.discovery, registration, stop, signing_key=signing_key)
    finally:
        done.set()


def _first(group: BaseExceptionGroup[KvTransportUnavailable]) -> BaseException:
    """The first leaf of a (nested) exception group."""
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first


def main(argv: list[str]) -> int:
    try:
        level, fmt = log_settings(argv)
        # (a deprecated key or flag is reported while the arguments are read)
        configure_logging(level, fmt, "worker")
        config, exit_with_stdin = parse_args(argv)
        configure_logging(level, fmt, config.instance_id or config.role)
        trio.run(serve_worker, config, exit_with_stdin)
    except ConfigError as exc:
        if exc.__cause__ is not None:
            # one line is the operator's answer; where it came from, at DEBUG only
            log.debug("the configuration error came from here", exc_info=exc.__cause__)
        print(f"pdtrio worker: {exc}", file=sys.stderr)
        return 2
    except LoadCrashed:
        return 1  # logged where it happened, with its traceback (once)
    except KeyboardInterrupt:
        return 0
    except BaseExceptionGroup as group:
        # a SIGINT that trio redelivers as the signal receiver closes, while stdin's
        # closing already stops the worker: a stop all the same, not a crash
        if group.split(KeyboardInterrupt)[1] is None:
            return 0
        raise
    return 0
