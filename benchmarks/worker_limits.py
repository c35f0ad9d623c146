"""``python -m benchmarks.worker_limits [--quick] [--mb N] [--json PATH]``: a worker's guards, measured.

Starts a prefill and a decode worker (synthetic engine, subprocesses) that share a
secret (``PDTRIO_WORKER_SECRET``), then plays two peers against them while
``GET /health`` is probed every 5 ms and the target's RSS (``/proc/PID/status``)
is sampled every 20 ms; idle probes just before each attack are the baseline.

1. A peer without the secret: 8 concurrent ``POST /pd/prefill`` of ``--mb`` MB each
   (raw sockets: the headers go out, the answer is read, only then is the body
   pushed, to see how much of it the worker still takes); a ``/pd/link`` handshake;
   a KV port connection with a zero proof asking for a real request's blocks;
   a ``POST /pd/release`` naming that request.  Reported: what each got back, how
   soon, how much of the body the worker can have read (no more than the kernel took
   before the worker closed: ``rchar`` does not count ``recv``), its RSS and KV blocks
   in use before and after (must not move), /health latency.
2. A peer with the secret, against the size and concurrency limits: 8 concurrent
   prefill bodies of ``--mb`` MB (4 are read at once, the rest get a 503), and one
   ``DecodeStart`` frame of ``--mb`` MB (a huge ``prompt_token_ids``) over a link
   to the decode worker.  Reported: answers, peak RSS, RSS after, /health p99
   during vs. idle.

Then, a finding rather than a refusal: silent connections to the KV port hold its
connection slots until the transfer deadline, credential or not; the line says
whether a pull with the credential is still served while they are open.

Last, a flood: ``--connections`` silent connections to the prefill worker's HTTP
port, held open; then a peer with the secret opens a new one and asks for
``/pd/info``.  Reported: how many the worker kept open (its bound on connections
without the secret), how many it closed for room, the peer's answer, RSS, and
/health latency (probed with the secret, as a router does).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import httpx
import msgspec
import trio

from benchmarks.kit import markdown_table, percentile, write_json
from pdtrio.kv.api import KvTransferError
from pdtrio.kv.tcp import (
    MAX_KV_CONNECTIONS,
    SESSION_BLOCKS,
    answer_decoder,
    connect_kv_port,
    receive_exactly,
    receive_message,
    send_message,
)
from pdtrio.peer_auth import WorkerAuth, link_authorization
from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.link import wire
from pdtrio.protocol.link.wire import (
    DecodeStart,
    KvHandle,
    PrefillReply,
    PrefillRequest,
    ReleaseReply,
    ReleaseRequest,
    TextPrompt,
    TransferRequest,
)
from pdtrio.protocol.sampling import SamplingParams
from pdtrio.router.workers.ws_client import HandshakeError, connect_websocket
from pdtrio.security import (
    WORKER_SECRET_ENV,
    PeerCredentials,
    answer_challenge,
    new_nonce,
    opening_authorization,
)
from pdtrio.testing import LOOPBACK, Processes, Service, synthetic_worker_config, worker_command

SECRET: Final = "worker-limits-benchmark-secret"
CREDENTIALS: Final = PeerCredentials(SECRET)
WORKER_AUTH: Final = WorkerAuth(CREDENTIALS)
PEERS: Final = 8
PROBE_INTERVAL_S: Final = 5e-3
RSS_INTERVAL_S: Final = 0.02
CHUNK: Final = 64 * 1024
# an unauthenticated peer's answer must come this soon after its headers, body unsent
ANSWER_WITHOUT_BODY_S: Final = 5.0
# how long the unauthenticated peer keeps pushing its body after the 401
PUSH_AFTER_ANSWER_S: Final = 3.0
SETTLE_S: Final = 1.0
REFUSED: Final = "refused"


# --- the worker, as /proc sees it -----------------------------------------------------


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rss_mb(pid: int) -> float:
    return _status_kb(pid, "VmRSS") / 1e3


def reset_peak(pid: int) -> bool:
    """Reset VmHWM (``clear_refs`` 5); False where the kernel does not let us."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_mb(pid: int) -> float:
    return _status_kb(pid, "VmHWM") / 1e3


