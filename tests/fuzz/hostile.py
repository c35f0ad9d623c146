"""What a hostile peer sends: a corpus of known-hostile byte streams and Hypothesis
strategies for more, per target of ``tests/fuzz/live.py``.

A :class:`Case` is bytes and a way to end: the chunks are written one after the
other on one connection (or on ``connections`` at once), then the connection is
closed, half-closed (``shutdown(SHUT_WR)``, then the answer read) or reset (RST).
Nothing here opens a socket; the runner in ``live.py`` does.

Targets (:data:`TARGETS`): the router's HTTP port, each worker's HTTP port (its
``/pd/link`` websocket before its handshake included), a worker's KV transfer port
before the proof of the secret; and, as a peer that did prove it (a router or a
decode gone wrong), the link after its websocket handshake and a KV session after
its opening: what a stranger can never reach, fuzzed all the same.
"""

from __future__ import annotations

import functools
import ssl
import struct
from collections.abc import Iterator, Sequence
from typing import Any, Final, Literal

import attrs
import msgpack
from hypothesis import strategies as st

from tests.fuzz.test_parsers import (
    near_valid_msgpack,
    to_worker_messages,
    transfer_dones,
    transfer_requests,
)

Ending = Literal["close", "half_close", "reset"]

ROUTER: Final = "router"
PREFILL: Final = "prefill"
DECODE: Final = "decode"
KV: Final = "kv"
LINK: Final = "link"  # prefill's /pd/link after its handshake, as a peer holding the secret
LINK_DECODE: Final = "link-decode"  # decode's
KV_SESSION: Final = "kv-session"  # the KV port after its opening, as a peer holding the secret
TARGETS: Final = (ROUTER, PREFILL, DECODE, KV, LINK, LINK_DECODE, KV_SESSION)
HTTP_TARGETS: Final = (ROUTER, PREFILL, DECODE)


@attrs.frozen
class Case:
    """Bytes a peer writes, and how it leaves."""

    name: str
    chunks: tuple[bytes, ...]
    ending: Ending = "close"
    connections: int = 1
    # whether the target must serve others while these connections are still open
    # (checked before they are read and closed)
    hold: bool = False

    def describe(self) -> str:
        """The case as exact bytes, for a report (long payloads shortened)."""
        data = b"".join(self.chunks)
        shown = repr(data) if len(data) <= 600 else f"{data[:400]!r} ... {data[-100:]!r}"
        cuts = [len(c) for c in self.chunks]
        return (
            f"{self.name}: {len(data)} bytes in writes of {cuts if len(cuts) <= 12 else '...'}, "
            f"then {self.ending}"
            + (f", on {self.connections} connections" if self.connections > 1 else "")
            + f"\n    {shown}"
        )


# --- building blocks ----------------------------------------------------------------

WS_KEY: Final = b"dGhlIHNhbXBsZSBub25jZQ=="
CRLF: Final = b"\r\n"


def request(
    method: bytes = b"GET",
    target: bytes = b"/",
    headers: Sequence[tuple[bytes, bytes]] = (),
    body: bytes = b"",
    *,
    version: bytes = b"HTTP/1.1",
    host: bool = True,
) -> bytes:
    lines = [method + b" " + target + b" " + version]
    if host:
        lines.append(b"Host: x")
    lines += [name + b": " + value for name, value in headers]
    return CRLF.join(lines) + CRLF + CRLF + body


def upgrade_headers(key: bytes = WS_KEY) -> list[tuple[bytes, bytes]]:
    return [
        (b"Upgrade", b"websocket"),
        (b"Connection", b"Upgrade"),
        (b"Sec-WebSocket-Key", key),
        (b"Sec-WebSocket-Version", b"13"),
    ]


def ws_frame(
    payload: bytes,
    opcode: int = 0x2,
    *,
    fin: bool = True,
    rsv: int = 0,
    mask: bytes | None = b"\x00\x00\x00\x00",
    length: int | None = None,
) -> bytes:
    """One websocket frame; ``length`` overrides the declared payload length."""
    size = len(payload) if length is None else length
    head = bytes([(0x80 if fin else 0) | (rsv & 0x7) << 4 | (opcode & 0xF)])
    bit = 0x80 if mask is not None else 0
    if size < 126:
        head += bytes([bit | size])
    elif size < 1 << 16:
        head += bytes([bit | 126]) + struct.pack("!H", size)
    else:
        head += bytes([bit | 127]) + struct.pack("!Q", size & ((1 << 64) - 1))
    if mask is None:
        return head + payload
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


