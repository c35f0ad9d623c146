"""Router <-> worker messages: one typed definition each, used at every hop.

Every message is a ``msgspec.Struct`` with ``array_like=True``: positional on
the wire (a msgpack array, no field names), named in code, and decoded
straight into the struct, validated, with no intermediate lists.  Messages of
the worker link (the one websocket between the router and each worker: prefill
calls, releases, decode starts, aborts, tokens) carry an integer tag as their
first element (``[kind, ...fields]``), so one decoder tells them apart.  A worker
whose router asks for it (``?batch=1`` on the link) sends what is ready at once
as one batch, an array of such messages (:func:`is_batch`).  The token entry is
the hot path: a frame of many entries decodes faster this way than plain
msgpack into lists did, and nobody indexes by magic number any more.

Nothing but plain msgpack crosses the wire: no ext types, never pickle.
Anything that does not decode into the expected type raises :class:`WireError`.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Iterator
from typing import Annotated, Any, Final, Generic, TypeVar, final

import msgspec

from pdtrio.protocol.errors import ERRORS, Reason
from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.sampling import MAX_CHOICES, SamplingParams

MSGPACK_CONTENT_TYPE = "application/msgpack"


class WireError(ValueError):
    """The peer sent something that is not a valid message."""


class MessageKind(enum.IntEnum):
    """The tag of each worker-link message (its first array element)."""

    START = 1
    ABORT = 2
    ACCEPTED = 3
    REJECTED = 4
    TOKENS = 5
    FAILED = 6
    CAPACITY = 7
    PREFILL = 8
    PREFILLED = 9
    PREFILL_FAILED = 10
    RELEASE = 11
    HEARTBEAT = 12
    LOGPROBS = 13
    PREFILLED_WITH_LOGPROB = 14
    PREFILLED_WITH_CHOICES = 15
    START_CHOICES = 16
    KV_EVENTS = 17


class RejectReason(enum.StrEnum):
    NO_ROOM = "no_room"
    LAYOUT_MISMATCH = "layout_mismatch"
    TRANSFER_FAILED = "transfer_failed"
    BAD_REQUEST = "bad_request"
    SHUTTING_DOWN = "shutting_down"


class _Positional(
    msgspec.Struct, array_like=True, frozen=True, gc=False, forbid_unknown_fields=True
):
    """Base of every wire message: a msgpack array of the fields, in order."""


class Usage(_Positional, frozen=True):
    """Token counts of a finished request, as the engine that ran it counted them."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


# the most token (and block) ids one message may carry: beyond any model's context, and a
# bound msgspec checks from the array's header, before decoding a huge peer frame
MAX_TOKEN_IDS = 1 << 21
TokenIds = Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_TOKEN_IDS)]
BlockIds = Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_TOKEN_IDS)]


class KvHandle(_Positional, frozen=True):
    """Where a request's prefilled KV blocks live and for how long.

    The lease crosses hosts as a duration, never as an instant: ``lease_ttl_s`` is
    what is left of it as the message carrying the handle is sent, and whoever
    receives it counts from its own (monotonic) clock at receipt
    (:func:`lease_deadline`); whoever passes it on sends what is left then
    (:func:`with_lease_left`). Two hosts' clocks are never compared.
    """

    request_id: str
    instance_id: str
    transfer_host: str
    transfer_port: Annotated[int, msgspec.Meta(ge=0, le=65535)]
    block_ids: BlockIds
    num_tokens: int
    layout: KvLayout
    # seconds left of prefill's lease as the handle is sent (it frees the blocks then);
    # was an absolute wall-clock instant before registration version 2
    lease_ttl_s: float
    # the grant prefill minted for this request: only its holder may read or release the
    # blocks (knowing the request id is not enough)
    access_token: str = ""


def lease_deadline(handle: KvHandle, received_at: float) -> float:
    """When the handle's lease ends on the receiver's clock, ``received_at`` being the
    receipt on that clock. A TTL that is not a number >= 0 (a peer's bad float) has
    ended already; an infinite one never ends here (prefill still frees at its own)."""
    ttl = handle.lease_ttl_s
    return received_at + ttl if ttl >= 0 else received_at  # (NaN: not >= 0)


