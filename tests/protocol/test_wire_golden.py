"""Every link message's bytes, pinned: the wire format may not change by a byte.

A worker and a router of different versions meet on the link, so a struct's tag and its
fields' order are the protocol; moving a message between modules, or renaming it, must
leave these bytes as they are. A message that changes on purpose gets a new tag (as
``PrefillReplyWithLogprob`` did), never new bytes under an old one.
"""

from __future__ import annotations

from typing import Any

import pytest

from pdtrio.protocol.errors import Reason
from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.link import wire
from pdtrio.protocol.sampling import SamplingParams

_LAYOUT = KvLayout("fp", 2, 4, 8, 16, "float16", "tp1", 3)
_HANDLE = wire.KvHandle("r-1", "i-1", "10.0.0.1", 7000, (1, 2), 30, _LAYOUT, 12.5, "grant")
_SAMPLING = SamplingParams(temperature=0.5, top_k=4, seed=9, stop=("x",), logprobs=2, n=2)
_USAGE = wire.Usage(5, 3, 1)
_LOGPROB = wire.TokenLogprob(" a", -0.25, (" a", " b"), (-0.25, -2.0))
_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
_START = wire.DecodeStart("r-1", (7, 8, 9), 9, _SAMPLING, 40, 1, 2, _HANDLE, 1)

