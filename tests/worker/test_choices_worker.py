"""n > 1 in the worker: prefill answers every choice's first token in one reply and
leases the prompt's KV once; decode admits a DecodeStartChoices on forked blocks, runs
each choice under its own id (its tokens, its abort) and frees everything at the end."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import msgspec
import pytest
import trio
import trio_websocket

from pdtrio.protocol.link import wire
from pdtrio.protocol.link.wire import (
    DecodeAbort,
    DecodeAccepted,
    DecodeCapacity,
    DecodeRejected,
    DecodeStart,
    DecodeStartChoices,
    Heartbeat,
    KvHandle,
    PrefillFailed,
    PrefillReply,
    PrefillReplyWithChoices,
    PrefillRequest,
    RejectReason,
    TextPrompt,
    TokenFrame,
    Usage,
    choice_request_id,
    reply_choices,
)
from pdtrio.protocol.sampling import SamplingParams, choice_sampling
from pdtrio.worker.admission import Accepted, DecodeAdmission, Rejected
from pdtrio.worker.leases import KvLeases
from pdtrio.worker.server import Worker
from tests.cluster import synthetic_worker, wait_for_stats
from tests.worker.test_admission import InMemoryTransport, synthetic

replace_fields = msgspec.structs.replace
MSGPACK = {"content-type": "application/msgpack"}
SEEDED = SamplingParams(seed=11, ignore_eos=True)
PROMPT = TextPrompt("a prompt that fills a few blocks and then some")


@attrs.define
class Pair:
    prefill: Worker
    decode: Worker
    prefill_url: str
    ws_url: str


@asynccontextmanager
async def running_pair(**decode_overrides: Any) -> AsyncIterator[Pair]:
    prefill = synthetic_worker("prefill")
    decode = synthetic_worker("decode", **({"decode_step_s": 0.001} | decode_overrides))
    async with trio.open_nursery() as nursery:
        prefill_ready = await nursery.start(prefill.run)
        decode_ready = await nursery.start(decode.run)
        yield Pair(
            prefill,
            decode,
            f"http://127.0.0.1:{prefill_ready['http_port']}",
            f"ws://127.0.0.1:{decode_ready['http_port']}/pd/link",
        )
        nursery.cancel_scope.cancel()


async def prefill(
    url: str, request_id: str, sampling: SamplingParams, max_tokens: int
) -> PrefillReply | PrefillFailed:
    body = wire.encode(PrefillRequest(request_id, PROMPT, sampling, max_tokens))
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{url}/pd/prefill", content=body, headers=MSGPACK)
    if response.status_code != 200:
        return PrefillFailed(request_id, response.status_code, response.text, "error")
    reply = wire.from_worker_decoder.decode(response.content)
    assert isinstance(reply, PrefillReply | PrefillFailed)
    return reply


def start_of(reply: PrefillReply, sampling: SamplingParams) -> DecodeStart:
    """The start a router sends for a prefilled request: the choices still running."""
    assert reply.kv_handle is not None
    fields = (
        reply.request_id, reply.prompt_token_ids, reply.first_token_id, sampling,
        reply.token_budget, 1, reply.cached_tokens, reply.kv_handle,
    )  # fmt: skip
    if sampling.n == 1:
        return DecodeStart(*fields)
    firsts = [(0, reply.first_token_id, reply.finish_reason)]
    firsts += [(c.choice, c.token_id, c.finish_reason) for c in reply_choices(reply)]
    running = tuple((c, token) for c, token, finish in firsts if finish is None)
    return DecodeStartChoices(*fields[:2], running[0][1], *fields[3:], choices=running)


async def next_message(ws: trio_websocket.WebSocketConnection) -> wire.FromWorker:
    """The next message that is neither a capacity report nor a heartbeat."""
    while True:
        message = wire.from_worker_decoder.decode(await ws.get_message())
        if not isinstance(message, DecodeCapacity | Heartbeat):
            return message


async def streams_until_finished(
    ws: trio_websocket.WebSocketConnection, request_ids: set[str]
) -> dict[str, tuple[list[int], str | None, Usage | None]]:
    """Each request's tokens, finish and usage, once every one of them has finished."""
    streams: dict[str, tuple[list[int], str | None, Usage | None]] = {}
    pending = set(request_ids)
    with trio.fail_after(30):
        while pending:
            message = await next_message(ws)
            if isinstance(message, DecodeAccepted):
                continue
            assert isinstance(message, TokenFrame), message
            for entry in message.entries:
                assert entry.request_id in request_ids, entry
                tokens, _, _ = streams.get(entry.request_id, ([], None, None))
                streams[entry.request_id] = (
                    tokens + entry.token_ids,
                    entry.finish_reason,
                    entry.usage,
                )
                if entry.finish_reason is not None:
                    pending.discard(entry.request_id)
    return streams


