"""Property-based fuzzing of every parser that reads bytes from the network.

Each parser may return a value or raise its own protocol error, nothing else,
whatever the bytes: the OpenAI request layer (:class:`OpenAIError`), the wire
messages (:class:`WireError`; ``decode_raw`` msgspec's two errors), the KV
transfer port's length-prefixed messages (:class:`KvTransferError` or
:class:`WireError`) and the websocket frame cutter (never raises; a broken peer
is reported as a close).  Inputs are random bytes and, mostly, valid messages
with something broken: a field of the wrong type, a truncation, a flipped byte,
huge numbers, deep nesting, bad UTF-8, NaN, duplicate keys, odd encodings, so
the fuzzing reaches past the first check.  Where an encoder exists, valid
messages must also round-trip.

CI runs a bounded, reproducible count (see ``tests/fuzz/profile.py``); a longer,
random run is one command::

    PDTRIO_FUZZ_EXAMPLES=20000 python -m pytest tests/fuzz
"""

from __future__ import annotations

import copy
import json
import math
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar
from unittest import mock

import msgpack
import pytest
import trio
import wsproto
from hypothesis import given
from hypothesis import strategies as st
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError

from pdtrio.kv import tcp
from pdtrio.kv.api import KvTransferError
from pdtrio.protocol import openai
from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.link.websocket_frames import ClientFrameReader, ReaderClosedError
from pdtrio.protocol.link.wire import (
    DECODE_ERRORS,
    ChatPrompt,
    DecodeAbort,
    DecodeAccepted,
    DecodeCapacity,
    DecodeFailed,
    Decoder,
    DecodeRejected,
    DecodeStart,
    Heartbeat,
    KvDigests,
    KvHandle,
    NixlAgentInfo,
    PrefillFailed,
    PrefillReply,
    PrefillRequest,
    RejectReason,
    ReleaseRequest,
    TextPrompt,
    TokenEntry,
    TokenFrame,
    TokenPrompt,
    TransferAnswerWithDigests,
    TransferDone,
    TransferRequest,
    Usage,
    WireError,
    encode,
    from_worker_decoder,
    to_worker_decoder,
)
from pdtrio.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    json_pieces,
    parse_chat_completion_request,
    parse_completion_request,
)
from pdtrio.protocol.openai import fields as openai_requests
from pdtrio.protocol.openai.responses import parse_responses_request
from pdtrio.protocol.sampling import SamplingParams
from tests.fuzz.profile import FUZZ

_T = TypeVar("_T")

# =============================================================================
# OpenAI request layer: parse_chat_completion_request / parse_completion_request
# =============================================================================

MODEL = "tiny"
LIMIT = 4096
CONTEXTS = {MODEL: 64, "other": 128}

_HUGE_INTS = [2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**400, -(10**400)]
json_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(_HUGE_INTS)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["\ud800", "a\udc00b", "\U0001f600", "\x00", "text", "user", MODEL])
)
json_values = st.recursive(
    json_leaves,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=25,
)

_text = st.text(min_size=1, max_size=20)
# some longer than any context: the piecewise parser only counts those
_few_ids = st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=12)
_token_ids = _few_ids | st.integers(60, 200).map(lambda n: list(range(n)))


def _with_tool_call_id(message: dict[str, Any]) -> dict[str, Any]:
    # a tool result names the call it answers (OpenAI requires it)
    return {**message, "tool_call_id": "call_1"} if message["role"] == "tool" else message


