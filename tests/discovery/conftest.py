"""A real etcd per test, for every discovery test that asks for ``etcd``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from pdtrio.testing.etcd import EtcdServer, require_etcd, running_etcd


@pytest.fixture
async def etcd() -> AsyncIterator[EtcdServer]:
    require_etcd()
    async with running_etcd() as server:
        yield server
