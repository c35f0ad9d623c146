"""``pdtrio worker`` exits 0 when stopped, however the stop reaches it."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import pdtrio.worker.main as worker_main

ARGV = ["--config-json", '{"role": "prefill", "engine": {"kind": "synthetic"}}']


async def _interrupted_in_a_nursery(*_: Any) -> None:
    # what a SIGINT redelivered as the signal receiver closes (stdin closed at the same
    # moment) looks like from main(): a KeyboardInterrupt out of the worker's nursery
    async def interrupt() -> None:
        raise KeyboardInterrupt

    async with trio.open_nursery() as nursery:
        nursery.start_soon(interrupt)


async def _crashed_in_a_nursery(*_: Any) -> None:
    async def crash() -> None:
        raise RuntimeError("a real crash")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(crash)


def test_an_interrupt_out_of_the_nursery_is_a_clean_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_main, "serve_worker", _interrupted_in_a_nursery)
    assert worker_main.main(ARGV) == 0


def test_a_crash_out_of_the_nursery_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_main, "serve_worker", _crashed_in_a_nursery)
    with pytest.raises(BaseExceptionGroup) as raised:
        worker_main.main(ARGV)
    assert raised.group_contains(RuntimeError, match="a real crash")
