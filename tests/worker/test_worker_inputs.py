"""The worker validates its inputs at the boundary: a 400 with a message, never a 500."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from pdtrio.protocol.link import wire
from pdtrio.protocol.link.wire import PrefillRequest, Prompt, TextPrompt, TokenPrompt
from pdtrio.protocol.sampling import SamplingParams
from tests.cluster import Cluster, cluster_in_a_thread, running_cluster

MSGPACK = {"content-type": wire.MSGPACK_CONTENT_TYPE}


@pytest.fixture(scope="module")
def shared() -> Iterator[Cluster]:
    """One cluster for the module's cases that only send a request and read the answer."""
    with cluster_in_a_thread() as cluster:
        yield cluster


def _prefill(prompt: object, sampling: object = (), max_tokens: object = None) -> bytes:
    return msgspec.msgpack.encode([wire.MessageKind.PREFILL, "r1", prompt, sampling, max_tokens])


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/pd/release", b"\xc1"),  # never valid msgpack
        ("/pd/release", msgspec.msgpack.encode([1])),
        ("/pd/release", msgspec.msgpack.encode({"request_id": "x"})),
        ("/pd/prefill", msgspec.msgpack.encode(["r1"])),
        ("/pd/prefill", _prefill(["tokens", [5, -1]])),
        ("/pd/prefill", _prefill(["tokens", ["a"]])),
        ("/pd/prefill", _prefill(["text", "hi"], [-1.0])),
        ("/pd/prefill", _prefill(["text", "hi"], [1.0, 0.0])),
        ("/pd/prefill", _prefill(["text", "hi"], [1.0, 1.0, 0, None, -3])),
        ("/pd/prefill", _prefill(["text", "hi"], [1.0, 1.0, 0, None, 0, [""]])),
        ("/pd/prefill", _prefill(["text", "hi"], [], 0)),
        ("/pd/prefill", msgspec.msgpack.encode([wire.MessageKind.PREFILL, "", ["text", "hi"], []])),
    ],
)
async def test_malformed_worker_body_is_400(shared: Cluster, path: str, body: bytes) -> None:
    url = f"http://127.0.0.1:{shared.workers[0].http_port}"
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        response = await http.post(path, content=body, headers=MSGPACK)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]
    assert not shared.busy()


async def test_huge_prompt_is_refused_before_tokenizing() -> None:
    prompts: list[Prompt] = [TextPrompt("a" * 15_000_000), TokenPrompt(tuple(range(9000)))]
    async with running_cluster() as cluster:
        url = f"http://127.0.0.1:{cluster.workers[0].http_port}"
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            for prompt in prompts:
                body = wire.encode(PrefillRequest("big", prompt, SamplingParams()))
                # refused on its count: no id list is made (15 M ids would take 120 MB
                # and more; the body and its decoded text are 15 MB each)
                tracemalloc.start()
                try:
                    response = await http.post("/pd/prefill", content=body, headers=MSGPACK)
                    _, peak = tracemalloc.get_traced_memory()
                finally:
                    tracemalloc.stop()
                assert response.status_code == 400, response.text
                assert "maximum context length" in response.json()["error"]["message"]
                assert peak < 80_000_000, peak
        assert not cluster.busy()


async def test_a_wrong_method_on_a_worker_route_is_405_with_allow() -> None:
    async with running_cluster() as cluster:
        prefill_url = f"http://127.0.0.1:{cluster.workers[0].http_port}"
        async with httpx.AsyncClient(base_url=prefill_url) as http:
            for method, path, allow in (
                ("POST", "/health", "GET"),
                ("GET", "/pd/prefill", "POST"),
                ("DELETE", "/pd/release", "POST"),
            ):
                response = await http.request(method, path)
                assert response.status_code == 405, (method, path)
                assert response.headers["allow"] == allow
                error = response.json()["error"]
                # the router's answer to a wrong method (one route table type for both)
                assert (error["type"], error["code"]) == (
                    "invalid_request_error",
                    "method_not_allowed",
                )
            nowhere = await http.get("/nowhere")
            assert (nowhere.status_code, nowhere.json()["error"]["code"]) == (404, "not_found")


async def test_the_workers_errors_take_status_type_and_code_from_the_one_table(
    shared: Cluster,
) -> None:
    """The worker's HTTP answers for a malformed body, a body too large and a request
    id it already knows are the error table's, as the router's are."""
    from pdtrio.protocol.errors import ERRORS, Reason
    from pdtrio.worker.http_api import _MAX_RELEASE_BODY

    url = f"http://127.0.0.1:{shared.workers[0].http_port}"
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        malformed = await http.post("/pd/release", content=b"\xc1", headers=MSGPACK)
        too_large = await http.post(
            "/pd/release", content=b"\0" * (_MAX_RELEASE_BODY + 1), headers=MSGPACK
        )
    for response, reason in (
        (malformed, Reason.INVALID_REQUEST),
        (too_large, Reason.REQUEST_TOO_LARGE),
    ):
        kind = ERRORS[reason]
        error = response.json()["error"]
        assert (response.status_code, error["type"], error["code"]) == (
            kind.status,
            kind.type,
            kind.code,
        ), response.text
    assert not shared.busy()
