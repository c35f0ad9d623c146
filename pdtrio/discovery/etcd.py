"""An etcd v3 client over etcd's JSON gateway: plain HTTP through httpx, under trio.

etcd serves its v3 API as JSON on the client port (`/v3/kv/range`, `/v3/watch`, ...), so the
router needs no gRPC stack and no asyncio. On that wire keys and values are base64 and int64
fields are strings; the private `_*Reply` structs below decode both (msgspec reads base64 into
`bytes`, and `strict=False` reads "42" as 42). Every failure leaves this module as an
`EtcdError`: the caller decides whether to retry, this module never does beyond trying the
next endpoint when one cannot be reached at all.

etcd's own authentication is supported: a user and password (the client authenticates
first, sends the token on every call, and authenticates again when etcd says the token
is no longer valid) and client TLS (https endpoints, a CA, a client certificate for
etcd's ``--client-cert-auth``).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Final, Literal, Self, TypeVar, final

import attrs
import httpx
import msgspec
import trio

from pdtrio.security import resolve_secret, system_tls_context

if TYPE_CHECKING:
    from pdtrio.config import DiscoveryConfig

__all__ = [
    "ETCD_PASSWORD_ENV",
    "EtcdAuthFailed",
    "EtcdClient",
    "EtcdCompacted",
    "EtcdError",
    "EtcdLeaseLost",
    "EtcdUnavailable",
    "KeyValue",
    "WatchEvent",
    "etcd_client",
    "etcd_tls_context",
    "resolve_etcd_password",
]

# the etcd password, over [discovery] etcd_password_file and etcd_password
ETCD_PASSWORD_ENV: Final = "PDTRIO_ETCD_PASSWORD"

# gRPC codes that mean "try again later", not "you asked for something wrong":
# CANCELLED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, UNAVAILABLE
_RETRYABLE_CODES = frozenset({1, 4, 8, 14})
_NOT_FOUND = 5
_INVALID_ARGUMENT = 3
_UNAUTHENTICATED = 16

_T = TypeVar("_T")


class EtcdError(Exception):
    """etcd answered with an error."""


class EtcdUnavailable(EtcdError):
    """No endpoint could be reached, the connection broke, etcd answered 5xx, or it timed out."""


class EtcdLeaseLost(EtcdError):
    """The lease is gone: it expired or was revoked."""


class EtcdCompacted(EtcdError):
    """A watch's start revision was compacted away; re-read the prefix and watch from there."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted; the oldest revision kept is {compact_revision}")
        self.compact_revision = compact_revision


class EtcdAuthFailed(EtcdError):
    """etcd refused the configured user and password, or asks for credentials none were
    configured for."""


class _TokenInvalid(EtcdError):
    """etcd no longer takes the auth token (expired, or etcd restarted): authenticate again."""


class _NotFound(EtcdError):
    """etcd's NOT_FOUND (a lease that is gone): callers turn it into what it means for them."""


@final
@attrs.frozen
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@final
@attrs.frozen
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    value: bytes
    mod_revision: int


# --- the gateway's JSON -------------------------------------------------------------


class _Header(msgspec.Struct):
    revision: int = 0


class _KeyValueReply(msgspec.Struct):
    key: bytes = b""
    value: bytes = b""
    create_revision: int = 0
    mod_revision: int = 0
    lease: int = 0


class _Reply(msgspec.Struct):
    header: _Header = msgspec.field(default_factory=_Header)


class _RangeReply(msgspec.Struct):
    header: _Header = msgspec.field(default_factory=_Header)
    kvs: list[_KeyValueReply] = []


class _LeaseReply(msgspec.Struct):
    ID: int = 0
    TTL: int = 0
    error: str = ""


class _KeepAliveLine(msgspec.Struct):
    result: _LeaseReply | None = None
    error: str | dict[str, object] | None = None