async def answered(
    pair: Pair, request_id: str, sampling: SamplingParams, max_tokens: int
) -> tuple[PrefillReply, dict[str, tuple[list[int], str | None, Usage | None]]]:
    reply = await prefill(pair.prefill_url, request_id, sampling, max_tokens)
    assert isinstance(reply, PrefillReply), reply
    start = start_of(reply, sampling)
    ids = [request_id]
    if isinstance(start, DecodeStartChoices):
        ids = [choice_request_id(request_id, c) for c, _ in start.choices]
    async with trio_websocket.open_websocket_url(pair.ws_url) as ws:
        await ws.send_message(wire.encode(start))
        streams = await streams_until_finished(ws, set(ids))
    assert reply.kv_handle is not None
    # the router's release, once decode has the KV
    async with httpx.AsyncClient() as http:
        release = wire.ReleaseRequest(request_id, reply.kv_handle.access_token)
        response = await http.post(
            f"{pair.prefill_url}/pd/release", content=wire.encode(release), headers=MSGPACK
        )
        assert response.status_code == 200
    return reply, streams


async def test_choices_prefill_once_and_decode_each_as_the_single_request_of_its_seed() -> None:
    async with running_pair() as pair:
        reply, streams = await answered(pair, "r", replace_fields(SEEDED, n=3), 12)
        assert type(reply) is PrefillReplyWithChoices
        assert [c.choice for c in reply.choices] == [1, 2]
        assert pair.prefill.stats()["served_prefills"] == 1
        # one KV handle for every choice
        assert reply.kv_handle is not None and reply.kv_handle.request_id == "r"
        answers = [
            [first, *streams[choice_request_id("r", c)][0]]
            for c, first in enumerate([reply.first_token_id, *(c.token_id for c in reply.choices)])
        ]
        for c in range(3):
            single, single_streams = await answered(pair, f"s{c}", choice_sampling(SEEDED, c), 12)
            assert type(single) is PrefillReply
            assert answers[c] == [single.first_token_id, *single_streams[f"s{c}"][0]]
            assert streams[choice_request_id("r", c)][1:] == single_streams[f"s{c}"][1:]
        assert len({tuple(a) for a in answers}) == 3
        await wait_for_stats(lambda: not pair.decode.stats()["decode_requests"])
        assert pair.decode.engine.statistics().kv_blocks_in_use == 0
        await wait_for_stats(lambda: pair.prefill.engine.statistics().kv_blocks_in_use == 0)
        assert len(pair.prefill.leases) == 0


async def test_a_choice_ending_at_prefill_runs_the_others_and_forgets_the_request_id() -> None:
    async with running_pair() as pair:
        probe = await prefill(pair.prefill_url, "probe", replace_fields(SEEDED, n=3), 12)
        assert isinstance(probe, PrefillReply) and probe.kv_handle is not None
        stop_at = probe.first_token_id
        assert stop_at not in [c.token_id for c in reply_choices(probe)]
        sampling = replace_fields(SEEDED, n=3, stop_token_ids=(stop_at,))
        reply = await prefill(pair.prefill_url, "r", sampling, 12)
        assert isinstance(reply, PrefillReply)
        # choice 0 ended at its first token; the KV stays leased for the others
        assert reply.finish_reason == "stop" and reply.usage is not None
        assert reply.kv_handle is not None
        links = pair.decode.link_server
        assert links is not None
        async with trio_websocket.open_websocket_url(pair.ws_url) as ws:
            await ws.send_message(wire.encode(start_of(reply, sampling)))
            streams = await streams_until_finished(ws, {"r/1", "r/2"})
            # (the link still open: nothing of the request is left on it, its own id included)
            assert links.request_count == 0
        assert all(finish is not None for _, finish, _ in streams.values())
        await wait_for_stats(lambda: pair.decode.engine.statistics().kv_blocks_in_use == 0)


