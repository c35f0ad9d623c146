"""Huge requests are refused early, big bodies parse exactly like json.loads, and the
router's memory goes back to where it was once they are done with."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from unittest import mock

import httpx
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdtrio import memory
from pdtrio.asgi import BodyTooLarge, ClientDisconnected, Receive, read_body
from pdtrio.protocol.link import encoding
from pdtrio.protocol.openai import (
    OpenAIError,
    json_pieces,
    parse_chat_completion_request,
    parse_completion_request,
)
from pdtrio.protocol.openai.json_pieces import PIECEWISE_JSON_BYTES, CountedArray, load_piecewise
from pdtrio.testing import Processes, synthetic_worker_config, write_router_config
from tests.cluster import client, running_cluster
from tests.examples import examples


async def test_token_prompt_longer_than_context_is_refused_by_the_router() -> None:
    body = {"model": "synthetic", "prompt": list(range(100, 300_100))}
    async with running_cluster() as cluster, client(cluster) as http:
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["param"] == "prompt"
        # refused before forwarding: prefill never saw it
        assert cluster.workers[0].stats()["served_prefills"] == 0


async def test_token_prompt_plus_max_tokens_over_context_is_refused() -> None:
    body = {"model": "synthetic", "prompt": [100] * 8000, "max_tokens": 500}
    async with running_cluster() as cluster, client(cluster) as http:
        response = await http.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


async def test_chat_with_more_messages_than_the_context_is_refused_by_the_router() -> None:
    messages = [{"role": "user", "content": f"message {i}"} for i in range(100_000)]
    async with running_cluster() as cluster, client(cluster) as http:
        response = await http.post(
            "/v1/chat/completions", json={"model": "synthetic", "messages": messages}
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["param"] == "messages"
        # refused before forwarding: prefill never saw it
        assert cluster.workers[0].stats()["served_prefills"] == 0


async def test_a_long_prompt_goes_to_prefill_without_being_encoded_whole() -> None:
    # one msgpack call over megabytes holds the event loop for milliseconds
    encoded: list[int] = []

    class SpyEncoder:
        def encode(self, message: object) -> bytes:
            data = msgspec.msgpack.encode(message)
            encoded.append(len(data))
            return data

    prompt = "\u00e9" * 400_000  # 800,000 bytes of UTF-8: the synthetic engine's tokens, +1
    with mock.patch.object(encoding, "_encoder", SpyEncoder()):
        async with running_cluster() as cluster, client(cluster) as http:
            response = await http.post(
                "/v1/completions", json={"model": "synthetic", "prompt": prompt}
            )
    assert response.status_code == 400  # the whole prompt arrived: every byte counted
    assert "your prompt has 800001 tokens" in response.json()["error"]["message"]
    assert max(encoded) < 64 * 1024


async def test_big_chat_body_is_parsed_off_the_loop_and_answered() -> None:
    messages = [{"role": "user", "content": f"m{i}"} for i in range(40_000)]
    body = json.dumps({"model": "synthetic", "messages": messages}).encode()
    assert len(body) > PIECEWISE_JSON_BYTES
    async with running_cluster() as cluster, client(cluster) as http:
        response = await http.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
    assert response.status_code == 400  # longer than the synthetic context (8192)
    assert "maximum context length" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "value",
    [
        {"prompt": list(range(50_000)), "x": [[1, -2.5e3, 0], {"a": [1, 'b\\"c\u00e9']}]},
        {"prompt": [[i % 7 for i in range(60_000)]], "stop": None, "t": True},
        {"messages": [{"role": "user", "content": "x" * 10} for _ in range(20_000)]},
    ],
)
@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_piecewise_parse_equals_json_loads(value: object, separators: tuple[str, str]) -> None:
    body = json.dumps(value, separators=separators).encode()
    assert load_piecewise(body) == json.loads(body)


@pytest.mark.parametrize(
    "body",
    [b'{"a":[1,2,]}', b'{"a":[1,2', b'{"a":1}x', b'{"a":[01,2]}', b"\xff", b'{"a" 1}', b"[1,"],
)
def test_piecewise_parse_rejects_what_json_loads_rejects(body: bytes) -> None:
    with pytest.raises(ValueError):
        json.loads(body)
    with pytest.raises(ValueError):
        load_piecewise(body)


_TRICKY_TEXT = 'a\\"b\\\\\n\t\x7f\u00e9\u4e2d\U0001f600\ud800x\udc00"' * 7


@pytest.mark.parametrize(
    "value",
    [
        {"prompt": _TRICKY_TEXT * 3000},
        {"prompt": [_TRICKY_TEXT * 3000], "stop": ["\\n", "\U0001f600"]},
        {"messages": [{"role": "user", "content": _TRICKY_TEXT * 3000}] * 3},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 300_000}]}]},
        {"deep": [[[[{"a": ["b" * 5000, {"c": [1, 2.5, None, True]}]}]]]]},
    ],
)
@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_long_strings_parse_window_by_window_like_json_loads(
    value: object, ensure_ascii: bool
) -> None:
    body = json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")
    assert load_piecewise(body) == json.loads(body)


# what JSON escapes, both halves of surrogate pairs, and anything else
_CHARACTERS = st.one_of(
    st.sampled_from(list('a"\\\n\t\x00\x1f/\u00e9\u4e2d\U0001f600\ud83d\ude00\ud800\udfff')),
    st.characters(codec=None, exclude_categories=()),
)


@settings(max_examples=examples(300), deadline=None)
@given(
    text=st.text(_CHARACTERS, max_size=60),
    ensure_ascii=st.booleans(),
    chunk=st.integers(13, 40),
    small=st.integers(2, 64),
)
def test_any_string_cut_at_any_window_parses_like_json_loads(
    text: str, ensure_ascii: bool, chunk: int, small: int
) -> None:
    # tiny windows put every cut (mid-escape, between a surrogate pair's halves) somewhere
    value = {"prompt": text, "messages": [{"role": "user", "content": text}], "stop": [text]}
    body = json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")
    with (
        mock.patch.object(json_pieces, "_CHUNK_CHARS", chunk),
        mock.patch.object(json_pieces, "_SMALL_VALUE_CHARS", small),
    ):
        assert load_piecewise(body) == json.loads(body)


@pytest.mark.parametrize(
    "content",
    [
        "x" * 100 + "\n" + "y" * 100,  # a raw control character
        "x" * 100 + "\\q",  # an unknown escape
        "x" * 100 + "\\u12G4",  # a bad \\u escape
        "x" * 100 + "\\ud800\\udcZZ",  # a high surrogate, then a bad low one
        "x" * 100 + "\\",  # the body ends in an escape
    ],
)
@pytest.mark.parametrize("chunk", [13, 50, 64 * 1024])
def test_bad_long_strings_are_refused_like_json_loads(content: str, chunk: int) -> None:
    body = ('{"prompt": "' + content + '", "model": "m"}').encode()
    with pytest.raises(ValueError):
        json.loads(body)
    with mock.patch.object(json_pieces, "_CHUNK_CHARS", chunk), pytest.raises(ValueError):
        load_piecewise(body)
    unterminated = ('{"prompt": "' + "x" * 100).encode()
    with mock.patch.object(json_pieces, "_CHUNK_CHARS", chunk), pytest.raises(ValueError):
        load_piecewise(unterminated)


@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
@pytest.mark.parametrize("nested", [False, True])
def test_a_token_array_past_the_limit_is_counted_not_built(
    separators: tuple[str, str], nested: bool
) -> None:
    ids = list(range(100_000))
    prompt = [ids] if nested else ids
    body = json.dumps({"prompt": prompt, "model": "m", "n": 1}, separators=separators).encode()
    obj = load_piecewise(body, ("prompt", 5000))
    counted = obj["prompt"][0] if nested else obj["prompt"]
    assert counted == CountedArray(100_000)
    assert obj["model"] == "m" and obj["n"] == 1
    assert load_piecewise(body, ("prompt", 200_000)) == json.loads(body)  # within: built


def test_a_million_token_ids_are_refused_with_their_count() -> None:
    body = json.dumps({"model": "synthetic", "prompt": list(range(1_000_000))}).encode()
    with pytest.raises(OpenAIError) as refused:
        parse_completion_request(
            body,
            served_models=["synthetic"],
            max_tokens_limit=4096,
            context_lengths={"synthetic": 8192},
        )
    assert refused.value.code == "context_length_exceeded"
    assert refused.value.param == "prompt"
    assert "requested 1000000 tokens" in refused.value.message


def test_a_lone_surrogate_past_the_first_megabyte_is_refused() -> None:
    content = "x" * 3_000_000 + "\\ud800"
    body = ('{"model": "m", "messages": [{"role": "user", "content": "' + content + '"}]}').encode()
    with pytest.raises(OpenAIError) as refused:
        parse_chat_completion_request(body, served_models=["m"], max_tokens_limit=16)
    assert "unpaired surrogate" in refused.value.message


def _messages(count: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"message {i}"} for i in range(count)]


async def test_a_body_is_read_into_one_buffer_up_to_its_limit() -> None:
    def receiver(*messages: dict[str, object]) -> Receive:
        queue = list(messages)

        async def receive() -> dict[str, object]:
            return queue.pop(0)

        return receive

    chunks = [{"type": "http.request", "body": b"ab", "more_body": True}]
    chunks.append({"type": "http.request", "body": b"cd", "more_body": False})
    assert await read_body(receiver(*chunks), 4) == bytearray(b"abcd")
    with pytest.raises(BodyTooLarge):
        await read_body(receiver(*chunks), 3)
    with pytest.raises(ClientDisconnected):
        await read_body(receiver(chunks[0], {"type": "http.disconnect"}), 4)


def _rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as statm:
                total += int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except FileNotFoundError:
            pass
    return total / 1e6


@pytest.mark.skipif(not memory.can_trim(), reason="glibc only (malloc_trim)")
def test_the_router_gives_the_memory_of_huge_requests_back() -> None:
    """Without limit_heap_retention, the trim and the collection, it kept over 100 MB more."""
    bodies = [
        ("/v1/completions", {"model": "synthetic", "prompt": list(range(1_000_000))}),
        ("/v1/completions", {"model": "synthetic", "prompt": "a" * 15_000_000}),
        ("/v1/chat/completions", {"model": "synthetic", "messages": _messages(100_000)}),
        ("/v1/chat/completions", {"model": "synthetic", "messages": _messages(8_000)}),
    ]
    encoded = [(path, json.dumps(body).encode()) for path, body in bodies]
    with Processes(stop_grace_s=10) as procs, tempfile.TemporaryDirectory() as tmp:
        prefill = procs.start_worker(synthetic_worker_config("prefill"))
        decode = procs.start_worker(synthetic_worker_config("decode"))
        instances = [("prefill", procs.wait_ready(prefill).url)]
        instances.append(("decode", procs.wait_ready(decode).url))
        router = procs.router(write_router_config(Path(tmp) / "router.toml", instances))
        pids = router.tree()
        with httpx.Client(base_url=router.url, timeout=120) as http:
            # what the first request loads (modules, pools) is not the huge ones' doing
            small = {"model": "synthetic", "prompt": "hi", "max_tokens": 2}
            assert http.post("/v1/completions", json=small).status_code == 200
            time.sleep(0.5)  # (what it frees after that request, gone before the baseline)
            start = _rss_mb(pids)
            for _ in range(2):
                for path, body in encoded:
                    response = http.post(
                        path, content=body, headers={"content-type": "application/json"}
                    )
                    assert response.status_code == 400, response.text[:200]
        # memory is the measure here, not time: the deadline only bounds a failing run
        deadline = time.monotonic() + 10
        while (grown := _rss_mb(pids) - start) > 30 and time.monotonic() < deadline:
            time.sleep(0.1)  # another process's memory: nothing to wait on but its size
        assert grown <= 30, f"the router kept {grown:.0f} MB more than at the start"
