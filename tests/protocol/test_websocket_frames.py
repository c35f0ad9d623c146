"""The sans-IO websocket frame reader, fed server->client bytes by hand (no sockets).

Valid streams come from wsproto's own server side (or hand-built frames where
wsproto would refuse to write them); the tests check what the shell sees: the
messages, in order, the pongs and close frame to send, and how it closed.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterable, Iterator

import pytest
import wsproto
from hypothesis import given, settings
from hypothesis import strategies as st
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    Pong,
    Request,
    TextMessage,
)

from pdtrio.protocol.link.websocket_frames import (
    MAX_READ_SIZE,
    ClientFrameReader,
    Closure,
    FrameBatch,
    ReaderClosedError,
    masked_binary_frame,
)
from tests.examples import examples

_OP_TEXT = 0x1
_OP_BINARY = 0x2
_OP_CONTINUATION = 0x0


def _open_pair() -> tuple[wsproto.WSConnection, wsproto.WSConnection]:
    """A client and a server ``WSConnection``, both past the handshake."""
    client = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
    server = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
    server.receive_data(client.send(Request(host="decode", target="/pd/link")))
    assert any(isinstance(e, Request) for e in server.events())
    client.receive_data(server.send(AcceptConnection()))
    assert any(isinstance(e, AcceptConnection) for e in client.events())
    return client, server


def _reader(
    *, max_message_size: int = 1 << 20, receive_size: int = 4096
) -> tuple[ClientFrameReader, wsproto.WSConnection, wsproto.WSConnection]:
    client, server = _open_pair()
    reader = ClientFrameReader(client, max_message_size=max_message_size, receive_size=receive_size)
    return reader, client, server


def _frame(opcode: int, payload: bytes, *, fin: bool = True, mask: bytes | None = None) -> bytes:
    """One frame as a server would write it (or, with ``mask``, as it must not)."""
    head = bytes([(0x80 if fin else 0) | opcode])
    mask_bit = 0x80 if mask is not None else 0
    if len(payload) < 126:
        head += bytes([mask_bit | len(payload)])
    elif len(payload) < 1 << 16:
        head += bytes([mask_bit | 126]) + struct.pack("!H", len(payload))
    else:
        head += bytes([mask_bit | 127]) + struct.pack("!Q", len(payload))
    if mask is None:
        return head + payload
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return head + mask + masked


def _server_bytes(server: wsproto.WSConnection, events: Iterable[Event]) -> bytes:
    return b"".join(server.send(event) for event in events)


class _Fed:
    """Everything the reader produced over a sequence of reads."""

    def __init__(self) -> None:
        self.messages: list[bytes | str] = []
        self.pongs: list[bytes] = []
        self.close_reply: CloseConnection | None = None
        self.closed: Closure | None = None
        self.batches = 0


def _feed(reader: ClientFrameReader, chunks: Iterable[bytes]) -> _Fed:
    """Feed ``chunks`` one read at a time, as the shell does; stop once closed."""
    fed = _Fed()
    for chunk in chunks:
        reader.receive_data(chunk)
        _collect(reader.take_batch(), fed)
        if fed.closed is not None:
            break
    return fed


def _collect(batch: FrameBatch, fed: _Fed) -> None:
    fed.batches += 1
    fed.messages += batch.messages
    fed.pongs += [pong.payload for pong in batch.replies]
    if batch.close_reply is not None:
        assert fed.close_reply is None, "a close reply is asked for once"
        fed.close_reply = batch.close_reply
    fed.closed = batch.closed


def _split(data: bytes, cuts: Iterable[int]) -> list[bytes]:
    points = sorted({min(max(cut, 0), len(data)) for cut in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:], strict=False)]


# --- whole binary messages (the fast path) --------------------------------------------


def test_a_single_binary_message() -> None:
    reader, _, server = _reader()
    assert reader.take_batch() == FrameBatch()
    reader.receive_data(server.send(BytesMessage(data=b"hello")))
    batch = reader.take_batch()
    assert batch.messages == [b"hello"] and type(batch.messages[0]) is bytes
    assert batch.replies == [] and batch.close_reply is None and batch.closed is None
    assert reader.take_batch().messages == []


def test_many_messages_in_one_read_come_out_as_one_batch() -> None:
    reader, _, server = _reader(receive_size=65536)
    expected = [bytes([i % 256]) * (i % 60) for i in range(1000)]
    reader.receive_data(_server_bytes(server, (BytesMessage(data=m) for m in expected)))
    assert reader.take_batch().messages == expected


@pytest.mark.parametrize(
    ("size", "length_byte"),
    [(0, 0), (125, 125), (126, 126), (65535, 126), (65536, 127), (70_000, 127)],
)
def test_all_three_length_header_forms(size: int, length_byte: int) -> None:
    reader, _, server = _reader(receive_size=1 << 20)
    message = bytes(range(256)) * (size // 256) + bytes(size % 256)
    data = server.send(BytesMessage(data=message))
    assert data[1] == length_byte
    # header split mid-way, then the rest
    fed = _feed(reader, [data[:1], data[1:3], data[3:9], data[9:]])
    assert fed.messages == [message]


def test_a_frame_larger_than_a_read_is_gathered_in_few_reads_and_cut_once() -> None:
    reader, _, server = _reader(receive_size=4096)
    message = b"g" * 300_000
    data = server.send(BytesMessage(data=b"before")) + server.send(BytesMessage(data=message))
    frame_end = len(data)
    data += server.send(BytesMessage(data=b"after"))
    assert reader.wanted_read_size() == 4096
    reader.receive_data(data[:4096])
    assert reader.take_batch().messages == [b"before"]
    # the next read asks for the rest of the large frame at once, and no further
    assert reader.wanted_read_size() == frame_end - 4096
    pos = 4096
    reads = 0
    while pos < frame_end:
        size = min(reader.wanted_read_size(), 50_000)  # the socket gives less than asked
        assert pos + size <= frame_end
        reader.receive_data(data[pos : pos + size])
        pos += size
        reads += 1
        # nothing is cut until the last byte is in; then the message at once
        assert reader.take_batch().messages == ([message] if pos == frame_end else [])
    assert reads == 6
    assert reader.wanted_read_size() == 4096
    assert _feed(reader, [data[pos:]]).messages == [b"after"]


def test_a_read_never_asks_for_more_than_the_cap() -> None:
    size = 40 << 20
    reader, _, _ = _reader(max_message_size=64 << 20, receive_size=65536)
    reader.receive_data(_frame(_OP_BINARY, b"")[:1] + bytes([127]) + struct.pack("!Q", size))
    assert reader.take_batch().messages == []
    assert reader.wanted_read_size() == MAX_READ_SIZE


# --- control frames, text, fragments (through wsproto) --------------------------------


def test_pings_between_messages_are_answered_in_order() -> None:
    reader, client, server = _reader()
    data = _server_bytes(
        server,
        [
            BytesMessage(data=b"a"),
            Ping(payload=b"one"),
            BytesMessage(data=b"b"),
            Ping(payload=b"two"),
            Pong(payload=b"unasked"),  # a pong from the server is ignored
            BytesMessage(data=b"c"),
        ],
    )
    reader.receive_data(data)
    batch = reader.take_batch()
    assert batch.messages == [b"a", b"b", b"c"]
    assert [pong.payload for pong in batch.replies] == [b"one", b"two"]
    server.receive_data(b"".join(client.send(pong) for pong in batch.replies))
    assert [e.payload for e in server.events() if isinstance(e, Pong)] == [b"one", b"two"]


def test_text_messages_come_out_as_str() -> None:
    reader, _, server = _reader()
    data = _server_bytes(server, [TextMessage(data="héllo"), BytesMessage(data=b"x")])
    data += server.send(TextMessage(data="ü" * 200))
    assert _feed(reader, _split(data, range(0, len(data), 3))).messages == [
        "héllo",
        b"x",
        "ü" * 200,
    ]


def test_fragmented_messages_are_put_together_with_pings_between_fragments() -> None:
    reader, _, server = _reader()
    data = _server_bytes(
        server,
        [
            BytesMessage(data=b"frag-", message_finished=False),
            Ping(payload=b"mid"),
            BytesMessage(data=b"men", message_finished=False),
            BytesMessage(data=b"ted", message_finished=True),
            TextMessage(data="dé", message_finished=False),
            TextMessage(data="jà", message_finished=True),
            BytesMessage(data=b"whole"),
        ],
    )
    fed = _feed(reader, [data])
    assert fed.messages == [b"frag-mented", "déjà", b"whole"]
    assert fed.pongs == [b"mid"]


def test_a_utf8_character_split_across_text_fragments() -> None:
    reader, _, _ = _reader()
    data = _frame(_OP_TEXT, "aé".encode()[:2], fin=False) + _frame(
        _OP_CONTINUATION, "aé".encode()[2:]
    )
    assert _feed(reader, [data]).messages == ["aé"]


def test_a_fragmented_message_over_the_limit_closes_with_1009() -> None:
    reader, _, server = _reader(max_message_size=100)
    data = _server_bytes(server, [BytesMessage(data=b"x" * 60, message_finished=False)] * 2)
    fed = _feed(reader, [data])
    assert fed.closed == Closure(1009, "a fragmented message is over the limit", by_peer=False)
    assert fed.close_reply is not None and fed.close_reply.code == 1009


# --- closing --------------------------------------------------------------------------


def test_a_close_from_the_server_comes_after_the_messages_before_it_and_is_answered() -> None:
    reader, client, server = _reader()
    data = _server_bytes(
        server,
        [BytesMessage(data=b"one"), CloseConnection(code=1001, reason="bye")],
    )
    data += b"\x82\x01z"  # after a close: never read
    reader.receive_data(data)
    batch = reader.take_batch()
    assert batch.messages == [b"one"]
    assert batch.closed == Closure(1001, "bye", by_peer=True) == reader.closed
    assert batch.close_reply is not None and batch.close_reply.code == 1001
    client.send(batch.close_reply)
    assert client.state is ConnectionState.CLOSED
    # later batches repeat how it closed, but ask for no second close frame
    assert reader.take_batch() == FrameBatch(closed=Closure(1001, "bye", by_peer=True))
    with pytest.raises(ReaderClosedError):
        reader.receive_data(b"\x82\x00")


def test_the_servers_answer_to_our_close_needs_no_reply() -> None:
    reader, client, server = _reader()
    server.receive_data(client.send(CloseConnection(code=1000)))
    close = next(e for e in server.events() if isinstance(e, CloseConnection))
    reader.receive_data(server.send(close.response()))
    batch = reader.take_batch()
    assert batch.closed == Closure(1000, "", by_peer=True)
    assert batch.close_reply is None


def test_a_message_over_the_limit_closes_with_1009_after_the_ones_before_it() -> None:
    reader, client, server = _reader(max_message_size=1024)
    data = _server_bytes(server, [BytesMessage(data=b"ok"), BytesMessage(data=b"x" * 2000)])
    fed = _feed(reader, [data[:-1000]])  # the oversized frame's header is enough
    assert fed.messages == [b"ok"]
    assert fed.closed == Closure(1009, "a message of 2000 bytes is over the limit", by_peer=False)
    assert fed.close_reply is not None and fed.close_reply.code == 1009
    client.send(fed.close_reply)


@pytest.mark.parametrize("opcode", [_OP_BINARY, _OP_TEXT])
def test_a_huge_declared_length_closes_with_1009_without_gathering(opcode: int) -> None:
    reader, _, _ = _reader(max_message_size=1024)
    reader.receive_data(bytes([0x80 | opcode, 127]) + struct.pack("!Q", 1 << 62))
    batch = reader.take_batch()
    assert batch.closed is not None and batch.closed.code == 1009
    assert reader.wanted_read_size() == 4096


def test_a_masked_frame_from_the_server_is_a_protocol_error() -> None:
    reader, client, _ = _reader()
    fed = _feed(reader, [_frame(_OP_BINARY, b"abc", mask=b"\x01\x02\x03\x04")])
    assert fed.messages == []
    assert fed.closed is not None and fed.closed.code == 1002 and not fed.closed.by_peer
    assert fed.close_reply is not None and fed.close_reply.code == 1002
    client.send(fed.close_reply)


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (bytes([0xC2, 0]), 1002),  # RSV1 without an extension
        (bytes([0x83, 0]), 1002),  # a reserved opcode
        (_frame(_OP_CONTINUATION, b"x"), 1002),  # a continuation with nothing to continue
        (_frame(_OP_BINARY, b"a", fin=False) + _frame(_OP_BINARY, b"b"), 1002),
        (_frame(0x9, b"p" * 126), 1002),  # a ping over 125 bytes
        (_frame(_OP_TEXT, b"\xff"), 1007),
        (_frame(0x8, b"\x03"), 1002),  # a close payload of one byte
    ],
)
def test_malformed_frames_close_with_wsprotos_code(data: bytes, code: int) -> None:
    reader, client, _ = _reader()
    fed = _feed(reader, [data])
    assert fed.closed is not None and fed.closed.code == code and not fed.closed.by_peer
    assert fed.close_reply is not None
    client.send(fed.close_reply)


# --- properties -----------------------------------------------------------------------

_messages = st.lists(
    st.one_of(
        st.binary(max_size=300),
        st.binary(min_size=60, max_size=300),  # larger than a read: gathered
        st.text(max_size=40),
        st.tuples(st.just("fragments"), st.lists(st.binary(max_size=50), min_size=1, max_size=4)),
        st.tuples(st.just("ping"), st.binary(max_size=125)),
    ),
    max_size=25,
)


def _build(server: wsproto.WSConnection, items: list[object]) -> tuple[bytes, list[object]]:
    """The server's bytes for ``items`` and the messages the client should see."""
    out = b""
    expected: list[object] = []
    for item in items:
        if isinstance(item, bytes):
            out += server.send(BytesMessage(data=item))
            expected.append(item)
        elif isinstance(item, str):
            out += server.send(TextMessage(data=item))
            expected.append(item)
        elif isinstance(item, tuple) and item[0] == "ping":
            out += server.send(Ping(payload=item[1]))
        elif isinstance(item, tuple):
            parts = item[1]
            for i, part in enumerate(parts):
                out += server.send(BytesMessage(data=part, message_finished=i == len(parts) - 1))
            expected.append(b"".join(parts))
    return out, expected


