"""Logprobs on the worker link: their own message, and a prefill reply old routers read."""

from __future__ import annotations

import msgspec
import pytest

from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.link import wire
from pdtrio.protocol.link.wire import (
    KvHandle,
    PrefillReply,
    PrefillReplyWithLogprob,
    TokenEntry,
    TokenFrame,
    TokenLogprob,
    TokenLogprobs,
    Usage,
    WireError,
    first_logprob,
)
from pdtrio.protocol.sampling import SamplingParams

LAYOUT = KvLayout("fp", 1, 1, 2, 16, "synthetic")
HANDLE = KvHandle("r", "p0", "127.0.0.1", 9, (1, 2), 20, LAYOUT, 30.0, "grant")
LOGPROB = TokenLogprob(" a", -0.25, (" a", " b"), (-0.25, -1.5))


class _PrefillReplyBeforeLogprobs(
    msgspec.Struct,
    array_like=True,
    frozen=True,
    forbid_unknown_fields=True,
    tag=int(wire.MessageKind.PREFILLED),
):
    """PrefillReply as a router from before logprobs decodes it (it refuses more fields)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    cached_tokens: int
    first_token_id: int
    first_text: str
    finish_reason: str | None
    token_budget: int
    kv_handle: KvHandle | None
    usage: Usage | None = None


@pytest.mark.parametrize("usage", [None, Usage(3, 1)])
def test_a_reply_without_logprobs_is_what_an_older_router_reads(usage: Usage | None) -> None:
    reply = PrefillReply("r", (1, 2, 3), 0, 7, " t7", None, 16, HANDLE, usage)
    data = wire.encode(reply)
    old = msgspec.msgpack.decode(data, type=_PrefillReplyBeforeLogprobs)
    assert (old.request_id, old.first_token_id, old.kv_handle, old.usage) == ("r", 7, HANDLE, usage)


def test_a_reply_carries_the_first_tokens_logprob_when_asked() -> None:
    reply = PrefillReplyWithLogprob("r", (1,), 0, 7, " a", None, 16, HANDLE, None, LOGPROB)
    decoded = wire.from_worker_decoder.decode(wire.encode(reply))
    assert decoded == reply and isinstance(decoded, PrefillReply)
    assert first_logprob(decoded) == LOGPROB
    plain = PrefillReply("r", (1,), 0, 7, " a", None, 16, HANDLE)
    assert first_logprob(wire.from_worker_decoder.decode(wire.encode(plain))) is None


def test_a_token_entry_has_no_room_for_logprobs() -> None:
    # the hot path stays as it was: logprobs never ride in the entry
    entry = TokenEntry("r", [5], " a")
    assert msgspec.msgpack.decode(wire.encode(entry)) == ["r", [5], " a", None, None]


def test_logprobs_are_their_own_link_message() -> None:
    message = TokenLogprobs("r", [LOGPROB, TokenLogprob(" b", -3.0)])
    data = wire.encode(message)
    assert wire.from_worker_decoder.decode(data) == message
    assert wire.from_worker_decoder.decode(wire.encode(TokenFrame([]))) == TokenFrame([])


def test_more_alternatives_than_served_is_a_wire_error() -> None:
    many = tuple(f" t{i}" for i in range(wire.MAX_TOP_LOGPROBS + 1))
    bad = TokenLogprobs("r", [TokenLogprob(" a", -1.0, many, (-1.0,) * len(many))])
    with pytest.raises(WireError):
        wire.from_worker_decoder.decode(wire.encode(bad))


def test_sampling_without_logprobs_asks_none() -> None:
    assert not SamplingParams().wants_logprobs
    assert SamplingParams(logprobs=0).wants_logprobs