# --- watching: /health and RSS while something runs -------------------------------------


async def _probe_health(
    url: str, latencies: list[float], failures: list[str], as_peer: bool = False
) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        if as_peer:  # one proven request makes the probes' connection a peer's
            (await http.get("/pd/stats", auth=WORKER_AUTH)).raise_for_status()
        while True:
            started = time.perf_counter()
            try:
                response = await http.get("/health")
            except httpx.HTTPError as exc:
                failures.append(type(exc).__name__)
            else:
                latencies.append(time.perf_counter() - started)
                if response.status_code != 200:
                    failures.append(str(response.status_code))
            await trio.sleep(PROBE_INTERVAL_S)


async def _sample_rss(pid: int, samples: list[float]) -> None:
    while True:
        samples.append(rss_mb(pid))
        await trio.sleep(RSS_INTERVAL_S)


async def idle_health(url: str, seconds: float, as_peer: bool = False) -> list[float]:
    latencies: list[float] = []
    failures: list[str] = []
    with trio.move_on_after(seconds):
        await _probe_health(url, latencies, failures, as_peer)
    return latencies


async def watched(
    service: Service,
    attack: Callable[[], Awaitable[None]],
    idle_s: float,
    probe_as_peer: bool = False,
) -> dict[str, Any]:
    """Run ``attack()`` with /health probed and RSS sampled; an idle baseline first."""
    idle = await idle_health(service.url, idle_s, probe_as_peer)
    pid = service.pid
    precise_peak = reset_peak(pid)
    latencies: list[float] = []
    failures: list[str] = []
    samples: list[float] = []
    before = rss_mb(pid)
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_probe_health, service.url, latencies, failures, probe_as_peer)
        nursery.start_soon(_sample_rss, pid, samples)
        await trio.sleep(0.05)
        await attack()
        seconds = time.perf_counter() - started
        await trio.sleep(0.2)  # what the answer's cleanup costs, too
        nursery.cancel_scope.cancel()
    await trio.sleep(SETTLE_S)
    peak = max([*samples, peak_mb(pid) if precise_peak else 0.0])
    return {
        "seconds": seconds,
        "rss_before_mb": before,
        "rss_peak_mb": peak,
        "rss_peak_sampled_mb": max(samples, default=float("nan")),
        "rss_after_mb": rss_mb(pid),
        "idle_p50_ms": percentile(idle, 50) * 1e3,
        "idle_p99_ms": percentile(idle, 99) * 1e3,
        "during_p50_ms": percentile(latencies, 50) * 1e3,
        "during_p99_ms": percentile(latencies, 99) * 1e3,
        "during_max_ms": max(latencies, default=float("nan")) * 1e3,
        "probes": len(latencies),
        "probe_failures": dict(Counter(failures)),
    }


# --- raw HTTP, so that headers, answer and body can be timed apart --------------------


async def fresh_authorization(url: str) -> str:
    """An answer to a fresh challenge of the worker at ``url``, for one raw request."""
    async with httpx.AsyncClient(base_url=url) as http:
        nonce = new_nonce()
        challenge = await http.get(
            "/pd/auth", headers={"authorization": opening_authorization(nonce)}
        )
    return answer_challenge(CREDENTIALS, challenge.headers.get("www-authenticate"), nonce, None)


