"""Credentials: clients' API keys, the secret routers and workers prove to each other, KV grants.

Every comparison is constant-time over SHA-256 digests, so neither a key's
content nor its length leaks through timing.  Secrets come from the
configuration, a file, or the environment, and are never logged.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import os
import secrets
import ssl
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final, final

import httpx

from pdtrio.config import ConfigError

WORKER_SECRET_ENV: Final = "PDTRIO_WORKER_SECRET"
API_KEYS_ENV: Final = "PDTRIO_API_KEYS"
METRICS_TOKEN_ENV: Final = "PDTRIO_METRICS_TOKEN"
# the API key of vLLM or SGLang engines registered in etcd (`pdtrio register`, the router)
ENGINE_API_KEY_ENV: Final = "PDTRIO_ENGINE_API_KEY"


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


def resolve_secret(
    value: str, file: str, *, env_name: str, what: str, environ: Mapping[str, str] | None = None
) -> str:
    """A secret from the environment (``env_name``), else the file, else the configured value."""
    environ = os.environ if environ is None else environ
    from_env = environ.get(env_name, "")
    if from_env:
        return from_env
    if file:
        secret = read_secret_file(file, what)
        if not secret:
            raise ConfigError(f"the {what} file {file} is empty")
        return secret
    return value


def resolve_worker_secret(value: str, file: str, environ: Mapping[str, str] | None = None) -> str:
    """The shared secret: the environment, else the file, else the configured value."""
    return resolve_secret(
        value, file, env_name=WORKER_SECRET_ENV, what="worker secret", environ=environ
    )


def resolve_metrics_token(value: str, file: str, environ: Mapping[str, str] | None = None) -> str:
    """A worker's /metrics token: the environment, else the file, else the configured value."""
    return resolve_secret(
        value, file, env_name=METRICS_TOKEN_ENV, what="metrics token", environ=environ
    )


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>`` (never, for no token)."""
    presented = bearer_token(authorization)
    return bool(token) and presented is not None and tokens_match(presented, token)


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


# the HTTP authentication scheme of routers and workers (RFC 9110 challenge and response)
AUTH_SCHEME: Final = "PDTRIO-HMAC"
NONCE_SIZE: Final = 32
# a worker's challenge is good for one answer, within this long
CHALLENGE_TTL_S: Final = 30.0
# challenges a worker keeps at once; the oldest goes first (a flood only costs its sender)
MAX_OPEN_CHALLENGES: Final = 4096


class PeerAuthenticationError(Exception):
    """A peer did not prove it holds the deployment's secret (or we hold none to check)."""


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


@final
class PeerCredentials:
    """What routers and workers prove to each other, and the TLS of cross-host connections.

    Nothing that opens a door is ever sent: each side answers the other's fresh nonce
    with an HMAC under a key derived from the shared secret, bound to the worker's
    identity (an instance id), so a listener the registry names without holding the
    secret learns nothing it can use, and cannot pose as the instance it relays to.
    No secret: every peer is let in and no proof is asked of anyone.
    """

    __slots__ = ("_auth_key", "_kv_key", "client_tls", "identity", "server_tls", "value")

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
        # a worker's own instance id, which its proofs are bound to ("" until it is known)
        self.identity = ""
        self._auth_key = derive_key(secret, "peer authentication") if secret else None
        self._kv_key = derive_key(secret, "kv port") if secret else None

    @property
    def required(self) -> bool:
        return self._auth_key is not None

    def _proof(self, key: bytes | None, *parts: bytes) -> bytes:
        if key is None:
            return bytes(32)
        mac = hmac.new(key, digestmod=hashlib.sha256)
        for part in parts:  # each part length-prefixed: no two splits give the same bytes
            mac.update(len(part).to_bytes(4, "big") + part)
        return mac.digest()

    def worker_proof(self, client_nonce: bytes, worker_nonce: bytes, instance: str) -> bytes:
        """A worker's answer to a router's nonce."""
        return self._proof(self._auth_key, b"worker", client_nonce, worker_nonce, instance.encode())

    def router_proof(self, client_nonce: bytes, worker_nonce: bytes, instance: str) -> bytes:
        """A router's (or a tool's) answer to a worker's nonce."""
        return self._proof(self._auth_key, b"router", client_nonce, worker_nonce, instance.encode())

    def kv_proof(
        self, side: bytes, session: bytes, client_nonce: bytes, server_nonce: bytes, instance: str
    ) -> bytes:
        """An answer on a KV transfer port; ``side`` is b"server" (prefill) or b"client"."""
        return self._proof(
            self._kv_key, b"kv " + side, session, client_nonce, server_nonce, instance.encode()
        )

    def proof_matches(self, presented: bytes, expected: bytes) -> bool:
        """Whether a peer's proof is the one expected (always, when no secret is set)."""
        return self._auth_key is None or hmac.compare_digest(presented, expected)


def format_auth_params(params: Mapping[str, str]) -> str:
    """An ``Authorization`` / ``WWW-Authenticate`` value of our scheme."""
    return AUTH_SCHEME + " " + ", ".join(f'{name}="{value}"' for name, value in params.items())


def parse_auth_params(value: str | None) -> dict[str, str] | None:
    """The parameters of a header value of our scheme (None: another scheme, or malformed).

    Values are base64url or instance ids, so no quoting rules beyond plain quotes apply.
    """
    if not value or len(value) > 4096:
        return None
    scheme, _, rest = value.strip().partition(" ")
    if scheme.upper() != AUTH_SCHEME:
        return None
    params: dict[str, str] = {}
    for item in rest.split(","):
        name, equals, raw = item.strip().partition("=")
        if not equals:
            if item.strip():
                return None
            continue
        params[name.strip().lower()] = raw.strip().strip('"')
    return params