def with_lease_left(handle: KvHandle, deadline: float, now: float) -> KvHandle:
    """The handle to pass on at ``now``: its TTL what is left until ``deadline`` (both
    on the holder's clock), 0 when the lease has ended."""
    left = deadline - now
    return msgspec.structs.replace(handle, lease_ttl_s=left if left > 0 else 0.0)


# --- prompts -----------------------------------------------------------------


class ChatPrompt(_Positional, frozen=True, tag="chat"):
    """Chat messages as (role, text) pairs; text parts are already joined."""

    messages: tuple[tuple[str, str], ...]


class ChatPromptWithTools(ChatPrompt, frozen=True, tag="chat_tools"):
    """Chat messages with tools to show the model and tool-call history.

    ``tools_json``: the request's tools as the chat template takes them (OpenAI's
    shape, JSON text; "" for none). ``message_extras``: per message, what it
    carries besides its text (an assistant's ``tool_calls``, a result's
    ``tool_call_id``) as JSON text, "" for nothing. A tag of its own: a plain
    chat's bytes stay as they were, and a worker too old for tools refuses
    these instead of dropping the tools.
    """

    tools_json: str
    message_extras: tuple[str, ...]


class TextPrompt(_Positional, frozen=True, tag="text"):
    text: str


class TokenPrompt(_Positional, frozen=True, tag="tokens"):
    token_ids: TokenIds


Prompt = ChatPrompt | ChatPromptWithTools | TextPrompt | TokenPrompt


# --- logprobs -------------------------------------------------------------------

# the most alternatives a token's logprob may come with (vLLM's default max_logprobs)
MAX_TOP_LOGPROBS: Final = 20


class TokenLogprob(_Positional, frozen=True):
    """One generated token's log-probability and the likeliest tokens at its position.

    ``token`` is the token decoded on its own (what OpenAI's logprobs name it);
    ``top_tokens`` and ``top_logprobs`` are the request's ``logprobs`` likeliest,
    best first.  Log-probabilities of the model's raw distribution, before any
    sampling parameter changes it (vLLM's default ``logprobs_mode``, ``raw_logprobs``).
    """

    token: str
    logprob: float
    top_tokens: Annotated[tuple[str, ...], msgspec.Meta(max_length=MAX_TOP_LOGPROBS)] = ()
    top_logprobs: Annotated[tuple[float, ...], msgspec.Meta(max_length=MAX_TOP_LOGPROBS)] = ()


class TokenLogprobs(_Positional, frozen=True, tag=int(MessageKind.LOGPROBS)):
    """The logprobs of a request's next tokens, one item per token in order.

    Sent only for a request that asked for them, ahead of the token frame that
    carries those tokens (so the token entry, the hot path, carries nothing for
    them): the router keeps them beside the request's stream and hands each
    delta the items of its tokens.
    """

    request_id: str
    items: Annotated[list[TokenLogprob], msgspec.Meta(max_length=MAX_TOKEN_IDS)]


# --- router -> prefill ----------------------------------------------------------


class PrefillRequest(_Positional, frozen=True, tag=int(MessageKind.PREFILL)):
    """Prefill the prompt and sample the first token.

    ``max_tokens`` is the client's limit (None: the configured default); prefill
    turns it into the request's whole token budget, once.  ``release_token`` is
    the router's own proof that it asked for this prefill: a release showing it
    stops the prefill or frees its KV over any link, like the KV handle's grant
    (so the router can free KV whose reply never reached it).

    ``generated_tokens`` > 0 makes it a continuation (a request whose decode failed
    mid-stream, migrated): the prompt is token ids, the last ``generated_tokens``
    of them already generated and delivered.  They are prefilled with the rest,
    but count as output: the budget comes from the prompt before them (so
    ``max_tokens`` is the request's whole budget, as first computed), they are
    spent from it, they feed the stop rules (min_tokens, the stop-string
    hold-back, the text stream) without being sent again, and usage counts them
    as completion tokens.  The token sampled is the next one of the request.
    """

    request_id: str
    prompt: Prompt
    sampling: SamplingParams
    max_tokens: int | None = None
    release_token: str = ""
    generated_tokens: int = 0