@functools.cache
def tls_client_hello() -> bytes:
    """The first flight of a TLS client (a ClientHello), as written to a plain port."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


H2_PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_SETTINGS: Final = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
# a HEADERS frame (stream 1, END_HEADERS|END_STREAM): :method GET, :scheme http, :path /
H2_HEADERS: Final = b"\x00\x00\x03\x01\x05\x00\x00\x00\x01\x82\x86\x84"
API_BODY: Final = b'{"model": "synthetic", "prompt": "hi", "max_tokens": 2}'
JSON: Final = (b"Content-Type", b"application/json")


def _cut_everywhere(name: str, data: bytes, ending: Ending, step: int = 1) -> Iterator[Case]:
    for at in range(0, len(data) + 1, step):
        yield Case(f"{name}[:{at}]", (data[:at],), ending)


# --- the corpus ---------------------------------------------------------------------


def http_corpus(paths: Sequence[bytes], *, every_offset: bool = True) -> list[Case]:
    """Known-hostile HTTP/1.1 streams for any of our HTTP ports; ``paths`` are its routes
    (the first a POST route taking a body)."""
    post = paths[0]
    upgrade = request(b"GET", b"/", upgrade_headers())
    frame = ws_frame(b"hi", 0x1)
    body_request = request(
        b"POST", post, [JSON, (b"Content-Length", b"%d" % len(API_BODY))], API_BODY
    )
    cases = [
        # the known crash: a frame in the same write as the upgrade
        Case("ws-upgrade-with-frame", (upgrade + b"\x81\x82\x00\x00\x00\x00hi",)),
        Case("ws-upgrade-with-frame-half-close", (upgrade + frame,), "half_close"),
        Case("ws-upgrade-with-frame-reset", (upgrade + frame,), "reset"),
        Case("ws-upgrade-then-frame", (upgrade, frame)),
        Case("ws-upgrade-no-frames", (upgrade,)),
        Case("ws-upgrade-no-frames-half-close", (upgrade,), "half_close"),
        Case("ws-upgrade-close-frame", (upgrade + ws_frame(b"\x03\xe8", 0x8),)),
        Case("ws-upgrade-huge-frame-length", (upgrade + ws_frame(b"", length=1 << 62),)),
        Case("ws-upgrade-unmasked-frame", (upgrade + ws_frame(b"hello", mask=None),)),
        Case("ws-upgrade-fragments", (upgrade + ws_frame(b"a", fin=False) + ws_frame(b"b", 0),)),
        Case("ws-upgrade-bad-opcode", (upgrade + ws_frame(b"x", 0xB),)),
        Case("ws-upgrade-rsv-bits", (upgrade + ws_frame(b"x", rsv=7),)),
        Case("ws-upgrade-many-frames", (upgrade + frame * 2000,)),
        Case("ws-upgrade-garbage", (upgrade + bytes(range(256)) * 8,)),
        Case(
            "ws-upgrade-pipelined-get",
            (upgrade + request(b"GET", b"/health"),),
        ),
        Case(
            "ws-upgrade-on-post-path",
            (request(b"GET", post, upgrade_headers()) + frame,),
        ),
        Case(
            "ws-upgrade-bad-version",
            (request(b"GET", b"/", [*upgrade_headers()[:3], (b"Sec-WebSocket-Version", b"99")]),),
        ),
        Case(
            "ws-upgrade-no-key",
            (request(b"GET", b"/", upgrade_headers()[:2]) + frame,),
        ),
        Case(
            "ws-upgrade-http10",
            (request(b"GET", b"/", upgrade_headers(), version=b"HTTP/1.0") + frame,),
        ),
        Case(
            "ws-upgrade-with-body",
            (
                request(b"POST", b"/", [*upgrade_headers(), (b"Content-Length", b"5")], b"hello")
                + frame,
            ),
        ),
        Case(
            "h2c-upgrade",
            (
                request(
                    b"GET",
                    b"/health",
                    [
                        (b"Connection", b"Upgrade, HTTP2-Settings"),
                        (b"Upgrade", b"h2c"),
                        (b"HTTP2-Settings", b"AAMAAABkAARAAAAAAAIAAAAA"),
                    ],
                )
                + H2_SETTINGS,
            ),
        ),
        Case(
            "h2c-upgrade-with-preface",
            (
                request(
                    b"GET",
                    b"/",
                    [
                        (b"Connection", b"Upgrade, HTTP2-Settings"),
                        (b"Upgrade", b"h2c"),
                        (b"HTTP2-Settings", b""),
                    ],
                )
                + H2_PREFACE
                + H2_SETTINGS
                + H2_HEADERS,
            ),
        ),
        Case("h2-preface", (H2_PREFACE,)),
        Case("h2-preface-settings-headers", (H2_PREFACE + H2_SETTINGS + H2_HEADERS,)),
        Case("h2-preface-garbage-frames", (H2_PREFACE + H2_SETTINGS + b"\xff" * 64,)),
        Case("h2-preface-truncated", (H2_PREFACE[:10],), "half_close"),
        Case("tls-client-hello", (tls_client_hello(),)),
        Case("tls-client-hello-half-close", (tls_client_hello(),), "half_close"),
        Case("pipelined-health-x100", (request(b"GET", b"/health") * 100,)),
        Case("pipelined-health-x100-reset", (request(b"GET", b"/health") * 100,), "reset"),
        Case("pipelined-posts", (body_request * 20,)),
        Case("pipelined-posts-half-close", (body_request * 20,), "half_close"),
        Case(
            "pipelined-after-unread-body",
            (
                request(b"POST", post, [(b"Content-Length", b"100000")], b"x" * 10)
                + request(b"GET", b"/health"),
            ),
        ),
        Case(
            "content-length-10M-no-body",
            (request(b"POST", post, [JSON, (b"Content-Length", b"10000000")]),),
        ),
        Case(
            "content-length-10M-no-body-x300",
            (request(b"POST", post, [JSON, (b"Content-Length", b"10000000")]),),
            connections=300,
        ),
        Case(
            "content-length-10M-no-body-x300-half-close",
            (request(b"POST", post, [JSON, (b"Content-Length", b"10000000")]),),
            "half_close",
            connections=300,
        ),
        Case(
            "strangers-x500-held-partial-head",
            (b"POST " + post + b" HTTP/1.1\r\nHost: x\r\nX-Slow: ",),
            connections=500,
            hold=True,
        ),
        Case(
            "strangers-x500-held-body-never-comes",
            (request(b"POST", post, [JSON, (b"Content-Length", b"10000000")], b"{"),),
            connections=500,
            hold=True,
        ),
        Case(
            "strangers-x300-held-upgrade-with-frame",
            (upgrade + b"\x81\x82\x00\x00\x00\x00hi",),
            connections=300,
            hold=True,
        ),
        Case(
            "content-length-10M-partial-body-reset",
            (request(b"POST", post, [JSON, (b"Content-Length", b"10000000")], b"{" * 70000),),
            "reset",
        ),
        Case("content-length-huge", (request(b"POST", post, [(b"Content-Length", b"9" * 40)]),)),
        Case("content-length-negative", (request(b"POST", post, [(b"Content-Length", b"-1")]),)),
        Case("content-length-plus", (request(b"POST", post, [(b"Content-Length", b"+2")], b"{}"),)),
        Case(
            "content-length-twice-differ",
            (
                request(
                    b"POST", post, [(b"Content-Length", b"2"), (b"Content-Length", b"3")], b"{}x"
                ),
            ),
        ),
        Case(
            "content-length-list", (request(b"POST", post, [(b"Content-Length", b"2, 2")], b"{}"),)
        ),
        Case(
            "content-length-and-chunked",
            (
                request(
                    b"POST",
                    post,
                    [(b"Content-Length", b"3"), (b"Transfer-Encoding", b"chunked")],
                    chunked(b"{}"),
                ),
            ),
        ),
        Case(
            "chunked-valid",
            (
                request(
                    b"POST",
                    post,
                    [JSON, (b"Transfer-Encoding", b"chunked")],
                    chunked(API_BODY[:10], API_BODY[10:]),
                ),
            ),
        ),
        Case(
            "chunked-bad-size",
            (
                request(
                    b"POST", post, [(b"Transfer-Encoding", b"chunked")], b"zz\r\n{}\r\n0\r\n\r\n"
                ),
            ),
        ),
        Case(
            "chunked-size-overflow",
            (
                request(
                    b"POST", post, [(b"Transfer-Encoding", b"chunked")], b"f" * 40 + b"\r\n{}\r\n"
                ),
            ),
        ),
        Case(
            "chunked-size-lies",
            (
                request(
                    b"POST", post, [(b"Transfer-Encoding", b"chunked")], b"ffff\r\n{}\r\n0\r\n\r\n"
                ),
            ),
            "half_close",
        ),
        Case(
            "chunked-missing-crlf",
            (request(b"POST", post, [(b"Transfer-Encoding", b"chunked")], b"2\r\n{}0\r\n\r\n"),),
        ),
        Case(
            "chunked-huge-extension",
            (
                request(
                    b"POST",
                    post,
                    [(b"Transfer-Encoding", b"chunked")],
                    b"2;" + b"a" * 200000 + b"\r\n{}\r\n0\r\n\r\n",
                ),
            ),
        ),
        Case(
            "chunked-huge-trailer",
            (
                request(
                    b"POST",
                    post,
                    [(b"Transfer-Encoding", b"chunked")],
                    b"2\r\n{}\r\n0\r\n" + b"X-T: " + b"t" * 200000 + b"\r\n\r\n",
                ),
            ),
        ),
        Case(
            "chunked-endless-tiny-chunks",
            (request(b"POST", post, [(b"Transfer-Encoding", b"chunked")], b"1\r\n \r\n" * 50000),),
        ),
        Case(
            "chunked-twice",
            (
                request(
                    b"POST", post, [(b"Transfer-Encoding", b"chunked, chunked")], chunked(b"{}")
                ),
            ),
        ),
        Case(
            "transfer-encoding-gzip",
            (request(b"POST", post, [(b"Transfer-Encoding", b"gzip")], b"\x1f\x8b"),),
        ),
        Case(
            "transfer-encoding-folded",
            (request(b"POST", post, [(b"Transfer-Encoding", b"\r\n chunked")], chunked(b"{}")),),
        ),
        Case("huge-header-value", (request(b"GET", b"/health", [(b"X-Big", b"a" * 1_000_000)]),)),
        Case(
            "many-headers",
            (request(b"GET", b"/health", [(b"X-%d" % i, b"v") for i in range(20000)]),),
        ),
        Case("huge-request-line", (b"GET /" + b"a" * 2_000_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",)),
        Case("huge-method", (b"G" * 100000 + b" / HTTP/1.1\r\n\r\n",)),
        Case(
            "folded-header",
            (request(b"GET", b"/health", [(b"X-Folded", b"a\r\n b\r\n\tc")]),),
        ),
        Case(
            "folded-authorization",
            (
                request(
                    b"POST",
                    post,
                    [(b"Authorization", b"Bearer\r\n x"), (b"Content-Length", b"2")],
                    b"{}",
                ),
            ),
        ),
        Case(
            "folded-first-header",
            (b"GET /health HTTP/1.1\r\n folded: x\r\nHost: x\r\n\r\n",),
        ),
        Case("header-no-colon", (b"GET /health HTTP/1.1\r\nHost: x\r\nnocolon\r\n\r\n",)),
        Case("header-space-before-colon", (b"GET /health HTTP/1.1\r\nHost : x\r\n\r\n",)),
        Case("header-nul", (b"GET /health HTTP/1.1\r\nHost: x\x00y\r\n\r\n",)),
        Case(
            "header-high-bytes",
            (b"GET /health HTTP/1.1\r\nHost: \xff\xfe\r\nX-\xc3: \x80\r\n\r\n",),
        ),
        Case("bare-lf", (b"GET /health HTTP/1.1\nHost: x\n\n",)),
        Case("bare-cr", (b"GET /health HTTP/1.1\rHost: x\r\r",)),
        Case("no-host", (request(b"GET", b"/health", host=False),)),
        Case("two-hosts", (request(b"GET", b"/health", [(b"Host", b"y")]),)),
        Case(
            "http10-keepalive",
            (
                request(b"GET", b"/health", [(b"Connection", b"keep-alive")], version=b"HTTP/1.0")
                * 3,
            ),
        ),
        Case("http09", (b"GET /health\r\n",)),
        Case("http2-version", (request(b"GET", b"/health", version=b"HTTP/2.0"),)),
        Case("http-bad-version", (request(b"GET", b"/health", version=b"HTTP/1.1111111"),)),
        Case("absolute-form", (request(b"GET", b"http://127.0.0.1/health"),)),
        Case("connect", (request(b"CONNECT", b"127.0.0.1:1"),)),
        Case("options-star", (request(b"OPTIONS", b"*"),)),
        Case("trace", (request(b"TRACE", b"/"),)),
        Case("head-post-path", (request(b"HEAD", post),)),
        Case(
            "get-with-body", (request(b"GET", b"/health", [(b"Content-Length", b"5")], b"hello"),)
        ),
        Case("path-percent-nul", (request(b"GET", b"/health%00/../%ff%c0%af"),)),
        Case("path-unicode", (request(b"GET", "/héalth/😀".encode()),)),
        Case("path-query-huge", (request(b"GET", b"/health?" + b"a=1&" * 50000),)),
        Case(
            "expect-100-no-body",
            (request(b"POST", post, [(b"Expect", b"100-continue"), (b"Content-Length", b"100")]),),
        ),
        Case(
            "expect-100-then-body",
            (
                request(
                    b"POST",
                    post,
                    [
                        JSON,
                        (b"Expect", b"100-continue"),
                        (b"Content-Length", b"%d" % len(API_BODY)),
                    ],
                ),
                API_BODY,
            ),
        ),
        Case(
            "bad-bearer",
            (
                request(
                    b"POST",
                    post,
                    [
                        JSON,
                        (b"Authorization", b"Bearer " + b"k" * 10000),
                        (b"Content-Length", b"%d" % len(API_BODY)),
                    ],
                    API_BODY,
                ),
            ),
        ),
        Case(
            "bad-hmac-authorization",
            (
                request(
                    b"GET",
                    b"/pd/stats",
                    [
                        (
                            b"Authorization",
                            b'PDTRIO-HMAC nonce="AAAA", '
                            b'client-nonce="====", proof="' + b"A" * 5000 + b'"',
                        )
                    ],
                ),
            ),
        ),
        Case("empty-lines-first", (CRLF * 1000 + request(b"GET", b"/health"),)),
        Case("only-crlf", (CRLF * 100000,)),
        Case("random-bytes", (bytes(range(256)) * 64,)),
        Case("nul-bytes", (b"\x00" * 65536,)),
        Case("nothing-half-close", (b"",), "half_close"),
        Case("nothing-reset", (b"",), "reset"),
        Case("body-byte-by-byte", tuple(bytes([b]) for b in body_request[:200])),
        Case("pipelined-mixed", (request(b"GET", b"/health") + upgrade + body_request,)),
        Case("health-then-reset", (request(b"GET", b"/health"),), "reset"),
    ]
    for path in paths[1:]:
        cases.append(
            Case(
                f"ws-upgrade-with-frame-{path.decode()}",
                (request(b"GET", path, upgrade_headers()) + b"\x81\x82\x00\x00\x00\x00hi",),
            )
        )
    # half-close at every byte offset of a request with a body, and of an upgrade and frame
    step = 1 if every_offset else 7
    cases += _cut_everywhere("post-half-closed", body_request, "half_close", step)
    cases += _cut_everywhere("upgrade-half-closed", upgrade + frame, "half_close", step)
    cases += _cut_everywhere("post-reset", body_request, "reset", step * 5)
    return cases


ROUTER_PATHS: Final = (
    b"/v1/completions",
    b"/v1/chat/completions",
    b"/v1/responses",
    b"/v1/models",
    b"/health",
    b"/metrics",
    b"/pd/link",
)
WORKER_PATHS: Final = (
    b"/pd/prefill",
    b"/pd/release",
    b"/pd/link",
    b"/pd/auth",
    b"/pd/info",
    b"/pd/stats",
    b"/health",
    b"/metrics",
)


def link_upgrade(extra: Sequence[tuple[bytes, bytes]] = (), query: bytes = b"") -> bytes:
    return request(b"GET", b"/pd/link" + query, [*upgrade_headers(), *extra])


def worker_corpus(*, every_offset: bool = True) -> list[Case]:
    """A worker's HTTP port: the HTTP corpus, and its link before the handshake."""
    message = msgpack.packb([4, "r", [1, 2]])
    fake = (
        b"Authorization",
        b'PDTRIO-HMAC nonce="'
        + b"A" * 43
        + b'", client-nonce="'
        + b"B" * 43
        + b'", proof="'
        + b"C" * 43
        + b'"',
    )
    cases = http_corpus(WORKER_PATHS, every_offset=every_offset)
    cases += [
        Case("link-no-auth-with-frame", (link_upgrade() + ws_frame(message),)),
        Case("link-fake-auth-with-frame", (link_upgrade([fake]) + ws_frame(message),)),
        Case("link-no-auth-then-frames", (link_upgrade(), ws_frame(message) * 100)),
        Case("link-no-auth-half-close", (link_upgrade(),), "half_close"),
        Case(
            "link-query-garbage",
            (link_upgrade(query=b"?heartbeat_s=nan&batch=%ff&kv_events=1" + b"&x" * 10000),),
        ),
        Case("link-bearer", (link_upgrade([(b"Authorization", b"Bearer x")]) + ws_frame(b"\xc1"),)),
    ]
    return cases