@st.composite
def valid_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A request body both endpoints may accept (chat reads messages, completions the prompt)."""
    body: dict[str, Any] = {"model": draw(st.sampled_from([MODEL, "other"]))}
    body["messages"] = draw(
        st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(sorted(openai.CHAT_ROLES)),
                    "content": _text
                    | st.lists(
                        st.fixed_dictionaries({"type": st.just("text"), "text": st.text()}),
                        max_size=3,
                    ),
                }
            ).map(_with_tool_call_id),
            min_size=1,
            max_size=3,
        )
    )
    body["prompt"] = draw(
        _text | _text.map(lambda t: [t]) | _token_ids | _token_ids.map(lambda ids: [ids])
    )
    optional = {
        "max_tokens": st.integers(1, 32),
        "max_completion_tokens": st.integers(1, 32),
        "min_tokens": st.integers(0, 1),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "top_k": st.integers(-1, 2**31 - 1),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "stop": _text | st.lists(_text, max_size=4),
        "stream": st.booleans(),
        "ignore_eos": st.booleans(),
        "n": st.just(1),
        "user": st.text(),
        "frequency_penalty": st.just(0),
        "logit_bias": st.just({}),
        "tools": st.just([]),
        "tool_choice": st.just("none"),
        "response_format": st.just({"type": "text"}),
        "echo": st.just(False),
        "best_of": st.just(1),
        "suffix": st.just(""),
    }
    for key in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=8)):
        body[key] = draw(optional[key])
    if body.get("stream"):
        body["stream_options"] = {
            "include_usage": draw(st.booleans()),
            "continuous_usage_stats": draw(st.booleans()),
        }
    return body


_PATHS: list[tuple[Any, ...]] = [
    (key,)
    for key in (
        "model messages prompt max_tokens max_completion_tokens min_tokens temperature top_p "
        "top_k seed stop stream stream_options ignore_eos n user presence_penalty logit_bias "
        "logprobs top_logprobs tools functions tool_choice function_call response_format echo "
        "best_of suffix"
    ).split()
] + [
    ("messages", 0),
    ("messages", 0, "role"),
    ("messages", 0, "content"),
    ("messages", 0, "content", 0),
    ("messages", 0, "content", 0, "text"),
    ("messages", 0, "tool_calls"),
    ("messages", 0, "function_call"),
    ("prompt", 0),
    ("prompt", 0, 0),
    ("stop", 0),
    ("stream_options", "include_usage"),
]


@st.composite
def near_valid_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A valid body with a few fields (top-level or nested) replaced or removed."""
    body = draw(valid_bodies())
    for path in draw(st.lists(st.sampled_from(_PATHS), max_size=3)):
        target: Any = body
        for key in path[:-1]:
            try:
                target = target[key]
            except (KeyError, IndexError, TypeError):
                break
        else:
            last = path[-1]
            if isinstance(target, dict) and draw(st.integers(0, 5)) == 0:
                target.pop(last, None)
            elif isinstance(target, dict) or (
                isinstance(target, list) and isinstance(last, int) and last < len(target)
            ):
                target[last] = draw(json_values)
    return body


# What a text mutation may insert: JSON's edges, and what json.loads alone accepts.
_TOKENS = [
    '"',
    "\\",
    "\\u",
    "\\ud800",
    "\\udc00",
    "\\ud83d\\ude00",
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-0",
    "0.0e-999",
    "true",
    "null",
    "\x00",
    "\x1f",
    "\ufeff",
    " \t\n\r",
    '"model": "tiny", ',
    '"model": 1, ',
    '"prompt": [1, 2, 3], ',
    '"prompt": [[1, 2], [3]], ',
    '"seed": ' + "9" * 5000 + ", ",
    '"top_k": ' + "1" * 30 + ", ",
    '"x": ' + "[" * 3000 + "]" * 3000 + ", ",
    '"x": ' + '{"a":' * 3000 + "1" + "}" * 3000 + ", ",
    "[" * 50000,
]


@st.composite
def mutated_text(draw: st.DrawFn, text: str) -> str:
    """``text`` with a few character-level edits: cuts, deletions, insertions, doubled keys."""
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))):
        op = draw(st.sampled_from(["truncate", "delete", "insert", "duplicate_key", "replace"]))
        at = draw(st.integers(0, len(text)))
        if op == "truncate":
            text = text[:at]
        elif op == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 8)) :]
        elif op == "insert":
            text = text[:at] + draw(st.sampled_from(_TOKENS) | st.text(max_size=4)) + text[at:]
        elif op == "duplicate_key":
            # the same key twice: json.loads keeps the last
            key = draw(st.sampled_from(["model", "prompt", "messages", "stream", "max_tokens"]))
            value = json.dumps(draw(json_values))
            text = text.replace("{", f'{{"{key}": {value}, ', 1)
        elif at < len(text):
            text = text[:at] + draw(st.characters()) + text[at + 1 :]
    return text


_ENCODINGS = ["utf-8"] * 6 + ["utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32"]


