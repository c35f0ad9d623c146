"""A prefill instance's KV side in a process of its own, for cross-process transport tests.

``python -m tests.kv.prefill_process '{"num_tokens": ..., ...}'`` leases one request's
blocks, filled with seeded random bytes, serves them with the NIXL transport,
prints a ready line (``PREFILL_READY {json}``), then one ``RELEASED {json}`` line
per release, and exits when its stdin closes.
"""

from __future__ import annotations

import json
import os
import sys

import trio

from pdtrio.kv.nixl import NixlKvTransport
from tests.kv.blocks import LOOPBACK, LeasedBlocks, fragment, leased_request, synthetic

READY = b"PREFILL_READY "
RELEASED = b"RELEASED "


class ReportingBlocks(LeasedBlocks):
    def release(self, request_id: str) -> bool:
        released = super().release(request_id)
        event = {"request_id": request_id, "released": released, "in_use": self.blocks_in_use()}
        print(RELEASED.decode() + json.dumps(event), flush=True)
        return released


async def serve(config: dict[str, int]) -> None:
    engine = synthetic(num_blocks=config["num_blocks"], block_size=config["block_size"])
    fragment(engine, holes=config["holes"])
    source = ReportingBlocks(engine)
    transport = NixlKvTransport(engine, required=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(source.leases.run_expiry)
        endpoint = await nursery.start(transport.run, source, LOOPBACK, 0)
        handle, _ = await leased_request(
            source, "r", config["num_tokens"], endpoint, seed=config["seed"]
        )
        print(
            READY.decode()
            + json.dumps(
                {
                    "handle": list(handle.block_ids),
                    "port": endpoint[1],
                    "lease_ttl_s": handle.lease_ttl_s,
                    "access_token": handle.access_token,
                    "agent": transport.info()["nixl"]["agent"],
                }
            ),
            flush=True,
        )
        stdin = trio.lowlevel.FdStream(os.dup(0))
        async with stdin:
            while await stdin.receive_some(4096):
                pass
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    try:
        trio.run(serve, json.loads(sys.argv[1]))
    except* KeyboardInterrupt:
        pass  # the harness's SIGINT, as stdin's closing already stops it: a clean stop