def _head(path: str, length: int, *, authorization: str = "") -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        f"host: {LOOPBACK}",
        f"content-type: {wire.MSGPACK_CONTENT_TYPE}",
        f"content-length: {length}",
    ]
    if authorization:
        lines.append(f"authorization: {authorization}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _read_answer(stream: trio.SocketStream) -> tuple[int, bytes]:
    """(status, body) of one response; (0, b"") when the connection closes first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return 0, b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        body += chunk
    return status, body


async def _push(stream: trio.SocketStream, body: memoryview, sent: list[int]) -> bool:
    """Send ``body`` in chunks, counting what the kernel took; False once the peer closed."""
    try:
        for offset in range(0, len(body), CHUNK):
            await stream.send_all(body[offset : offset + CHUNK])
            sent[0] += len(body[offset : offset + CHUNK])
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return False
    return True


async def unauthenticated_post(port: int, body: bytes) -> dict[str, Any]:
    """Headers only, the answer read, then the body pushed anyway (for a while)."""
    stream = await trio.open_tcp_stream(LOOPBACK, port)
    async with stream:
        started = time.perf_counter()
        await stream.send_all(_head("/pd/prefill", len(body)))
        status = 0
        with trio.move_on_after(ANSWER_WITHOUT_BODY_S):
            status, _ = await _read_answer(stream)
        answered_s = time.perf_counter() - started
        sent = [0]
        open_ = True
        with trio.move_on_after(PUSH_AFTER_ANSWER_S):
            open_ = await _push(stream, memoryview(body), sent)
        return {
            "status": status,
            "answer_s": answered_s,
            "pushed_after": sent[0],
            "worker_closed": not open_,
        }


async def authenticated_post(port: int, body: bytes) -> dict[str, Any]:
    """Headers and body sent while the answer is awaited (a 503 may come before the body)."""
    authorization = await fresh_authorization(f"http://{LOOPBACK}:{port}")
    stream = await trio.open_tcp_stream(LOOPBACK, port)
    async with stream:
        started = time.perf_counter()
        sent = [0]
        answer: tuple[int, bytes] = (0, b"")
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                await stream.send_all(_head("/pd/prefill", len(body), authorization=authorization))
                await _push(stream, memoryview(body), sent)

            nursery.start_soon(send)
            answer = await _read_answer(stream)
            nursery.cancel_scope.cancel()
        return {
            "status": answer[0],
            "answer_s": time.perf_counter() - started,
            "body_sent": sent[0],
        }


# --- requests and frames ---------------------------------------------------------------


def prefill_body(request_id: str, size: int) -> bytes:
    text = "a" * max(1, size - 64)
    return wire.encode(PrefillRequest(request_id, TextPrompt(text), SamplingParams(), 4))


async def prefill_small(url: str, request_id: str) -> PrefillReply:
    """An authenticated prefill whose blocks stay leased: the request someone else names."""
    for attempt in range(2):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            try:
                response = await http.post(
                    "/pd/prefill",
                    content=prefill_body(request_id, 2000),
                    headers={"content-type": wire.MSGPACK_CONTENT_TYPE},
                    auth=WORKER_AUTH,
                )
                break
            except httpx.RemoteProtocolError as exc:
                # seen once in CI on an overloaded machine: the worker closed the connection
                # between the challenge and the answer; this setup call is not what is measured
                if attempt:
                    raise
                print(f"prefill_small: {exc!r}; once more", file=sys.stderr)
    response.raise_for_status()
    reply = wire.from_worker_decoder.decode(response.content)
    assert isinstance(reply, PrefillReply) and reply.kv_handle is not None, reply
    return reply


async def stats(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        response = await http.get("/pd/stats", auth=WORKER_AUTH)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def decode_start_frame(size: int, layout: KvLayout, transfer_port: int, id_bytes: int) -> bytes:
    """A DecodeStart of about ``size`` bytes, its token ids of ``id_bytes`` each on the wire:
    1 (msgpack fixint, ids below 128: Python's cached small ints) or 3 (uint16: one int
    object per id once decoded)."""
    count = max(1, size // id_bytes)
    if id_bytes == 1:
        token_ids = tuple(4 + (i * 7) % 100 for i in range(count))
    else:
        token_ids = tuple(1000 + (i * 7919) % 30000 for i in range(count))
    handle = KvHandle("huge-start", "prefill", LOOPBACK, transfer_port, (0,), count, layout, 60.0)
    start = DecodeStart("huge-start", token_ids, 5, SamplingParams(), count + 8, 1, 0, handle)
    return wire.encode(start)


# --- the unauthenticated peer --------------------------------------------------------------


async def _ws_without_secret(port: int) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        with trio.fail_after(10):
            ws = await connect_websocket(
                f"ws://{LOOPBACK}:{port}/pd/link", max_message_size=1 << 20
            )
    except HandshakeError as exc:
        return {"answer": str(exc).rsplit(": ", 1)[-1], "refused": True, "s": _since(started)}
    await ws.aclose()
    return {"answer": "the websocket opened", "refused": False, "s": _since(started)}


async def _kv_zero_proof(port: int, handle: KvHandle) -> dict[str, Any]:
    started = time.perf_counter()
    stream = await trio.open_tcp_stream(LOOPBACK, port)
    async with stream:
        try:
            await stream.send_all(SESSION_BLOCKS + new_nonce())
            await receive_exactly(stream, 64)  # the port's nonce and proof
            await stream.send_all(bytes(32))  # a proof of nothing
            request = TransferRequest(handle.request_id, handle.block_ids, handle.access_token)
            await send_message(stream, request)
            with trio.fail_after(10):
                answer = await receive_message(stream, answer_decoder)
        except (KvTransferError, trio.BrokenResourceError, trio.TooSlowError, OSError) as exc:
            return {
                "answer": f"closed ({type(exc).__name__})",
                "refused": True,
                "s": _since(started),
            }
    return {"answer": f"answered {answer}", "refused": False, "s": _since(started)}


async def _release_without_secret(url: str, request_id: str) -> dict[str, Any]:
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        response = await http.post(
            "/pd/release",
            content=wire.encode(ReleaseRequest(request_id)),
            headers={"content-type": wire.MSGPACK_CONTENT_TYPE},
        )
    return {
        "answer": f"HTTP {response.status_code}",
        "refused": response.status_code == 401,
        "s": _since(started),
    }


async def _release_without_grant(url: str, request_id: str) -> bool:
    """With the secret but not the request's grant: whether the blocks were freed."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        response = await http.post(
            "/pd/release",
            content=wire.encode(ReleaseRequest(request_id)),
            headers={"content-type": wire.MSGPACK_CONTENT_TYPE},
            auth=WORKER_AUTH,
        )
    response.raise_for_status()
    return msgspec.msgpack.decode(response.content, type=ReleaseReply).released