class _Event(msgspec.Struct):
    type: str = "PUT"
    kv: _KeyValueReply = msgspec.field(default_factory=_KeyValueReply)


class _WatchReply(msgspec.Struct):
    created: bool = False
    canceled: bool = False
    compact_revision: int = 0
    cancel_reason: str = ""
    events: list[_Event] = []


class _WatchLine(msgspec.Struct):
    result: _WatchReply | None = None
    error: str | dict[str, object] | None = None


class _AuthReply(msgspec.Struct):
    token: str = ""


class _ErrorReply(msgspec.Struct):
    error: str | dict[str, object] | None = None
    message: str = ""
    code: int = 0


def _decoder(kind: type[_T]) -> msgspec.json.Decoder[_T]:
    return msgspec.json.Decoder(kind, strict=False)


_REPLY = _decoder(_Reply)
_RANGE_REPLY = _decoder(_RangeReply)
_LEASE_REPLY = _decoder(_LeaseReply)
_KEEP_ALIVE_LINE = _decoder(_KeepAliveLine)
_WATCH_LINE = _decoder(_WatchLine)
_ERROR_REPLY = _decoder(_ErrorReply)
_AUTH_REPLY = _decoder(_AuthReply)


def _key_bytes(key: str) -> bytes:
    return key.encode("utf-8", "surrogateescape")


def _key_str(key: bytes) -> str:
    return key.decode("utf-8", "surrogateescape")


def _prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes [prefix, end) cover every key starting with prefix."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\x00"  # etcd: every key


def _key_value(kv: _KeyValueReply) -> KeyValue:
    return KeyValue(
        key=_key_str(kv.key),
        value=kv.value,
        create_revision=kv.create_revision,
        mod_revision=kv.mod_revision,
        lease=kv.lease,
    )


def _watch_event(event: _Event) -> WatchEvent:
    return WatchEvent(
        kind="delete" if event.type == "DELETE" else "put",
        key=_key_str(event.kv.key),
        value=event.kv.value,
        mod_revision=event.kv.mod_revision,
    )


def _error_of(error: str | dict[str, object] | None, code: int, message: str) -> tuple[int, str]:
    """(gRPC code, message) from either of the gateway's two error shapes."""
    if isinstance(error, dict):  # inside a stream: {"grpc_code": 14, "message": "..."}
        grpc_code = error.get("grpc_code")
        return (
            grpc_code if isinstance(grpc_code, int) else 0,
            str(error.get("message", error)),
        )
    return code, message or error or "unknown error"


def _answer_error(endpoint: str, code: int, message: str, status: int = 0) -> EtcdError:
    what = f"etcd at {endpoint}: {message} (code {code}{f', HTTP {status}' if status else ''})"
    if code == _UNAUTHENTICATED or "invalid auth token" in message:
        return _TokenInvalid(what)
    if code == _INVALID_ARGUMENT and "user name is empty" in message:
        return EtcdAuthFailed(f"{what}: etcd has authentication on; set etcd_username")
    if status >= 500 or code in _RETRYABLE_CODES:
        return EtcdUnavailable(what)
    if code == _NOT_FOUND:
        return _NotFound(what)
    return EtcdError(what)


def _decode(decoder: msgspec.json.Decoder[_T], endpoint: str, body: bytes) -> _T:
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise EtcdUnavailable(
            f"etcd at {endpoint}: malformed reply ({exc}): {body[:200]!r}"
        ) from exc


# --- the client -----------------------------------------------------------------------


