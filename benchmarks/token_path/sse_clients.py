"""The e2e section's load: many raw-socket SSE clients in one process, one selector.

Clients start spread over the first second, each streaming completions back
to back.  From ``warmup_s`` on, for ``measure_s``, tokens, events, bytes and
inter-event gaps are counted (the lines ``MARK start`` / ``MARK end`` let the
driver read CPU counters at the same moments); then every socket is closed
and ``RESULT {json}`` printed.  Tokens are counted in the bytes: each
synthetic token's text is " t<id>", and nothing else in a compact OpenAI
chunk has a space before a "t".
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import socket
import time
from collections import Counter
from typing import Any

from benchmarks.token_path.measure import percentile


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
    }
    print("RESULT " + json.dumps(result), flush=True)
