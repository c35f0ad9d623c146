"""``kv_transport``: which transport a worker runs, and what ``auto`` does without NIXL."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import trio

from pdtrio.config import ConfigError, WorkerConfig, config_from_dict
from pdtrio.engine.api import KvRegion
from pdtrio.kv.api import KvTransportUnavailable
from pdtrio.kv.selection import kv_transport_for
from pdtrio.kv.tcp import TcpKvTransport
from tests.kv.blocks import LOOPBACK, synthetic

nixl = pytest.importorskip("pdtrio.kv.nixl")


class OddMemory:
    """A KV cache on a device NIXL has no memory kind for."""

    def kv_region(self) -> KvRegion:
        return KvRegion(address=4096, num_blocks=4, block_nbytes=64, device="tpu")


def test_the_key_takes_three_values_and_auto_is_the_default() -> None:
    assert WorkerConfig().kv_transport == "auto"
    assert config_from_dict({"kv_transport": "nixl"}, WorkerConfig).kv_transport == "nixl"
    with pytest.raises(ConfigError, match="kv_transport"):
        config_from_dict({"kv_transport": "rdma"}, WorkerConfig)


def test_each_choice_builds_its_transport() -> None:
    engine = synthetic()
    assert isinstance(kv_transport_for("tcp", engine), TcpKvTransport)
    assert isinstance(kv_transport_for("auto", engine), nixl.NixlKvTransport)
    assert isinstance(kv_transport_for("nixl", engine), nixl.NixlKvTransport)


async def test_auto_without_a_working_nixl_runs_tcp_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    transport = kv_transport_for("auto", OddMemory())  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="pdtrio.kv"):
        async with trio.open_nursery() as nursery:
            await nursery.start(transport.run, None, LOOPBACK, 0)
            assert transport.name == "tcp"
            info = transport.info()
            assert info["transport"] == "tcp" and "'tpu'" in info["nixl"]["unavailable"]
            nursery.cancel_scope.cancel()
    assert "KV transport: tcp (kv_transport = 'auto' and NIXL cannot register" in caplog.text


async def test_nixl_required_but_unworkable_fails_at_start() -> None:
    transport = kv_transport_for("nixl", OddMemory())  # type: ignore[arg-type]
    with pytest.RaisesGroup(KvTransportUnavailable, flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            await nursery.start(transport.run, None, LOOPBACK, 0)


async def test_auto_with_nixl_says_it_chose_nixl(caplog: pytest.LogCaptureFixture) -> None:
    transport = kv_transport_for("auto", synthetic())
    with caplog.at_level(logging.INFO, logger="pdtrio.kv"):
        async with trio.open_nursery() as nursery:
            await nursery.start(transport.run, None, LOOPBACK, 0)
            assert transport.name == "nixl"
            assert transport.info()["nixl"]["memory"] == "DRAM"
            nursery.cancel_scope.cancel()
    assert "KV transport: nixl (UCX" in caplog.text


def test_a_worker_that_needs_nixl_and_cannot_start_it_exits_with_one_line_of_ours() -> None:
    # UCX with no usable transport: NIXL's backend cannot start (UCX and NIXL say so too)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdtrio",
            "worker",
            "--engine-kind",
            "synthetic",
            "--kv-transport",
            "nixl",
        ],
        capture_output=True,
        env={**os.environ, "UCX_TLS": "nosuch"},
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    ours = [line for line in done.stderr.decode().splitlines() if line.startswith("pdtrio worker:")]
    assert len(ours) == 1 and "kv_transport = 'nixl': NIXL does not start" in ours[0], ours


def _import_fails(name: str) -> object:
    real = __import__

    def fake(module: str, *args: object, **kwargs: object) -> object:
        if module == "pdtrio.kv.nixl":
            raise ImportError(f"no {name} here", name=name)
        return real(module, *args, **kwargs)  # type: ignore[arg-type]

    return fake


def test_auto_without_numpy_runs_tcp_but_a_broken_import_of_ours_is_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import builtins

    monkeypatch.delitem(sys.modules, "pdtrio.kv.nixl")
    monkeypatch.setattr(builtins, "__import__", _import_fails("numpy"))
    transport = kv_transport_for("auto", synthetic())
    assert isinstance(transport, TcpKvTransport)
    with pytest.raises(KvTransportUnavailable, match="does not import") as raised:
        kv_transport_for("nixl", synthetic())
    assert isinstance(raised.value.__cause__, ImportError)  # kept for the DEBUG log

    # a bug (an import inside pdtrio that fails) never passes for "no NIXL: TCP then"
    monkeypatch.setattr(builtins, "__import__", _import_fails("pdtrio.kv.api"))
    with pytest.raises(ImportError, match="no pdtrio.kv.api here"):
        kv_transport_for("auto", synthetic())