@final
class EtcdClient:
    """etcd's KV, lease and watch APIs; owns its httpx client (close with `aclose`)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout_s: float = 5.0,
        username: str = "",
        password: str = "",
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``username`` (and ``password``): etcd's authentication; ``tls``: the context
        https endpoints are verified with (and the client certificate shown), else the
        system's CAs."""
        if not endpoints:
            raise ValueError("EtcdClient needs at least one endpoint")
        self._endpoints = [endpoint.rstrip("/") for endpoint in endpoints]
        self._current = 0  # the endpoint that answered last; tried first
        # a watch waits for events indefinitely; only connecting and sending are bounded
        self._watch_timeout = httpx.Timeout(timeout_s, read=None)
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s), trust_env=False, verify=tls or system_tls_context()
        )
        self._username = username
        self._password = password
        self._token = ""  # etcd's auth token, once authenticated
        self._authenticating = trio.Lock()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # --- KV ---

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Set key to value (attached to lease, if any); returns the revision it made."""
        body: dict[str, object] = {"key": _key_bytes(key), "value": value}
        if lease:
            body["lease"] = lease
        try:
            endpoint, reply = await self._post("/v3/kv/put", body)
        except _NotFound as exc:
            raise EtcdLeaseLost(f"lease {lease:x} is gone: {exc}") from exc
        return _decode(_REPLY, endpoint, reply).header.revision

    async def get(self, key: str) -> KeyValue | None:
        endpoint, reply = await self._post("/v3/kv/range", {"key": _key_bytes(key)})
        kvs = _decode(_RANGE_REPLY, endpoint, reply).kvs
        return _key_value(kvs[0]) if kvs else None

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under prefix, and the revision they were read at (to watch from +1)."""
        start = _key_bytes(prefix)
        endpoint, reply = await self._post(
            "/v3/kv/range", {"key": start, "range_end": _prefix_end(start)}
        )
        decoded = _decode(_RANGE_REPLY, endpoint, reply)
        return [_key_value(kv) for kv in decoded.kvs], decoded.header.revision

    async def delete(self, key: str) -> None:
        endpoint, reply = await self._post("/v3/kv/deleterange", {"key": _key_bytes(key)})
        _decode(_REPLY, endpoint, reply)

    # --- leases ---

    async def grant_lease(self, ttl_s: int) -> int:
        endpoint, reply = await self._post("/v3/lease/grant", {"TTL": ttl_s})
        lease = _decode(_LEASE_REPLY, endpoint, reply)
        if lease.error or not lease.ID:
            raise EtcdError(f"etcd at {endpoint} granted no lease: {lease.error or 'no ID'}")
        return lease.ID

    async def keep_alive_once(self, lease_id: int) -> int:
        """Refresh the lease; returns its remaining TTL. Raises EtcdLeaseLost if it is gone."""
        # the gateway maps the keep-alive stream to one request, one line of reply
        endpoint, reply = await self._post("/v3/lease/keepalive", {"ID": lease_id})
        line = _decode(_KEEP_ALIVE_LINE, endpoint, reply.split(b"\n", 1)[0])
        if line.result is None:
            code, message = _error_of(line.error, 0, "")
            raise _answer_error(endpoint, code, message)
        if line.result.TTL <= 0:
            raise EtcdLeaseLost(f"lease {lease_id:x} is gone (expired or revoked)")
        return line.result.TTL

    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke the lease, deleting its keys; a lease already gone is not an error."""
        try:
            await self._post("/v3/lease/revoke", {"ID": lease_id})
        except _NotFound:
            pass

    # --- watch ---

    async def watch_prefix(
        self,
        prefix: str,
        *,
        start_revision: int,
        on_events: Callable[[list[WatchEvent]], None],
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Report every change under prefix from start_revision on, until cancelled.

        Starts (task_status) once etcd has created the watch. Raises EtcdCompacted if
        start_revision is older than etcd keeps, EtcdUnavailable if the stream breaks or ends.
        """
        start = _key_bytes(prefix)
        payload = msgspec.json.encode(
            {
                "create_request": {
                    "key": start,
                    "range_end": _prefix_end(start),
                    "start_revision": start_revision,
                }
            }
        )
        headers = await self._headers()
        failures: list[str] = []
        for endpoint in self._rotation():
            try:
                async with self._http.stream(
                    "POST",
                    endpoint + "/v3/watch",
                    content=payload,
                    timeout=self._watch_timeout,
                    headers=headers,
                ) as response:
                    self._current = self._endpoints.index(endpoint)
                    if response.status_code != 200:
                        raise _http_error(endpoint, response.status_code, await response.aread())
                    await self._follow(endpoint, response, on_events, task_status)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                failures.append(f"{endpoint}: {exc or type(exc).__name__}")
                continue
            except (httpx.RequestError, httpx.StreamError) as exc:
                raise EtcdUnavailable(
                    f"etcd at {endpoint}: watch broke: {type(exc).__name__}: {exc}"
                ) from exc
            except _TokenInvalid:
                self._token_refused(headers.get("authorization", ""))
                raise
            raise EtcdUnavailable(f"etcd at {endpoint} ended the watch stream")
        raise EtcdUnavailable("no etcd endpoint reachable: " + "; ".join(failures))

    async def _follow(
        self,
        endpoint: str,
        response: httpx.Response,
        on_events: Callable[[list[WatchEvent]], None],
        task_status: trio.TaskStatus[None],
    ) -> None:
        started = False
        failure: Exception | None = None
        # raising out of this loop would leave httpx's async generators suspended (a
        # ResourceWarning when collected); cancelling the read unwinds them instead
        with trio.CancelScope() as reading:
            async for text in response.aiter_lines():
                if failure is not None or not text.strip():
                    continue
                try:  # no await in here: only this stream's verdicts and on_events's errors
                    result = _watch_result(endpoint, text)
                    if result.created and not started:
                        started = True
                        task_status.started()
                    if result.events:
                        on_events([_watch_event(event) for event in result.events])
                except Exception as exc:
                    failure = exc
                    reading.cancel()
        if failure is not None:
            raise failure

    # --- HTTP ---

    def _rotation(self) -> list[str]:
        n = len(self._endpoints)
        return [self._endpoints[(self._current + i) % n] for i in range(n)]

    async def _headers(self) -> dict[str, str]:
        """The headers of a call: etcd's auth token, authenticating first if need be."""
        if not self._username:
            return {}
        if not self._token:
            await self._authenticate("")
        return {"authorization": self._token}

    async def _authenticate(self, stale: str) -> None:
        """Get a token (once, for every task that found ``stale`` refused at once)."""
        async with self._authenticating:
            if self._token and self._token != stale:
                return  # another task authenticated meanwhile
            self._token = ""
            body: dict[str, object] = {"name": self._username, "password": self._password}
            try:
                endpoint, reply = await self._post_once("/v3/auth/authenticate", body, {})
            except _TokenInvalid as exc:
                raise EtcdAuthFailed(str(exc)) from exc
            except EtcdError as exc:
                if isinstance(exc, EtcdUnavailable):
                    raise
                # (the reason is etcd's; the password is never part of a message)
                raise EtcdAuthFailed(f"etcd refused the user {self._username!r}: {exc}") from exc
            token = _decode(_AUTH_REPLY, endpoint, reply).token
            if not token:
                raise EtcdAuthFailed(
                    f"etcd at {endpoint} gave no token to {self._username!r} "
                    "(is its authentication enabled?)"
                )
            self._token = token

    async def _post(self, path: str, body: dict[str, object]) -> tuple[str, bytes]:
        """(endpoint that answered, its 200 body); every failure as an EtcdError."""
        headers = await self._headers()
        try:
            return await self._post_once(path, body, headers)
        except _TokenInvalid:
            # (_TokenInvalid is etcd's "auth required" reply: this message says all of it)
            if not self._username:
                raise EtcdAuthFailed(
                    f"etcd at {self._endpoints[self._current]} asks for authentication: "
                    "set etcd_username and etcd_password"
                ) from None
        # the token expired (or etcd restarted and forgot it): once more with a new one
        await self._authenticate(headers.get("authorization", ""))
        return await self._post_once(path, body, await self._headers())

    async def _post_once(
        self, path: str, body: dict[str, object], headers: Mapping[str, str]
    ) -> tuple[str, bytes]:
        payload = msgspec.json.encode(body)
        failures: list[str] = []
        for endpoint in self._rotation():
            try:
                response = await self._http.post(endpoint + path, content=payload, headers=headers)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                failures.append(f"{endpoint}: {exc or type(exc).__name__}")
                continue
            except httpx.RequestError as exc:
                raise EtcdUnavailable(f"etcd at {endpoint}: {type(exc).__name__}: {exc}") from exc
            self._current = self._endpoints.index(endpoint)
            if response.status_code != 200:
                raise _http_error(endpoint, response.status_code, response.content)
            return endpoint, response.content
        raise EtcdUnavailable("no etcd endpoint reachable: " + "; ".join(failures))

    def _token_refused(self, token: str) -> None:
        """A watch was refused for its token: the next call authenticates again."""
        if self._token == token:
            self._token = ""


