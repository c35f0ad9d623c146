"""Fault hooks inside a worker, for testing only: ``[faults]`` of the worker's config.

Every hook is off by default; with all of them off the worker holds no
:class:`FaultHooks` at all (``Worker.faults is None``), so each call site costs
one ``is None`` check.  When any is on, the worker logs a WARNING at start
naming them.  What each does, and where it sits:

- ``prefill_error_status``, ``prefill_hang``, ``prefill_exit_after``:
  :meth:`FaultHooks.before_prefill`, called by the worker at the start of each
  prefill (inside its cancel scope, so a release still stops a hung one);
- ``decode_exit_at_token``: :meth:`FaultHooks.on_decode_outputs`, where the
  router link hands engine outputs to a link (counts the tokens this instance
  generated for each request);
- ``decode_stall_s``: :meth:`FaultHooks.before_frame`, in each link's writer;
- ``heartbeats_off``: the link's sender never schedules a heartbeat;
- ``kv_transfer_fail``, ``kv_transfer_stall_s``, ``kv_transfer_corrupt``:
  :class:`FaultyKvTransport`, wrapped around the worker's transport (decode's pulls);
- ``layout_mismatch``: :meth:`FaultHooks.layout`, the layout the worker reports
  in ``/pd/info``, puts in its KV handles (prefill) and checks starts against
  (decode).

An exit is ``os._exit(FAULT_EXIT_CODE)``: no cleanup, as a crash would be.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Final, final

import attrs
import msgspec
import trio

from pdtrio.config import WorkerFaultsConfig
from pdtrio.engine.api import StepOutputs
from pdtrio.kv.api import KvBlockSink, KvBlockSource, KvTransferError, KvTransport
from pdtrio.kv.tcp import DEFAULT_TRANSFER_TIMEOUT_S
from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.link.wire import KvDigests, KvHandle, PrefillFailed, TokenFrame
from pdtrio.security import PeerCredentials

log = logging.getLogger("pdtrio.worker.faults")

# the exit status of a process a fault hook ended: tells it from a crash or a signal
FAULT_EXIT_CODE: Final = 86

_NO_FAULTS: Final = WorkerFaultsConfig()


def fault_hooks_for(config: WorkerFaultsConfig) -> FaultHooks | None:
    """The hooks ``config`` turns on (logged as a WARNING), or None when none is."""
    if config == _NO_FAULTS:
        return None
    return FaultHooks(config)


def _on(config: WorkerFaultsConfig) -> dict[str, Any]:
    """The hooks that differ from their default."""
    return {
        field.name: getattr(config, field.name)
        for field in attrs.fields(WorkerFaultsConfig)
        if getattr(config, field.name) != getattr(_NO_FAULTS, field.name)
    }


def _error_type(status: int) -> str:
    if status == 503:
        return "service_unavailable"
    if status >= 500:
        return "internal_server_error"
    return "invalid_request_error"


@final
class FaultHooks:
    """What the worker consults at its few fault points; only built when a hook is on."""

    def __init__(self, config: WorkerFaultsConfig) -> None:
        self.config = config
        self.heartbeats_off = config.heartbeats_off
        self.prefills = 0  # prefills begun, for prefill_exit_after
        # request id -> tokens generated here (an aborted request's entry stays: tests only)
        self._decode_tokens: dict[str, int] = {}
        self._stall_pending = config.decode_stall_s > 0
        self._stall_until = -1.0  # (trio time) while a stall lasts, link writers wait for it
        described = ", ".join(f"{name}={value!r}" for name, value in _on(config).items())
        log.warning("fault hooks on: %s (for testing only)", described)

    @property
    def watches_prefill(self) -> bool:
        config = self.config
        return bool(config.prefill_error_status or config.prefill_hang or config.prefill_exit_after)

    # --- prefill -------------------------------------------------------------------

    async def before_prefill(self, request_id: str) -> PrefillFailed | None:
        """The failure to answer instead of prefilling, or None to go on; may never return."""
        config = self.config
        self.prefills += 1
        if config.prefill_exit_after and self.prefills >= config.prefill_exit_after:
            _exit(f"prefill_exit_after={config.prefill_exit_after} (request {request_id})")
        if config.prefill_hang:
            log.warning("fault hook prefill_hang: prefill of %s hangs", request_id)
            await trio.sleep_forever()
        status = config.prefill_error_status
        if status:
            return PrefillFailed(
                request_id,
                status,
                f"prefill failed: fault hook prefill_error_status={status}",
                _error_type(status),
            )
        return None

    # --- decode --------------------------------------------------------------------

    def on_decode_outputs(self, entries: StepOutputs) -> None:
        """Engine outputs about to go to a router link: exit at ``decode_exit_at_token``."""
        limit = self.config.decode_exit_at_token
        if not limit:
            return
        counts = self._decode_tokens
        for entry in entries:
            count = counts.get(entry.request_id, 0) + len(entry.token_ids)
            if count >= limit:
                _exit(f"decode_exit_at_token={limit} (request {entry.request_id})")
            if entry.finish_reason is None:
                counts[entry.request_id] = count
            else:
                counts.pop(entry.request_id, None)

    async def before_frame(self, frame: object) -> None:
        """A link writer is about to write ``frame``: wait out a stall (the first token
        frame starts it), so nothing, heartbeats included, leaves any link meanwhile."""
        if self._stall_pending and isinstance(frame, TokenFrame):
            self._stall_pending = False
            stall_s = self.config.decode_stall_s
            log.warning("fault hook decode_stall_s: the links write nothing for %g s", stall_s)
            self._stall_until = trio.current_time() + stall_s
        if self._stall_until > 0:
            if trio.current_time() < self._stall_until:
                await trio.sleep_until(self._stall_until)
            else:
                self._stall_until = -1.0

    # --- layout --------------------------------------------------------------------

    def layout(self, layout: KvLayout) -> KvLayout:
        """The layout the worker reports: another block size under ``layout_mismatch``."""
        if not self.config.layout_mismatch:
            return layout
        return msgspec.structs.replace(layout, block_size=layout.block_size * 2)

    # --- KV transfer ---------------------------------------------------------------

    def wrap_transport(self, transport: KvTransport) -> KvTransport:
        """``transport``, failing, stalling or damaging its pulls when those hooks are on."""
        config = self.config
        if not (
            config.kv_transfer_fail or config.kv_transfer_stall_s or config.kv_transfer_corrupt
        ):
            return transport
        return FaultyKvTransport(transport, config)


@final
class FaultyKvTransport:
    """A transport whose pulls fail (``kv_transfer_fail``), stall (``kv_transfer_stall_s``)
    or land damaged (``kv_transfer_corrupt``).

    The stall runs inside the pull's deadline, the wrapped transport's ``timeout_s``
    (both TCP and NIXL name it so): a stall past it fails the pull as a stalled
    transfer would, with :class:`KvTransferError`.  The damage is done after the pull,
    in decode's own blocks: the first byte of each, which every digest coverage reads
    (``pdtrio.kv.digest``), is flipped.  Serving (prefill) is untouched.
    """

    def __init__(self, inner: KvTransport, config: WorkerFaultsConfig) -> None:
        self.inner = inner
        self._fail = config.kv_transfer_fail
        self._stall_s = config.kv_transfer_stall_s
        self._corrupt = config.kv_transfer_corrupt
        self.failed_pulls = 0
        self.corrupted_pulls = 0

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def secret(self) -> PeerCredentials:
        return self.inner.secret

    @secret.setter
    def secret(self, secret: PeerCredentials) -> None:
        self.inner.secret = secret

    @property
    def timeout_s(self) -> float:
        timeout: float = getattr(self.inner, "timeout_s", DEFAULT_TRANSFER_TIMEOUT_S)
        return timeout

    async def run(
        self,
        source: KvBlockSource | None,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[tuple[str, int] | None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        await self.inner.run(source, host, port, task_status=task_status)

    async def pull(
        self, handle: KvHandle, sink: KvBlockSink, dest_block_ids: tuple[int, ...]
    ) -> KvDigests | None:
        if self._fail:
            self.failed_pulls += 1
            raise KvTransferError("the KV transfer failed: fault hook kv_transfer_fail")
        timeout_s = self.timeout_s
        digests: KvDigests | None = None
        with trio.move_on_after(timeout_s) as deadline:
            if self._stall_s:
                log.warning("fault hook kv_transfer_stall_s: a KV pull stalls %g s", self._stall_s)
                await trio.sleep(self._stall_s)
            digests = await self.inner.pull(handle, sink, dest_block_ids)
        if deadline.cancelled_caught:
            self.failed_pulls += 1
            raise KvTransferError(
                f"the KV transfer stalled past its deadline ({timeout_s:g} s): "
                "fault hook kv_transfer_stall_s"
            )
        if self._corrupt and dest_block_ids:
            await _flip_first_bytes(sink, dest_block_ids)
            self.corrupted_pulls += 1
            log.warning(
                "fault hook kv_transfer_corrupt: flipped a byte of each of the %d blocks of %s",
                len(dest_block_ids),
                handle.request_id,
            )
        return digests

    def info(self) -> dict[str, Any]:
        info = dict(self.inner.info())
        info["fault_hooks"] = {
            "kv_transfer_fail": self._fail,
            "kv_transfer_stall_s": self._stall_s,
            "kv_transfer_corrupt": self._corrupt,
            "failed_pulls": self.failed_pulls,
            "corrupted_pulls": self.corrupted_pulls,
        }
        return info


async def _flip_first_bytes(sink: KvBlockSink, block_ids: tuple[int, ...]) -> None:
    """Invert the first byte of each block, through the engine (its memory may be a GPU's)."""
    block_nbytes = sink.kv_region().block_nbytes
    data = bytearray(await sink.read_blocks(block_ids))
    for offset in range(0, len(data), block_nbytes):
        data[offset] ^= 0xFF
    await sink.write_blocks(block_ids, bytes(data))


def _exit(why: str) -> None:
    log.critical("fault hook: the process exits now (%s)", why)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(FAULT_EXIT_CODE)