class PrefillReply(_Positional, frozen=True, tag=int(MessageKind.PREFILLED)):
    """The prompt is in the cache; here is the first token and where the KV lives.

    ``token_budget`` is the request's whole completion budget, the first token
    included.  ``kv_handle`` is None when generation already finished at the
    first token (prefill has then released the blocks itself, and ``usage`` is set).
    The first token's logprob, when asked for, comes in a PrefillReplyWithLogprob.
    """

    request_id: str
    prompt_token_ids: TokenIds
    cached_tokens: int
    first_token_id: int
    first_text: str
    finish_reason: str | None
    token_budget: int
    kv_handle: KvHandle | None
    usage: Usage | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class PrefillReplyWithLogprob(
    PrefillReply, frozen=True, tag=int(MessageKind.PREFILLED_WITH_LOGPROB)
):
    """A :class:`PrefillReply` to a request that asked for logprobs: the first token's too.

    A kind of its own, not a field of PrefillReply: msgspec writes every field of
    a positional struct, and a router from before logprobs refuses a reply
    longer than it knows (``forbid_unknown_fields``); it never asks for logprobs,
    so it never gets one of these.
    """

    first_logprob: TokenLogprob | None = None


def first_logprob(reply: PrefillReply) -> TokenLogprob | None:
    """The first token's logprob a prefill reply carries (None: not asked for)."""
    return reply.first_logprob if isinstance(reply, PrefillReplyWithLogprob) else None


def choice_request_id(request_id: str, choice: int) -> str:
    """The id choice ``choice`` of a request runs under on decode (its token entries,
    logprobs and failures name it): choice 0 keeps the request's own."""
    return request_id if choice == 0 else f"{request_id}/{choice}"


class FirstToken(_Positional, frozen=True):
    """The first token of one more choice of a request with ``n`` > 1 (prefill samples
    it from the same logits as choice 0's); ``usage`` is set with ``finish_reason``."""

    choice: int
    token_id: int
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    logprob: TokenLogprob | None = None


class PrefillReplyWithChoices(
    PrefillReplyWithLogprob, frozen=True, tag=int(MessageKind.PREFILLED_WITH_CHOICES)
):
    """A :class:`PrefillReply` to a request with ``n`` > 1: choice 0 in the reply's own
    fields, choices 1.. in ``choices`` (in order).  ``kv_handle`` is None only when
    every choice finished at its first token.  A kind of its own, as the logprob's."""

    choices: Annotated[tuple[FirstToken, ...], msgspec.Meta(max_length=MAX_CHOICES)] = ()


def reply_choices(reply: PrefillReply) -> tuple[FirstToken, ...]:
    """The first tokens of choices 1.. a prefill reply carries (n = 1: none)."""
    return reply.choices if type(reply) is PrefillReplyWithChoices else ()


class PrefillFailed(_Positional, frozen=True, tag=int(MessageKind.PREFILL_FAILED)):
    """Prefill refused or failed the request: the error the client should see.

    Prefill holds nothing of the request any more.
    """

    request_id: str
    status: int
    message: str
    error_type: str
    param: str | None = None


# PrefillFailed.error_type of a prefill refused because its instance is stopping: routers
# take the instance out of rotation at once and send the request elsewhere
DRAINING_ERROR_TYPE = "instance_draining"


def prefill_failed(
    request_id: str,
    reason: Reason,
    message: str,
    *,
    param: str | None = None,
    error_type: str | None = None,
) -> PrefillFailed:
    """Prefill's answer for a request it refused or failed: the status and type are the
    one table's (:data:`pdtrio.protocol.errors.ERRORS`); ``error_type`` only where the
    router must tell this failure apart (a draining instance)."""
    kind = ERRORS[reason]
    return PrefillFailed(request_id, kind.status, message, error_type or kind.type, param)


def request_id_in_use(request_id: str) -> PrefillFailed:
    """A second request of an id prefill knows: it would share the first one's blocks."""
    return prefill_failed(
        request_id, Reason.REQUEST_ID_IN_USE, f"request {request_id} is already known"
    )


class ReleaseRequest(_Positional, frozen=True, tag=int(MessageKind.RELEASE)):
    """Free a request's KV blocks on prefill (decode has them, or nobody will).

    Also stops a prefill still in progress: this is how the router cancels a call.
    Over a link, a prefill that link asked for, whose reply it has not been sent
    yet, needs no token; anything else needs the KV handle's ``access_token`` or
    the call's ``release_token``.
    """

    request_id: str
    access_token: str = ""