@st.composite
def request_bytes(draw: st.DrawFn) -> bytes:
    """Bytes of a near-valid request body, mutated as text and then as bytes."""
    body = draw(near_valid_bodies())
    separators = draw(st.sampled_from([(", ", ": "), (",", ":"), (" ,\n", " :\t")]))
    text = json.dumps(body, ensure_ascii=draw(st.booleans()), separators=separators)
    text = draw(mutated_text(text))
    data = text.encode(draw(st.sampled_from(_ENCODINGS)), "surrogatepass")
    for _ in range(draw(st.sampled_from([0, 0, 0, 0, 1, 2]))):
        at = draw(st.integers(0, len(data)))
        junk = draw(
            st.sampled_from([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"])
            | st.binary(max_size=3)
        )
        data = data[:at] + junk + data[at + draw(st.integers(0, 1)) :]
    return data


@contextmanager
def _piecewise_everywhere() -> Iterator[None]:
    """The piecewise JSON parser for every body, with windows small enough to cut anything."""
    with (
        mock.patch.object(openai_requests, "PIECEWISE_JSON_BYTES", 0),
        mock.patch.multiple(
            json_pieces,
            _CHUNK_CHARS=16,  # past _LONGEST_ESCAPE: a window always holds one whole escape
            _SMALL_VALUE_CHARS=24,
            _DECODE_CHUNK_BYTES=5,
        ),
    ):
        yield


def _parse(
    body: bytes, chat: bool, with_contexts: bool
) -> ChatCompletionRequest | CompletionRequest | None:
    """The router's call; None when it refused with an OpenAIError (checked here)."""
    try:
        if chat:
            return parse_chat_completion_request(
                body, served_models=CONTEXTS.keys(), max_tokens_limit=LIMIT
            )
        return parse_completion_request(
            body,
            served_models=CONTEXTS.keys(),
            max_tokens_limit=LIMIT,
            context_lengths=CONTEXTS if with_contexts else None,
        )
    except OpenAIError as error:
        assert error.status in (400, 404)
        json.dumps(error.to_body())
        repr(error)
        return None


def _check_accepted(request: ChatCompletionRequest | CompletionRequest) -> None:
    """An accepted request can go on the wire to prefill, and comes back the same."""
    assert request.model in CONTEXTS
    message = PrefillRequest("r", request.prompt, request.sampling, request.max_tokens)
    decoded: PrefillRequest = Decoder(PrefillRequest).decode(encode(message))
    assert decoded == message


_paths = pytest.mark.parametrize("piecewise", [False, True], ids=["loads", "piecewise"])


@_paths
@FUZZ
@given(st.binary(max_size=300), st.booleans(), st.booleans())
def test_openai_random_bytes_only_raise_openai_error(
    piecewise: bool, body: bytes, chat: bool, with_contexts: bool
) -> None:
    with _piecewise_everywhere() if piecewise else _nothing():
        request = _parse(body, chat, with_contexts)
    if request is not None:
        _check_accepted(request)


@_paths
@FUZZ
@given(request_bytes(), st.booleans(), st.booleans())
def test_openai_broken_bodies_only_raise_openai_error(
    piecewise: bool, body: bytes, chat: bool, with_contexts: bool
) -> None:
    with _piecewise_everywhere() if piecewise else _nothing():
        request = _parse(body, chat, with_contexts)
    if request is not None:
        _check_accepted(request)


_RESPONSES_KEYS = [
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "stream_options",
    "text",
    "metadata",
    "store",
    "tools",
    "tool_choice",
    "include",
    "truncation",
    "previous_response_id",
]
_input_items = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call"]) | json_leaves,
        "role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]),
        "content": json_values
        | _text
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["input_text", "output_text", "input_image"])},
                optional={"text": _text | json_leaves},
            ),
            max_size=3,
        ),
    },
)
_responses_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL)},
    optional={
        **{key: json_values for key in _RESPONSES_KEYS},
        "input": _text | st.lists(_input_items, max_size=4) | json_values,
        "text": st.fixed_dictionaries(
            {},
            optional={
                "format": st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "json_object", "json_schema", "x"])},
                    optional={"name": _text | json_leaves, "schema": json_values},
                )
            },
        ),
    },
)


@FUZZ
@given(_responses_bodies | json_values)
def test_responses_bodies_only_raise_openai_error(body: Any) -> None:
    try:
        request = parse_responses_request(
            json.dumps(body).encode(),
            served_models=CONTEXTS.keys(),
            max_tokens_limit=LIMIT,
            context_lengths=CONTEXTS,
        )
    except OpenAIError as error:
        assert error.status in (400, 404)
        json.dumps(error.to_body())
        return
    _check_accepted(request.chat)
    assert request.chat.prompt.messages


@_paths
@FUZZ
@given(valid_bodies(), st.sampled_from(_ENCODINGS))
def test_openai_valid_bodies_parse_to_what_they_say(
    piecewise: bool, body: dict[str, Any], encoding: str
) -> None:
    raw = json.dumps(body).encode(encoding)
    with _piecewise_everywhere() if piecewise else _nothing():
        chat = _parse(raw, chat=True, with_contexts=False)
        completion = _parse(raw, chat=False, with_contexts=False)
    assert isinstance(chat, ChatCompletionRequest)
    expected_messages = tuple(
        (
            m["role"],
            m["content"]
            if isinstance(m["content"], str)
            else "".join(p["text"] for p in m["content"]),
        )
        for m in body["messages"]
    )
    assert chat.prompt.messages == expected_messages
    # a tool result's call id rides beside its text; a plain chat stays a plain prompt
    has_results = any(m["role"] == "tool" for m in body["messages"])
    assert (type(chat.prompt) is ChatPrompt) is not has_results
    assert isinstance(completion, CompletionRequest)
    prompt = body["prompt"]
    if isinstance(prompt, list) and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    expected_prompt = TextPrompt(prompt) if isinstance(prompt, str) else TokenPrompt(tuple(prompt))
    assert completion.prompt == expected_prompt
    for request in (chat, completion):
        assert request.model == body["model"]
        assert request.stream == bool(body.get("stream"))
        assert request.sampling.seed == body.get("seed")
        assert request.sampling.temperature == body.get("temperature", 1.0)
        stop = body.get("stop", ())
        assert request.sampling.stop == ((stop,) if isinstance(stop, str) else tuple(stop))
        _check_accepted(request)
    assert completion.max_tokens == body.get("max_tokens")
    assert chat.max_tokens == body.get("max_completion_tokens", body.get("max_tokens"))


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@st.composite
def json_texts(draw: st.DrawFn) -> bytes:
    """JSON text (a body, or any value), often broken, in one of JSON's encodings."""
    if draw(st.booleans()):
        value: Any = draw(near_valid_bodies())
    else:
        value = draw(json_values)
    text = json.dumps(value, ensure_ascii=draw(st.booleans()))
    return draw(mutated_text(text)).encode(draw(st.sampled_from(_ENCODINGS)), "surrogatepass")


