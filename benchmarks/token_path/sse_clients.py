"""The e2e section's load: many raw-socket SSE clients in one process, one selector.

Clients start spread over the first second, each streaming completions back
to back.  From ``warmup_s`` on, for ``measure_s``, tokens, events, bytes and
inter-event gaps are counted (the lines ``MARK start`` / ``MARK end`` let the
driver read CPU counters at the same moments); then every socket is closed
and ``RESULT {json}`` printed (with the raw TTFTs and gaps in whole
microseconds, for ``--plot``).  Tokens are counted in the bytes: each
synthetic token's text is " t<id>", and nothing else in a compact OpenAI
chunk has a space before a "t".

:func:`closed_loop` is ``benchmarks.router_cost``'s load: clients of the same
kind on one epoll in the caller's own process, on kept-alive connections or
new ones, back to back or in rounds, reporting per-request and per-read
figures (see its docstring).
"""

from __future__ import annotations

import json
import os
import resource
import select
import selectors
import socket
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from benchmarks.kit import percentile


class _SseClient:
    __slots__ = (
        "sock",
        "start_at",
        "request_start",
        "last_event",
        "gaps",
        "ttfts",
        "tail",
        "requests",
    )

    def __init__(self, start_at: float) -> None:
        self.sock: socket.socket | None = None
        self.start_at = start_at
        self.request_start = 0.0
        self.last_event: float | None = None
        self.gaps: list[float] = []
        self.ttfts: list[float] = []
        self.tail = b""
        self.requests = 0