def _watch_result(endpoint: str, text: str) -> _WatchReply:
    """One line of the watch stream; raises what it means when it ends the watch."""
    line = _decode(_WATCH_LINE, endpoint, text.encode())
    if line.result is None:
        code, message = _error_of(line.error, 0, "no result")
        raise EtcdUnavailable(f"etcd at {endpoint}: watch failed: {message} (code {code})")
    if line.result.compact_revision:
        raise EtcdCompacted(line.result.compact_revision)
    if line.result.canceled:
        reason = line.result.cancel_reason or "no reason given"
        what = f"etcd at {endpoint} cancelled the watch: {reason}"
        if "Unauthenticated" in reason or "invalid auth token" in reason:
            raise _TokenInvalid(what)
        if "user name is empty" in reason:
            raise EtcdAuthFailed(f"{what}: etcd has authentication on; set etcd_username")
        raise EtcdUnavailable(what)
    return line.result


def _http_error(endpoint: str, status: int, body: bytes) -> EtcdError:
    try:
        reply = _ERROR_REPLY.decode(body)
    except msgspec.DecodeError:
        return _answer_error(endpoint, 0, f"unreadable error reply {body[:200]!r}", status)
    code, message = _error_of(reply.error, reply.code, reply.message)
    return _answer_error(endpoint, code, message, status)


