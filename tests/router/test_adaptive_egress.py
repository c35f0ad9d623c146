"""Adaptive egress in the router: spacing groups tokens into fewer events, and changes nothing else.

The spacing is pinned here (the controller's input, the loop's load, is not
something a test can hold steady): the policy itself is tested in
tests/protocol/test_egress.py, the load meter in tests/router/test_loop_load.py.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import pytest
import trio

from pdtrio.config import RouterConfig
from pdtrio.protocol.tokens.egress import EgressConfig, EgressController
from pdtrio.router import core
from tests.cluster import client, running_cluster, synthetic_worker, wait_until_idle


def _pin_spacing(monkeypatch: pytest.MonkeyPatch, spacing_s: float) -> None:
    class PinnedSpacing(EgressController):  # type: ignore[misc]
        def __init__(self, config: EgressConfig) -> None:
            super().__init__(config)
            self.spacing_s = spacing_s

        def update(self, busy_fraction: float) -> float:
            return self.spacing_s

    monkeypatch.setattr(core, "EgressController", PinnedSpacing)


def _events(sse: str) -> list[dict[str, Any]]:
    return [json.loads(e[6:]) for e in sse.split("\n\n") if e.startswith("data: {")]


async def _stream(cluster: Any, count: int, max_tokens: int) -> list[str]:
    out = [""] * count
    async with client(cluster) as http:
        async with trio.open_nursery() as nursery:
            for index in range(count):

                async def one(index: int = index) -> None:
                    body = {
                        "model": "synthetic",
                        "prompt": f"stream {index}",
                        "max_tokens": max_tokens,
                        "seed": index,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    }
                    response = await http.post("/v1/completions", json=body)
                    assert response.status_code == 200
                    out[index] = response.text

                nursery.start_soon(one)
    return out


def _summary(sse: str) -> tuple[str, str | None, dict[str, Any] | None]:
    events = _events(sse)
    text = "".join(c["text"] for e in events for c in e["choices"])
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    usage = [e["usage"] for e in events if e.get("usage")]
    return text, (finish[-1] if finish else None), (usage[-1] if usage else None)


async def test_spacing_groups_tokens_and_changes_nothing_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    make = partial(synthetic_worker, decode_step_s=0.002)
    results = {}
    for spacing in (0.0, 0.05):
        _pin_spacing(monkeypatch, spacing)
        async with running_cluster(make_worker=make) as cluster:
            results[spacing] = await _stream(cluster, 4, 60)
            await wait_until_idle(cluster)
    for plain, spaced in zip(results[0.0], results[0.05], strict=True):
        assert _summary(plain) == _summary(spaced)
        assert spaced.endswith("data: [DONE]\n\n")
    events_plain = sum(len(_events(r)) for r in results[0.0])
    events_spaced = sum(len(_events(r)) for r in results[0.05])
    assert events_spaced < events_plain


async def test_a_finish_is_never_held(monkeypatch: pytest.MonkeyPatch) -> None:
    # an hour's spacing: only the finish rule can end these streams
    _pin_spacing(monkeypatch, 3600.0)
    async with running_cluster(decode_step_s=0.001) as cluster:
        with trio.fail_after(60):  # liveness bound, not a timing assertion
            raw = await _stream(cluster, 4, 30)
        await wait_until_idle(cluster)
    assert all(_summary(r)[1] == "length" and r.endswith("data: [DONE]\n\n") for r in raw)
    assert all(len(_summary(r)[0].split()) == 30 for r in raw)


async def test_an_error_is_never_held(monkeypatch: pytest.MonkeyPatch) -> None:
    _pin_spacing(monkeypatch, 3600.0)
    decode_scope = trio.CancelScope()
    decode = synthetic_worker("decode", decode_step_s=0.01)
    prefill = synthetic_worker("prefill")

    def make(role: str) -> Any:
        return prefill if role == "prefill" else decode

    original_run = decode.run

    async def run_decode(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with decode_scope:
            await original_run(task_status=task_status)

    decode.run = run_decode  # type: ignore[method-assign]
    # (the one decode is gone for good: no 5 s wait for another to connect)
    router = RouterConfig(decode_reconnect_wait_s=0.2)
    async with running_cluster(make_worker=make, router=router) as cluster:
        async with client(cluster) as http:
            body = {"model": "synthetic", "prompt": "x", "max_tokens": 2000, "stream": True}
            with trio.fail_after(60):  # liveness bound, not a timing assertion
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    seen = ""
                    async for chunk in response.aiter_text():
                        seen += chunk
                        if seen.count("data: {") == 2:
                            decode_scope.cancel()  # decode goes away mid-hold
            assert '"error"' in seen and seen.endswith("data: [DONE]\n\n")