def _same_json(a: Any, b: Any) -> bool:
    # json.dumps tells 1 from 1.0 and -0.0 from 0.0, and NaN equals itself there
    return json.dumps(a) == json.dumps(b)


@FUZZ
@given(json_texts() | st.binary(max_size=100))
def test_piecewise_json_is_json_loads(data: bytes) -> None:
    """The big-body parser, cut into tiny windows, accepts and rejects what json.loads does."""
    expected = _load_or_error(json.loads, data)
    with _piecewise_everywhere():
        got = _load_or_error(json_pieces.load_piecewise, data)
    if expected is RecursionError or got is RecursionError:
        return  # each parser has its own depth limit
    if expected is ValueError or got is ValueError:
        assert expected is got
    else:
        assert _same_json(got, expected)


def _load_or_error(load: Callable[[bytes], Any], data: bytes) -> Any:
    try:
        return load(data)
    except RecursionError:
        return RecursionError
    except ValueError:  # JSONDecodeError, bad UTF-8, an over-long integer
        return ValueError


# =============================================================================
# Wire messages (worker link, worker HTTP endpoints, KV port): msgspec msgpack
# =============================================================================

_ints = st.integers(-(2**63), 2**64 - 1)
_small_ints = st.integers(-(2**31), 2**31)
_wire_text = st.text(max_size=12)
_wire_floats = st.floats(allow_nan=False)
_id_tuples = st.lists(_ints, max_size=6).map(tuple)

layouts = st.builds(KvLayout, _wire_text, _ints, _ints, _ints, _ints, _wire_text, _wire_text, _ints)
samplings = st.builds(
    SamplingParams,
    _wire_floats,
    _wire_floats,
    _ints,
    st.none() | _ints,
    _ints,
    st.lists(_wire_text, max_size=4).map(tuple),
    st.booleans(),
)
usages = st.builds(Usage, _ints, _ints, _ints)
kv_handles = st.builds(
    KvHandle,
    _wire_text,
    _wire_text,
    _wire_text,
    st.integers(0, 65535),  # a port (the decoder refuses others)
    _id_tuples,
    _ints,
    layouts,
    _wire_floats,
)
prompts = (
    st.builds(ChatPrompt, st.lists(st.tuples(_wire_text, _wire_text), max_size=4).map(tuple))
    | st.builds(TextPrompt, _wire_text)
    | st.builds(TokenPrompt, _id_tuples)
)
_opt_reason = st.none() | st.sampled_from(["stop", "length", "abort"]) | _wire_text

to_worker_messages = (
    st.builds(
        DecodeStart, _wire_text, _id_tuples, _ints, samplings, _ints, _ints, _ints, kv_handles
    )
    | st.builds(DecodeAbort, _wire_text)
    | st.builds(PrefillRequest, _wire_text, prompts, samplings, st.none() | _ints)
    | st.builds(ReleaseRequest, _wire_text)
)
token_entries = st.builds(
    TokenEntry,
    _wire_text,
    st.lists(_ints, max_size=6),
    _wire_text,
    _opt_reason,
    st.none() | usages,
)
from_worker_messages = (
    st.builds(DecodeAccepted, _wire_text)
    | st.builds(DecodeRejected, _wire_text, st.sampled_from(list(RejectReason)), _wire_text)
    | st.builds(DecodeFailed, _wire_text, _wire_text)
    | st.builds(TokenFrame, st.lists(token_entries, max_size=4))
    | st.builds(DecodeCapacity, _ints, _ints, _ints)
    | st.builds(
        PrefillReply,
        _wire_text,
        _id_tuples,
        _ints,
        _ints,
        _wire_text,
        _opt_reason,
        _ints,
        st.none() | kv_handles,
        st.none() | usages,
    )
    | st.builds(
        PrefillFailed, _wire_text, _small_ints, _wire_text, _wire_text, st.none() | _wire_text
    )
    | st.just(Heartbeat())
)
transfer_requests = st.builds(TransferRequest, _wire_text, _id_tuples)
kv_digests = st.builds(KvDigests, _ints, _ints, _id_tuples, _id_tuples, _id_tuples)
# decode reads every answer as one with digests (a plain answer's array has none)
transfer_answers = st.builds(
    TransferAnswerWithDigests, st.booleans(), _ints, _wire_text, st.none() | kv_digests
)
transfer_dones = st.builds(TransferDone, _wire_text)
nixl_infos = st.builds(
    NixlAgentInfo,
    _wire_text,
    _wire_text,
    st.binary(max_size=16),
    st.sampled_from(["DRAM", "VRAM"]) | _wire_text,
    _ints,
    _ints,
    _ints,
    _ints,
)