def _since(started: float) -> float:
    return time.perf_counter() - started


async def unauthenticated(
    prefill: Service, decode: Service, size: int, idle_s: float
) -> dict[str, Any]:
    victim = await prefill_small(prefill.url, "victim-request")
    handle = victim.kv_handle
    assert handle is not None
    body = prefill_body("attack", size)
    stats_before = await stats(prefill.url)
    port = int(prefill.ready["http_port"])
    probes: dict[str, Any] = {}

    async def attack() -> None:
        posts: list[dict[str, Any]] = []

        async def one_post() -> None:
            posts.append(await unauthenticated_post(port, body))

        async def other(name: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
            probes[name] = await fn(*args)

        async with trio.open_nursery() as nursery:
            for _ in range(PEERS):
                nursery.start_soon(one_post)
            nursery.start_soon(
                other, "/pd/link on decode", _ws_without_secret, decode.ready["http_port"]
            )
            nursery.start_soon(other, "/pd/link on prefill", _ws_without_secret, port)
            nursery.start_soon(
                other,
                "KV port, zero proof",
                _kv_zero_proof,
                prefill.ready["transfer_port"],
                handle,
            )
            nursery.start_soon(
                other,
                "POST /pd/release of a live request",
                _release_without_secret,
                prefill.url,
                handle.request_id,
            )
        probes["posts"] = posts

    watch = await watched(prefill, attack, idle_s)
    stats_after = await stats(prefill.url)
    # not the unauthenticated peer's doing: the grant guards release even with the secret
    freed_without_grant = await _release_without_grant(prefill.url, handle.request_id)
    return {
        **watch,
        "probes": probes,
        "body_mb": len(body) / 1e6,
        "kv_blocks_before": stats_before["kv_blocks_in_use"],
        "kv_blocks_after": stats_after["kv_blocks_in_use"],
        "kv_leases_before": stats_before["kv_leases"],
        "kv_leases_after": stats_after["kv_leases"],
        "freed_with_secret_without_grant": freed_without_grant,
        "victim": {"request_id": handle.request_id, "blocks": len(handle.block_ids)},
    }


def only_refusals(result: dict[str, Any]) -> list[str]:
    """What an unauthenticated peer got beyond a refusal (empty: nothing)."""
    found: list[str] = []
    for post in result["probes"]["posts"]:
        if post["status"] != 401:
            found.append(f"POST /pd/prefill answered {post['status'] or 'nothing'}")
        elif not post["worker_closed"]:
            found.append("POST /pd/prefill: the worker went on taking the body after its 401")
    for name, probe in result["probes"].items():
        if name != "posts" and not probe["refused"]:
            found.append(f"{name}: {probe['answer']}")
    if result["kv_blocks_after"] != result["kv_blocks_before"]:
        found.append(
            f"KV blocks in use moved {result['kv_blocks_before']} -> {result['kv_blocks_after']}"
        )
    if result["kv_leases_after"] != result["kv_leases_before"]:
        found.append(f"KV leases moved {result['kv_leases_before']} -> {result['kv_leases_after']}")
    return found


# --- the authenticated peer, against the limits ------------------------------------------


async def authenticated_prefills(prefill: Service, size: int, idle_s: float) -> dict[str, Any]:
    bodies = [prefill_body(f"big-{i}", size) for i in range(PEERS)]
    port = int(prefill.ready["http_port"])
    answers: list[dict[str, Any]] = []

    async def attack() -> None:
        async def one(body: bytes) -> None:
            answers.append(await authenticated_post(port, body))

        async with trio.open_nursery() as nursery:
            for body in bodies:
                nursery.start_soon(one, body)

    watch = await watched(prefill, attack, idle_s)
    return {
        **watch,
        "case": f"{PEERS} x {len(bodies[0]) / 1e6:.0f} MB POST /pd/prefill",
        "answers": dict(Counter(str(a["status"]) for a in answers)),
        "answer_s_max": max(a["answer_s"] for a in answers),
    }


async def authenticated_decode_start(
    decode: Service, prefill: Service, size: int, id_bytes: int, idle_s: float
) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=decode.url, timeout=30) as http:
        info = (await http.get("/pd/info", auth=WORKER_AUTH)).json()
        handshake = await link_authorization(http, decode.url, CREDENTIALS, None)
    layout = msgspec.convert(info["layout"], KvLayout)
    frame = decode_start_frame(size, layout, int(prefill.ready["transfer_port"]), id_bytes)
    replies: list[str] = []

    async def attack() -> None:
        with trio.fail_after(120):
            ws = await connect_websocket(
                f"ws://{decode.address}/pd/link", max_message_size=64 << 20, headers=handshake
            )
            try:
                await ws.send_messages([frame])
                # a frame over the wire's bounds (MAX_TOKEN_IDS) is dropped unanswered
                with trio.move_on_after(3):
                    while not replies:
                        for data in await ws.receive_messages():
                            assert isinstance(data, bytes)
                            message = wire.from_worker_decoder.decode(data)
                            if getattr(message, "request_id", None) == "huge-start":
                                replies.append(type(message).__name__)
                if not replies:
                    replies.append("dropped unanswered (too many ids)")
            finally:
                await ws.aclose()

    watch = await watched(decode, attack, idle_s)
    return {
        **watch,
        "case": f"{len(frame) / 1e6:.0f} MB DecodeStart on /pd/link "
        f"({len(frame) // id_bytes / 1e6:.0f}M ids of {id_bytes} B)",
        "answers": dict(Counter(replies)),
        "answer_s_max": watch["seconds"],
    }