def kv_corpus(*, every_offset: bool = True) -> list[Case]:
    """A KV transfer port before the opening's proof: session byte, nonce, proof."""
    opening = b"B" + bytes(32)
    wrong = opening + b"\x00" * 32
    cases = [
        Case("kv-nothing", (b"",)),
        Case("kv-nothing-half-close", (b"",), "half_close"),
        Case("kv-nothing-reset", (b"",), "reset"),
        Case("kv-opening-only", (opening,)),
        Case("kv-wrong-proof", (wrong,)),
        Case("kv-wrong-proof-then-request", (wrong + struct.pack("!I", 3) + b"\x93\xa1r\x90",)),
        Case("kv-nixl-wrong-proof", (b"N" + bytes(64),)),
        Case("kv-unknown-session", (b"Z" + bytes(64) + b"rest",)),
        Case("kv-http-get", (request(b"GET", b"/health"),)),
        Case(
            "kv-ws-upgrade-with-frame",
            (request(b"GET", b"/", upgrade_headers()) + b"\x81\x82\x00\x00\x00\x00hi",),
        ),
        Case("kv-tls-client-hello", (tls_client_hello(),)),
        Case("kv-h2-preface", (H2_PREFACE + H2_SETTINGS,)),
        Case("kv-megabyte", (bytes(range(256)) * 4096,)),
        Case("kv-byte-by-byte", tuple(bytes([b]) for b in wrong)),
        Case("kv-connections-x300", (opening,), connections=300),
        Case("kv-strangers-x500-held", (opening,), connections=500, hold=True),
        Case("kv-strangers-x500-held-silent", (b"",), connections=500, hold=True),
        Case("kv-connections-x300-half-close", (b"B",), "half_close", connections=300),
    ]
    step = 1 if every_offset else 5
    cases += _cut_everywhere("kv-opening-half-closed", wrong, "half_close", step)
    cases += _cut_everywhere("kv-opening-reset", wrong, "reset", step * 4)
    return cases