@settings(max_examples=examples(200), deadline=None)
@given(items=_messages, cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
def test_any_split_of_a_valid_stream_gives_the_same_messages(
    items: list[object], cuts: list[int]
) -> None:
    # a small receive size so that frames are gathered across reads too
    reader, _, server = _reader(receive_size=64)
    data, expected = _build(server, items)
    whole_reader, _, _ = _reader(receive_size=64)
    whole = _feed(whole_reader, [data])
    split = _feed(reader, _split(data, cuts))
    assert whole.messages == split.messages == expected
    assert whole.pongs == split.pongs
    assert whole.closed is None and split.closed is None
    # and read as the shell reads: what the reader wants, or less when the socket has less
    shell_reader, _, _ = _reader(receive_size=64)
    assert _feed(shell_reader, _shell_reads(shell_reader, data, cuts)).messages == expected


def _shell_reads(reader: ClientFrameReader, data: bytes, caps: list[int]) -> Iterator[bytes]:
    pos = 0
    for i in itertools.count():
        if pos >= len(data):
            return
        cap = caps[i % len(caps)] + 1 if caps else len(data)
        size = min(reader.wanted_read_size(), cap)
        yield data[pos : pos + size]
        pos += size


@settings(max_examples=examples(200), deadline=None)
@given(
    data=st.binary(max_size=400),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10),
    max_message_size=st.sampled_from([0, 10, 1000]),
)
def test_arbitrary_bytes_only_ever_give_messages_or_a_close(
    data: bytes, cuts: list[int], max_message_size: int
) -> None:
    reader, client, _ = _reader(max_message_size=max_message_size, receive_size=16)
    fed = _feed(reader, _split(data, cuts))
    _check_outcome(fed, client, max_message_size)