class ReleaseReply(_Positional, frozen=True):
    released: bool


# --- router <-> decode ---------------------------------------------------------


class DecodeStart(_Positional, frozen=True, tag=int(MessageKind.START)):
    """Run a prefilled request.

    ``token_budget`` is the whole completion budget; ``tokens_generated`` how
    much of it is already spent (the first token, sampled by prefill, and for a
    continuation the tokens delivered before it).  ``generated_tokens``: for a
    continuation (see :class:`PrefillRequest`), how many of the last
    ``prompt_token_ids`` (the prefilled ids, all in the KV) are generated output;
    the prompt proper is the ids before them.
    """

    request_id: str
    prompt_token_ids: TokenIds
    first_token_id: int
    sampling: SamplingParams
    token_budget: int
    tokens_generated: int
    cached_tokens: int
    kv_handle: KvHandle
    generated_tokens: int = 0

    @property
    def own_prompt_tokens(self) -> int:
        """The prompt's own tokens, without those generated before (a continuation's)."""
        return len(self.prompt_token_ids) - self.generated_tokens


class DecodeStartChoices(DecodeStart, frozen=True, tag=int(MessageKind.START_CHOICES)):
    """A :class:`DecodeStart` of a request with ``n`` > 1: the choices still to run, as
    (choice, its first token id), those that did not finish at prefill.  Each runs as
    :func:`choice_request_id` on the prompt's one KV (its full blocks shared, the
    partial last one copied); ``first_token_id`` is the first choice's of them.  The
    router aborts each choice by its own id."""

    choices: Annotated[tuple[tuple[int, int], ...], msgspec.Meta(max_length=MAX_CHOICES)] = ()

    @classmethod
    def of(cls, start: DecodeStart, choices: tuple[tuple[int, int], ...]) -> DecodeStartChoices:
        """``start`` running ``choices`` (not empty), the first of them standing first."""
        return cls(
            start.request_id,
            start.prompt_token_ids,
            choices[0][1],
            start.sampling,
            start.token_budget,
            start.tokens_generated,
            start.cached_tokens,
            start.kv_handle,
            start.generated_tokens,
            choices,
        )


class DecodeAbort(_Positional, frozen=True, tag=int(MessageKind.ABORT)):
    request_id: str


class DecodeAccepted(_Positional, frozen=True, tag=int(MessageKind.ACCEPTED)):
    request_id: str


class DecodeRejected(_Positional, frozen=True, tag=int(MessageKind.REJECTED)):
    request_id: str
    reason: RejectReason
    message: str


class DecodeFailed(_Positional, frozen=True, tag=int(MessageKind.FAILED)):
    """A running request failed on decode after it was accepted."""

    request_id: str
    message: str


class DecodeCapacity(_Positional, frozen=True, tag=int(MessageKind.CAPACITY)):
    """Decode's KV room now: sent when the link opens and whenever the free count changes.

    It goes out before the accept it may reflect, so a router that sees
    ``DecodeAccepted`` already holds a report that counts that request's blocks.
    """

    free_blocks: int
    total_blocks: int
    block_size: int


