"""Reading a registry entry (anyone who can write to etcd writes them) and its signature."""

from __future__ import annotations

import msgspec
import pytest

from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.link.registration import (
    MAX_REGISTRATION_BYTES,
    REJECTED_BAD_SIGNATURE,
    REJECTED_MALFORMED,
    REJECTED_UNSIGNED,
    Registration,
    RegistrationError,
    decode_registration,
    encode_registration,
    is_own_url,
    sign_registration,
    verify_registration,
)
from pdtrio.security import derive_key

VALID = Registration(
    instance_id="decode-a",
    role="decode",
    url="http://10.0.0.6:8100",
    transfer_host="10.0.0.6",
    transfer_port=8200,
    model="smollm2-135m-instruct",
    max_model_len=8192,
    layout=KvLayout("m", 30, 3, 64, 16, "float32"),
    kv_blocks_total=1024,
    kv_transport="tcp",
)
KEY = "/pdtrio/instances/decode-a"
SIGNING_KEY = derive_key("the deployment's secret", "registration")


def entry(**changes: object) -> bytes:
    fields = msgspec.to_builtins(VALID)
    fields.update(changes)
    return msgspec.json.encode(fields)


def test_a_deeply_nested_entry_is_refused_not_a_recursion_error() -> None:
    for nested in (b'{"a":' * 5000, b"[" * 5000, entry()[:-1] + b',"x":' + b"[" * 5000):
        with pytest.raises(RegistrationError) as refused:
            decode_registration(nested)
        assert refused.value.reason == REJECTED_MALFORMED


def test_an_oversized_entry_is_refused_before_it_is_read() -> None:
    padded = entry(model="m" * MAX_REGISTRATION_BYTES)
    with pytest.raises(RegistrationError, match="bytes"):
        decode_registration(padded)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_model_len", -5),
        ("max_model_len", 0),
        ("kv_blocks_total", -1),
        ("transfer_port", 70000),
        ("url", "http://10.0.0.6:99999"),
        ("url", "http://10.0.0.6:0"),
        ("url", "http://:8100"),
        ("url", "http://user:pw@10.0.0.6:8100"),
        ("url", "http://10.0.0.6:8100/\nx"),
        ("url", "ftp://10.0.0.6"),
        ("instance_id", ""),
        ("instance_id", "a\x1b[2Jb"),
        ("instance_id", "x" * 1000),
        ("model", "m\x00"),
        ("role", "router"),
        ("layout", ["m", 0, 3, 64, 16, "float32"]),
        ("layout", ["m", 30, 3, 64, -16, "float32"]),
        ("transfer_host", "evil host"),
    ],
)
def test_values_that_cannot_be_right_are_refused(field: str, value: object) -> None:
    with pytest.raises(RegistrationError):
        decode_registration(entry(**{field: value}))


def test_a_valid_entry_still_reads() -> None:
    assert decode_registration(encode_registration(VALID)) == VALID
    assert decode_registration(entry(url="https://worker.example:8443/prefix")).url.endswith(
        "/prefix"
    )


def test_a_signed_registration_verifies_only_under_its_key_and_secret() -> None:
    signed = sign_registration(VALID, KEY, SIGNING_KEY)
    assert signed.signature and signed.signature != VALID.signature
    read = decode_registration(encode_registration(signed))
    verify_registration(read, KEY, SIGNING_KEY)  # no error
    with pytest.raises(RegistrationError) as unsigned:
        verify_registration(VALID, KEY, SIGNING_KEY)
    assert unsigned.value.reason == REJECTED_UNSIGNED
    altered = msgspec.structs.replace(read, url="http://10.6.6.6:8100")
    copied_elsewhere = "/pdtrio/instances/decode-b"
    other_secret = derive_key("another secret", "registration")
    another_purpose = derive_key("the deployment's secret", "link")
    for registration, key, signing_key in (
        (altered, KEY, SIGNING_KEY),
        (read, copied_elsewhere, SIGNING_KEY),
        (read, KEY, other_secret),
        (read, KEY, another_purpose),
        (msgspec.structs.replace(read, signature="0" * 64), KEY, SIGNING_KEY),
    ):
        with pytest.raises(RegistrationError) as refused:
            verify_registration(registration, key, signing_key)
        assert refused.value.reason == REJECTED_BAD_SIGNATURE


def test_own_url_is_compared_by_host_and_port() -> None:
    own = {("127.0.0.1", 8000)}
    assert is_own_url("http://127.0.0.1:8000", own)
    assert is_own_url("http://127.0.0.1:8000/", own)
    assert not is_own_url("http://127.0.0.1:8001", own)
    assert is_own_url("http://router.example", {("router.example", 80)})