@settings(max_examples=examples(200), deadline=None)
@given(
    items=_messages,
    edits=st.lists(
        st.tuples(st.integers(min_value=0, max_value=10_000), st.integers(0, 255)),
        min_size=1,
        max_size=5,
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=10),
)
def test_mutated_valid_streams_only_ever_give_messages_or_a_close(
    items: list[object], edits: list[tuple[int, int]], cuts: list[int]
) -> None:
    reader, client, server = _reader(max_message_size=1000, receive_size=32)
    valid, _ = _build(server, items)
    data = bytearray(valid + b"\x82\x03end")
    for at, value in edits:
        data[at % len(data)] = value
    fed = _feed(reader, _split(bytes(data), cuts))
    _check_outcome(fed, client, 1000)


def _check_outcome(fed: _Fed, client: wsproto.WSConnection, max_message_size: int) -> None:
    """What came out is well formed, and every frame asked for can be sent."""
    for message in fed.messages:
        assert isinstance(message, (bytes, str))
        if isinstance(message, bytes):
            assert len(message) <= max_message_size
    for payload in fed.pongs:
        if client.state is ConnectionState.OPEN:
            client.send(Pong(payload=payload))
    if fed.closed is not None:
        assert fed.closed.by_peer or fed.closed.code in (1002, 1007, 1009)
    if fed.close_reply is not None:
        assert fed.closed is not None
        client.send(fed.close_reply)


# --- the client's own frames ---------------------------------------------------------


@given(payload=st.binary(max_size=70_000), mask=st.binary(min_size=4, max_size=4))
@settings(max_examples=examples(60), deadline=None)
def test_masked_binary_frame_is_what_wsproto_writes_and_a_server_reads(
    payload: bytes, mask: bytes
) -> None:
    import wsproto.frame_protocol

    # wsproto draws its mask from os.urandom: give it ours, and compare the bytes
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wsproto.frame_protocol.os, "urandom", lambda size: mask[:size])
        client = wsproto.frame_protocol.FrameProtocol(client=True, extensions=[])
        assert masked_binary_frame(payload, mask) == client.send_data(payload, fin=True)
    # and a server takes it for the message it is
    server = wsproto.frame_protocol.FrameProtocol(client=False, extensions=[])
    server.receive_bytes(masked_binary_frame(payload, mask))
    frames = list(server.received_frames())
    assert b"".join(bytes(frame.payload) for frame in frames) == payload
    assert frames[-1].frame_finished and frames[-1].message_finished


def test_masked_binary_frame_wants_a_four_byte_mask() -> None:
    with pytest.raises(ValueError, match="4 bytes"):
        masked_binary_frame(b"x", b"abc")