def link_corpus() -> list[Case]:
    """The link after its handshake (we hold the secret): frames a broken router sends."""
    big = 1 << 62
    return [
        Case("link-nothing", (b"",)),
        Case("link-nothing-half-close", (b"",), "half_close"),
        Case("link-nothing-reset", (b"",), "reset"),
        Case("link-text-frame", (ws_frame(b"hello", 0x1),)),
        Case("link-bad-utf8-text", (ws_frame(b"\xff\xfe", 0x1),)),
        Case("link-empty-binary", (ws_frame(b""),)),
        Case("link-msgpack-nil", (ws_frame(b"\xc0"),)),
        Case("link-msgpack-deep", (ws_frame(b"\x91" * 3000 + b"\xc0"),)),
        Case("link-msgpack-truncated", (ws_frame(b"\x95\x04\xa1r"),)),
        Case("link-msgpack-huge-array-header", (ws_frame(b"\xdd\xff\xff\xff\xff"),)),
        Case("link-msgpack-huge-str-header", (ws_frame(b"\xdb\xff\xff\xff\xff"),)),
        Case("link-unknown-tag", (ws_frame(msgpack.packb([999, "r"])),)),
        Case("link-abort-unknown", (ws_frame(msgpack.packb([6, "nobody"])),)),
        Case("link-frame-length-huge", (ws_frame(b"", length=big),)),
        Case("link-frame-length-2g", (ws_frame(b"", length=1 << 31),)),
        Case("link-frame-truncated", (ws_frame(b"x" * 100)[:50],)),
        Case("link-frame-truncated-half-close", (ws_frame(b"x" * 100)[:50],), "half_close"),
        Case("link-unmasked", (ws_frame(b"\xc0", mask=None),)),
        Case("link-ping", (ws_frame(b"p", 0x9),)),
        Case("link-ping-too-long", (ws_frame(b"p" * 200, 0x9),)),
        Case("link-pong", (ws_frame(b"p", 0xA),)),
        Case("link-close-bad-code", (ws_frame(b"\x00\x01", 0x8),)),
        Case("link-close-one-byte", (ws_frame(b"\x03", 0x8),)),
        Case("link-close-then-more", (ws_frame(b"\x03\xe8", 0x8) + ws_frame(b"\xc0"),)),
        Case("link-continuation-first", (ws_frame(b"\xc0", 0x0),)),
        Case("link-fragmented-never-ends", (ws_frame(b"\x91", fin=False),)),
        Case(
            "link-fragments-many",
            (ws_frame(b"\x91", fin=False) + ws_frame(b"\x91", 0, fin=False) * 5000,),
        ),
        Case("link-fragmented-control", (ws_frame(b"p", 0x9, fin=False),)),
        Case("link-rsv", (ws_frame(b"\xc0", rsv=4),)),
        Case("link-reserved-opcode", (ws_frame(b"\xc0", 0x3),)),
        Case("link-many-frames", (ws_frame(b"\xc0") * 10000,)),
        Case("link-random", (bytes(range(256)) * 16,)),
        Case("link-http-inside", (request(b"GET", b"/health"),)),
        Case("link-reset-mid-frame", (ws_frame(b"x" * 1000)[:500],), "reset"),
    ]