def completion_request(host: str, max_tokens: int) -> bytes:
    """A streamed ``/v1/completions`` POST of a 16-token prompt, ignore_eos, as raw bytes."""
    body = json.dumps(
        {
            "model": "synthetic",
            "prompt": list(range(1, 17)),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def run(spec: dict[str, Any]) -> None:
    host, port = spec["address"].rsplit(":", 1)
    request = completion_request(host, spec["max_tokens"])
    sel = selectors.DefaultSelector()
    t0 = time.perf_counter()
    window_start = t0 + spec["warmup_s"]
    window_end = window_start + spec["measure_s"]
    clients = [_SseClient(t0 + i / spec["clients"]) for i in range(spec["clients"])]
    waiting = sorted(clients, key=lambda c: c.start_at, reverse=True)
    counted = {"tokens": 0, "events": 0, "bytes": 0, "requests_done": 0}
    failures: Counter[str] = Counter()
    connect_times: list[float] = []
    measuring = False

    def begin(client: _SseClient) -> None:
        # non-blocking connect: a slow accept delays this client only
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        sock.connect_ex((host, int(port)))
        client.sock = sock
        client.request_start = time.perf_counter()
        client.last_event = None
        client.tail = b""
        sel.register(sock, selectors.EVENT_WRITE, client)

    def connected(client: _SseClient) -> None:
        assert client.sock is not None
        error = client.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            failures[f"connect: {os.strerror(error)}"] += 1
            end(client)
            return
        client.sock.send(request)  # a few hundred bytes into an empty socket buffer
        connect_times.append(time.perf_counter() - client.request_start)
        sel.modify(client.sock, selectors.EVENT_READ, client)

    def end(client: _SseClient) -> None:
        assert client.sock is not None
        sel.unregister(client.sock)
        client.sock.close()
        client.sock = None
        client.requests += 1
        begin(client)

    while True:
        now = time.perf_counter()
        while waiting and waiting[-1].start_at <= now:
            begin(waiting.pop())
        if not measuring and now >= window_start:
            measuring = True
            print("MARK start", flush=True)
        if now >= window_end:
            print("MARK end", flush=True)
            break
        timeout = (window_end if measuring else window_start) - now
        if waiting:
            timeout = min(timeout, waiting[-1].start_at - now)
        for key, mask in sel.select(max(0.0, timeout)):
            client = key.data
            if mask & selectors.EVENT_WRITE:
                connected(client)
                continue
            data = client.sock.recv(262144)
            now = time.perf_counter()
            if not data:
                failures["closed before [DONE]"] += 1
                end(client)
                continue
            window = client.tail + data
            events = window.count(b"\n\n") - client.tail.count(b"\n\n")
            if measuring:
                counted["bytes"] += len(data)
                counted["tokens"] += window.count(b" t") - client.tail.count(b" t")
                counted["events"] += events
            if events:
                if client.last_event is None:
                    if measuring:
                        client.ttfts.append(now - client.request_start)
                elif measuring:
                    client.gaps.append(now - client.last_event)
                client.last_event = now
            client.tail = window[-64:]
            if b"data: [DONE]" in client.tail:
                counted["requests_done"] += measuring
                end(client)
            elif window.startswith(b"HTTP/1.1 ") and not window.startswith(b"HTTP/1.1 200"):
                failures[window.split(b"\r\n", 1)[0].decode(errors="replace")] += 1
                end(client)
    sel.close()
    for client in clients:
        if client.sock is not None:
            client.sock.close()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    per_client = [(percentile(c.gaps, 50), percentile(c.gaps, 99)) for c in clients if c.gaps]
    ttfts = [t for c in clients for t in c.ttfts]
    result = {
        **counted,
        "measure_s": spec["measure_s"],
        "failures": failures,
        "client_p50s": [p for p, _ in per_client],
        "client_p99s": [p for _, p in per_client],
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "connect_p99": percentile(connect_times, 99),
        "connect_max": max(connect_times, default=float("nan")),
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "ttfts_us": [round(t * 1e6) for t in ttfts],
        "gaps_us": [round(g * 1e6) for c in clients for g in c.gaps],
    }
    print("RESULT " + json.dumps(result), flush=True)


# --- closed loop, in-process: the router cost benchmark's load ---------------------------


class _Stream:
    """One client of :func:`closed_loop`: a socket and the response under way on it."""

    __slots__ = (
        "sock",
        "connecting",
        "sent_at",
        "head",
        "in_body",
        "tail",
        "tokens",
        "first",
        "second",
        "second_tokens",
        "last",
        "done_seen",
        "errored",
        "close_after",
    )

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.connecting = False
        self.sent_at = 0.0
        self.reset()

    def reset(self) -> None:
        self.head = b""
        self.in_body = False
        self.tail = b""
        self.tokens = 0
        self.first: float | None = None
        self.second: float | None = None  # the response's second read that carried tokens
        self.second_tokens = 0  # tokens received up to and including it
        self.last = 0.0
        self.done_seen = False
        self.errored = False
        self.close_after = False  # the server said "connection: close"


_END_OF_BODY = b"\r\n0\r\n\r\n"  # the last chunk of a chunked response


def closed_loop(
    address: str,
    request: bytes,
    *,
    clients: int,
    expected_tokens: int,
    warmup_s: float,
    measure_s: float,
    keepalive: bool = True,
    rounds: bool = False,
    ramp_s: float = 1.0,
    on_window: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """``clients`` streams sending ``request`` back to back, in this process, on one epoll.

    Clients start spread over ``ramp_s``; each sends ``request`` (a streamed
    completion of ``expected_tokens`` tokens), reads the response to its last
    chunk and sends the next, on the same connection (``keepalive``, unless the
    server said ``connection: close``) or a new one.  With ``rounds``, requests
    go in rounds instead: all clients send at once (from the start, no ramp),
    and the next round goes when every response of the last one has ended.
    ``on_window("start")`` and ``on_window("end")`` are called at the
    edges of the measured window (from ``warmup_s`` on, for ``measure_s``), so
    the caller reads CPU counters at the same moments; then every socket is
    closed.  What is counted, over the window only:

    - ``tokens`` (in the body bytes: a synthetic token's text is " t<id>", and
      nothing else in a compact OpenAI chunk has a space before a "t");
    - ``arrivals``: socket reads that carried at least one token, and for each
      but a request's first, ``gaps`` (seconds since that request's previous
      arrival; the first decode token's gap includes the KV handoff) with
      ``gap_tokens`` (how many tokens it carried);
    - ``ttfts``: from sending the request (from starting to connect, without
      ``keepalive``) to its first token;
    - ``requests_done`` (ended within the window), ``incomplete`` (of those, ones
      with a token count other than ``expected_tokens``), and ``streaming``:
      for each ended request whose tokens came in three reads or more, (last
      read's time - second read's time, tokens in the reads after the second):
      the decode phase, without the first token (prefill's) and the handoff;
    - ``failures`` by kind (a status other than 200, an ``"error"`` in the stream,
      the server closing mid-response, a failed connect), and ``failures_total``
      from the very start, warm-up included;
    - ``load_cpu_s``: this process's CPU time.
    """
    host, port_text = address.rsplit(":", 1)
    port = int(port_text)
    epoll = select.epoll()
    streams: dict[int, _Stream] = {}
    t0 = time.perf_counter()
    window_start = t0 + warmup_s
    window_end = window_start + measure_s
    starts = [t0 + (0.0 if rounds else ramp_s * i / clients) for i in range(clients)][::-1]
    idle: list[_Stream] = []  # with rounds: done with this round
    measuring = False
    tokens = arrivals = received = requests_done = incomplete = 0
    gaps: list[float] = []
    gap_tokens: list[int] = []
    ttfts: list[float] = []
    streaming: list[tuple[float, int]] = []
    failures: Counter[str] = Counter()
    failures_total: Counter[str] = Counter()
    cpu_start = 0.0

    def fail(kind: str) -> None:
        failures_total[kind] += 1
        if measuring:
            failures[kind] += 1

    def connect(stream: _Stream, now: float) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        sock.connect_ex((host, port))
        stream.sock = sock
        stream.connecting = True
        stream.sent_at = now
        stream.reset()
        streams[sock.fileno()] = stream
        epoll.register(sock.fileno(), select.EPOLLOUT)

    def reconnect(stream: _Stream, now: float) -> None:
        sock = stream.sock
        assert sock is not None
        epoll.unregister(sock.fileno())
        del streams[sock.fileno()]
        sock.close()
        connect(stream, now)

    def next_request(stream: _Stream, now: float) -> None:
        sock = stream.sock
        assert sock is not None
        if keepalive and not stream.close_after:
            stream.reset()
            stream.sent_at = now
            sock.send(request)
        else:
            reconnect(stream, now)

    try:
        while True:
            now = time.perf_counter()
            while starts and starts[-1] <= now:
                starts.pop()
                connect(_Stream(), now)
            if not measuring and now >= window_start:
                if on_window is not None:
                    on_window("start")
                measuring = True
                cpu_start = time.process_time()
            if now >= window_end:
                if on_window is not None:
                    on_window("end")
                break
            timeout = (window_end if measuring else window_start) - now
            if starts:
                timeout = min(timeout, starts[-1] - now)
            for fd, _ in epoll.poll(max(0.0, timeout)):
                stream = streams[fd]
                sock = stream.sock
                assert sock is not None
                if stream.connecting:
                    error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if error:
                        fail(f"connect: {os.strerror(error)}")
                        reconnect(stream, time.perf_counter())
                        continue
                    sock.send(request)  # a few hundred bytes into an empty socket buffer
                    stream.connecting = False
                    epoll.modify(fd, select.EPOLLIN)
                    continue
                try:
                    data = sock.recv(262144)
                except ConnectionError:
                    data = b""
                now = time.perf_counter()
                if not data:
                    fail("closed mid-response")
                    reconnect(stream, now)
                    continue
                if not stream.in_body:
                    head = stream.head + data
                    end = head.find(b"\r\n\r\n")
                    if end < 0:
                        stream.head = head
                        continue
                    if not head.startswith(b"HTTP/1.1 200"):
                        fail(head.split(b"\r\n", 1)[0].decode(errors="replace"))
                        reconnect(stream, now)
                        continue
                    # hypercorn closes a connection after keep_alive_max_requests (1000)
                    stream.close_after = b"\r\nconnection: close\r\n" in head[: end + 2].lower()
                    stream.head = b""
                    stream.in_body = True
                    data = head[end + 4 :]
                    if measuring:
                        received += len(head) - len(data)
                if measuring:
                    received += len(data)
                window = stream.tail + data
                count = window.count(b" t") - stream.tail.count(b" t")
                if count:
                    stream.tokens += count
                    if stream.first is None:
                        stream.first = now
                        if measuring:
                            ttfts.append(now - stream.sent_at)
                    else:
                        if stream.second is None:
                            stream.second = now
                            stream.second_tokens = stream.tokens
                        if measuring:
                            gaps.append(now - stream.last)
                            gap_tokens.append(count)
                    stream.last = now
                    if measuring:
                        tokens += count
                        arrivals += 1
                if not stream.errored and b'"error"' in window:
                    stream.errored = True
                    fail("error event")
                stream.tail = window[-16:]
                if not stream.done_seen:
                    stream.done_seen = b"data: [DONE]" in window
                if stream.done_seen and window.endswith(_END_OF_BODY):
                    if measuring:
                        requests_done += 1
                        incomplete += stream.tokens != expected_tokens
                        after = stream.tokens - stream.second_tokens
                        if stream.second is not None and after > 0:
                            streaming.append((stream.last - stream.second, after))
                    if not rounds:
                        next_request(stream, now)
                        continue
                    idle.append(stream)
                    if len(idle) == clients:
                        for waiting in idle:
                            next_request(waiting, now)
                        idle.clear()
    finally:
        load_cpu_s = time.process_time() - cpu_start
        for stream in streams.values():
            if stream.sock is not None:
                stream.sock.close()
        epoll.close()
    return {
        "window_s": time.perf_counter() - window_start if measuring else 0.0,
        "tokens": tokens,
        "arrivals": arrivals,
        "bytes": received,
        "requests_done": requests_done,
        "incomplete": incomplete,
        "gaps": gaps,
        "gap_tokens": gap_tokens,
        "ttfts": ttfts,
        "streaming": streaming,
        "failures": dict(failures),
        "failures_total": dict(failures_total),
        "load_cpu_s": load_cpu_s,
    }
