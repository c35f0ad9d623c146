"""The fault proxy against a real trio echo server, a real router and decode link, and by hand.

Margins are generous: these check that each fault has its effect, not how
fast anything is.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import attrs
import httpx
import pytest
import trio

from pdtrio.config import InstanceConfig, PdtrioConfig, RouterConfig
from pdtrio.faults import Fault, FaultProxy
from pdtrio.router.app import RouterApp
from pdtrio.testing import LOOPBACK, Processes, free_port
from tests.cluster import serve_app, synthetic_worker, wait_for_answer

# bounds, not measurements: a fault that has no effect fails them, a slow machine does not
DEADLINE_S = 10.0


async def _echo(stream: trio.SocketStream) -> None:
    async with stream:
        try:
            while chunk := await stream.receive_some(65536):
                await stream.send_all(chunk)
        except trio.BrokenResourceError:
            pass


async def _start_echo(nursery: trio.Nursery) -> int:
    listeners = await nursery.start(partial(trio.serve_tcp, _echo, 0, host=LOOPBACK))
    return int(listeners[0].socket.getsockname()[1])


@asynccontextmanager
async def proxied_echo(fault: Fault | None = None) -> AsyncIterator[FaultProxy]:
    """An echo server behind a proxy; the proxy's ``listen_port`` is where to connect."""
    async with trio.open_nursery() as nursery:
        proxy = FaultProxy(LOOPBACK, 0, LOOPBACK, await _start_echo(nursery), fault=fault)
        await nursery.start(proxy.run)
        yield proxy
        nursery.cancel_scope.cancel()


async def _connect(proxy: FaultProxy) -> trio.SocketStream:
    return await trio.open_tcp_stream(LOOPBACK, proxy.listen_port)