class TokenEntry(_Positional, frozen=True):
    """New output of one request: the hot path, built by the engine, read by the router.

    ``usage`` is set on the entry that carries ``finish_reason``: decode's
    count is the one the client sees (it covers tokens cut by a stop string).
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None


class TokenFrame(_Positional, frozen=True, tag=int(MessageKind.TOKENS)):
    entries: list[TokenEntry]


class Heartbeat(_Positional, frozen=True, tag=int(MessageKind.HEARTBEAT)):
    """The worker is alive: sent when it has sent nothing else for a heartbeat interval.

    Any frame proves liveness; this one only fills silence, so the router can
    tell a hung worker (stopped, wedged) from an idle one.
    """


# a block hash of the prefix cache (``pdtrio.protocol.placement.prefix_index.block_hashes``)
BlockHashes = Annotated[tuple[bytes, ...], msgspec.Meta(max_length=MAX_TOKEN_IDS)]


class KvEvents(_Positional, frozen=True, tag=int(MessageKind.KV_EVENTS)):
    """What the worker's prefix cache stored and evicted since the link's last report: many
    block hashes in one message, sent ahead of the link's next frame (never one per block).

    ``snapshot``: ``stored`` is the whole cache (``removed`` empty), sent first on each
    connection, so the router's view is rebuilt, never stale; else the two are
    disjoint, each hash's state now.  Only to a router that asks (``?kv_events=1``) and
    only with the cache on: a router from before them never gets one.
    """

    snapshot: bool
    stored: BlockHashes = ()
    removed: BlockHashes = ()


# what travels on the worker link, each way
ToWorker = DecodeStart | DecodeStartChoices | DecodeAbort | PrefillRequest | ReleaseRequest
FromWorker = (
    DecodeAccepted
    | DecodeRejected
    | DecodeFailed
    | TokenFrame
    | DecodeCapacity
    | PrefillReply
    | PrefillReplyWithLogprob
    | PrefillReplyWithChoices
    | PrefillFailed
    | Heartbeat
    | TokenLogprobs
    | KvEvents
)


# --- decode <- prefill (KV transfer port) --------------------------------------


class TransferRequest(_Positional, frozen=True):
    """Decode asks prefill for a request's blocks, with the handle's grant."""

    request_id: str
    block_ids: BlockIds
    access_token: str = ""


class KvDigests(_Positional, frozen=True):
    """What prefill wrote in the blocks it grants, for decode to check once they are its own.

    For the i-th block asked for: ``digests[i]``, the CRC-32 of its bytes as prefill
    wrote them (of every byte when ``sample_lines`` is 0; else of ``sample_lines`` of its
    lines of ``line_bytes`` bytes, spread evenly, the first and the last included:
    ``pdtrio.kv.digest``), and its generation then and when the read was granted: a block
    freed and reused meanwhile shows two, whatever its bytes.
    """

    sample_lines: int
    line_bytes: int
    digests: tuple[int, ...]
    written_generations: tuple[int, ...]
    granted_generations: tuple[int, ...]


class TransferAnswer(_Positional, frozen=True):
    """``nbytes`` of block data follow when ``granted``; else ``reason`` says why not."""

    granted: bool
    nbytes: int = 0
    reason: str = ""


class TransferAnswerWithDigests(TransferAnswer, frozen=True):
    """A ``TransferAnswer`` with what prefill wrote in the blocks: what a prefill that
    recorded it sends.  Its own struct, so a plain answer stays the array an older decode
    reads; decode reads either as this (a plain one without digests)."""

    digests: KvDigests | None = None


class TransferDone(_Positional, frozen=True):
    """Decode holds the bytes: prefill may free the blocks (the grant says who may)."""

    request_id: str
    access_token: str = ""


# --- encoding -----------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_T = TypeVar("_T")


def encode(message: Any) -> bytes:
    """Any wire message (or list of them) as msgpack bytes."""
    return _encoder.encode(message)


# A prompt text at least this long is encoded a slice at a time (a fraction of a millisecond).
PIECEWISE_TEXT_CHARS: Final = 256 * 1024


def prompt_is_long(prompt: Prompt) -> bool:
    """Whether :func:`encode_in_pieces` would cut ``prompt``'s text (else: just encode)."""
    if type(prompt) is TextPrompt:
        return len(prompt.text) >= PIECEWISE_TEXT_CHARS
    if isinstance(prompt, ChatPrompt):
        return any(len(text) >= PIECEWISE_TEXT_CHARS for _, text in prompt.messages)
    return False


def encode_in_pieces(request: PrefillRequest, piece_bytes: int) -> Iterator[bytes]:
    """``encode(request)``, as consecutive pieces: a long prompt text a slice at a time.

    One msgpack call over a prompt of megabytes holds the GIL (the event loop)
    for milliseconds, 5-8 for 15 MB, most of it the page faults of its fresh
    output buffer; slices of at most ``piece_bytes`` bytes cost a fraction of
    one, each made just before it is sent.  A text's UTF-8 length comes first
    (msgpack's header): ASCII's is its length, anything else is encoded once
    to count it, a slice per step, with an empty piece after each (nothing to
    send, a moment for others).
    """
    long_texts: list[str] = []

    def stand_in(text: str) -> str:
        if len(text) < PIECEWISE_TEXT_CHARS:
            return text
        long_texts.append(text)
        return f"{marker}{len(long_texts) - 1}"

    # random: no client string can be mistaken for one
    marker = f"\x00pdtrio-long-text-{secrets.token_hex(8)}-"
    prompt = request.prompt
    if type(prompt) is TextPrompt:
        prompt = TextPrompt(stand_in(prompt.text))
    elif isinstance(prompt, ChatPrompt):
        messages = tuple((role, stand_in(text)) for role, text in prompt.messages)
        prompt = msgspec.structs.replace(prompt, messages=messages)
    skeleton = encode(msgspec.structs.replace(request, prompt=prompt))
    del prompt
    start = 0
    for index, text in enumerate(long_texts):
        stand_in_bytes = encode(f"{marker}{index}")
        at = skeleton.index(stand_in_bytes, start)
        yield skeleton[start:at]
        start = at + len(stand_in_bytes)
        yield from _text_in_pieces(text, piece_bytes)
    yield skeleton[start:]