# --- a finding: silent connections hold the KV port's slots --------------------------------


async def _pull_answer(port: int, handle: KvHandle) -> str:
    try:
        stream = await connect_kv_port(
            LOOPBACK, port, SESSION_BLOCKS, CREDENTIALS, handle.instance_id
        )
    except KvTransferError as exc:
        return f"closed ({type(exc).__name__})"
    async with stream:
        try:
            await send_message(
                stream, TransferRequest(handle.request_id, handle.block_ids, handle.access_token)
            )
            with trio.fail_after(10):
                answer = await receive_message(stream, answer_decoder)
        except (KvTransferError, trio.BrokenResourceError, trio.TooSlowError, OSError) as exc:
            return f"closed ({type(exc).__name__})"
    return "granted" if answer.granted else f"not granted: {answer.reason}"


async def silent_kv_slots(prefill: Service) -> dict[str, Any]:
    reply = await prefill_small(prefill.url, "slot-request")
    handle = reply.kv_handle
    assert handle is not None
    port = int(prefill.ready["transfer_port"])
    silent: list[trio.SocketStream] = []
    try:
        for _ in range(MAX_KV_CONNECTIONS):
            silent.append(await trio.open_tcp_stream(LOOPBACK, port))
        await trio.sleep(0.3)  # the worker has accepted them all
        while_held = await _pull_answer(port, handle)
    finally:
        for stream in silent:
            await trio.aclose_forcefully(stream)
    await trio.sleep(0.3)
    after = await _pull_answer(port, handle)
    return {"silent": len(silent), "while_held": while_held, "after": after}