async def _receive_exactly(stream: trio.SocketStream, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = await stream.receive_some(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


async def _round_trip(stream: trio.SocketStream, data: bytes) -> bytes:
    await stream.send_all(data)
    return await _receive_exactly(stream, len(data))


async def _read_until_closed(stream: trio.SocketStream) -> tuple[bytes, str]:
    """Everything until the connection ends, and how: ``"eof"`` or ``"reset"``."""
    data = b""
    try:
        while chunk := await stream.receive_some(65536):
            data += chunk
    except trio.BrokenResourceError:
        return data, "reset"
    return data, "eof"


async def test_without_a_fault_bytes_pass_unchanged_and_are_counted() -> None:
    async with proxied_echo() as proxy:
        with trio.fail_after(DEADLINE_S):
            for _ in range(2):
                async with await _connect(proxy) as stream:
                    payload = bytes(range(256)) * 40
                    assert await _round_trip(stream, payload) == payload
            await trio.testing.wait_all_tasks_blocked()
        counters = proxy.counters
        assert counters.connections_accepted == 2 and counters.connections_open == 0
        assert counters.bytes_to_target == counters.bytes_to_client == 2 * 10240
        assert counters.connections_reset == 0


async def test_latency_delays_each_direction_and_keeps_the_order() -> None:
    async with proxied_echo(Fault(latency_s=0.2)) as proxy:
        async with await _connect(proxy) as stream:
            with trio.fail_after(DEADLINE_S):
                started = trio.current_time()
                for part in (b"one ", b"two ", b"three"):
                    await stream.send_all(part)
                    await trio.sleep(0.01)  # a paced client: three writes, each delayed
                assert await _receive_exactly(stream, 13) == b"one two three"
                # there and back: two delays, and trio never wakes early
                assert trio.current_time() - started >= 0.39
                proxy.update(latency_s=0.0)  # open connections take the change
                started = trio.current_time()
                assert await _round_trip(stream, b"quick") == b"quick"
                assert trio.current_time() - started < 0.39


async def test_a_bandwidth_cap_slows_a_transfer_to_about_the_rate() -> None:
    async with proxied_echo(Fault(bandwidth_bytes_per_s=20_000)) as proxy:
        async with await _connect(proxy) as stream:
            with trio.fail_after(DEADLINE_S):
                started = trio.current_time()
                payload = b"x" * 10_000
                assert await _round_trip(stream, payload) == payload
                # 10 kB at 20 kB/s is 0.5 s (the directions overlap); allow for the burst
                assert trio.current_time() - started >= 0.3


async def test_a_stall_holds_open_and_new_connections_until_it_is_lifted() -> None:
    async with proxied_echo() as proxy:
        async with await _connect(proxy) as held:
            with trio.fail_after(DEADLINE_S):
                assert await _round_trip(held, b"before") == b"before"
            proxy.update(stall=True)
            await held.send_all(b"during")
            with trio.move_on_after(0.5) as waited:
                await held.receive_some(100)
            assert waited.cancelled_caught
            async with await _connect(proxy) as fresh:  # accepted...
                await fresh.send_all(b"fresh")
                with trio.move_on_after(0.5) as waited:
                    await fresh.receive_some(100)  # ...but never answered
                assert waited.cancelled_caught
                proxy.update(stall=False)
                with trio.fail_after(DEADLINE_S):
                    assert await _receive_exactly(held, 6) == b"during"
                    assert await _receive_exactly(fresh, 5) == b"fresh"


async def test_held_requests_wait_while_other_requests_and_connections_pass() -> None:
    completion = b"POST /v1/completions HTTP/1.1\r\ncontent-length: 0\r\n\r\n"
    health = b"GET /health HTTP/1.1\r\n\r\n"
    async with proxied_echo(Fault(hold_requests=("POST /v1/completions",))) as proxy:
        async with await _connect(proxy) as held, await _connect(proxy) as reads:
            with trio.fail_after(DEADLINE_S):
                assert await _round_trip(held, health) == health  # a read on it passes...
            await held.send_all(completion)  # ...a completion on the same connection waits
            await held.send_all(b"its body")  # and what follows it
            with trio.move_on_after(0.5) as waited:
                await held.receive_some(100)
            assert waited.cancelled_caught
            assert proxy.counters.requests_held == 1
            with trio.fail_after(DEADLINE_S):  # another connection's reads go on meanwhile
                assert await _round_trip(reads, health) == health
                assert await _round_trip(reads, health) == health
            proxy.fault = Fault()
            with trio.fail_after(DEADLINE_S):
                assert await _receive_exactly(held, len(completion) + 8) == completion + b"its body"


async def test_a_connection_is_reset_after_the_bytes_it_may_forward() -> None:
    async with proxied_echo(Fault(reset_after_bytes=1000)) as proxy:
        async with await _connect(proxy) as stream:
            with trio.fail_after(DEADLINE_S):
                await stream.send_all(b"y" * 4000)
                received, how = await _read_until_closed(stream)
        assert how == "reset", received
        assert len(received) <= 1000
        assert proxy.counters.bytes_to_target + proxy.counters.bytes_to_client == 1000
        assert proxy.counters.connections_reset == 1


async def test_refusing_closes_the_listener_but_not_the_open_connections() -> None:
    async with proxied_echo() as proxy:
        async with await _connect(proxy) as kept:
            proxy.update(refuse=True)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(OSError):
                await _connect(proxy)
            with trio.fail_after(DEADLINE_S):
                assert await _round_trip(kept, b"still here") == b"still here"
            proxy.update(refuse=False)
            await trio.testing.wait_all_tasks_blocked()
            with trio.fail_after(DEADLINE_S):
                async with await _connect(proxy) as again:  # the same port as before
                    assert await _round_trip(again, b"back") == b"back"


async def test_a_proxy_can_start_refusing_and_still_knows_its_port() -> None:
    async with proxied_echo(Fault(refuse=True)) as proxy:
        assert proxy.listen_port != 0
        with pytest.raises(OSError):
            await _connect(proxy)
        proxy.fault = Fault()
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(DEADLINE_S):
            async with await _connect(proxy) as stream:
                assert await _round_trip(stream, b"ok") == b"ok"


async def test_reset_all_resets_every_open_connection() -> None:
    async with proxied_echo() as proxy:
        streams = [await _connect(proxy) for _ in range(3)]
        with trio.fail_after(DEADLINE_S):
            for stream in streams:
                assert await _round_trip(stream, b"hi") == b"hi"
            assert proxy.reset_all() == 3
            for stream in streams:
                assert await _read_until_closed(stream) == (b"", "reset")
                await stream.aclose()
            await trio.testing.wait_all_tasks_blocked()
        assert proxy.counters.connections_reset == 3
        assert proxy.counters.connections_open == 0


async def test_an_unreachable_target_resets_the_client() -> None:
    async with trio.open_nursery() as nursery:
        proxy = FaultProxy(LOOPBACK, 0, LOOPBACK, free_port())  # nothing listens there
        await nursery.start(proxy.run)
        with trio.fail_after(DEADLINE_S):
            async with await _connect(proxy) as stream:
                assert await _read_until_closed(stream) == (b"", "reset")
        nursery.cancel_scope.cancel()


# --- between the router and a decode worker -----------------------------------------------


async def _until_healthy(client: httpx.AsyncClient) -> None:
    """Poll ``GET /health`` until 200, as a load balancer would: it is the observable contract."""
    await wait_for_answer(
        lambda: client.get("/health"), lambda health: health.status_code == 200, DEADLINE_S
    )


async def test_a_stalled_decode_link_fails_its_stream_and_the_instance_comes_back() -> None:
    router_config = RouterConfig(link_timeout_s=1.5, link_heartbeat_s=0.5)
    async with trio.open_nursery() as nursery:
        prefill = synthetic_worker("prefill")
        decode = synthetic_worker("decode", decode_step_s=0.02)
        prefill_ready = await nursery.start(prefill.run)
        decode_ready = await nursery.start(decode.run)
        proxy = FaultProxy(LOOPBACK, 0, LOOPBACK, decode_ready["http_port"])
        proxy_port = await nursery.start(proxy.run)
        config = PdtrioConfig(
            router=router_config,
            instances=(
                InstanceConfig(
                    role="prefill", url=f"http://127.0.0.1:{prefill_ready['http_port']}"
                ),
                InstanceConfig(role="decode", url=f"http://127.0.0.1:{proxy_port}"),
            ),
        )
        url = await serve_app(RouterApp(config), nursery)
        async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S) as client:
            await _until_healthy(client)
            body = {"model": "synthetic", "prompt": "hi", "max_tokens": 4000, "stream": True}
            events: list[str] = []
            with trio.fail_after(DEADLINE_S):
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if not line:
                            continue
                        events.append(line)
                        if len(events) == 5:
                            proxy.update(stall=True)  # the link goes silent, sockets open
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert "sent nothing" in error["message"]
            assert (await client.get("/health")).status_code == 503
            proxy.update(stall=False)
            await _until_healthy(client)
        nursery.cancel_scope.cancel()


# --- the command line ---------------------------------------------------------------------


def test_the_command_line_explains_itself() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdtrio.faults", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for option in (
        "--listen",
        "--target",
        "--latency-ms",
        "--bandwidth-kbps",
        "--stall",
        "--reset-after-bytes",
        "--refuse",
        "--control-port",
    ):
        assert option in done.stdout