def _text_in_pieces(text: str, piece_bytes: int) -> Iterator[bytes]:
    """A msgpack str, header first, then the UTF-8 bytes a slice at a time."""
    if text.isascii():  # O(1): CPython keeps the flag
        size, chars = len(text), piece_bytes
    else:
        chars = piece_bytes // 4  # at most 4 bytes a character
        size = 0
        for start in range(0, len(text), chars):
            size += len(text[start : start + chars].encode())
            yield b""
    yield _STR32_HEADER + size.to_bytes(4, "big")
    for start in range(0, len(text), chars):
        yield text[start : start + chars].encode()


_STR32_HEADER: Final = b"\xdb"  # msgpack str, 32-bit length: a long text always is one


@final
class Decoder(Generic[_T]):
    """Decodes one message type (or tagged union); every failure is a :class:`WireError`."""

    __slots__ = ("_decoder", "decode_raw")

    def __init__(self, message_type: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(message_type)
        # for a caller that maps msgspec's errors itself, to save a call on the hot path
        self.decode_raw = self._decoder.decode

    def decode(self, data: bytes | bytearray | memoryview) -> _T:
        try:
            return self._decoder.decode(data)  # type: ignore[no-any-return]
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireError(str(exc)) from None


# what decode_raw raises for bytes that are not the expected message
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)

to_worker_decoder: Decoder[ToWorker] = Decoder(ToWorker)
from_worker_decoder: Decoder[FromWorker] = Decoder(FromWorker)
# a worker's batch: several messages in one websocket message, when the router asks (?batch=1)
from_worker_batch_decoder: Decoder[list[FromWorker]] = Decoder(list[FromWorker])

# msgpack array headers: fixarray (0x90-0x9f, the length inside), array 16 and array 32
_ARRAY16: Final = 0xDC
_ARRAY32: Final = 0xDD


def is_batch(data: bytes) -> bool:
    """Whether ``data`` is a batch of messages (an array of arrays), not one message.

    A message is an array whose first item is its tag, an integer; a batch is
    an array whose first item is a message: an array.
    """
    if not data:
        return False
    first = data[0]
    if 0x90 <= first <= 0x9F:
        item = 1
    elif first == _ARRAY16:
        item = 3
    elif first == _ARRAY32:
        item = 5
    else:
        return False
    if len(data) <= item:
        return True  # an empty array: no message has no tag, so an empty batch
    head = data[item]
    return 0x90 <= head <= 0x9F or head == _ARRAY16 or head == _ARRAY32


# --- decode <- prefill: NIXL (a control session on the KV transfer port) --------


class NixlAgentInfo(_Positional, frozen=True):
    """Prefill's NIXL agent: the first message of a NIXL session on its KV transfer port.

    Decode loads ``agent_metadata`` into its own agent and READs block ``b``
    from ``base_address + b * block_nbytes`` of prefill's ``memory`` ("DRAM" or
    "VRAM" on GPU ``device_id``).  It asks before each read (``TransferRequest``,
    answered by ``TransferAnswer`` on the session) and says it is done with a
    NIXL notification carrying a msgpack ``TransferDone``.  ``unavailable`` says
    why, when this instance serves no NIXL reads (the rest is then empty).
    """

    unavailable: str
    agent_name: str = ""
    agent_metadata: bytes = b""
    memory: str = ""
    device_id: int = 0
    base_address: int = 0
    num_blocks: int = 0
    block_nbytes: int = 0
