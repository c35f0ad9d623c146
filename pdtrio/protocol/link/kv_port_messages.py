"""Decode <- prefill on the KV transfer port: the grant-checked asks for a request's blocks
over TCP, and the NIXL agent a NIXL session starts with."""

from __future__ import annotations

from pdtrio.protocol.link.message_base import BlockIds, Positional


class TransferRequest(Positional, frozen=True):
    """Decode asks prefill for a request's blocks, with the handle's grant."""

    request_id: str
    block_ids: BlockIds
    access_token: str = ""


class TransferAnswer(Positional, frozen=True):
    """``nbytes`` of block data follow when ``granted``; else ``reason`` says why not."""

    granted: bool
    nbytes: int = 0
    reason: str = ""


class TransferDone(Positional, frozen=True):
    """Decode holds the bytes: prefill may free the blocks (the grant says who may)."""

    request_id: str
    access_token: str = ""


class NixlAgentInfo(Positional, frozen=True):
    """Prefill's NIXL agent: the first message of a NIXL session on its KV transfer port.

    Decode loads ``agent_metadata`` into its own agent and READs block ``b``
    from ``base_address + b * block_nbytes`` of prefill's ``memory`` ("DRAM" or
    "VRAM" on GPU ``device_id``).  It asks before each read (``TransferRequest``,
    answered by ``TransferAnswer`` on the session) and says it is done with a
    NIXL notification carrying a msgpack ``TransferDone``.  ``unavailable`` says
    why, when this instance serves no NIXL reads (the rest is then empty).
    """

    unavailable: str
    agent_name: str = ""
    agent_metadata: bytes = b""
    memory: str = ""
    device_id: int = 0
    base_address: int = 0
    num_blocks: int = 0
    block_nbytes: int = 0
