"""The NIXL grant protocol on a KV port's ``N`` session: decode asks, prefill grants.

Decode asks for a handle's blocks with a ``TransferRequest`` and prefill answers
each, in order, with a ``TransferAnswer`` (:class:`DecodeSession`, decode's end);
prefill grants only blocks the request's lease holds (:class:`PrefillGrants`,
prefill's end), and a grant says what prefill wrote in them when it recorded that
(``TransferAnswerWithDigests``, checked by decode once it has read them).  The READ itself carries a NIXL notification (a msgpack
``TransferDone``) that tells prefill the read is done (the blocks stay leased
until the router releases them, once decode has produced a token).  Prefill
looks for notifications only while a read it granted is outstanding, so an idle
worker does no work at all; when one is, it polls from trio with growing sleeps.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from typing import Final, final

import attrs
import trio

from pdtrio.kv.api import KvBlockSource, KvTransferError
from pdtrio.kv.nixl_agent import NixlAgent, blocks_within
from pdtrio.kv.tcp import (
    answer_decoder,
    done_decoder,
    granted,
    receive_message,
    request_decoder,
    send_message,
)
from pdtrio.protocol.link.wire import (
    NixlAgentInfo,
    TransferAnswer,
    TransferAnswerWithDigests,
    TransferRequest,
    WireError,
)

log = logging.getLogger("pdtrio.kv")

# a read must end this long before prefill's lease does (the lease's TTL left prefill a
# network hop and a send queue ago: decode's count starts a little late)
LEASE_MARGIN_S: Final = 1.0
# polling prefill's notifications while a read is outstanding
_FIRST_NOTIF_POLL_S: Final = 0.001
_LAST_NOTIF_POLL_S: Final = 0.016


class SessionEnded(KvTransferError):
    """The session ended before prefill answered: nothing was granted."""


@attrs.define(eq=False)
class _Waiter:
    done: trio.Event = attrs.Factory(trio.Event)
    answer: TransferAnswerWithDigests | None = None


@final
class DecodeSession:
    """Decode's end of a NIXL session: grants asked in order, answered in order."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.ended = trio.Event()
        self.end_reason = ""
        self._waiting: deque[_Waiter] = deque()
        self._send_lock = trio.Lock()

    async def ask(self, request: TransferRequest) -> TransferAnswerWithDigests:
        """Prefill's answer; SessionEnded if the session ends first."""
        if self.ended.is_set():
            raise SessionEnded(self.end_reason)
        waiter = _Waiter()
        async with self._send_lock:
            self._waiting.append(waiter)
            try:
                await send_message(self.stream, request)
            except BaseException as exc:
                # a half-sent message leaves the stream unusable: end the session
                self.end(f"the NIXL session with prefill broke ({exc!r})")
                await trio.aclose_forcefully(self.stream)
                if isinstance(exc, (trio.BrokenResourceError, trio.ClosedResourceError)):
                    raise SessionEnded(self.end_reason) from exc
                raise
        await waiter.done.wait()
        if waiter.answer is None:
            raise SessionEnded(self.end_reason)
        return waiter.answer

    def end(self, reason: str) -> None:
        """No more asking on this session (its reader ends it for good)."""
        if not self.end_reason:
            self.end_reason = reason
        self.ended.set()

    async def read_answers(self) -> None:
        """Hand each answer to the oldest asker, until the session ends."""
        try:
            while True:
                answer = await receive_message(self.stream, answer_decoder)
                if not self._waiting:
                    raise WireError("prefill answered a request nobody made")
                waiter = self._waiting.popleft()
                waiter.answer = answer
                waiter.done.set()
        except (
            KvTransferError,
            WireError,
            trio.BrokenResourceError,
            trio.ClosedResourceError,
        ) as exc:
            self.end(f"the NIXL session with prefill ended ({exc})")
        finally:
            self.end("the NIXL session with prefill ended")
            for waiter in self._waiting:
                waiter.done.set()
            self._waiting.clear()
            await trio.aclose_forcefully(self.stream)


