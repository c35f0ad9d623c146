"""Fuzz: a registry entry is read from etcd, which anyone with etcd access may write."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.link.registration import (
    Registration,
    RegistrationError,
    decode_registration,
    encode_registration,
)
from tests.fuzz.profile import FUZZ

_VALID = Registration(
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
_FIELDS = list(msgspec.to_builtins(_VALID))
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


def _decodes_or_refuses(data: bytes) -> None:
    try:
        decode_registration(data)
    except RegistrationError:
        pass


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_are_refused_cleanly(data: bytes) -> None:
    _decodes_or_refuses(data)


@FUZZ
@given(st.sampled_from(_FIELDS), _json_values, st.booleans())
def test_a_mutated_registration_is_read_or_refused_cleanly(
    field: str, value: Any, drop: bool
) -> None:
    entry = msgspec.to_builtins(_VALID)
    if drop:
        del entry[field]
    else:
        entry[field] = value
    data = msgspec.json.encode(entry)
    _decodes_or_refuses(data)
    _decodes_or_refuses(data[: len(data) // 2])


def test_a_valid_registration_round_trips() -> None:
    assert decode_registration(encode_registration(_VALID)) == _VALID