# every decoder that reads a peer's bytes, and the messages it is for
DECODERS: dict[str, tuple[Decoder[Any], st.SearchStrategy[Any]]] = {
    "to_worker": (to_worker_decoder, to_worker_messages),
    "from_worker": (from_worker_decoder, from_worker_messages),
    # the worker's HTTP endpoints (pdtrio/worker/http_api.py)
    "prefill_request": (
        Decoder(PrefillRequest),
        st.builds(PrefillRequest, _wire_text, prompts, samplings, st.none() | _ints),
    ),
    "release_request": (Decoder(ReleaseRequest), st.builds(ReleaseRequest, _wire_text)),
    # the KV transfer port (pdtrio/kv/tcp.py; the NIXL session: pdtrio/kv/nixl.py, nixl_grants.py)
    "transfer_request": (tcp.request_decoder, transfer_requests),
    "transfer_answer": (tcp.answer_decoder, transfer_answers),
    "transfer_done": (tcp.done_decoder, transfer_dones),
    "nixl_agent_info": (Decoder(NixlAgentInfo), nixl_infos),
}
_decoders = pytest.mark.parametrize("name", sorted(DECODERS))

_deep: list[Any] = [[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]
_MSGPACK_ODDITIES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
    1.5,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "x" * 300,
    "\u00e9\U0001f600",
    b"",
    b"\x00" * 9,
    [],
    [[]],
    _deep,
    {},
    {"a": 1},
    {1: [2]},
    msgpack.ExtType(1, b"x"),
    msgpack.Timestamp(0, 0),  # ext type -1
    msgpack.Timestamp(2**40, 999_999_999),
    *range(0, 14),  # every message tag and then some
    "chat",
    "text",
    "tokens",
    "no_room",
]
# raw msgpack heads that promise far more than follows, or are not msgpack at all
_RAW_HEADS = [
    b"\xc1",  # never used
    b"\xdd\xff\xff\xff\xff",  # array32 of 4 G elements
    b"\xdc\xff\xff",  # array16
    b"\xdf\xff\xff\xff\xff",  # map32
    b"\xdb\xff\xff\xff\xff",  # str32 of 4 GB
    b"\xc6\xff\xff\xff\xff",  # bin32
    b"\xc9\xff\xff\xff\xff\x01",  # ext32
    b"\xd7\xff" + b"\xff" * 8,  # timestamp64 out of range
    b"\xcf" + b"\xff" * 8,  # uint64 max
    b"\xd3\x80" + b"\x00" * 7,  # int64 min
    b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00",  # float64 NaN
    b"\x91" * 3000,  # deep nesting
    b"\xde\x00\x01\xa1a\x01",  # a map where an array belongs
]


def _list_paths(node: Any, path: tuple[int, ...] = ()) -> Iterator[tuple[int, ...]]:
    if isinstance(node, list):
        yield path
        for i, child in enumerate(node):
            yield from _list_paths(child, (*path, i))


@st.composite
def near_valid_msgpack(draw: st.DrawFn, messages: st.SearchStrategy[Any]) -> bytes:
    """A valid message re-packed by an independent msgpack, with its tree and bytes broken."""
    tree = msgpack.unpackb(encode(draw(messages)), raw=False, strict_map_key=False)
    for _ in range(draw(st.integers(0, 3))):
        paths = list(_list_paths(tree))
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        target = tree
        for i in path:
            target = target[i]
        op = draw(st.sampled_from(["replace", "delete", "insert", "truncate", "wrap"]))
        oddity = copy.deepcopy(draw(st.sampled_from(_MSGPACK_ODDITIES)))
        at = draw(st.integers(0, len(target)))
        if op == "insert" or (op == "replace" and at == len(target)):
            target.insert(at, oddity)
        elif op == "replace":
            target[at] = oddity
        elif op == "delete" and at < len(target):
            del target[at]
        elif op == "truncate":
            del target[at:]
        elif op == "wrap" and at < len(target):
            target[at] = [target[at]]
    data: bytes = msgpack.packb(tree, use_bin_type=draw(st.booleans()))
    for _ in range(draw(st.integers(0, 2))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["truncate", "flip", "head", "append"]))
        if op == "truncate":
            data = data[:at]
        elif op == "flip" and at < len(data):
            data = data[:at] + bytes([data[at] ^ (1 << draw(st.integers(0, 7)))]) + data[at + 1 :]
        elif op == "head":
            data = data[:at] + draw(st.sampled_from(_RAW_HEADS)) + data[at:]
        elif op == "append":
            data += draw(st.binary(min_size=1, max_size=4))
    return data