# --- from the configuration -------------------------------------------------------------


def resolve_etcd_password(value: str, file: str, environ: Mapping[str, str] | None = None) -> str:
    """etcd's password: ``PDTRIO_ETCD_PASSWORD``, else the file, else the configured value."""
    return resolve_secret(
        value, file, env_name=ETCD_PASSWORD_ENV, what="etcd password", environ=environ
    )


def etcd_tls_context(ca_file: str, cert_file: str, key_file: str) -> ssl.SSLContext | None:
    """The context https etcd endpoints are dialed with; None: the system's CAs, no client
    certificate."""
    from pdtrio.config import ConfigError

    if not (ca_file or cert_file or key_file):
        return None
    if bool(cert_file) != bool(key_file):
        raise ConfigError("etcd client TLS needs both etcd_cert_file and etcd_key_file")
    try:
        context = ssl.create_default_context(cafile=ca_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the etcd CA file {ca_file}: {exc}") from None
    if cert_file:
        try:
            context.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"cannot load the etcd client certificate {cert_file}: {exc}"
            ) from None
    return context


def etcd_client(config: DiscoveryConfig) -> EtcdClient:
    """A client for the configuration's etcd, with its credentials (ConfigError when a
    file cannot be read)."""
    return EtcdClient(
        config.etcd_endpoints,
        timeout_s=config.etcd_timeout_s,
        username=config.etcd_username,
        password=resolve_etcd_password(config.etcd_password, config.etcd_password_file),
        tls=etcd_tls_context(config.etcd_ca_file, config.etcd_cert_file, config.etcd_key_file),
    )
