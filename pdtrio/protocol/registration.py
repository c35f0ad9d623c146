"""What a worker registers about itself, and the key it registers under (pure).

A registration is JSON, so an operator can read it with ``etcdctl get``; it
names only advertised addresses: what a router or a decode instance dials.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from pdtrio.protocol.kv_layout import KvLayout

REGISTRATION_VERSION = 1


class RegistrationError(Exception):
    """A registry entry that is not a registration this version understands."""


class Registration(msgspec.Struct, frozen=True, kw_only=True):
    instance_id: str
    role: Literal["prefill", "decode", "both"]
    # the base URL of its control API and router link (advertised host and port)
    url: str
    # where decode pulls this instance's KV from (advertised); port 0: it serves none
    transfer_host: str
    transfer_port: Annotated[int, msgspec.Meta(ge=0, le=65535)]
    model: str
    max_model_len: int
    layout: KvLayout
    kv_blocks_total: int
    kv_transport: str
    version: int = REGISTRATION_VERSION


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Registration)


def encode_registration(registration: Registration) -> bytes:
    return _encoder.encode(registration)


def decode_registration(data: bytes) -> Registration:
    try:
        registration = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise RegistrationError(f"not a registration: {exc}") from None
    if registration.version != REGISTRATION_VERSION:
        raise RegistrationError(
            f"registration version {registration.version}, this router reads {REGISTRATION_VERSION}"
        )
    if not registration.instance_id:
        raise RegistrationError("the instance id is empty")
    if not registration.url.startswith(("http://", "https://")):
        raise RegistrationError(f"url {registration.url!r} is not an http(s) URL")
    return registration


def registration_key(prefix: str, instance_id: str) -> str:
    """The key of an instance's registration: the deployment's prefix and its id."""
    return f"{prefix}{instance_id}"


def instance_id_from_key(prefix: str, key: str) -> str | None:
    """The instance id a key names, or None for a key outside the prefix."""
    if not key.startswith(prefix) or len(key) == len(prefix):
        return None
    return key[len(prefix) :]
