"""The router's prefill calls on a worker's link: the prompt, prefill's reply (the first
token and where the KV lives), its failure, and the release that frees the KV."""

from __future__ import annotations

from typing import Annotated

import msgspec

from pdtrio.protocol.errors import ERRORS, Reason
from pdtrio.protocol.link.message_base import (
    KvHandle,
    MessageKind,
    Positional,
    TokenIds,
    TokenLogprob,
    Usage,
)
from pdtrio.protocol.sampling import MAX_CHOICES, SamplingParams

# --- prompts -----------------------------------------------------------------


class ChatPrompt(Positional, frozen=True, tag="chat"):
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


class TextPrompt(Positional, frozen=True, tag="text"):
    text: str


class TokenPrompt(Positional, frozen=True, tag="tokens"):
    token_ids: TokenIds


Prompt = ChatPrompt | ChatPromptWithTools | TextPrompt | TokenPrompt

# --- router -> prefill ----------------------------------------------------------


class PrefillRequest(Positional, frozen=True, tag=int(MessageKind.PREFILL)):
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


class PrefillRequestTraced(PrefillRequest, frozen=True, tag=int(MessageKind.PREFILL_TRACED)):
    """A :class:`PrefillRequest` of a request the router traces: ``traceparent`` names the
    router's prefill span (W3C trace context), the parent of the worker's.

    A kind of its own, not a field of PrefillRequest: every field of a positional struct
    is written, so a field would change every call's bytes and an older worker would
    refuse them all; it meets this kind only from a router that traces.
    """

    traceparent: str = ""


def traced_call(call: PrefillRequest, traceparent: str) -> PrefillRequest:
    """``call`` carrying ``traceparent`` (as it is, for "": not traced)."""
    if not traceparent:
        return call
    fields = (getattr(call, name) for name in PrefillRequest.__struct_fields__)
    return PrefillRequestTraced(*fields, traceparent=traceparent)  # type: ignore[misc]


def traceparent_of(message: object) -> str:
    """The router's span a prefill call or a decode start names ("": not traced)."""
    traceparent: str = getattr(message, "traceparent", "")
    return traceparent


class PrefillReply(Positional, frozen=True, tag=int(MessageKind.PREFILLED)):
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


class FirstToken(Positional, frozen=True):
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


class PrefillFailed(Positional, frozen=True, tag=int(MessageKind.PREFILL_FAILED)):
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


class ReleaseRequest(Positional, frozen=True, tag=int(MessageKind.RELEASE)):
    """Free a request's KV blocks on prefill (decode has them, or nobody will).

    Also stops a prefill still in progress: this is how the router cancels a call.
    Over a link, a prefill that link asked for, whose reply it has not been sent
    yet, needs no token; anything else needs the KV handle's ``access_token`` or
    the call's ``release_token``.
    """

    request_id: str
    access_token: str = ""


class ReleaseReply(Positional, frozen=True):
    released: bool