# each message with every field set (away from its default, where it has one), and its bytes
_GOLDEN: list[tuple[Any, str]] = [
    (
        wire.PrefillRequest("r-1", wire.ChatPrompt((("user", "hi"),)), _SAMPLING, 40, "rt", 1),
        (
            "9708a3722d3192a4636861749192a475736572a26869dc0010cb3fe0000000000000cb3ff0000000"
            "00000004090091a178c290cb0000000000000000cb0000000000000000cb3ff0000000000000cb00"
            "000000000000009002c00228a2727401"
        ),
    ),
    (
        wire.PrefillRequest(
            "r-2", wire.ChatPromptWithTools((("user", "hi"),), "[]", ("",)), _SAMPLING
        ),
        (
            "9708a3722d3294aa636861745f746f6f6c739192a475736572a26869a25b5d91a0dc0010cb3fe000"
            "0000000000cb3ff000000000000004090091a178c290cb0000000000000000cb0000000000000000"
            "cb3ff0000000000000cb00000000000000009002c002c0a000"
        ),
    ),
    (
        wire.PrefillRequest("r-3", wire.TextPrompt("text"), _SAMPLING, None),
        (
            "9708a3722d3392a474657874a474657874dc0010cb3fe0000000000000cb3ff00000000000000409"
            "0091a178c290cb0000000000000000cb0000000000000000cb3ff0000000000000cb000000000000"
            "00009002c002c0a000"
        ),
    ),
    (
        wire.PrefillRequest("r-4", wire.TokenPrompt((1, 2, 3)), _SAMPLING),
        (
            "9708a3722d3492a6746f6b656e7393010203dc0010cb3fe0000000000000cb3ff000000000000004"
            "090091a178c290cb0000000000000000cb0000000000000000cb3ff0000000000000cb0000000000"
            "0000009002c002c0a000"
        ),
    ),
    (
        wire.PrefillReply("r-1", (7, 8), 1, 9, " a", None, 40, _HANDLE, None),
        (
            "9a09a3722d319207080109a22061c02899a3722d31a3692d31a831302e302e302e31cd1b58920102"
            "1e98a2667002040810a7666c6f61743136a374703103cb4029000000000000a56772616e74c0"
        ),
    ),
    (
        wire.PrefillReply("r-1", (7, 8), 1, 9, " a", "stop", 40, None, _USAGE),
        "9a09a3722d319207080109a22061a473746f7028c093050301",
    ),
    (
        wire.PrefillReplyWithLogprob("r-1", (7, 8), 1, 9, " a", None, 40, _HANDLE, None, _LOGPROB),
        (
            "9b0ea3722d319207080109a22061c02899a3722d31a3692d31a831302e302e302e31cd1b58920102"
            "1e98a2667002040810a7666c6f61743136a374703103cb4029000000000000a56772616e74c094a2"
            "2061cbbfd000000000000092a22061a2206292cbbfd0000000000000cbc000000000000000"
        ),
    ),
    (
        wire.PrefillReplyWithChoices(
            "r-1",
            (7, 8),
            1,
            9,
            " a",
            None,
            40,
            _HANDLE,
            None,
            _LOGPROB,
            (wire.FirstToken(1, 10, " b", "length", _USAGE, _LOGPROB),),
        ),
        (
            "9c0fa3722d319207080109a22061c02899a3722d31a3692d31a831302e302e302e31cd1b58920102"
            "1e98a2667002040810a7666c6f61743136a374703103cb4029000000000000a56772616e74c094a2"
            "2061cbbfd000000000000092a22061a2206292cbbfd0000000000000cbc000000000000000919601"
            "0aa22062a66c656e6774689305030194a22061cbbfd000000000000092a22061a2206292cbbfd000"
            "0000000000cbc000000000000000"
        ),
    ),
    (
        wire.prefill_failed("r-1", Reason.REQUEST_ID_IN_USE, "known", param="p"),
        "960aa3722d31cd0199a56b6e6f776eb5696e76616c69645f726571756573745f6572726f72a170",
    ),
    (wire.ReleaseRequest("r-1", "grant"), "930ba3722d31a56772616e74"),
    (wire.ReleaseReply(True), "91c3"),
    (
        _START,
        (
            "9a01a3722d319307080909dc0010cb3fe0000000000000cb3ff000000000000004090091a178c290"
            "cb0000000000000000cb0000000000000000cb3ff0000000000000cb00000000000000009002c002"
            "28010299a3722d31a3692d31a831302e302e302e31cd1b589201021e98a2667002040810a7666c6f"
            "61743136a374703103cb4029000000000000a56772616e7401"
        ),
    ),
    (
        wire.DecodeStartChoices.of(_START, ((1, 11), (2, 12))),
        (
            "9b10a3722d31930708090bdc0010cb3fe0000000000000cb3ff000000000000004090091a178c290"
            "cb0000000000000000cb0000000000000000cb3ff0000000000000cb00000000000000009002c002"
            "28010299a3722d31a3692d31a831302e302e302e31cd1b589201021e98a2667002040810a7666c6f"
            "61743136a374703103cb4029000000000000a56772616e74019292010b92020c"
        ),
    ),
    # a traced request's call and starts: kinds of their own, the untraced bytes unchanged
    (
        wire.traced_call(
            wire.PrefillRequest("r-5", wire.TextPrompt("t"), _SAMPLING, 8, "rt"), _TRACEPARENT
        ),
        (
            "9812a3722d3592a474657874a174dc0010cb3fe0000000000000cb3ff000000000000004090091a1"
            "78c290cb0000000000000000cb0000000000000000cb3ff0000000000000cb000000000000000090"
            "02c00208a2727400d93730302d306166373635313931366364343364643834343865623231316338"
            "30333139632d623761643662373136393230333333312d3031"
        ),
    ),
    (
        wire.traced_start(_START, _TRACEPARENT),
        (
            "9b13a3722d319307080909dc0010cb3fe0000000000000cb3ff000000000000004090091a178c290"
            "cb0000000000000000cb0000000000000000cb3ff0000000000000cb00000000000000009002c002"
            "28010299a3722d31a3692d31a831302e302e302e31cd1b589201021e98a2667002040810a7666c6f"
            "61743136a374703103cb4029000000000000a56772616e7401d93730302d30616637363531393136"
            "636434336464383434386562323131633830333139632d623761643662373136393230333333312d"
            "3031"
        ),
    ),
    (
        wire.traced_start(wire.DecodeStartChoices.of(_START, ((1, 11), (2, 12))), _TRACEPARENT),
        (
            "9c14a3722d31930708090bdc0010cb3fe0000000000000cb3ff000000000000004090091a178c290"
            "cb0000000000000000cb0000000000000000cb3ff0000000000000cb00000000000000009002c002"
            "28010299a3722d31a3692d31a831302e302e302e31cd1b589201021e98a2667002040810a7666c6f"
            "61743136a374703103cb4029000000000000a56772616e74019292010b92020cd93730302d306166"
            "37363531393136636434336464383434386562323131633830333139632d62376164366237313639"
            "3230333333312d3031"
        ),
    ),
    (wire.DecodeAbort("r-1"), "9202a3722d31"),
    (wire.DecodeAccepted("r-1"), "9203a3722d31"),
    (
        wire.DecodeRejected("r-1", wire.RejectReason.NO_ROOM, "full"),
        "9404a3722d31a76e6f5f726f6f6da466756c6c",
    ),
    (wire.DecodeFailed("r-1", "boom"), "9306a3722d31a4626f6f6d"),
    (wire.DecodeCapacity(7, 9, 16), "9407070910"),
    (
        wire.TokenFrame([wire.TokenEntry("r-1", [5, 6], " a b", "stop", _USAGE)]),
        "92059195a3722d31920506a420612062a473746f7093050301",
    ),
    (wire.Heartbeat(), "910c"),
    (
        wire.TokenLogprobs("r-1", [_LOGPROB]),
        (
            "930da3722d319194a22061cbbfd000000000000092a22061a2206292cbbfd0000000000000cbc000"
            "000000000000"
        ),
    ),
    (
        wire.KvEvents(False, (b"\x01" * 8,), (b"\x02" * 8,)),
        "9411c291c408010101010101010191c4080202020202020202",
    ),
    (wire.TransferRequest("r-1", (1, 2), "grant"), "93a3722d31920102a56772616e74"),
    (wire.TransferAnswer(False, 0, "no"), "93c200a26e6f"),
    (
        wire.TransferAnswerWithDigests(
            True, 4096, "", wire.KvDigests(64, 64, (1, 2), (3, 4), (3, 4))
        ),
        "94c3cd1000a0954040920102920304920304",
    ),
    (wire.TransferDone("r-1", "grant"), "92a3722d31a56772616e74"),
    (
        wire.NixlAgentInfo("", "agent", b"meta", "VRAM", 1, 4096, 8, 512),
        "98a0a56167656e74c4046d657461a45652414d01cd100008cd0200",
    ),
]