# --- a flood of silent connections to the HTTP port -------------------------------------


async def _closed_by_worker(stream: trio.SocketStream) -> bool:
    """Whether the worker has closed ``stream`` (it never sent anything)."""
    with trio.move_on_after(0.001):
        try:
            return await stream.receive_some(1) == b""
        except (trio.BrokenResourceError, OSError):
            return True
    return False


async def http_connection_flood(prefill: Service, count: int, idle_s: float) -> dict[str, Any]:
    """``count`` silent connections to the prefill worker's HTTP port, held open; meanwhile
    a peer with the secret opens a new connection and asks for /pd/info."""
    port = int(prefill.ready["http_port"])
    held: list[trio.SocketStream] = []
    found: dict[str, Any] = {}

    async def attack() -> None:
        started = time.perf_counter()
        for _ in range(count):
            held.append(await trio.open_tcp_stream(LOOPBACK, port))
        found["opened_s"] = time.perf_counter() - started
        await trio.sleep(0.3)  # the worker has accepted them all
        started = time.perf_counter()
        async with httpx.AsyncClient(base_url=prefill.url, auth=WORKER_AUTH, timeout=10) as http:
            try:
                answer = await http.get("/pd/info")
                found["peer_answer"] = str(answer.status_code)
            except httpx.HTTPError as exc:
                found["peer_answer"] = type(exc).__name__
        found["peer_s"] = time.perf_counter() - started
        closed = [await _closed_by_worker(stream) for stream in held]
        found["still_open"] = closed.count(False)

    try:
        result = await watched(prefill, attack, idle_s, probe_as_peer=True)
    finally:
        for stream in held:
            await trio.aclose_forcefully(stream)
    async with httpx.AsyncClient(base_url=prefill.url, auth=WORKER_AUTH, timeout=10) as http:
        metrics = (await http.get("/metrics")).text
    evicted = [
        line.split()[-1]
        for line in metrics.splitlines()
        if line.startswith("pdtrio_worker_http_connections_evicted_total")
    ]
    return {
        **result,
        **found,
        "count": count,
        "evicted": float(evicted[0]) if evicted else float("nan"),
    }


# --- the run -----------------------------------------------------------------------------