def kv_session_corpus() -> list[Case]:
    """A KV blocks session after its opening (we hold the secret): what a broken decode sends."""
    length = struct.Struct("!I").pack
    req = msgpack.packb(["nobody", [1, 2, 3], "grant"])
    return [
        Case("kvs-nothing", (b"",)),
        Case("kvs-nothing-half-close", (b"",), "half_close"),
        Case("kvs-length-only", (length(10),), "half_close"),
        Case("kvs-length-huge", (length(0xFFFFFFFF),)),
        Case("kvs-length-zero", (length(0),)),
        Case("kvs-request-unknown", (length(len(req)) + req,)),
        Case("kvs-request-unknown-half-close", (length(len(req)) + req,), "half_close"),
        Case("kvs-request-garbage", (length(5) + b"\xc1\xc1\xc1\xc1\xc1",)),
        Case("kvs-request-deep", (length(3001) + b"\x91" * 3000 + b"\xc0",)),
        Case(
            "kvs-request-many-blocks",
            (length(len(big := msgpack.packb(["r", list(range(100000)), "g"]))) + big,),
        ),
        Case("kvs-truncated", ((length(len(req)) + req)[:7],), "half_close"),
        Case("kvs-random", (bytes(range(256)) * 16,)),
        Case("kvs-reset", (length(len(req)) + req[:3],), "reset"),
    ]


