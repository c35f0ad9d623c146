"""Credentials: clients' API keys, the secret routers and workers share, KV grants.

Every comparison is constant-time over SHA-256 digests, so neither a key's
content nor its length leaks through timing.  Secrets come from the
configuration, a file, or the environment, and are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import ssl
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final, final

from pdtrio.config import ConfigError

WORKER_SECRET_ENV: Final = "PDTRIO_WORKER_SECRET"
API_KEYS_ENV: Final = "PDTRIO_API_KEYS"
# the bytes after a KV port connection's session byte: a digest of the shared secret
KV_CREDENTIAL_SIZE: Final = 32


def _digest(secret: str | bytes) -> bytes:
    data = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(data).digest()


def _header_digest(token: str) -> bytes:
    # a header value is its bytes decoded as latin-1 (asgi.header): hash those bytes
    return _digest(token.encode("latin-1"))


def read_secret_file(path: str, what: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from None
    return text.strip()


def resolve_worker_secret(value: str, file: str, environ: Mapping[str, str] | None = None) -> str:
    """The shared secret: the environment, else the file, else the configured value."""
    environ = os.environ if environ is None else environ
    from_env = environ.get(WORKER_SECRET_ENV, "")
    if from_env:
        return from_env
    if file:
        secret = read_secret_file(file, "worker secret")
        if not secret:
            raise ConfigError(f"the worker secret file {file} is empty")
        return secret
    return value


def derive_key(secret: str, purpose: str) -> bytes:
    """A key for one use of the deployment's secret (signing registrations, proving a peer
    holds it): each purpose gets its own, so a value made for one is worthless for another."""
    return hmac.new(secret.encode(), b"pdtrio key\0" + purpose.encode(), hashlib.sha256).digest()


def new_worker_secret() -> str:
    """A secret for one start of an embedded cluster."""
    return secrets.token_urlsafe(32)


def new_access_token() -> str:
    """A per-request KV grant: whoever holds it may read or release the request's blocks."""
    return secrets.token_urlsafe(16)


def tokens_match(presented: str, expected: str) -> bool:
    return hmac.compare_digest(_digest(presented), _digest(expected))


@final
class PeerCredentials:
    """What routers and workers show each other: the shared secret every worker endpoint
    asks for (none: every peer is let in), and the TLS contexts of cross-host connections
    (None: plain TCP)."""

    __slots__ = ("_digest", "authorization", "client_tls", "kv_credential", "server_tls", "value")

    def __init__(
        self,
        secret: str,
        *,
        client_tls: ssl.SSLContext | None = None,
        server_tls: ssl.SSLContext | None = None,
    ) -> None:
        self.value = secret  # for the embedded cluster's children (their environment)
        self.client_tls = client_tls  # dialing a worker (its HTTP, link, KV port)
        self.server_tls = server_tls  # a worker's own KV port
        self._digest = _digest(secret) if secret else None
        # what a peer sends: the HTTP header value, the KV port's opening bytes
        self.authorization = f"Bearer {secret}".encode() if secret else b""
        self.kv_credential = (
            hashlib.sha256(b"pdtrio kv port\0" + secret.encode()).digest()
            if secret
            else bytes(KV_CREDENTIAL_SIZE)
        )

    @property
    def required(self) -> bool:
        return self._digest is not None

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The headers a request to a worker carries."""
        return [(b"authorization", self.authorization)] if self.required else []

    def admits_header(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value is the secret (always, when none is set)."""
        if self._digest is None:
            return True
        presented = bearer_token(authorization)
        return presented is not None and hmac.compare_digest(
            _header_digest(presented), self._digest
        )

    def admits_kv_credential(self, presented: bytes) -> bool:
        if self._digest is None:
            return True
        return hmac.compare_digest(presented, self.kv_credential)


def bearer_token(authorization: str | None) -> str | None:
    """The token of a ``Bearer`` authorization header value, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


@final
class ApiKeys:
    """The router's client keys; each known by a short id (a digest prefix) for limits."""

    __slots__ = ("_digests",)

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [_digest(key) for key in keys if key]

    @classmethod
    def resolve(
        cls, keys: Iterable[str], file: str, environ: Mapping[str, str] | None = None
    ) -> ApiKeys:
        """Keys from the environment (comma-separated), else the file (one per line,
        ``#`` comments), else the configuration."""
        environ = os.environ if environ is None else environ
        from_env = [k.strip() for k in environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
        if from_env:
            return cls(from_env)
        if file:
            lines = read_secret_file(file, "API keys").splitlines()
            listed = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
            if not listed:
                raise ConfigError(f"the API keys file {file} lists no key")
            return cls(listed)
        return cls(keys)

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def identify(self, authorization: str | None) -> str | None:
        """The id of the key the header carries, or None if it carries none of them.

        Every key is compared, so the time taken says nothing about which matched.
        """
        presented = bearer_token(authorization)
        if presented is None:
            return None
        digest = _header_digest(presented)
        matched: bytes | None = None
        for known in self._digests:
            if hmac.compare_digest(digest, known):
                matched = known
        return None if matched is None else matched[:6].hex()


def client_tls_context(ca_file: str) -> ssl.SSLContext | None:
    """A context that trusts ``ca_file``'s certificates (and checks host names); None: no TLS."""
    if not ca_file:
        return None
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS CA file {ca_file}: {exc}") from None


def server_tls_context(cert_file: str, key_file: str) -> ssl.SSLContext | None:
    """A server context for ``cert_file`` and ``key_file``; None when neither is set."""
    if not cert_file and not key_file:
        return None
    if not (cert_file and key_file):
        raise ConfigError("TLS needs both tls_cert_file and tls_key_file")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS certificate {cert_file}: {exc}") from None
    return context