@pytest.mark.parametrize(("message", "golden"), _GOLDEN, ids=lambda m: type(m).__name__)
def test_a_message_encodes_to_its_pinned_bytes(message: Any, golden: str) -> None:
    assert wire.encode(message).hex() == golden


@pytest.mark.parametrize(("message", "golden"), _GOLDEN, ids=lambda m: type(m).__name__)
def test_pinned_bytes_decode_to_the_message_of_their_type(message: Any, golden: str) -> None:
    decoded = wire.Decoder[Any](type(message)).decode(bytes.fromhex(golden))
    assert type(decoded) is type(message)
    assert decoded == message


def _link_messages(union: Any) -> list[tuple[Any, str]]:
    members = set(union.__args__)
    return [(message, golden) for message, golden in _GOLDEN if type(message) in members]


@pytest.mark.parametrize(
    ("decoder", "union"),
    [(wire.to_worker_decoder, wire.ToWorker), (wire.from_worker_decoder, wire.FromWorker)],
    ids=["to_worker", "from_worker"],
)
def test_each_way_of_the_link_tells_every_message_apart_by_its_tag(
    decoder: wire.Decoder[Any], union: Any
) -> None:
    pinned = _link_messages(union)
    assert {type(message) for message, _ in pinned} == set(union.__args__)
    for message, golden in pinned:
        decoded = decoder.decode(bytes.fromhex(golden))
        assert type(decoded) is type(message)
        assert decoded == message