def corpus(target: str, *, every_offset: bool = True) -> list[Case]:
    """The known-hostile cases for ``target``."""
    if target == ROUTER:
        return http_corpus(ROUTER_PATHS, every_offset=every_offset)
    if target in (PREFILL, DECODE):
        return worker_corpus(every_offset=every_offset)
    if target == KV:
        return kv_corpus(every_offset=every_offset)
    if target in (LINK, LINK_DECODE):
        return link_corpus()
    if target == KV_SESSION:
        return kv_session_corpus()
    raise ValueError(f"no target {target!r}")


# --- strategies ---------------------------------------------------------------------

_token = st.text(
    alphabet="!#$%&'*+-.^_`|~abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
    min_size=1,
    max_size=12,
).map(str.encode)
_any_bytes = st.binary(max_size=64)
_methods = (
    st.sampled_from(
        [
            b"GET",
            b"POST",
            b"PUT",
            b"HEAD",
            b"OPTIONS",
            b"DELETE",
            b"PATCH",
            b"CONNECT",
            b"TRACE",
            b"PRI",
            b"get",
            b"",
        ]
    )
    | _token
)
_versions = st.sampled_from(
    [b"HTTP/1.1"] * 6
    + [
        b"HTTP/1.0",
        b"HTTP/2.0",
        b"HTTP/0.9",
        b"HTTP/1.2",
        b"http/1.1",
        b"HTTP/1.1 extra",
        b"",
        b"HTTP/" + b"1" * 100,
    ]
)
_numbers = st.sampled_from(
    [
        b"0",
        b"1",
        b"2",
        b"10",
        b"100",
        b"10000000",
        b"-1",
        b"+1",
        b"1e3",
        b"0x10",
        b"1, 1",
        b" 3 ",
        b"9" * 30,
        b"",
        b"\x00",
    ]
) | st.integers(0, 1 << 70).map(lambda n: b"%d" % n)
_header_values: dict[bytes, st.SearchStrategy[bytes]] = {
    b"Content-Length": _numbers,
    b"Transfer-Encoding": st.sampled_from(
        [
            b"chunked",
            b"chunked, chunked",
            b"gzip, chunked",
            b"identity",
            b"gzip",
            b"chunked\x00",
            b"Chunked",
            b" chunked",
            b"x",
        ]
    ),
    b"Connection": st.sampled_from(
        [b"close", b"keep-alive", b"Upgrade", b"upgrade, close", b"Upgrade, HTTP2-Settings", b""]
    ),
    b"Upgrade": st.sampled_from(
        [b"websocket", b"h2c", b"WebSocket", b"websocket, h2c", b"tls/1.3", b""]
    ),
    b"Sec-WebSocket-Key": st.sampled_from([WS_KEY, b"", b"short", b"=" * 24]) | _any_bytes,
    b"Sec-WebSocket-Version": st.sampled_from([b"13", b"8", b"", b"13, 8", b"99999999999"]),
    b"Sec-WebSocket-Extensions": st.sampled_from(
        [b"permessage-deflate", b"permessage-deflate; client_max_window_bits=8", b'x; y="']
    ),
    b"Sec-WebSocket-Protocol": _token,
    b"HTTP2-Settings": st.sampled_from([b"AAMAAABkAARAAAAAAAIAAAAA", b"", b"!!!"]),
    b"Authorization": st.sampled_from(
        [
            b"Bearer wrong",
            b"Bearer ",
            b"Basic Zm9vOmJhcg==",
            b'PDTRIO-HMAC client-nonce="' + b"A" * 43 + b'"',
            b'PDTRIO-HMAC nonce="x", client-nonce="y", proof="z"',
            b"PDTRIO-HMAC " + b",=" * 3000,
        ]
    )
    | _any_bytes.map(lambda b: b"Bearer " + b),
    b"Expect": st.sampled_from([b"100-continue", b"102-processing", b""]),
    b"Content-Type": st.sampled_from(
        [
            b"application/json",
            b"application/msgpack",
            b"text/plain",
            b"multipart/form-data; boundary=x",
        ]
    ),
    b"Host": st.sampled_from([b"x", b"", b"127.0.0.1:1", b"a" * 300, b"[::1"]),
    b"Accept-Encoding": st.sampled_from([b"gzip", b"br", b"*"]),
    b"Cookie": _any_bytes,
    b"Range": st.sampled_from([b"bytes=0-", b"bytes=-1", b"bytes=9-1"]),
    b"X-Forwarded-For": st.sampled_from([b"1.2.3.4", b"", b"::"]),
}
_known_header = st.sampled_from(sorted(_header_values)).flatmap(
    lambda name: st.tuples(st.just(name), _header_values[name])
)
_weird_header = st.tuples(
    _token | _any_bytes,
    _any_bytes | st.sampled_from([b"a\r\n b", b"\r\n folded", b"x" * 70000, b"\x00", b"\xff"]),
)
_bodies = st.sampled_from(
    [
        b"",
        API_BODY,
        b"{}",
        b"[]",
        b"null",
        b'{"model":',
        b"\x00" * 10,
        b'{"prompt": "' + b"a" * 5000 + b'"}',
        b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}',
        msgpack.packb([1, "r", ["text", "hi"], []]),
    ]
) | st.binary(max_size=256)


