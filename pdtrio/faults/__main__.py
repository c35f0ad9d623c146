"""``python -m pdtrio.faults``: the fault proxy by hand, in front of a live deployment.

Runs until SIGINT or SIGTERM, printing one line per connection opened and
closed; ``--control-port`` opens a line-based control on loopback, where the
fault in force can be changed while it runs (``printf 'stall on\\n' | nc 127.0.0.1 PORT``).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from functools import partial

import trio

from pdtrio.faults.plan import (
    CONTROL_HELP,
    FaultSpecError,
    fault_from_options,
    parse_address,
    parse_control_line,
)
from pdtrio.faults.proxy import FaultProxy

_MAX_CONTROL_LINE = 4096
LOOPBACK = "127.0.0.1"


def _say(line: str) -> None:
    print(line, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pdtrio.faults",
        description=(
            "A TCP proxy that injects faults between two parts of a deployment (client and "
            "router, router and a worker, decode and prefill's KV transfer): point the one "
            "side at --listen and the proxy forwards to --target. Runs until SIGINT/SIGTERM, "
            "printing one line per connection opened and closed."
        ),
        epilog="control port " + CONTROL_HELP,
    )
    parser.add_argument("--listen", required=True, metavar="HOST:PORT", help="where to listen")
    parser.add_argument("--target", required=True, metavar="HOST:PORT", help="where to forward")
    parser.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="delay each chunk this long, both directions, order kept",
    )
    parser.add_argument(
        "--bandwidth-kbps",
        type=float,
        default=None,
        metavar="KBPS",
        help="cap each direction of each connection (kilobits per second: 8 = 1000 bytes/s)",
    )
    parser.add_argument(
        "--stall",
        action="store_true",
        help="forward nothing (sockets stay open; new connections are accepted and held)",
    )
    parser.add_argument(
        "--reset-after-bytes",
        type=int,
        default=None,
        metavar="N",
        help="reset (RST) each connection once it has forwarded N bytes, both ways together",
    )
    parser.add_argument(
        "--refuse", action="store_true", help="refuse new connections (the listener is closed)"
    )
    parser.add_argument(
        "--control-port",
        type=int,
        default=None,
        metavar="PORT",
        help="listen on 127.0.0.1:PORT for control lines (e.g. 'latency 50', 'stall on', 'reset')",
    )
    return parser


async def _serve_control(proxy: FaultProxy, stream: trio.SocketStream) -> None:
    """One operator's control session: a line in, one line back (``ok ...`` or ``error: ...``)."""
    buffer = b""
    async with stream:
        await stream.send_all(f"ok {proxy.fault.describe()}\n".encode())
        while chunk := await stream.receive_some(_MAX_CONTROL_LINE):
            buffer += chunk
            while b"\n" in buffer:
                raw, buffer = buffer.split(b"\n", 1)
                await stream.send_all((_control(proxy, raw) + "\n").encode())
            if len(buffer) > _MAX_CONTROL_LINE:
                await stream.send_all(b"error: line too long\n")
                return


def _control(proxy: FaultProxy, raw: bytes) -> str:
    line = raw.decode(errors="replace").strip()
    if line.lower() == "help":
        return "ok " + CONTROL_HELP
    try:
        command = parse_control_line(line, proxy.fault)
    except FaultSpecError as exc:
        return f"error: {exc}"
    if command.fault != proxy.fault:
        proxy.fault = command.fault
        _say(f"fault: {command.fault.describe()}")
    if command.reset_all:
        count = proxy.reset_all()
        _say(f"reset {count} connections")
        return f"ok reset {count} connections; {command.fault.describe()}"
    return f"ok {command.fault.describe()}"


async def _main(proxy: FaultProxy, control_port: int | None) -> None:
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            port = await nursery.start(proxy.run)
            _say(
                f"listening on {proxy.listen_host}:{port} -> "
                f"{proxy.target_host}:{proxy.target_port} ({proxy.fault.describe()})"
            )
            if control_port is not None:
                listeners = await nursery.start(
                    partial(
                        trio.serve_tcp, partial(_serve_control, proxy), control_port, host=LOOPBACK
                    )
                )
                _say(f"control on {LOOPBACK}:{listeners[0].socket.getsockname()[1]}")
            async for signum in signals:
                _say(f"stopping on {signal.Signals(signum).name}")
                nursery.cancel_scope.cancel()
                break
    counters = proxy.counters
    _say(
        f"stopped: {counters.connections_accepted} connections, {counters.connections_reset} "
        f"reset, {counters.bytes_to_target} bytes to target, "
        f"{counters.bytes_to_client} bytes to clients"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    options = parser.parse_args(argv)
    try:
        listen = parse_address(options.listen)
        target = parse_address(options.target)
        fault = fault_from_options(
            latency_ms=options.latency_ms,
            bandwidth_kbps=options.bandwidth_kbps,
            stall=options.stall,
            reset_after_bytes=options.reset_after_bytes,
            refuse=options.refuse,
        )
    except FaultSpecError as exc:
        parser.error(str(exc))
    proxy = FaultProxy(*listen, *target, fault=fault, on_event=_say)
    try:
        trio.run(_main, proxy, options.control_port)
    except OSError as exc:
        print(f"python -m pdtrio.faults: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