def start_worker(procs: Processes, role: str) -> subprocess.Popen[bytes]:
    config = synthetic_worker_config(role)
    return procs.start(
        worker_command(config), env={WORKER_SECRET_ENV: SECRET}, stdin=True, output="lines"
    )


def run(size: int, idle_s: float, flood: int) -> dict[str, Any]:
    with Processes(stop_grace_s=10) as procs:
        prefill_process = start_worker(procs, "prefill")
        decode_process = start_worker(procs, "decode")
        prefill = procs.wait_ready(prefill_process)
        decode = procs.wait_ready(decode_process)
        result = {
            "unauthenticated": trio.run(unauthenticated, prefill, decode, size, idle_s),
            "limits": [
                trio.run(authenticated_prefills, prefill, size, idle_s),
                trio.run(authenticated_decode_start, decode, prefill, size, 1, idle_s),
                trio.run(authenticated_decode_start, decode, prefill, size, 3, idle_s),
            ],
            "kv_slots": trio.run(silent_kv_slots, prefill),
            "http_flood": trio.run(http_connection_flood, prefill, flood, idle_s),
        }
    return result


# --- output ------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _ratio(during: float, idle: float) -> str:
    return f"{during / idle:.1f}x" if idle > 0 else "n/a"


def render(result: dict[str, Any]) -> str:
    unauth = result["unauthenticated"]
    posts = unauth["probes"]["posts"]
    statuses = Counter(str(p["status"] or "none") for p in posts)
    out = [
        f"## A peer without the secret (prefill worker, bodies of {unauth['body_mb']:.0f} MB)",
        "",
    ]
    rows = [
        [
            f"{PEERS} x POST /pd/prefill (headers only, then the body)",
            ", ".join(f"{n} x {s}" for s, n in sorted(statuses.items())),
            _ms(max(p["answer_s"] for p in posts)),
            "none of the body sent when the answer came; pushed anyway, the worker "
            f"{'closed' if all(p['worker_closed'] for p in posts) else 'KEPT'} the connection",
        ]
    ]
    for name, probe in unauth["probes"].items():
        if name != "posts":
            rows.append([name, probe["answer"], _ms(probe["s"]), ""])
    out.append(markdown_table(["probe", "answer", "time to answer ms (max)", "note"], rows))
    out += [
        "",
        markdown_table(
            [
                "body the worker can have read, max kB per connection (what the kernel took)",
                "RSS before -> peak -> after MB",
                "KV blocks in use before -> after",
                "leases",
                "/health p50 idle -> during ms",
                "p99 idle -> during ms",
                "p99 ratio",
                "max ms",
            ],
            [
                [
                    f"{max(p['pushed_after'] for p in posts) / 1e3:.0f}",
                    f"{unauth['rss_before_mb']:.0f} -> {unauth['rss_peak_mb']:.0f} -> "
                    f"{unauth['rss_after_mb']:.0f}",
                    f"{unauth['kv_blocks_before']} -> {unauth['kv_blocks_after']}",
                    f"{unauth['kv_leases_before']} -> {unauth['kv_leases_after']}",
                    f"{unauth['idle_p50_ms']:.2f} -> {unauth['during_p50_ms']:.2f}",
                    f"{unauth['idle_p99_ms']:.2f} -> {unauth['during_p99_ms']:.2f}",
                    _ratio(unauth["during_p99_ms"], unauth["idle_p99_ms"]),
                    f"{unauth['during_max_ms']:.1f}",
                ]
            ],
        ),
        "",
        "## A peer with the secret, against the size and concurrency limits",
        "",
    ]
    rows = []
    for r in result["limits"]:
        rows.append(
            [
                r["case"],
                ", ".join(f"{n} x {s}" for s, n in sorted(r["answers"].items())),
                f"{r['seconds']:.2f}",
                f"{r['rss_before_mb']:.0f}",
                f"{r['rss_peak_mb']:.0f}",
                f"{r['rss_after_mb']:.0f}",
                f"{r['idle_p99_ms']:.2f} -> {r['during_p99_ms']:.2f}",
                _ratio(r["during_p99_ms"], r["idle_p99_ms"]),
                f"{r['during_max_ms']:.1f}",
                str(r["probes"]),
            ]
        )
    out.append(
        markdown_table(
            [
                "case",
                "answers",
                "done in s",
                "RSS before MB",
                "peak MB",
                "after MB",
                "/health p99 idle -> during ms",
                "ratio",
                "max ms",
                "probes",
            ],
            rows,
        )
    )
    flood = result["http_flood"]
    out += [
        "",
        f"## {flood['count']} silent connections to the prefill worker's HTTP port, held open",
        "",
        markdown_table(
            [
                "opened in s",
                "still open (the worker's bound)",
                "evicted by the worker",
                "then: a peer with the secret, new connection, GET /pd/info",
                "RSS before -> peak -> after MB",
                "/health p99 idle -> during ms (probe with the secret)",
                "probe failures",
            ],
            [
                [
                    f"{flood['opened_s']:.2f}",
                    str(flood["still_open"]),
                    f"{flood['evicted']:.0f}",
                    f"{flood['peer_answer']} in {_ms(flood['peer_s'])} ms",
                    f"{flood['rss_before_mb']:.0f} -> {flood['rss_peak_mb']:.0f} -> "
                    f"{flood['rss_after_mb']:.0f}",
                    f"{flood['idle_p99_ms']:.2f} -> {flood['during_p99_ms']:.2f}",
                    str(flood["probe_failures"] or 0),
                ]
            ],
        ),
    ]
    out += ["", *verdicts(result)]
    return "\n".join(out)