@st.composite
def http_requests(draw: st.DrawFn, paths: Sequence[bytes]) -> bytes:
    """One HTTP/1.1 request, usually well-formed up to one or two things."""
    method = draw(_methods)
    path = draw(
        st.sampled_from(list(paths))
        | st.sampled_from([b"/", b"*", b"//", b"/%00", b"/..%2f", b"http://x/health", b"", b"?"])
        | _any_bytes.map(lambda b: b"/" + b)
    )
    if draw(st.booleans()):
        path += b"?" + draw(_any_bytes)
    version = draw(_versions)
    headers = draw(st.lists(_known_header | _weird_header, max_size=8))
    upgrade = draw(st.sampled_from(["none", "none", "websocket", "h2c"]))
    if upgrade == "websocket":
        headers = upgrade_headers() + headers
    elif upgrade == "h2c":
        headers = [
            (b"Connection", b"Upgrade, HTTP2-Settings"),
            (b"Upgrade", b"h2c"),
            (b"HTTP2-Settings", b"AAMAAABkAARAAAAAAAIAAAAA"),
            *headers,
        ]
    body = draw(_bodies)
    framing = draw(st.sampled_from(["length", "length", "chunked", "lie", "none"]))
    if framing == "length":
        headers.append((b"Content-Length", b"%d" % len(body)))
    elif framing == "chunked":
        headers.append((b"Transfer-Encoding", b"chunked"))
        pieces = draw(st.lists(st.integers(0, len(body)), max_size=4))
        cuts = sorted(pieces)
        parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        body = chunked(*[p for p in parts if p])
        if draw(st.booleans()):
            at = draw(st.integers(0, len(body)))
            body = body[:at] + draw(_any_bytes) + body[at + 1 :]  # break the chunking
    elif framing == "lie":
        headers.append((b"Content-Length", b"%d" % (len(body) + draw(st.integers(1, 1 << 20)))))
    line_end = draw(st.sampled_from([CRLF] * 8 + [b"\n", b"\r", b"\r\r\n"]))
    head = line_end.join(
        [method + b" " + path + b" " + version, *(n + b": " + v for n, v in headers)]
    )
    data = head + line_end + line_end + body
    if upgrade == "websocket" and draw(st.booleans()):
        data += b"".join(draw(st.lists(ws_frames(), max_size=3)))  # frames in the same write
    elif upgrade == "h2c" and draw(st.booleans()):
        data += H2_PREFACE + H2_SETTINGS + draw(_any_bytes)
    return data


