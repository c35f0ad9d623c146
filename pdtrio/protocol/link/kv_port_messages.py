"""Decode <- prefill on the KV transfer port: the grant-checked asks for a request's blocks
over TCP, and the NIXL agent a NIXL session starts with."""

from __future__ import annotations

from pdtrio.protocol.link.message_base import BlockIds, Positional


class TransferRequest(Positional, frozen=True):
    """Decode asks prefill for a request's blocks, with the handle's grant."""

    request_id: str
    block_ids: BlockIds
    access_token: str = ""


class KvDigests(Positional, frozen=True):
    """What prefill wrote in the blocks it grants, for decode to check once they are its own.

    For the i-th block asked for: ``digests[i]``, the CRC-32 of its bytes as prefill
    wrote them (of every byte when ``sample_lines`` is 0; else of ``sample_lines`` of its
    lines of ``line_bytes`` bytes, spread evenly, the first and the last included:
    ``pdtrio.kv.digest``), and its generation then and when the read was granted: a block
    freed and reused meanwhile shows two, whatever its bytes.
    """

    sample_lines: int
    line_bytes: int
    digests: tuple[int, ...]
    written_generations: tuple[int, ...]
    granted_generations: tuple[int, ...]


class TransferAnswer(Positional, frozen=True):
    """``nbytes`` of block data follow when ``granted``; else ``reason`` says why not."""

    granted: bool
    nbytes: int = 0
    reason: str = ""


class TransferAnswerWithDigests(TransferAnswer, frozen=True):
    """A ``TransferAnswer`` with what prefill wrote in the blocks: what a prefill that
    recorded it sends.  Its own struct, so a plain answer stays the array an older decode
    reads; decode reads either as this (a plain one without digests)."""

    digests: KvDigests | None = None


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