def _check_decode(decoder: Decoder[Any], data: bytes | bytearray | memoryview) -> None:
    """A message (that re-encodes to itself) or the callers' errors: WireError, DECODE_ERRORS."""
    try:
        message = decoder.decode(data)
    except WireError:
        message = None
    else:
        again = encode(message)
        assert encode(decoder.decode(again)) == again
    try:
        decoder.decode_raw(data)
    except DECODE_ERRORS:
        assert message is None
    else:
        assert message is not None


@_decoders
@FUZZ
@given(st.binary(max_size=200) | st.sampled_from(_RAW_HEADS))
def test_wire_random_bytes_only_raise_wire_errors(name: str, data: bytes) -> None:
    decoder, _ = DECODERS[name]
    _check_decode(decoder, data)
    _check_decode(decoder, memoryview(bytearray(data)))


@_decoders
@FUZZ
@given(st.data())
def test_wire_broken_messages_only_raise_wire_errors(name: str, data: st.DataObject) -> None:
    decoder, messages = DECODERS[name]
    _check_decode(decoder, data.draw(near_valid_msgpack(messages)))


@_decoders
@FUZZ
@given(st.data())
def test_wire_messages_round_trip(name: str, data: st.DataObject) -> None:
    decoder, messages = DECODERS[name]
    message = data.draw(messages)
    raw = encode(message)
    assert decoder.decode(raw) == message
    assert type(decoder.decode_raw(raw)) is type(message)
    # plain msgpack only (no ext types): another implementation reads it and writes it back
    plain = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    assert decoder.decode(msgpack.packb(plain, use_bin_type=True)) == message


# =============================================================================
# KV transfer port: a 4-byte length, then a msgpack message (pdtrio.kv.tcp)
# =============================================================================


class _BytesStream(trio.abc.Stream):
    """A peer that sends ``data`` in reads of the given sizes, and takes whatever is sent."""

    def __init__(self, data: bytes, read_sizes: list[int]) -> None:
        self._data = data
        self._read_sizes = read_sizes or [len(data) or 1]
        self._reads = 0
        self.sent = bytearray()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        size = self._read_sizes[self._reads % len(self._read_sizes)]
        self._reads += 1
        if max_bytes is not None:
            size = min(size, max_bytes)
        chunk, self._data = self._data[:size], self._data[size:]
        return chunk

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        self.sent += data

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


_KV_DECODERS = ["transfer_request", "transfer_answer", "transfer_done", "nixl_agent_info"]


@st.composite
def kv_frames(draw: st.DrawFn, messages: st.SearchStrategy[Any]) -> bytes:
    """What a KV peer may send: a length and a message, each right or wrong."""
    kind = draw(st.sampled_from(["valid", "broken", "random", "lying_length", "huge_length"]))
    if kind == "valid":
        body = encode(draw(messages))
    elif kind == "broken":
        body = draw(near_valid_msgpack(messages))
    else:
        body = draw(st.binary(max_size=64))
    length = len(body)
    if kind == "lying_length":
        length = draw(st.integers(0, (1 << 20) + 1))
    elif kind == "huge_length":
        length = draw(st.integers((1 << 20) + 1, 2**32 - 1))
    frame = struct.pack("!I", length) + body
    if draw(st.integers(0, 4)) == 0:
        frame = frame[: draw(st.integers(0, len(frame)))]
    return frame


def _receive(stream: _BytesStream, decoder: Decoder[_T]) -> Callable[[], Any]:
    async def main() -> _T:
        return await tcp.receive_message(stream, decoder)

    return lambda: trio.run(main)


@pytest.mark.parametrize("name", _KV_DECODERS)
@FUZZ
@given(st.data(), st.lists(st.integers(1, 9), max_size=4))
def test_kv_frames_only_raise_transfer_or_wire_errors(
    name: str, data: st.DataObject, read_sizes: list[int]
) -> None:
    decoder, messages = DECODERS[name]
    frame = data.draw(kv_frames(messages) | st.binary(max_size=40))
    stream = _BytesStream(frame, read_sizes)
    try:
        message = _receive(stream, decoder)()
    except KvTransferError:
        # the peer left early: the length promised more than came
        assert len(frame) < 4 or struct.unpack("!I", frame[:4])[0] > len(frame) - 4
    except WireError:
        pass
    else:
        (length,) = struct.unpack("!I", frame[:4])
        assert encode(message) == encode(decoder.decode(frame[4 : 4 + length]))
    if len(frame) >= 4 and struct.unpack("!I", frame[:4])[0] > 1 << 20:
        # a length over the limit is refused before a byte of the body is read
        assert stream._data == frame[4:]