async def test_every_choice_ending_at_prefill_leases_nothing() -> None:
    async with running_pair() as pair:
        reply = await prefill(pair.prefill_url, "r", replace_fields(SEEDED, n=3), 1)
        assert type(reply) is PrefillReplyWithChoices and reply.kv_handle is None
        assert all(c.finish_reason == "length" and c.usage is not None for c in reply.choices)
        assert pair.prefill.engine.statistics().kv_blocks_in_use == 0
        assert len(pair.prefill.leases) == 0


async def test_aborting_each_choice_over_the_link_frees_the_decode_blocks() -> None:
    async with running_pair(decode_step_s=0.01) as pair:
        sampling = replace_fields(SEEDED, n=3)
        reply = await prefill(pair.prefill_url, "r", sampling, 2000)
        assert isinstance(reply, PrefillReply)
        async with trio_websocket.open_websocket_url(pair.ws_url) as ws:
            await ws.send_message(wire.encode(start_of(reply, sampling)))
            assert await next_message(ws) == DecodeAccepted("r")
            with trio.fail_after(30):  # every choice runs
                seen: set[str] = set()
                while len(seen) < 3:
                    message = await next_message(ws)
                    assert isinstance(message, TokenFrame)
                    seen |= {e.request_id for e in message.entries}
            for c in range(3):
                await ws.send_message(wire.encode(DecodeAbort(choice_request_id("r", c))))
            await wait_for_stats(lambda: not pair.decode.stats()["decode_requests"])
            assert pair.decode.engine.statistics().kv_blocks_in_use == 0


async def test_a_colocated_worker_forks_the_leased_prompt_blocks() -> None:
    worker = synthetic_worker("both", decode_step_s=0.001)
    async with trio.open_nursery() as nursery:
        ready = await nursery.start(worker.run)
        url = f"ws://127.0.0.1:{ready['http_port']}/pd/link"
        sampling = replace_fields(SEEDED, n=4)
        async with trio_websocket.open_websocket_url(url) as ws:
            await ws.send_message(wire.encode(PrefillRequest("r", PROMPT, sampling, 8)))
            reply = await next_message(ws)
            assert type(reply) is PrefillReplyWithChoices
            await ws.send_message(wire.encode(start_of(reply, sampling)))
            streams = await streams_until_finished(ws, {"r", "r/1", "r/2", "r/3"})
        assert all(finish == "length" for _, finish, _ in streams.values())
        assert all(
            usage == Usage(len(reply.prompt_token_ids), 8, 0) for *_, usage in streams.values()
        )
        await wait_for_stats(lambda: worker.engine.statistics().kv_blocks_in_use == 0)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("n", [0, 17])
async def test_a_prefill_of_impossible_choices_is_refused(n: int) -> None:
    async with running_pair() as pair:
        reply = await prefill(pair.prefill_url, "r", replace_fields(SEEDED, n=n), 4)
        assert isinstance(reply, PrefillFailed) and reply.status == 400
        assert pair.prefill.engine.statistics().kv_blocks_in_use == 0


async def test_a_continuation_with_choices_is_refused() -> None:
    async with running_pair() as pair:
        request = PrefillRequest(
            "c", wire.TokenPrompt((5, 6, 7, 8)), replace_fields(SEEDED, n=2), 4,
            generated_tokens=2,
        )  # fmt: skip
        async with httpx.AsyncClient() as http:
            response = await http.post(
                f"{pair.prefill_url}/pd/prefill", content=wire.encode(request), headers=MSGPACK
            )
        assert response.status_code == 400
        assert "continuation" in response.text


# --- admission on its own ---------------------------------------------------------------