def verdicts(result: dict[str, Any]) -> list[str]:
    unauth = result["unauthenticated"]
    beyond = only_refusals(unauth)
    lines = [
        "unauthenticated: nothing but refusals"
        if not beyond
        else "unauthenticated: MORE THAN REFUSALS: " + "; ".join(beyond)
    ]
    grant = unauth["freed_with_secret_without_grant"]
    lines.append(
        "with the secret but without the request's grant, /pd/release freed the blocks: "
        f"{'YES' if grant else 'no'}"
    )
    everything = [("unauthenticated", unauth)] + [(r["case"], r) for r in result["limits"]]
    drift = max(abs(r["rss_after_mb"] - r["rss_before_mb"]) for _, r in everything)
    lines.append(f"RSS after returns within {drift:.0f} MB of before (worst of the attacks)")
    for name, r in everything:
        lines.append(
            f"health p99 during/idle ratio, {name}: "
            f"{_ratio(r['during_p99_ms'], r['idle_p99_ms'])} "
            f"(max {r['during_max_ms']:.0f} ms; peak RSS {r['rss_peak_mb']:.0f} MB)"
        )
    slots = result["kv_slots"]
    lines.append(
        f"finding: {slots['silent']} silent unauthenticated connections to the KV port; a pull "
        f"with the credential meanwhile: {slots['while_held']}; after they closed: {slots['after']}"
    )
    flood = result["http_flood"]
    lines.append(
        f"HTTP flood: {flood['count']} silent connections, {flood['still_open']} left open by "
        f"the worker; a peer with the secret meanwhile: {flood['peer_answer']}"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="8 MB bodies, short baselines")
    parser.add_argument("--mb", type=float, help="body and frame size in MB (default 60)")
    parser.add_argument(
        "--connections",
        type=int,
        help="silent connections in the HTTP flood (default 2000; quick: 400)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    size = int((args.mb or (8 if args.quick else 60)) * 1e6)
    flood = args.connections or (400 if args.quick else 2000)
    result = run(size, idle_s=0.5 if args.quick else 1.5, flood=flood)
    print(render(result))
    write_json(args.json, result)
    kept_out = result["http_flood"]["peer_answer"] != "200"
    return 0 if not only_refusals(result["unauthenticated"]) and not kept_out else 1


if __name__ == "__main__":
    raise SystemExit(main())