@pytest.mark.parametrize("name", _KV_DECODERS)
@FUZZ
@given(st.data(), st.lists(st.integers(1, 9), max_size=4))
def test_kv_messages_round_trip(name: str, data: st.DataObject, read_sizes: list[int]) -> None:
    decoder, messages = DECODERS[name]
    message = data.draw(messages)
    sender = _BytesStream(b"", [])

    async def send() -> None:
        await tcp.send_message(sender, message)

    trio.run(send)
    receiver = _BytesStream(bytes(sender.sent), read_sizes)
    assert _receive(receiver, decoder)() == message


# =============================================================================
# The websocket frame cutter (pdtrio.protocol.link.websocket_frames)
# =============================================================================

_OP_CONT, _OP_TEXT, _OP_BINARY, _OP_CLOSE, _OP_PING, _OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA


def _open_client() -> wsproto.WSConnection:
    client = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
    server = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
    server.receive_data(client.send(Request(host="decode", target="/pd/link")))
    list(server.events())
    client.receive_data(server.send(AcceptConnection()))
    list(client.events())
    return client


def _ws_frame(
    first: int, payload: bytes, *, mask: bytes | None = None, length_form: str = "minimal"
) -> bytes:
    """One frame; ``length_form`` other than minimal breaks RFC 6455's length rules."""
    n = len(payload)
    mask_bit = 0x80 if mask is not None else 0
    if length_form == "minimal":
        length_form = "7" if n < 126 else "16" if n < 1 << 16 else "64"
    if length_form == "7":
        head = bytes([first, mask_bit | n])
    elif length_form == "16":
        head = bytes([first, mask_bit | 126]) + struct.pack("!H", n)
    elif length_form == "64":
        head = bytes([first, mask_bit | 127]) + struct.pack("!Q", n)
    else:  # "msb": the 64-bit length with its forbidden top bit set
        head = bytes([first, mask_bit | 127]) + struct.pack("!Q", n | 1 << 63)
    if mask is None:
        return head + payload
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


@st.composite
def ws_frames(draw: st.DrawFn) -> tuple[bytes, bool]:
    """(a frame a server might send, whether the cutter and plain wsproto must agree on it)."""
    opcode = draw(
        st.sampled_from(
            [_OP_BINARY] * 6 + [_OP_TEXT] * 2 + [_OP_CONT, _OP_CLOSE, _OP_PING, _OP_PONG]
        )
        | st.integers(0, 15)
    )
    fin = draw(st.integers(0, 5)) > 0
    rsv = draw(st.sampled_from([0] * 12 + [1, 2, 4, 7]))
    if opcode == _OP_TEXT or (opcode == _OP_CONT and draw(st.booleans())):
        text = draw(st.text(max_size=20)).encode("utf-8", "surrogatepass")
        payload = draw(st.just(text) | st.binary(max_size=8))
        if draw(st.booleans()):
            payload = payload[: draw(st.integers(0, len(payload)))]  # cut mid-character
    elif opcode == _OP_CLOSE:
        code = draw(st.sampled_from([1000, 1001, 1002, 1005, 1006, 1011, 1015, 999, 3000, 5000]))
        reason = draw(st.text(max_size=10)).encode("utf-8", "surrogatepass")
        payload = draw(st.just(struct.pack("!H", code) + reason) | st.binary(max_size=3))
    else:
        payload = draw(
            st.binary(max_size=40) | st.sampled_from([b"x" * 125, b"y" * 126, b"z" * 300])
        )
    mask = draw(st.sampled_from([None] * 10 + [b"\x01\x02\x03\x04"]))
    length_form = draw(st.sampled_from(["minimal"] * 10 + ["7", "16", "64", "msb"]))
    if length_form == "7" and len(payload) >= 126:
        length_form = "minimal"
    first = (0x80 if fin else 0) | rsv << 4 | opcode
    frame = _ws_frame(first, payload, mask=mask, length_form=length_form)
    # the fast path takes a whole unmasked binary frame however its length is written
    agree = not (first == 0x82 and mask is None and length_form not in ("minimal",))
    if length_form == "msb":
        agree = False  # the cutter waits for 2**63 bytes; wsproto refuses at once
    return frame, agree


