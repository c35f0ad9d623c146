"""What every link message is built on: the positional struct, the message tags, and the
values several messages carry (usage, the KV handle, a token's logprob).

Nothing but plain msgpack crosses the wire: no ext types, never pickle.
"""

from __future__ import annotations

import enum
from typing import Annotated, Final

import msgspec

from pdtrio.protocol.kv_layout import KvLayout


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
    # the prefill call and the decode starts of a request the router traces
    PREFILL_TRACED = 18
    START_TRACED = 19
    START_CHOICES_TRACED = 20


class Positional(
    msgspec.Struct, array_like=True, frozen=True, gc=False, forbid_unknown_fields=True
):
    """Base of every wire message: a msgpack array of the fields, in order."""


class Usage(Positional, frozen=True):
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


class KvHandle(Positional, frozen=True):
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


# the most alternatives a token's logprob may come with (vLLM's default max_logprobs)
MAX_TOP_LOGPROBS: Final = 20


class TokenLogprob(Positional, frozen=True):
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
