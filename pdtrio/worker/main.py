"""``pdtrio worker``: one worker process."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import Any

import trio

from pdtrio.config import (
    ConfigError,
    EngineConfig,
    WorkerConfig,
    config_from_dict,
)
from pdtrio.engine.api import Engine, EngineError
from pdtrio.engine.config import UnsupportedModel
from pdtrio.kv.api import KvTransportUnavailable
from pdtrio.worker.launch import ready_line
from pdtrio.worker.server import Worker


def build_engine(config: EngineConfig) -> Engine:
    if config.kind == "synthetic":
        from pdtrio.engine.synthetic import SyntheticEngine

        return SyntheticEngine(
            config.synthetic,
            num_blocks=config.num_kv_blocks,
            block_size=config.block_size,
            default_max_tokens=config.default_max_tokens,
        )
    try:
        from pdtrio.engine.torch.engine import TorchEngine
    except ImportError as exc:
        raise ConfigError(
            f"engine.kind = 'torch' needs the worker extras (pip install 'pdtrio[worker]'): {exc}"
        ) from None
    # (the torch engine is outside mypy's files, see pyproject: Any to it)
    engine: Engine = TorchEngine.from_config(config)
    return engine


def parse_args(argv: list[str]) -> tuple[WorkerConfig, bool]:
    parser = argparse.ArgumentParser(prog="pdtrio worker", description="run one pdtrio worker")
    parser.add_argument("--role", choices=["prefill", "decode", "both"], default=None)
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--engine", choices=["synthetic", "torch"], default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument(
        "--kv-transport",
        choices=["nixl", "tcp", "auto"],
        default=None,
        help="how decode pulls KV from prefill (default: auto, NIXL where it works)",
    )
    parser.add_argument("--config-json", default=None, help="a whole WorkerConfig as JSON")
    parser.add_argument(
        "--exit-with-stdin",
        action="store_true",
        help="exit when stdin closes (the supervising router died)",
    )
    args = parser.parse_args(argv)
    raw: dict[str, Any] = json.loads(args.config_json) if args.config_json else {}
    for key in ("role", "host", "port", "kv_transport"):
        if getattr(args, key) is not None:
            raw[key] = getattr(args, key)
    engine = raw.setdefault("engine", {})
    if args.engine is not None:
        engine["kind"] = args.engine
    if args.model is not None:
        engine["model"] = args.model
    config: WorkerConfig = config_from_dict(raw, WorkerConfig)
    return config, args.exit_with_stdin


async def _exit_when_stdin_closes(cancel_scope: trio.CancelScope) -> None:
    stdin = trio.lowlevel.FdStream(os.dup(0))
    async with stdin:
        while await stdin.receive_some(4096):
            pass
    logging.getLogger("pdtrio.worker").warning("supervisor went away; exiting")
    cancel_scope.cancel()


async def _exit_on_signal(cancel_scope: trio.CancelScope) -> None:
    """SIGINT or SIGTERM: stop serving and exit 0 (links close, so routers fail over)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            logging.getLogger("pdtrio.worker").info(
                "%s received; exiting", signal.Signals(signum).name
            )
            cancel_scope.cancel()
            return


async def serve_worker(config: WorkerConfig, exit_with_stdin: bool = False) -> None:
    try:
        engine = build_engine(config.engine)
    except (OSError, UnsupportedModel, EngineError) as exc:
        # a missing or unreadable model is the operator's to fix: say which, not where
        raise ConfigError(f"cannot load model {config.engine.model!r}: {exc}") from None
    try:
        worker = Worker(config, engine)
    except KvTransportUnavailable as exc:
        raise ConfigError(f"kv_transport = {config.kv_transport!r}: {exc}") from None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_exit_on_signal, nursery.cancel_scope)
            if exit_with_stdin:
                nursery.start_soon(_exit_when_stdin_closes, nursery.cancel_scope)
            ready = await nursery.start(worker.run)
            ready["role"] = config.role
            ready["model"] = engine.model_name
            ready["kv_transport"] = worker.transport.name
            # the supervisor reads this line to learn the ports
            print(ready_line(ready), flush=True)
    except* KvTransportUnavailable as group:
        raise ConfigError(f"kv_transport = {config.kv_transport!r}: {_first(group)}") from None


def _first(group: BaseExceptionGroup[KvTransportUnavailable]) -> BaseException:
    """The first leaf of a (nested) exception group."""
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config, exit_with_stdin = parse_args(argv)
        trio.run(serve_worker, config, exit_with_stdin)
    except ConfigError as exc:
        print(f"pdtrio worker: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0
