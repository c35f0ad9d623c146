"""A worker's batch: several link messages in one websocket message, told apart from one."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdtrio.protocol.link import wire
from pdtrio.protocol.link.wire import (
    DecodeAccepted,
    DecodeCapacity,
    DecodeFailed,
    Heartbeat,
    PrefillFailed,
    TokenEntry,
    TokenFrame,
    TokenLogprob,
    TokenLogprobs,
    Usage,
)

_MESSAGES = [
    Heartbeat(),
    DecodeCapacity(free_blocks=7, total_blocks=9, block_size=16),
    DecodeAccepted("r-1"),
    DecodeFailed("r-1", "boom"),
    PrefillFailed("r-2", 400, "bad prompt", "invalid_request_error"),
    TokenFrame([TokenEntry("r-1", [5, 6], " a b", "stop", Usage(3, 2, 0))]),
    TokenLogprobs("r-1", [TokenLogprob(" a", -0.5, (" a", " b"), (-0.5, -2.0))]),
]


@pytest.mark.parametrize("message", _MESSAGES, ids=lambda m: type(m).__name__)
def test_one_message_is_not_a_batch_and_a_list_of_it_is(message: object) -> None:
    assert not wire.is_batch(wire.encode(message))
    batch = wire.encode([message])
    assert wire.is_batch(batch)
    assert wire.from_worker_batch_decoder.decode(batch) == [message]


@given(st.lists(st.sampled_from(_MESSAGES), max_size=70_000 // 700))
def test_any_batch_is_one_and_decodes_to_its_messages_in_order(messages: list[object]) -> None:
    # past 15 messages the batch's header is msgpack's array 16: it is still told apart
    data = wire.encode(messages)
    assert wire.is_batch(data)
    assert wire.from_worker_batch_decoder.decode(data) == messages


def test_a_batch_of_65536_messages_has_a_32_bit_header_and_is_one() -> None:
    data = wire.encode([Heartbeat()] * 65_536)
    assert data[0] == 0xDD
    assert wire.is_batch(data)


@pytest.mark.parametrize(
    "data",
    [b"", b"\x05", msgpack.packb("text"), msgpack.packb({"a": 1}), msgpack.packb([1, [2]])],
)
def test_what_is_no_array_of_arrays_is_no_batch(data: bytes) -> None:
    assert not wire.is_batch(data)


def test_a_bad_message_inside_a_batch_is_a_wire_error() -> None:
    data = msgpack.packb([msgpack.unpackb(wire.encode(Heartbeat())), [99, "no such kind"]])
    assert wire.is_batch(data)
    with pytest.raises(wire.WireError):
        wire.from_worker_batch_decoder.decode(data)