@st.composite
def ws_frames(draw: st.DrawFn, payloads: st.SearchStrategy[bytes] | None = None) -> bytes:
    """A websocket client frame, now and then broken (unmasked, RSV bits, a lying length,
    a control frame too long or fragmented, an opcode no one defined)."""
    payload = draw(payloads if payloads is not None else _any_bytes)
    opcode = draw(st.sampled_from([0x2] * 6 + [0x1, 0x0, 0x8, 0x9, 0xA, 0x3, 0xB, 0xF]))
    fin = draw(st.booleans()) if draw(st.integers(0, 4)) == 0 else True
    rsv = draw(st.integers(0, 7)) if draw(st.integers(0, 6)) == 0 else 0
    mask = draw(st.sampled_from([b"\x00" * 4, b"\x12\x34\x56\x78", None]))
    length = None
    if draw(st.integers(0, 8)) == 0:
        length = draw(st.sampled_from([0, 125, 126, 65535, 65536, 1 << 31, 1 << 63]))
    frame = ws_frame(payload, opcode, fin=fin, rsv=rsv, mask=mask, length=length)
    if draw(st.integers(0, 8)) == 0:
        frame = frame[: draw(st.integers(0, len(frame)))]
    return frame


def _split(draw: st.DrawFn, data: bytes) -> tuple[bytes, ...]:
    """``data`` in one write or cut into a few, at drawn offsets."""
    if not data or draw(st.integers(0, 2)) != 0:
        return (data,)
    cuts = sorted(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=4, unique=True)))
    return tuple(data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True))


_endings: st.SearchStrategy[Ending] = st.sampled_from(["close", "close", "half_close", "reset"])


@st.composite
def _case(draw: st.DrawFn, name: str, streams: st.SearchStrategy[bytes]) -> Case:
    data = draw(streams)
    if draw(st.integers(0, 5)) == 0:
        data = data[: draw(st.integers(0, len(data)))]  # cut short: the half-close case
    return Case(name, _split(draw, data), draw(_endings))


def http_streams(paths: Sequence[bytes]) -> st.SearchStrategy[bytes]:
    """One request or a few pipelined, now and then with garbage in between or ahead."""
    one = http_requests(paths)
    return st.one_of(
        one,
        st.lists(one, min_size=2, max_size=4).map(b"".join),
        st.tuples(
            st.sampled_from(
                [H2_PREFACE + H2_SETTINGS, tls_client_hello(), CRLF * 3, b"\x16\x03\x01"]
            )
            | _any_bytes,
            one,
        ).map(b"".join),
        st.binary(max_size=512),
    )


def link_messages() -> st.SearchStrategy[bytes]:
    """A link message's payload: near-valid msgpack of what a router sends, or noise."""
    return st.one_of(
        near_valid_msgpack(to_worker_messages),
        st.binary(max_size=128),
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers(-(1 << 64), 1 << 64)
            | st.binary(max_size=8)
            | st.text(max_size=8)
            | st.floats(),
            lambda inner: st.lists(inner, max_size=5),
            max_leaves=20,
        ).map(lambda tree: msgpack.packb(tree, use_bin_type=True) if _packable(tree) else b"\xc1"),
    )


def _packable(tree: Any) -> bool:
    try:
        msgpack.packb(tree)
    except (OverflowError, ValueError, TypeError):
        return False
    return True


def kv_session_messages() -> st.SearchStrategy[bytes]:
    """What a decode sends after the opening: length-prefixed near-valid msgpack, or noise."""
    message = near_valid_msgpack(transfer_requests | transfer_dones) | st.binary(max_size=64)

    @st.composite
    def framed(draw: st.DrawFn) -> bytes:
        body = draw(message)
        size = len(body) if draw(st.integers(0, 5)) else draw(st.integers(0, (1 << 32) - 1))
        return struct.pack("!I", size) + body

    return st.lists(framed(), min_size=1, max_size=3).map(b"".join) | st.binary(max_size=256)


def cases(target: str) -> st.SearchStrategy[Case]:
    """Random cases for ``target``."""
    if target == ROUTER:
        return _case("random-http", http_streams(ROUTER_PATHS))
    if target in (PREFILL, DECODE):
        link = st.tuples(
            st.sampled_from([link_upgrade(), link_upgrade(query=b"?batch=1&kv_events=1")]),
            st.lists(ws_frames(link_messages()), max_size=4).map(b"".join),
        ).map(b"".join)
        return _case("random-http", http_streams(WORKER_PATHS)) | _case("random-link-upgrade", link)
    if target == KV:
        opening = st.tuples(
            st.sampled_from([b"B", b"N", b"\x00", b"G"]), st.binary(max_size=80)
        ).map(b"".join)
        return _case("random-kv", opening | st.binary(max_size=512) | http_streams(WORKER_PATHS))
    if target in (LINK, LINK_DECODE):
        frames = st.lists(ws_frames(link_messages()), min_size=1, max_size=5).map(b"".join)
        return _case("random-link-frames", frames)
    if target == KV_SESSION:
        return _case("random-kv-session", kv_session_messages())
    raise ValueError(f"no target {target!r}")
