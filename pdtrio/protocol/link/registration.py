"""What a worker registers about itself, and the key it registers under (pure).

A registration is JSON, so an operator can read it with ``etcdctl get``; it
names only advertised addresses: what a router or a decode instance dials.
An entry is a pdtrio worker's :class:`Registration` (no ``kind``, as every
worker writes it, or ``"kind": "pdtrio"``), or an :class:`EngineRegistration`
(``"kind": "vllm"`` or ``"sglang"``): an engine that ``pdtrio register``
registers beside it.  An engine's API key is never in an entry: the router has
it from its own configuration.

Anyone who can write to etcd can write an entry, so reading one is bounded
(size, arrays and objects, hence nesting) and total: whatever the bytes, the result is a
:class:`Registration` whose every field is sane, or a :class:`RegistrationError`.
A deployment with a shared worker secret signs its registrations: an HMAC-SHA256,
under a key derived from the secret, over the registration's canonical encoding
and the etcd key it is stored under (so an entry copied under another key fails).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated, Final, Literal, TypeVar
from urllib.parse import urlsplit

import msgspec

from pdtrio.protocol.kv_layout import KvLayout

# 2: KV handles carry their lease as a TTL (KvHandle.lease_ttl_s), no longer a wall-clock
# instant: a worker of version 1 and a router of version 2 (or the reverse) cannot pair
REGISTRATION_VERSION = 2

# an entry larger than this is not read at all (a real one is well under 1 KiB)
MAX_REGISTRATION_BYTES: Final = 64 * 1024
# the most arrays and objects an entry may open, so also the deepest it may nest (a
# registration opens 2: itself and its layout)
MAX_REGISTRATION_CONTAINERS: Final = 32

# why an entry was refused, as counted (pdtrio_registry_rejected_entries_total{reason})
REJECTED_MALFORMED: Final = "malformed"  # not a registration this version reads
REJECTED_INVALID: Final = "invalid"  # a registration with a value that cannot be right
REJECTED_UNSIGNED: Final = "unsigned"
REJECTED_BAD_SIGNATURE: Final = "bad_signature"
REJECTED_WRONG_KEY: Final = "wrong_key"  # registered under another instance's key
REJECTED_ROUTER_URL: Final = "router_url"  # its URL is a router (this one or another)
REJECTED_INTERNAL: Final = "internal"  # the router failed handling it (a bug: logged)
REJECTED_KIND: Final = "kind"  # of a kind the router does not front ([discovery] kind)
REJECTION_REASONS: Final = (
    REJECTED_MALFORMED,
    REJECTED_INVALID,
    REJECTED_UNSIGNED,
    REJECTED_BAD_SIGNATURE,
    REJECTED_WRONG_KEY,
    REJECTED_ROUTER_URL,
    REJECTED_INTERNAL,
    REJECTED_KIND,
)

# the header a pdtrio router puts on its answers to /pd/* (a worker's paths): a
# registration pointing at a router is recognised when the router dials it
ROUTER_HEADER: Final = "x-pdtrio-router"

_SIGNATURE_CONTEXT: Final = b"pdtrio registration signature v1\0"
_SIGNATURE_HEX_LENGTH: Final = 64

# printable text: no control characters (C0, DEL, C1), bounded
_NAME = r"^[^\x00-\x1f\x7f-\x9f]+$"
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=_NAME)]
Host = Annotated[str, msgspec.Meta(max_length=255, pattern=r"^[^\x00-\x20\x7f-\x9f/?#@]*$")]
Url = Annotated[
    str, msgspec.Meta(min_length=1, max_length=2048, pattern=r"^[^\x00-\x20\x7f-\x9f]+$")
]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Signature = Annotated[str, msgspec.Meta(max_length=_SIGNATURE_HEX_LENGTH)]


class RegistrationError(Exception):
    """A registry entry that is not a registration this version understands (or trusts)."""

    def __init__(self, message: str, reason: str = REJECTED_INVALID) -> None:
        super().__init__(message)
        self.reason = reason


class Registration(msgspec.Struct, frozen=True, kw_only=True):
    instance_id: Name
    role: Literal["prefill", "decode", "both"]
    # the base URL of its control API and router link (advertised host and port)
    url: Url
    # where decode pulls this instance's KV from (advertised); port 0: it serves none
    transfer_host: Host
    transfer_port: Port
    model: Name
    max_model_len: Annotated[int, msgspec.Meta(gt=0)]
    layout: KvLayout
    kv_blocks_total: Annotated[int, msgspec.Meta(ge=0)]
    kv_transport: Name
    version: int = REGISTRATION_VERSION
    # hex HMAC-SHA256 (sign_registration); empty: unsigned
    signature: Signature = ""


EngineKind = Literal["vllm", "sglang"]
# what an entry's "kind" says, as the operator calls it
KIND_NAMES: Final = {"pdtrio": "pdtrio worker", "vllm": "vLLM engine", "sglang": "SGLang engine"}


class EngineRegistration(msgspec.Struct, frozen=True, kw_only=True):
    """An engine (vLLM, SGLang) registered by ``pdtrio register`` running beside it.

    No KV layout: engines pair by kind. No API key: the router's configuration has
    it (``[security] engine_api_key``), so whoever reads etcd never learns it.
    """

    instance_id: Name
    kind: EngineKind
    role: Literal["prefill", "decode", "both"]
    url: Url  # the engine's HTTP base URL (its OpenAI server)
    model: Name  # the served model name clients ask for
    # an SGLang prefill's --disaggregation-bootstrap-port; 0: none (vLLM, a decode)
    bootstrap_port: Port = 0
    version: int = REGISTRATION_VERSION
    # hex HMAC-SHA256 (sign_registration); empty: unsigned
    signature: Signature = ""


AnyRegistration = Registration | EngineRegistration
_AnyRegistrationT = TypeVar("_AnyRegistrationT", bound=AnyRegistration)


class _Kind(msgspec.Struct):
    """An entry's kind alone (absent: a pdtrio worker's, as every worker writes it)."""

    kind: str = "pdtrio"


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Registration)
_engine_decoder = msgspec.json.Decoder(EngineRegistration)
_kind_decoder = msgspec.json.Decoder(_Kind)


def encode_registration(registration: AnyRegistration) -> bytes:
    return _encoder.encode(registration)


def decode_registration(data: bytes) -> Registration:
    """The pdtrio worker's registration an entry holds; RegistrationError for anything
    else, whatever it is."""
    entry = decode_entry(data)
    if not isinstance(entry, Registration):
        raise RegistrationError(
            f"the registration of a {KIND_NAMES[entry.kind]}, not a pdtrio worker", REJECTED_KIND
        )
    return entry


def decode_entry(data: bytes) -> AnyRegistration:
    """The registration an entry holds, a worker's or an engine's (by its ``kind``);
    RegistrationError for anything else, whatever it is."""
    if len(data) > MAX_REGISTRATION_BYTES:
        raise RegistrationError(
            f"the entry is {len(data)} bytes, more than {MAX_REGISTRATION_BYTES}",
            REJECTED_MALFORMED,
        )
    _check_nesting(data)
    try:
        kind = _kind_decoder.decode(data).kind
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        kind = "pdtrio"  # (not an object with a string kind: the full decode says why)
    registration: AnyRegistration
    try:
        if kind == "pdtrio":
            registration = _decoder.decode(data)
        elif kind in ("vllm", "sglang"):
            registration = _engine_decoder.decode(data)
        else:
            raise RegistrationError(
                f"an entry of kind {kind[:40]!r} (known: pdtrio, vllm, sglang)", REJECTED_INVALID
            )
    except msgspec.ValidationError as exc:
        raise RegistrationError(f"not a usable registration: {exc}", REJECTED_INVALID) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise RegistrationError(f"not a registration: {exc}", REJECTED_MALFORMED) from None
    if isinstance(registration, Registration):
        check_registration(registration)
    else:
        check_engine_registration(registration)
    return registration


def check_engine_registration(registration: EngineRegistration) -> None:
    """Refuse what the types alone do not: another version, a URL that is not a base
    URL, a bootstrap port where it cannot be or none where SGLang's prefill needs one."""
    _check_version(registration.version)
    check_base_url(registration.url)
    if registration.kind == "sglang":
        if registration.role != "decode" and not registration.bootstrap_port:
            raise RegistrationError("an SGLang prefill registered without its bootstrap port")
    elif registration.bootstrap_port:
        raise RegistrationError("a bootstrap port is SGLang's, not vLLM's")


