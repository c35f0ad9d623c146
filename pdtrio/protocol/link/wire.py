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

This module is where the rest of the package takes them from; they are defined by
domain beside it: what they are built on (``message_base``), prefill's
(``prefill_messages``), decode's (``decode_messages``), a worker's reports
(``control_messages``), the KV transfer port's (``kv_port_messages``) and the bytes
(``encoding``).  Here: what travels each way of the link, and its decoders.
"""

from __future__ import annotations

from pdtrio.protocol.link.control_messages import BlockHashes, DecodeCapacity, Heartbeat, KvEvents
from pdtrio.protocol.link.decode_messages import (
    DecodeAbort,
    DecodeAccepted,
    DecodeFailed,
    DecodeRejected,
    DecodeStart,
    DecodeStartChoices,
    DecodeStartChoicesTraced,
    DecodeStartTraced,
    RejectReason,
    TokenEntry,
    TokenFrame,
    TokenLogprobs,
    choice_request_id,
    traced_start,
)
from pdtrio.protocol.link.encoding import (
    DECODE_ERRORS,
    MSGPACK_CONTENT_TYPE,
    PIECEWISE_TEXT_CHARS,
    Decoder,
    encode,
    encode_in_pieces,
    is_batch,
    prompt_is_long,
)
from pdtrio.protocol.link.kv_port_messages import (
    KvDigests,
    NixlAgentInfo,
    TransferAnswer,
    TransferAnswerWithDigests,
    TransferDone,
    TransferRequest,
)
from pdtrio.protocol.link.message_base import (
    MAX_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    BlockIds,
    KvHandle,
    MessageKind,
    TokenIds,
    TokenLogprob,
    Usage,
    WireError,
    lease_deadline,
    with_lease_left,
)
from pdtrio.protocol.link.prefill_messages import (
    DRAINING_ERROR_TYPE,
    ChatPrompt,
    ChatPromptWithTools,
    FirstToken,
    PrefillFailed,
    PrefillReply,
    PrefillReplyWithChoices,
    PrefillReplyWithLogprob,
    PrefillRequest,
    PrefillRequestTraced,
    Prompt,
    ReleaseReply,
    ReleaseRequest,
    TextPrompt,
    TokenPrompt,
    first_logprob,
    prefill_failed,
    reply_choices,
    request_id_in_use,
    traced_call,
    traceparent_of,
)

# what travels on the worker link, each way
ToWorker = (
    DecodeStart
    | DecodeStartChoices
    | DecodeStartTraced
    | DecodeStartChoicesTraced
    | DecodeAbort
    | PrefillRequest
    | PrefillRequestTraced
    | ReleaseRequest
)
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

to_worker_decoder: Decoder[ToWorker] = Decoder(ToWorker)
from_worker_decoder: Decoder[FromWorker] = Decoder(FromWorker)
# a worker's batch: several messages in one websocket message, when the router asks (?batch=1)
from_worker_batch_decoder: Decoder[list[FromWorker]] = Decoder(list[FromWorker])

__all__ = [
    "KvDigests",
    "DECODE_ERRORS",
    "DRAINING_ERROR_TYPE",
    "MAX_TOKEN_IDS",
    "MAX_TOP_LOGPROBS",
    "MSGPACK_CONTENT_TYPE",
    "PIECEWISE_TEXT_CHARS",
    "BlockHashes",
    "BlockIds",
    "ChatPrompt",
    "ChatPromptWithTools",
    "DecodeAbort",
    "DecodeAccepted",
    "DecodeCapacity",
    "DecodeFailed",
    "DecodeRejected",
    "DecodeStart",
    "DecodeStartChoices",
    "DecodeStartChoicesTraced",
    "DecodeStartTraced",
    "Decoder",
    "FirstToken",
    "FromWorker",
    "Heartbeat",
    "KvEvents",
    "KvHandle",
    "MessageKind",
    "NixlAgentInfo",
    "PrefillFailed",
    "PrefillReply",
    "PrefillReplyWithChoices",
    "PrefillReplyWithLogprob",
    "PrefillRequest",
    "PrefillRequestTraced",
    "Prompt",
    "RejectReason",
    "ReleaseReply",
    "ReleaseRequest",
    "TextPrompt",
    "ToWorker",
    "TokenEntry",
    "TokenFrame",
    "TokenIds",
    "TokenLogprob",
    "TokenLogprobs",
    "TokenPrompt",
    "TransferAnswer",
    "TransferAnswerWithDigests",
    "TransferDone",
    "TransferRequest",
    "Usage",
    "WireError",
    "choice_request_id",
    "encode",
    "encode_in_pieces",
    "first_logprob",
    "traced_call",
    "traced_start",
    "traceparent_of",
    "from_worker_batch_decoder",
    "from_worker_decoder",
    "is_batch",
    "lease_deadline",
    "prefill_failed",
    "prompt_is_long",
    "reply_choices",
    "request_id_in_use",
    "to_worker_decoder",
    "with_lease_left",
]