def test_the_command_line_refuses_a_bad_address() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdtrio.faults", "--listen", "9000", "--target", "x:1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "HOST:PORT" in done.stderr


async def test_the_command_line_proxy_adds_latency_and_stops_on_sigterm() -> None:
    async with trio.open_nursery() as nursery:
        echo_port = await _start_echo(nursery)
        with Processes(stop_grace_s=10) as procs:
            command = [
                sys.executable,
                "-m",
                "pdtrio.faults",
                "--listen",
                f"{LOOPBACK}:0",
                "--target",
                f"{LOOPBACK}:{echo_port}",
                "--latency-ms",
                "150",
                "--control-port",
                "0",
            ]
            process = procs.start(command, output="lines")
            ready = await trio.to_thread.run_sync(procs.read_line, process, b"listening on ", 60)
            port = int(ready.split(b" ")[0].rsplit(b":", 1)[1])
            assert b"latency=150ms" in ready
            control = await trio.to_thread.run_sync(procs.read_line, process, b"control on ", 10)
            control_port = int(control.strip().rsplit(b":", 1)[1])
            with trio.fail_after(DEADLINE_S):
                async with await trio.open_tcp_stream(LOOPBACK, port) as stream:
                    started = trio.current_time()
                    assert await _round_trip(stream, b"ping") == b"ping"
                    assert trio.current_time() - started >= 0.29
                async with await trio.open_tcp_stream(LOOPBACK, control_port) as operator:
                    assert (await operator.receive_some(1000)).startswith(b"ok latency=150ms")
                    await operator.send_all(b"latency 0\nstall maybe\n")
                    replies = b""
                    while replies.count(b"\n") < 2:
                        replies += await operator.receive_some(1000)
                    assert replies.splitlines() == [b"ok no fault", replies.splitlines()[1]]
                    assert replies.splitlines()[1].startswith(b"error: stall takes on or off")
            opened = await trio.to_thread.run_sync(procs.read_line, process, b"connection 1 ", 10)
            assert opened.startswith(b"opened from")
            closed = await trio.to_thread.run_sync(procs.read_line, process, b"connection 1 ", 10)
            assert closed.startswith(b"closed")
            status = await trio.to_thread.run_sync(partial(procs.stop, process, sig=signal.SIGTERM))
            assert status == 0
        nursery.cancel_scope.cancel()


def test_fault_values_are_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        Fault().stall = True  # type: ignore[misc]
