"""The router <-> worker wire, spoken by hand: msgpack frames only, never pickle."""

from __future__ import annotations

import attrs
import httpx
import msgpack
import trio
import trio_websocket

from pdtrio.protocol.sampling import SamplingParams
from pdtrio.protocol.wire import (
    DecodeAbort,
    DecodeStart,
    MessageKind,
    PrefillReply,
    PrefillRequest,
    TextPrompt,
)
from pdtrio.worker.server import Worker
from tests.cluster import synthetic_worker

PICKLE_MARKERS = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


def _strict_unpack(data: bytes):
    def no_ext(code: int, payload: bytes) -> None:
        raise AssertionError(f"msgpack ext type {code} on the wire")

    return msgpack.unpackb(data, raw=False, ext_hook=no_ext)


async def _prefill(url: str, request_id: str, prompt: str, max_tokens: int) -> PrefillReply:
    request = PrefillRequest(request_id, TextPrompt(prompt), SamplingParams(max_tokens=max_tokens))
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{url}/pd/prefill",
            content=msgpack.packb(request.to_wire()),
            headers={"content-type": "application/msgpack"},
        )
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/msgpack"
    assert not response.content.startswith(PICKLE_MARKERS)
    return PrefillReply.from_wire(_strict_unpack(response.content))


async def test_decode_frames_are_plain_msgpack_and_abort_frees_blocks() -> None:
    prefill = synthetic_worker("prefill")
    decode = synthetic_worker("decode", decode_step_s=0.001)
    async with trio.open_nursery() as nursery:
        prefill_ready = await nursery.start(prefill.run)
        decode_ready = await nursery.start(decode.run)
        prefill_url = f"http://127.0.0.1:{prefill_ready['http_port']}"
        ws_url = f"ws://127.0.0.1:{decode_ready['http_port']}/pd/decode"
        replies = [await _prefill(prefill_url, f"req-{i}", f"prompt {i}", 20) for i in range(3)]
        frames: list[bytes] = []
        async with trio_websocket.open_websocket_url(ws_url) as ws:
            for reply in replies:
                start = DecodeStart(
                    reply.request_id,
                    reply.prompt_token_ids,
                    reply.first_token_id,
                    SamplingParams(max_tokens=20),
                    reply.remaining_tokens,
                    reply.cached_tokens,
                    reply.kv_handle,  # type: ignore[arg-type]
                )
                await ws.send_message(msgpack.packb(start.to_wire()))
            await ws.send_message(msgpack.packb(DecodeAbort("req-2").to_wire()))
            finished: set[str] = set()
            with trio.fail_after(30):
                while finished != {"req-0", "req-1"}:
                    data = await ws.get_message()
                    assert isinstance(data, bytes)
                    frames.append(data)
                    message = _strict_unpack(data)
                    if message[0] == MessageKind.TOKENS:
                        finished |= {e[0] for e in message[1] if e[3] is not None}
        # the aborted request may never have been pulled: releasing it is the router's cleanup
        async with httpx.AsyncClient() as http:
            released = await http.post(
                f"{prefill_url}/pd/release",
                content=msgpack.packb(["req-2"]),
                headers={"content-type": "application/msgpack"},
            )
        assert released.status_code == 200
        nursery.cancel_scope.cancel()
    assert frames and not any(f.startswith(PICKLE_MARKERS) for f in frames)
    kinds = [_strict_unpack(f)[0] for f in frames]
    assert MessageKind.ACCEPTED in kinds and MessageKind.TOKENS in kinds
    # prefill released each request's blocks once decode pulled them; decode freed its own
    assert prefill.engine.statistics().kv_blocks_in_use == 0
    assert decode.engine.statistics().kv_blocks_in_use == 0
    assert len(prefill.leases) == 0


async def test_a_start_with_a_foreign_layout_is_rejected_naming_both() -> None:
    prefill = synthetic_worker("prefill", vocab_size=1000)
    decode = synthetic_worker("decode", vocab_size=2000)
    async with trio.open_nursery() as nursery:
        prefill_ready = await nursery.start(prefill.run)
        decode_ready = await nursery.start(decode.run)
        reply = await _prefill(f"http://127.0.0.1:{prefill_ready['http_port']}", "r", "hi", 5)
        async with trio_websocket.open_websocket_url(
            f"ws://127.0.0.1:{decode_ready['http_port']}/pd/decode"
        ) as ws:
            start = DecodeStart("r", reply.prompt_token_ids, reply.first_token_id, SamplingParams(),
                                reply.remaining_tokens, 0, reply.kv_handle)  # type: ignore[arg-type]
            await ws.send_message(msgpack.packb(start.to_wire()))
            message = _strict_unpack(await ws.get_message())  # type: ignore[arg-type]
        nursery.cancel_scope.cancel()
    assert message[0] == MessageKind.REJECTED
    assert message[2] == "layout_mismatch"
    assert "vocab1000" in message[3] and "vocab2000" in message[3]


async def test_an_unreachable_kv_endpoint_is_rejected_and_frees_decode_blocks() -> None:
    prefill = synthetic_worker("prefill")
    decode = synthetic_worker("decode")
    async with trio.open_nursery() as nursery:
        prefill_ready = await nursery.start(prefill.run)
        decode_ready = await nursery.start(decode.run)
        reply = await _prefill(f"http://127.0.0.1:{prefill_ready['http_port']}", "gone", "hi", 5)
        assert reply.kv_handle is not None
        with trio.socket.socket() as placeholder:  # a port with nobody listening
            await placeholder.bind(("127.0.0.1", 0))
            dead_port = placeholder.getsockname()[1]
        handle = attrs.evolve(reply.kv_handle, transfer_port=dead_port)
        async with trio_websocket.open_websocket_url(
            f"ws://127.0.0.1:{decode_ready['http_port']}/pd/decode"
        ) as ws:
            start = DecodeStart("gone", reply.prompt_token_ids, reply.first_token_id, SamplingParams(),
                                reply.remaining_tokens, 0, handle)
            await ws.send_message(msgpack.packb(start.to_wire()))
            message = _strict_unpack(await ws.get_message())  # type: ignore[arg-type]
        assert message[0] == MessageKind.REJECTED and message[2] == "transfer_failed"
        assert decode.engine.statistics().kv_blocks_in_use == 0
        nursery.cancel_scope.cancel()


async def test_a_lease_nobody_claims_is_freed_when_it_expires() -> None:
    base = synthetic_worker("prefill")
    prefill = Worker(attrs.evolve(base.config, kv_lease_s=0.2), base.engine)
    async with trio.open_nursery() as nursery:
        ready = await nursery.start(prefill.run)
        reply = await _prefill(f"http://127.0.0.1:{ready['http_port']}", "orphan", "hello there", 5)
        assert reply.kv_handle is not None
        assert prefill.engine.statistics().kv_blocks_in_use == len(reply.kv_handle.block_ids)
        with trio.fail_after(10):
            while len(prefill.leases):  # noqa: ASYNC110 - observing the expiry from outside
                await trio.sleep(0.02)
        assert prefill.engine.statistics().kv_blocks_in_use == 0
        assert prefill.stats()["kv_leases_expired"] == 1
        nursery.cancel_scope.cancel()