async def choices_start(
    engine: Any, instance_id: str, n: int = 3, max_tokens: int = 8
) -> DecodeStartChoices:
    sampling = replace_fields(SEEDED, n=n)
    ids = await engine.tokenize(PROMPT)
    result = await engine.prefill("r", ids, sampling, max_tokens)
    handle = KvHandle(
        "r", instance_id, "127.0.0.1", 1, result.block_ids, len(ids), engine.layout, 30.0
    )
    firsts = [result.first_token_id, *(c.token_id for c in result.choices)]
    return DecodeStartChoices(
        "r", tuple(ids), firsts[0], sampling, result.token_budget, 1, 0, handle,
        choices=tuple(enumerate(firsts)),
    )  # fmt: skip


async def test_admission_forks_every_choice_and_pulls_the_kv_once() -> None:
    source, decode = synthetic(), synthetic()
    start = await choices_start(source, "prefill-0")
    transport = InMemoryTransport(source)
    admission = DecodeAdmission(decode, KvLeases(decode.free_request), transport, "decode-0")
    assert await admission.admit(start) == Accepted()
    assert transport.pulls == 1
    prompt = len(start.prompt_token_ids)
    total = prompt + start.token_budget
    own = -(-total // 4)
    assert decode.statistics().kv_blocks_in_use == own + 2 * (own - prompt // 4)
    await decode.start_decode(
        "r", list(start.prompt_token_ids), start.first_token_id, start.sampling,
        start.token_budget, 1, 0, choices=start.choices,
    )  # fmt: skip
    for c in range(3):
        decode.abort(choice_request_id("r", c))
    assert decode.statistics().kv_blocks_in_use == 0


async def test_no_room_for_a_choice_frees_every_fork_and_the_request() -> None:
    source = synthetic()
    start = await choices_start(source, "prefill-0", n=3, max_tokens=40)
    prompt = len(start.prompt_token_ids)
    own = -(-(prompt + start.token_budget) // 4)
    # room for the request and one fork, not two
    decode = synthetic(num_blocks=own + 2 * (own - prompt // 4) - 1)
    transport = InMemoryTransport(source)
    admission = DecodeAdmission(decode, KvLeases(decode.free_request), transport, "decode-0")
    decision = await admission.admit(start)
    assert isinstance(decision, Rejected) and decision.reason == RejectReason.NO_ROOM
    assert transport.pulls == 0
    assert decode.statistics().kv_blocks_in_use == 0


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"sampling": SEEDED}, "n = 1"),
        ({"choices": ()}, "no choice"),
        ({"choices": ((0, 300), (0, 301))}, "not distinct"),
        ({"choices": ((1, 300), (3, 301))}, "not distinct"),
        ({"generated_tokens": 1, "tokens_generated": 2}, "continuation"),
    ],
)
async def test_impossible_choices_are_a_bad_request(change: dict[str, object], says: str) -> None:
    source, decode = synthetic(), synthetic()
    start = replace_fields(await choices_start(source, "prefill-0"), **change)
    admission = DecodeAdmission(
        decode, KvLeases(decode.free_request), InMemoryTransport(source), "decode-0"
    )
    decision = await admission.admit(start)
    assert isinstance(decision, Rejected) and decision.reason == RejectReason.BAD_REQUEST
    assert says in decision.message
    assert decode.statistics().kv_blocks_in_use == 0


async def test_a_choice_id_in_use_on_the_link_is_rejected() -> None:
    async with running_pair(decode_step_s=0.01) as pair:
        single = await prefill(pair.prefill_url, "r/1", SEEDED, 2000)
        sampling = replace_fields(SEEDED, n=2)
        reply = await prefill(pair.prefill_url, "r", sampling, 8)
        assert isinstance(single, PrefillReply) and isinstance(reply, PrefillReply)
        async with trio_websocket.open_websocket_url(pair.ws_url) as ws:
            await ws.send_message(wire.encode(start_of(single, SEEDED)))
            assert await next_message(ws) == DecodeAccepted("r/1")
            await ws.send_message(wire.encode(start_of(reply, sampling)))
            while isinstance(message := await next_message(ws), TokenFrame):
                pass
            assert isinstance(message, DecodeRejected)
            assert message.reason == RejectReason.BAD_REQUEST
            await ws.send_message(wire.encode(DecodeAbort("r/1")))
        await wait_for_stats(lambda: not pair.decode.stats()["decode_requests"])
        assert pair.decode.engine.statistics().kv_blocks_in_use == 0