@final
class PrefillGrants:
    """Prefill's end of the NIXL sessions: the reads it granted and not yet known to be done.

    Made once the transport serves a KV port with an agent; ``timeout_s`` is the
    transport's, how long a granted read may take.
    """

    def __init__(self, agent: NixlAgent, source: KvBlockSource, timeout_s: float) -> None:
        self._agent = agent
        self._source = source
        self._timeout_s = timeout_s
        # each read granted and not yet known to be done, with the trio time it ends by
        self._granted: dict[str, float] = {}
        self._granted_changed = trio.Event()
        self.sessions = 0
        self.releases_notified = 0

    @property
    def outstanding(self) -> int:
        """Reads granted and not yet known to be done."""
        return len(self._granted)

    async def serve_session(self, stream: trio.abc.Stream) -> None:
        """One decode instance's NIXL session: describe the agent, then grant reads."""
        agent = self._agent
        region = agent.region
        info = NixlAgentInfo(
            unavailable="",
            agent_name=agent.name,
            agent_metadata=agent.metadata,
            memory=agent.memory,
            device_id=region.device_id,
            base_address=region.address,
            num_blocks=region.num_blocks,
            block_nbytes=region.block_nbytes,
        )
        self.sessions += 1
        try:
            await send_message(stream, info)
            while True:
                try:
                    request = await receive_message(stream, request_decoder)
                except KvTransferError:
                    return  # decode closed the session
                await send_message(stream, self.grant(request))
        finally:
            self.sessions -= 1

    def grant(self, request: TransferRequest) -> TransferAnswer:
        """May decode read these blocks now? Only blocks the request's lease holds."""
        region = self._agent.region
        request_id, block_ids = request.request_id, request.block_ids
        if not block_ids or not blocks_within(block_ids, region.num_blocks):
            return TransferAnswer(False, reason=f"bad block ids for {request_id}")
        if not self._source.holds(request_id, block_ids, request.access_token):
            # (no lease, or not this request's grant: the same answer, telling nothing)
            return TransferAnswer(False, reason=f"no lease held for {request_id} on those blocks")
        self._granted[request_id] = trio.current_time() + self._timeout_s + LEASE_MARGIN_S
        self._granted_changed.set()
        # (the generations as granted: the READ follows, within the lease)
        digests = self._source.kv_digests(request_id, block_ids)
        return granted(len(block_ids) * region.block_nbytes, digests)

    async def collect_releases(self) -> None:
        """Free blocks as decode's notifications say; looks only while a read is outstanding."""
        agent = self._agent
        source = self._source
        delay = _FIRST_NOTIF_POLL_S
        while True:
            if not self._granted:
                self._granted_changed = trio.Event()
                await self._granted_changed.wait()
                delay = _FIRST_NOTIF_POLL_S
            notifications = await agent.call_here(agent.agent.get_new_notifs)
            released = self._release_notified(_messages(notifications))
            now = trio.current_time()
            for request_id, until in list(self._granted.items()):
                # done elsewhere (the router's release, the lease), or abandoned by decode
                if until <= now or not source.holds(request_id, ()):
                    del self._granted[request_id]
            delay = _FIRST_NOTIF_POLL_S if released else min(2 * delay, _LAST_NOTIF_POLL_S)
            await trio.sleep(delay)

    def _release_notified(self, messages: Iterable[bytes]) -> bool:
        source = self._source
        released = False
        for message in messages:
            try:
                done = done_decoder.decode(message)
            except WireError as exc:
                log.warning("a NIXL notification that is not a TransferDone: %s", exc)
                continue
            if done.request_id not in self._granted:
                # not a read this instance granted (or one given up on): the lease decides
                log.warning("a NIXL release for %s, which no read was granted", done.request_id)
                continue
            if not source.holds(done.request_id, (), done.access_token):
                continue  # gone already (expired, released by the router), or not its grant
            # the read is done; the blocks stay leased until the router releases them, once
            # decode has produced a token (a decode failing before that is replaced)
            del self._granted[done.request_id]
            self.releases_notified += 1
            released = True
        return released


def _messages(notifications: dict[str, list[bytes]]) -> list[bytes]:
    return [message for messages in notifications.values() for message in messages]