def _check_version(version: int) -> None:
    if version != REGISTRATION_VERSION:
        raise RegistrationError(
            f"registration version {version}, this router reads {REGISTRATION_VERSION}",
            REJECTED_MALFORMED,
        )


def check_registration(registration: Registration) -> None:
    """Refuse what the types alone do not: another version, a URL that is not http(s)
    with a host and a valid port, a layout with sizes that cannot be."""
    _check_version(registration.version)
    check_base_url(registration.url)
    if registration.transfer_port and not registration.transfer_host:
        raise RegistrationError("a transfer port without a transfer host")
    layout = registration.layout
    sizes = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size)
    if min(sizes) <= 0 or max(sizes) > 1 << 20:
        raise RegistrationError(f"the KV layout's sizes are not usable: {layout.describe()}")
    if max(len(layout.model_fingerprint), len(layout.dtype), len(layout.parallel)) > 256:
        raise RegistrationError("the KV layout's names are too long")


def check_base_url(url: str) -> None:
    """Refuse a URL that is not an http(s) base URL: a host, a valid port, no user, query
    or fragment."""
    if not url.startswith(("http://", "https://")):
        raise RegistrationError(f"url {url!r} is not an http(s) URL")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise RegistrationError(f"url {url!r} is not usable: {exc}") from None
    if not parts.hostname or parts.username is not None or parts.query or parts.fragment:
        raise RegistrationError(f"url {url!r} is not a base URL (host[:port], no user or query)")
    if port == 0:
        raise RegistrationError(f"url {url!r} has port 0")