@st.composite
def ws_messages(draw: st.DrawFn) -> bytes:
    """A valid message from a server: whole or in fragments, pings between them."""
    kind = draw(st.sampled_from(["binary"] * 4 + ["text", "ping", "pong"]))
    if kind != "binary" and kind != "text":
        opcode = _OP_PING if kind == "ping" else _OP_PONG
        return _ws_frame(0x80 | opcode, draw(st.binary(max_size=125)))
    if kind == "text":
        payload = draw(st.text(max_size=40)).encode()
    else:
        payload = draw(st.binary(max_size=300))
    # fragments may cut a character in two: only the whole message must be UTF-8
    points = sorted(draw(st.lists(st.integers(0, len(payload)), max_size=2)))
    bounds = [0, *points, len(payload)]
    frames = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        opcode = (_OP_TEXT if kind == "text" else _OP_BINARY) if i == 0 else _OP_CONT
        fin = 0x80 if b == len(payload) and i == len(bounds) - 2 else 0
        frames.append(_ws_frame(fin | opcode, payload[a:b]))
        if not fin and draw(st.integers(0, 3)) == 0:
            frames.append(_ws_frame(0x80 | _OP_PING, b"between"))
    return b"".join(frames)


@st.composite
def ws_streams(draw: st.DrawFn) -> tuple[bytes, bool]:
    """Valid messages, with now and then a broken frame or garbage; maybe a close at the end."""
    parts: list[tuple[bytes, bool]] = []
    for _ in range(draw(st.integers(0, 10))):
        pick = draw(st.integers(0, 19))
        if pick == 0:
            parts.append((draw(st.binary(min_size=1, max_size=6)), False))
        elif pick <= 3:
            parts.append(draw(ws_frames()))
        else:
            parts.append((draw(ws_messages()), True))
    if draw(st.integers(0, 3)) == 0:
        code = draw(st.sampled_from([1000, 1001, 1011, 3000, 4999]))
        reason = draw(st.text(max_size=20)).encode()
        parts.append((_ws_frame(0x80 | _OP_CLOSE, struct.pack("!H", code) + reason), True))
    return b"".join(p for p, _ in parts), all(agree for _, agree in parts)


@st.composite
def _cuts(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """``data`` as the reads a socket might return."""
    points = sorted(draw(st.lists(st.integers(0, len(data)), max_size=6)))
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def _wsproto_reference(data: bytes) -> tuple[list[bytes | str], int | None]:
    """The messages and close code plain wsproto makes of the whole stream."""
    client = _open_client()
    client.receive_data(data)
    messages: list[bytes | str] = []
    parts: list[bytes | str] = []
    for event in client.events():
        if isinstance(event, BytesMessage | TextMessage):
            parts.append(bytes(event.data) if isinstance(event, BytesMessage) else event.data)
            if event.message_finished:
                if isinstance(event, TextMessage):
                    messages.append("".join(p for p in parts if isinstance(p, str)))
                else:
                    messages.append(b"".join(p for p in parts if isinstance(p, bytes)))
                parts = []
        elif isinstance(event, CloseConnection):
            return messages, event.code
    return messages, None


def _run_reader(
    reads: list[bytes], max_message_size: int, receive_size: int
) -> tuple[list[bytes | str], int | None]:
    """Feed the reads as the shell does; return the messages and the close code."""
    ws = _open_client()
    reader = ClientFrameReader(ws, max_message_size=max_message_size, receive_size=receive_size)
    messages: list[bytes | str] = []
    for chunk in reads:
        reader.receive_data(chunk)
        batch = reader.take_batch()
        for message in batch.messages:
            assert isinstance(message, bytes | str)
            assert len(message) <= max_message_size
        messages += batch.messages
        for reply in [*batch.replies, batch.close_reply]:
            if reply is not None:
                try:
                    ws.send(reply)
                except LocalProtocolError:
                    pass  # the shell reports ConnectionClosed: nothing more to send
        assert reader.wanted_read_size() >= 1
        if batch.closed is not None:
            assert reader.closed == batch.closed
            with pytest.raises(ReaderClosedError):
                reader.receive_data(b"\x82\x00")
            return messages, batch.closed.code
    return messages, None


@FUZZ
@given(st.data())
def test_websocket_cutter_never_raises(data: st.DataObject) -> None:
    stream, _ = data.draw(ws_streams() | st.binary(max_size=120).map(lambda b: (b, False)))
    reads = data.draw(_cuts(stream))
    max_message_size = data.draw(st.sampled_from([0, 1, 64, 200, 1 << 20]))
    receive_size = data.draw(st.sampled_from([1, 7, 64, 4096]))
    _run_reader(reads, max_message_size, receive_size)


@FUZZ
@given(st.data())
def test_websocket_cutter_agrees_with_wsproto(data: st.DataObject) -> None:
    """Whatever the cuts, the cutter reads what wsproto alone reads from the same bytes."""
    stream, agree = data.draw(ws_streams())
    reads = data.draw(_cuts(stream))
    receive_size = data.draw(st.sampled_from([1, 7, 64, 4096]))
    messages, code = _run_reader(reads, 1 << 30, receive_size)
    if agree:
        assert (messages, code) == _wsproto_reference(stream)