def encode_nonce(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def decode_nonce(text: str | None) -> bytes | None:
    """Bytes of a base64url field, or None when absent or malformed."""
    if not text or len(text) > 128:
        return None
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, binascii.Error):
        return None


@final
class ChallengeBook:
    """A worker's side of the HTTP exchange: it hands out challenges (each proving the
    worker holds the secret, when the caller sent a nonce of its own) and admits a request
    whose answer matches one it handed out, once.  Pure: the caller passes the clock."""

    __slots__ = ("_credentials", "_open", "_ttl_s")

    def __init__(self, credentials: PeerCredentials, *, ttl_s: float = CHALLENGE_TTL_S) -> None:
        self._credentials = credentials
        self._ttl_s = ttl_s
        # worker nonce -> (the client's nonce it answered, when it expires); insertion order
        self._open: dict[bytes, tuple[bytes, float]] = {}

    def __len__(self) -> int:
        return len(self._open)

    def admits(self, authorization: str | None, now: float) -> bool:
        """Whether the ``Authorization`` header answers an open challenge (consumed here)."""
        credentials = self._credentials
        if not credentials.required:
            return True
        params = parse_auth_params(authorization)
        if params is None:
            return False
        worker_nonce = decode_nonce(params.get("nonce"))
        client_nonce = decode_nonce(params.get("client-nonce"))
        proof = decode_nonce(params.get("proof"))
        if worker_nonce is None or client_nonce is None or proof is None:
            return False
        issued = self._open.pop(worker_nonce, None)
        if issued is None or issued[1] < now or issued[0] != client_nonce:
            return False
        expected = credentials.router_proof(client_nonce, worker_nonce, credentials.identity)
        return credentials.proof_matches(proof, expected)

    def challenge(self, authorization: str | None, now: float, nonce: bytes) -> str:
        """A ``WWW-Authenticate`` value for a request that was not admitted; ``nonce`` is
        fresh randomness.  It proves this worker holds the secret when the request
        carried a client nonce (an ``Authorization`` of our scheme with ``client-nonce``)."""
        params = parse_auth_params(authorization) or {}
        client_nonce = decode_nonce(params.get("client-nonce"))
        challenge = {"nonce": encode_nonce(nonce), "instance": self._credentials.identity}
        if client_nonce is not None and len(client_nonce) == NONCE_SIZE:
            self._forget_expired(now)
            while len(self._open) >= MAX_OPEN_CHALLENGES:
                del self._open[next(iter(self._open))]
            self._open[nonce] = (client_nonce, now + self._ttl_s)
            challenge["client-nonce"] = encode_nonce(client_nonce)
            challenge["proof"] = encode_nonce(
                self._credentials.worker_proof(client_nonce, nonce, self._credentials.identity)
            )
        return format_auth_params(challenge)

    def _forget_expired(self, now: float) -> None:
        for nonce, (_, expires) in list(self._open.items()):
            if expires >= now:
                break  # insertion order is expiry order
            del self._open[nonce]


def answer_challenge(
    credentials: PeerCredentials,
    www_authenticate: str | None,
    client_nonce: bytes,
    expected_instance: str | None,
) -> str:
    """The ``Authorization`` value that answers a worker's challenge, once the challenge
    proves the worker holds the secret (and is ``expected_instance``, when given).

    Raises PeerAuthenticationError otherwise.
    """
    params = parse_auth_params(www_authenticate)
    if params is None:
        raise PeerAuthenticationError(
            f"the peer asks for no {AUTH_SCHEME} answer, so it did not prove it holds the "
            "worker secret (is it a pdtrio worker started with the same secret?)"
        )
    worker_nonce = decode_nonce(params.get("nonce"))
    proof = decode_nonce(params.get("proof"))
    instance = params.get("instance", "")
    if (
        worker_nonce is None
        or proof is None
        or decode_nonce(params.get("client-nonce")) != (client_nonce)
    ):
        raise PeerAuthenticationError("the peer's challenge is malformed or answers another nonce")
    if expected_instance is not None and instance != expected_instance:
        raise PeerAuthenticationError(
            f"the peer says it is {instance!r}, not {expected_instance!r}"
        )
    if not hmac.compare_digest(
        proof, credentials.worker_proof(client_nonce, worker_nonce, instance)
    ):
        raise PeerAuthenticationError(
            "the peer does not hold the worker secret (its proof is wrong)"
        )
    answer = credentials.router_proof(client_nonce, worker_nonce, instance)
    return format_auth_params(
        {
            "nonce": encode_nonce(worker_nonce),
            "client-nonce": encode_nonce(client_nonce),
            "proof": encode_nonce(answer),
        }
    )


def opening_authorization(client_nonce: bytes) -> str:
    """The ``Authorization`` value of a first request: our nonce, for the worker to answer."""
    return format_auth_params({"client-nonce": encode_nonce(client_nonce)})


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


@functools.cache
def system_tls_context() -> ssl.SSLContext:
    """The verifying context an httpx client builds for itself by default, built once for
    the process: loading the CA bundle costs each new client about 50 ms here, which the
    router's start, every etcd client and every test's client paid again.  A context is
    safe to share between clients."""
    return httpx.create_ssl_context()


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