def _check_nesting(data: bytes) -> None:
    """Refuse an entry with more arrays and objects than a registration could have: that
    bounds how deep it can nest (and how deep msgspec recurses), in one pass in C.
    (Brackets inside strings count too: no real name holds dozens.)"""
    openers = data.count(b"[") + data.count(b"{")
    if openers > MAX_REGISTRATION_CONTAINERS:
        raise RegistrationError(
            f"the entry opens {openers} arrays and objects (nested values?), more than "
            f"{MAX_REGISTRATION_CONTAINERS}",
            REJECTED_MALFORMED,
        )


def registration_key(prefix: str, instance_id: str) -> str:
    """The key of an instance's registration: the deployment's prefix and its id."""
    return f"{prefix}{instance_id}"


def instance_id_from_key(prefix: str, key: str) -> str | None:
    """The instance id a key names, or None for a key outside the prefix."""
    if not key.startswith(prefix) or len(key) == len(prefix):
        return None
    return key[len(prefix) :]


# --- signatures -----------------------------------------------------------------------


def _signature(registration: AnyRegistration, key: str, signing_key: bytes) -> str:
    """The HMAC over the registration without its signature, bound to its etcd key."""
    unsigned = msgspec.structs.replace(registration, signature="")
    message = b"".join(
        (
            _SIGNATURE_CONTEXT,
            key.encode("utf-8", "surrogateescape"),
            b"\0",
            _encoder.encode(unsigned),
        )
    )
    return hmac.new(signing_key, message, hashlib.sha256).hexdigest()


def sign_registration(
    registration: _AnyRegistrationT, key: str, signing_key: bytes
) -> _AnyRegistrationT:
    """The registration, signed for storing under ``key`` (``signing_key``:
    ``pdtrio.security.derive_key(secret, "registration")``)."""
    return msgspec.structs.replace(
        registration, signature=_signature(registration, key, signing_key)
    )


def verify_registration(registration: AnyRegistration, key: str, signing_key: bytes) -> None:
    """Raise RegistrationError unless the registration is signed with ``signing_key`` for
    ``key``."""
    if not registration.signature:
        raise RegistrationError(
            "the registration is not signed (the router has a worker secret)", REJECTED_UNSIGNED
        )
    expected = _signature(registration, key, signing_key)
    if not hmac.compare_digest(registration.signature.encode(), expected.encode()):
        raise RegistrationError(
            "the registration's signature does not match (another secret, another key, or altered)",
            REJECTED_BAD_SIGNATURE,
        )


def is_own_url(url: str, own_addresses: frozenset[tuple[str, int]] | set[tuple[str, int]]) -> bool:
    """Whether ``url`` names one of the (host, port) pairs the router serves on."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return False
    host = (parts.hostname or "").lower()
    return (host, port) in own_addresses
