"""The request machine, driven without sockets through arbitrary interleavings of events.

Every run is checked against an independent model of what the instances hold
(said from what each event and command means, not from the machine's table):
for both kinds of backend (a prefill that samples the first token, and an
engine's decode that regenerates every token, its prefill maybe beside it),
it always ends; cleanup owes nothing at the end; no command follows the end;
the client's response ends well-formed exactly once (or not at all, for a
client gone or a stream torn mid-write).
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable
from copy import deepcopy

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdtrio.protocol.errors import ERRORS, Reason
from pdtrio.protocol.request import (
    AbortDecode,
    AnyFailure,
    Arrived,
    ClientGone,
    ClientStalled,
    Command,
    Deadline,
    DeadlinePassed,
    DecodeAccepted,
    DecodeConnected,
    DecodeFailed,
    DecodeNotSent,
    DecodeRejected,
    DecodeStartQueued,
    DecodeStartSent,
    DecodeTokens,
    DecodeUnavailable,
    DrainCut,
    EmitFirstToken,
    End,
    Ending,
    Event,
    Failed,
    Failure,
    Finish,
    FirstToken,
    Limits,
    MachineError,
    Migrate,
    Phase,
    PlaceDecode,
    PrefillConnected,
    Prefilled,
    PrefillFailed,
    PrefillLost,
    PrefillNotSent,
    PrefillSent,
    PrefillUnavailable,
    ReleasePrefill,
    RequestMachine,
    RerunChoice,
    RespondWithError,
    SendChoicePrefill,
    SendPrefill,
    StreamError,
    WaitForDecode,
    WaitForPrefill,
    WaitUntil,
    WorkerFailure,
)
from pdtrio.protocol.request.machine import TABLES, EventKey
from tests.examples import examples

LIMITS = Limits(
    request_timeout_s=60.0,
    prefill_timeout_s=10.0,
    prefill_attempts=3,
    migration_limit=2,
    decode_reconnect_wait_s=2.0,
    handoff_attempts=3,
    prefill_wait_s=1.0,
)
LEASE_S = 20.0

# --- the independent model ---------------------------------------------------------


@attrs.define
class Held:
    """What the instances may hold of the request, from what events and commands mean."""

    prefill: set[str] = attrs.Factory(set)  # instances that may hold its KV (or a call)
    decode: set[str] = attrs.Factory(set)  # instances that may run it
    sending_prefill: str | None = None  # the instance the prefill call is out to
    sending_decode: str | None = None
    # an engine's: Prefilled(None) says no lease is known, not that prefill kept nothing
    regenerates: bool = False

    def event(self, event: Event) -> None:
        if isinstance(event, PrefillSent):
            self.prefill.add(event.instance)
            self.sending_prefill = event.instance
        elif isinstance(event, PrefillNotSent | PrefillLost | PrefillFailed):
            # it never saw it, or dropped it, or freed what it had
            assert self.sending_prefill is not None
            self.prefill.discard(self.sending_prefill)
        elif isinstance(event, Prefilled) and event.lease_ends_at is None and not self.regenerates:
            assert self.sending_prefill is not None
            self.prefill.discard(self.sending_prefill)  # generation ended there: no KV kept
        elif isinstance(event, DecodeStartSent):
            self.decode.add(event.instance)
            self.sending_decode = event.instance
        elif isinstance(event, DecodeNotSent | DecodeRejected | DecodeFailed):
            assert self.sending_decode is not None
            self.decode.discard(self.sending_decode)  # decode holds nothing of it
        elif isinstance(event, DecodeTokens) and event.final:
            assert self.sending_decode is not None
            self.decode.discard(self.sending_decode)  # it finished there

    def command(self, command: Command) -> None:
        if isinstance(command, ReleasePrefill):
            self.prefill.discard(command.instance)
        elif isinstance(command, AbortDecode):
            self.decode.discard(command.instance)


# --- the driver --------------------------------------------------------------------

_FAILURE = Failure(Reason.BAD_KV_HANDLE, "bad handle")


_PREFILL_BESIDE_FAILURES: list[Event] = [
    PrefillNotSent(),
    PrefillLost("bootstrap lost"),
    PrefillFailed(WorkerFailure(500, "server_error", "boom")),
    PrefillFailed(WorkerFailure(400, "invalid_request_error", "bad prompt")),
]


def _events_for(
    machine: RequestMachine, rng: random.Random, now: float
) -> tuple[list[Event], list[Event]]:
    """Every kind of event the shell may report in the machine's phase (fields drawn):
    those that move the request on, and the rarer ones that end or cut it short."""
    phase = machine.phase
    from_prefill = machine.first_token is FirstToken.FROM_PREFILL
    n = rng.randrange(3)
    torn = rng.random() < 0.2
    on: list[Event] = []
    rare: list[Event] = [ClientGone(), ClientStalled(), DrainCut(torn), Failed(_FAILURE, torn)]
    armed = machine.next_deadline()
    if armed is not None:
        rare.append(DeadlinePassed(armed[1], torn))
    rare.append(DeadlinePassed(rng.choice(list(Deadline))))  # stale, or not armed
    if phase is Phase.NEW:
        return [Arrived()], [Arrived(draining=True), Arrived(queue_full=True)]
    if phase is Phase.PLACING_PREFILL:
        on += [PrefillSent(f"p{n}")]
        rare += [PrefillUnavailable()]
    elif phase is Phase.PREFILLING:
        on += [
            PrefillNotSent(),
            PrefillLost("link down"),
            PrefillFailed(WorkerFailure(500, "server_error", "boom")),
            PrefillFailed(WorkerFailure(503, "server_error", "busy")),
            Prefilled(now + LEASE_S),
            Prefilled(now + LEASE_S),
            Prefilled(now + LEASE_S),
        ]
        rare += [
            PrefillFailed(WorkerFailure(400, "invalid_request_error", "bad prompt", "p")),
            Prefilled(None),
        ]
    elif phase in (Phase.PLACING_DECODE, Phase.REPLACING_DECODE):
        on += [DecodeStartSent(f"d{n}", ("link", n))]
        rare += [
            DecodeUnavailable(Failure(Reason.SERVICE_UNAVAILABLE, "none")),
            DecodeUnavailable(Failure(Reason.QUEUE_FULL, "full")),
        ]
    elif phase in (Phase.DECODE_SENDING, Phase.DECODE_RESENDING):
        on += [DecodeStartQueued(), DecodeStartQueued(), DecodeNotSent("closed")]
    elif phase is Phase.DECODE_STARTING:
        on += [
            DecodeAccepted(),
            DecodeAccepted(),
            DecodeRejected("no room", retryable=True, exclude=False),
            DecodeRejected("pull failed", retryable=True),
            DecodeRejected("KV port refused", retryable=True, kv_source_failed=True),
            DecodeFailed("link lost", "link_lost", migratable=True),
        ]
        rare += [DecodeRejected("mismatch", retryable=False, layout_mismatch=True)]
        if not from_prefill:
            four = WorkerFailure(400, "invalid_request_error", "decode says no")
            rare += [DecodeRejected("decode says no", retryable=False, failure=four)]
            rare += _PREFILL_BESIDE_FAILURES  # (SGLang's prefill runs beside its decode)
    elif phase in (Phase.CONFIRMING_DECODE, Phase.STREAMING):
        on += [
            DecodeTokens(),
            DecodeFailed("link lost", "link_lost", migratable=True),
            DecodeFailed("worker error", "decode_failed", migratable=rng.random() < 0.5),
        ]
        rare += [DecodeTokens(final=True), DecodeFailed("cut off", "cut_off", cut_off=True)]
        if not from_prefill:
            rare += _PREFILL_BESIDE_FAILURES
    elif phase in (Phase.AWAITING_RETRY, Phase.AWAITING_MIGRATION):
        on += [DecodeConnected()]
    elif phase is Phase.AWAITING_PREFILL:
        on += [PrefillConnected()]
    return on, rare


@attrs.define
class Run:
    events: list[Event] = attrs.Factory(list)
    commands: list[Command] = attrs.Factory(list)
    ended: End | None = None
    entries: set[tuple[Phase, EventKey]] = attrs.Factory(set)  # the table's, as taken


def _drive(
    rng: random.Random,
    *,
    streaming: bool,
    keep_tokens: bool,
    regenerates: bool = False,
    steps: int = 60,
    probe: bool = False,
) -> Run:
    """A run of ``steps`` events at most; ``probe``: at each step, every event the shell
    may report then is tried on a copy of the machine too (``Run.entries`` has them all)."""
    machine = RequestMachine(
        LIMITS,
        streaming=streaming,
        keep_tokens=keep_tokens and not regenerates,
        first_token_from_prefill=not regenerates,
    )
    held = Held(regenerates=regenerates)
    run = Run()
    now = 0.0
    for step in range(steps):
        if machine.phase is Phase.DONE:
            break
        on, rare = _events_for(machine, rng, now)
        # (a wait for a decode is where time runs out, or the request is cut: more often)
        awaiting = machine.phase in (
            Phase.AWAITING_RETRY,
            Phase.AWAITING_MIGRATION,
            Phase.AWAITING_PREFILL,
        )
        odds = 0.3 if awaiting else 0.08
        if probe:
            run.entries |= _probe(machine, [*on, *rare], now)
        event = rng.choice(rare if rng.random() < odds else on)
        if step == steps - 1:
            event = DeadlinePassed(Deadline.REQUEST)  # it always comes: it ends what is pending
        armed = machine.next_deadline()
        if isinstance(event, DeadlinePassed):
            due = machine.armed_at(event.deadline)
            if due is not None and due >= now:
                now = due  # the shell's timer reports it when it is due
        else:
            # time moves on, but not past a deadline the shell's timer would have reported
            step_s = rng.choice([0.0, 0.01, 0.5, 3.0])
            if armed is not None:
                step_s = min(step_s, max(0.0, armed[0] - now) * 0.99)
            now += step_s
        held.event(event)
        awaited = machine.phase
        entry = _entry(machine, event, now)
        if entry is not None:
            run.entries.add(entry)
        commands = machine.handle(event, now)
        if isinstance(event, DecodeConnected):
            # the phase says what the wait was for: a migration continues from prefill,
            # a retry places decode again on prefill's KV
            migrates = any(isinstance(command, Migrate) for command in commands)
            places = any(isinstance(command, PlaceDecode) for command in commands)
            assert migrates == (awaited is Phase.AWAITING_MIGRATION), (awaited, commands)
            assert places == (awaited is Phase.AWAITING_RETRY), (awaited, commands)
        for command in commands:
            held.command(command)
        run.events.append(event)
        run.commands += commands
        # the time the shell's timer follows is the earliest armed deadline's, always
        earliest = machine.next_deadline()
        assert machine.earliest_deadline_at == (math.inf if earliest is None else earliest[0])
        if machine.phase is not Phase.DONE and machine.phase is not Phase.NEW:
            # something always comes: at the least, the request's deadline is armed
            assert machine.next_deadline() is not None
            assert machine.armed_at(Deadline.REQUEST) is not None
    assert machine.phase is Phase.DONE, run.events
    run.ended = machine.ended
    # cleanup owes nothing at the end: the instances hold nothing of it
    assert held.prefill == set(), run
    assert held.decode == set(), run
    assert machine.lifecycle.owed().name == "NOTHING"
    # no command follows the end, whatever comes late
    for late in (
        ClientGone(),
        DeadlinePassed(Deadline.REQUEST),
        DecodeTokens(final=True),
        PrefillLost("late"),
    ):
        assert machine.handle(late, now + 1000) == []
    return run


def _entry(machine: RequestMachine, event: Event, now: float) -> tuple[Phase, EventKey] | None:
    """The table's entry ``event`` takes (None: a stale timer, which takes none)."""
    if not isinstance(event, DeadlinePassed):
        return machine.phase, type(event)
    due = machine.armed_at(event.deadline)
    return None if due is None or due > now else (machine.phase, event.deadline)


def _probe(machine: RequestMachine, events: list[Event], now: float) -> set[tuple[Phase, EventKey]]:
    """Each of ``events`` on a copy of ``machine``: the table takes every one (a deadline
    when it is due), and the entries they took."""
    entries = set()
    for event in events:
        at = now
        if isinstance(event, DeadlinePassed):
            at = max(now, machine.armed_at(event.deadline) or now)
        # (the table is the machine's rule, not its state: shared, not copied)
        table = machine._table  # noqa: SLF001
        copy = deepcopy(machine, {id(table): table})
        entry = _entry(copy, event, at)
        copy.handle(event, at)
        if entry is not None:
            entries.add(entry)
    return entries


def _check_well_formed(run: Run, *, streaming: bool, regenerates: bool = False) -> None:
    commands = run.commands
    if regenerates:
        # decode generates every token: prefill's is never sent, nothing migrates
        assert not [c for c in commands if isinstance(c, EmitFirstToken | Migrate | WaitForDecode)]
    else:
        # prefill's token goes out once a leg: the first one's, and each migration's
        # (which may end before its own, cut short; a failed handoff's new leg may come
        # before its leg's token went out)
        emitted = sum(isinstance(c, EmitFirstToken) for c in commands)
        migrated = sum(isinstance(c, Migrate) for c in commands)
        handoffs = sum(isinstance(c, Migrate) and c.reason == "handoff_failed" for c in commands)
        assert migrated - handoffs <= emitted <= migrated + 1, commands
        # a handoff goes again from a new prefill at most the rounds allowed
        assert handoffs <= LIMITS.handoff_attempts - 1, commands
    ends = [c for c in commands if isinstance(c, End)]
    assert len(ends) == 1 and commands[-1] is ends[0], commands
    end = ends[0]
    endings = [c for c in commands if isinstance(c, Finish | RespondWithError | StreamError)]
    assert len(endings) <= 1, commands
    emitted_before = (
        [c for c in commands[: commands.index(endings[0])] if isinstance(c, EmitFirstToken)]
        if endings
        else [c for c in commands if isinstance(c, EmitFirstToken)]
    )
    headers_went_out = streaming and bool(emitted_before)
    if regenerates:
        # the response starts with decode's first batch (the run stops at the end)
        headers_went_out = streaming and any(isinstance(e, DecodeTokens) for e in run.events)
    if end.ending is Ending.OK:
        assert endings and isinstance(endings[0], Finish), commands
        assert end.failure is None
    elif end.ending is Ending.DISCONNECTED:
        assert not endings, commands  # the client is gone: nothing is sent to it
    elif end.ending is Ending.REJECTED:
        # refused before any byte went out: the error is the response, with its status
        assert not headers_went_out
        assert endings and isinstance(endings[0], RespondWithError), commands
        assert endings[0].failure == end.failure
    else:
        assert end.ending is Ending.FAILED
        assert headers_went_out
        # the error ends the stream as an event, unless no byte may go out any more
        torn = isinstance(run.events[-1], ClientStalled | DeadlinePassed | DrainCut | Failed) and (
            isinstance(run.events[-1], ClientStalled) or run.events[-1].torn
        )  # type: ignore[union-attr]
        if torn:
            assert not endings, commands
        else:
            assert endings and isinstance(endings[0], StreamError), commands
            assert endings[0].failure == end.failure
    # a final prefill token ends the response: nothing is emitted after it but the end
    finals = [i for i, c in enumerate(commands) if isinstance(c, EmitFirstToken) and c.final]
    for i in finals:
        assert isinstance(commands[i + 1], Finish)
    # every failure has a status in the one table
    if isinstance(end.failure, Failure):
        assert end.failure.reason in ERRORS


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("keep_tokens", [True, False])
def test_seeded_random_interleavings(streaming: bool, keep_tokens: bool) -> None:
    endings: set[Ending] = set()
    kinds: set[type] = set()
    for seed in range(1500):
        run = _drive(random.Random(seed), streaming=streaming, keep_tokens=keep_tokens)
        _check_well_formed(run, streaming=streaming)
        assert run.ended is not None
        endings.add(run.ended.ending)
        kinds.update(type(c) for c in run.commands)
    # the runs walk every way a request ends, and the machine says everything it can
    expected = set(Ending) if streaming else set(Ending) - {Ending.FAILED}
    assert endings == expected
    expected_kinds = {
        WaitUntil,
        SendPrefill,
        WaitForPrefill,
        PlaceDecode,
        WaitForDecode,
        EmitFirstToken,
        ReleasePrefill,
        AbortDecode,
        Finish,
        RespondWithError,
        End,
    }
    if streaming:
        expected_kinds.add(StreamError)
    if keep_tokens:
        expected_kinds.add(Migrate)
    assert expected_kinds <= kinds


@pytest.mark.parametrize("first_token", list(FirstToken))
def test_the_runs_take_every_entry_of_the_table(first_token: FirstToken) -> None:
    """Every (phase, event) the table lists, a deadline passing among them, is one a run
    meets: no phase or entry is out of the runs' reach."""
    regenerates = first_token is FirstToken.FROM_DECODE
    entries: set[tuple[Phase, EventKey]] = set()
    for seed in range(100):
        for streaming in (True, False):
            for keep_tokens in (True, False):
                rng = random.Random(seed)
                run = _drive(
                    rng,
                    streaming=streaming,
                    keep_tokens=keep_tokens,
                    regenerates=regenerates,
                    probe=True,
                )
                entries |= run.entries
    assert set(TABLES[first_token]) - entries == set()


@pytest.mark.parametrize("streaming", [True, False])
def test_seeded_random_interleavings_of_a_regenerating_engine(streaming: bool) -> None:
    endings: set[Ending] = set()
    kinds: set[type] = set()
    again_from_prefill = beside_failed = 0
    for seed in range(1500):
        run = _drive(random.Random(seed), streaming=streaming, keep_tokens=False, regenerates=True)
        _check_well_formed(run, streaming=streaming, regenerates=True)
        assert run.ended is not None
        endings.add(run.ended.ending)
        kinds.update(type(c) for c in run.commands)
        for i, event in enumerate(run.events[:-1]):
            if isinstance(event, DecodeFailed | DecodeRejected) and isinstance(
                run.events[i + 1], PrefillSent
            ):
                again_from_prefill += 1
            if (
                isinstance(event, PrefillNotSent | PrefillLost | PrefillFailed)
                and i > 0
                and not isinstance(run.events[i - 1], PrefillSent)
            ):
                beside_failed += 1
    expected = set(Ending) if streaming else set(Ending) - {Ending.FAILED}
    assert endings == expected
    expected_kinds = {
        WaitUntil,
        SendPrefill,
        PlaceDecode,
        ReleasePrefill,
        AbortDecode,
        Finish,
        RespondWithError,
        End,
    }
    if streaming:
        expected_kinds.add(StreamError)
    assert expected_kinds <= kinds
    # the runs walk a decode failing early and a prefill failing beside its decode
    assert again_from_prefill and beside_failed


@settings(max_examples=examples(300), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    streaming=st.booleans(),
    keep_tokens=st.booleans(),
    regenerates=st.booleans(),
)
def test_hypothesis_interleavings(
    seed: int, streaming: bool, keep_tokens: bool, regenerates: bool
) -> None:
    run = _drive(
        random.Random(seed), streaming=streaming, keep_tokens=keep_tokens, regenerates=regenerates
    )
    _check_well_formed(run, streaming=streaming, regenerates=regenerates)


def test_the_table_refuses_what_cannot_happen() -> None:
    machine = RequestMachine(LIMITS, streaming=True, keep_tokens=True)
    with pytest.raises(MachineError, match="DecodeAccepted"):
        machine.handle(DecodeAccepted(), 0.0)
    machine.handle(Arrived(), 0.0)
    with pytest.raises(MachineError, match="DecodeTokens"):
        machine.handle(DecodeTokens(), 0.0)
    # every phase of a table but the first can be cut short, by the request's deadline too
    for table in TABLES.values():
        for phase in {phase for phase, _ in table} - {Phase.NEW}:
            for cut in (Deadline.REQUEST, ClientGone, ClientStalled, DrainCut, Failed):
                assert (phase, cut) in table
        assert not [phase for phase, _ in table if phase is Phase.DONE]


# --- scenarios: what the client sees, as the router answered before ------------------


def _play(
    events: list[Event],
    *,
    streaming: bool = True,
    keep_tokens: bool = True,
    limits: Limits = LIMITS,
    regenerates: bool = False,
) -> tuple[RequestMachine, list[Command]]:
    machine = RequestMachine(
        limits,
        streaming=streaming,
        keep_tokens=keep_tokens and not regenerates,
        first_token_from_prefill=not regenerates,
    )
    out: list[Command] = []
    now = 0.0
    for event in events:
        if isinstance(event, DeadlinePassed):
            armed = machine.armed_at(event.deadline)
            now = now if armed is None else armed
        out += machine.handle(event, now)
    return machine, out


def _ending(out: list[Command]) -> End:
    assert isinstance(out[-1], End)
    return out[-1]


def _reason(failure: AnyFailure | None) -> Reason | None:
    return failure.reason if isinstance(failure, Failure) else None


HAPPY = [
    Arrived(),
    PrefillSent("p0"),
    Prefilled(LEASE_S),
    DecodeStartSent("d0", 1),
    DecodeStartQueued(),
    DecodeAccepted(),
    DecodeTokens(),
    DecodeTokens(final=True),
]


def test_the_happy_path() -> None:
    _, out = _play(HAPPY)
    kinds = [type(c) for c in out if not isinstance(c, WaitUntil)]
    assert kinds == [
        SendPrefill,
        PlaceDecode,
        EmitFirstToken,
        ReleasePrefill,  # at decode's first token
        Finish,
        End,
    ]
    assert _ending(out).ending is Ending.OK


def test_the_request_deadline_is_armed_at_arrival_and_prefill_has_its_own() -> None:
    machine, out = _play([Arrived(), PrefillSent("p0")])
    waits = [c for c in out if isinstance(c, WaitUntil)]
    assert waits == [WaitUntil(Deadline.REQUEST, 60.0), WaitUntil(Deadline.PREFILL, 10.0)]
    out = machine.handle(DeadlinePassed(Deadline.PREFILL), 10.0)
    assert out[0] == ReleasePrefill("p0")  # a cut prefill call may have left blocks
    assert _ending(out).failure == Failure(Reason.TIMEOUT, "prefill did not answer in time")


def test_prefill_is_tried_three_times_and_the_last_failure_is_the_answer() -> None:
    failed = PrefillFailed(WorkerFailure(500, "server_error", "boom"))
    machine, out = _play(
        [Arrived(), PrefillSent("p0"), failed, PrefillSent("p1"), PrefillLost("gone")]
    )
    sends = [c for c in out if isinstance(c, SendPrefill)]
    # p1 was lost with its link: once back it may take the request again; p0 answered 500
    assert sends[-1] == SendPrefill(frozenset({"p0"}), retry=True)
    out = machine.handle(PrefillSent("p1"), 0) + machine.handle(failed, 0)
    end = _ending(out)
    assert end.ending is Ending.REJECTED and end.failure == failed.failure


def test_prefills_lost_with_their_links_are_waited_for_and_taken_again_within_the_attempts() -> (
    None
):
    lost = PrefillLost("the worker sent nothing for 1.5s")
    machine, out = _play([Arrived(), PrefillSent("p0"), lost, PrefillSent("p1"), lost])
    assert [c for c in out if isinstance(c, SendPrefill)][-1].exclude == frozenset()
    # neither is up yet: the request waits for one, as it would at its start
    out = machine.handle(PrefillUnavailable(), 1.0)
    assert WaitForPrefill(frozenset()) in out
    assert machine.phase is Phase.AWAITING_PREFILL
    out = machine.handle(PrefillConnected(), 2.0)
    assert [c for c in out if isinstance(c, SendPrefill)] == [SendPrefill(frozenset(), retry=True)]
    # the third attempt was the last
    out = machine.handle(PrefillSent("p0"), 2.0) + machine.handle(lost, 3.0)
    end = _ending(out)
    assert end.ending is Ending.REJECTED and end.failure.reason is Reason.SERVICE_UNAVAILABLE


def test_a_4xx_from_prefill_is_not_retried() -> None:
    bad = PrefillFailed(WorkerFailure(400, "invalid_request_error", "no", "prompt"))
    _, out = _play([Arrived(), PrefillSent("p0"), bad])
    assert not [c for c in out if isinstance(c, SendPrefill) and c.retry]
    assert _ending(out).failure == bad.failure


ONE_ROUND = attrs.evolve(LIMITS, handoff_attempts=1, prefill_wait_s=0.0)  # as before either


def test_no_prefill_instance_is_explained_by_the_shell() -> None:
    _, out = _play([Arrived(), PrefillUnavailable()], limits=ONE_ROUND)
    end = _ending(out)
    assert isinstance(end.failure, Failure) and end.failure.explain_no_prefill
    assert end.failure.reason is Reason.SERVICE_UNAVAILABLE


def test_a_request_that_finds_no_prefill_waits_for_one() -> None:
    machine, out = _play([Arrived(), PrefillUnavailable()])
    assert out[-2:] == [WaitUntil(Deadline.PREFILL_WAIT, 1.0), WaitForPrefill(frozenset())]
    out = machine.handle(PrefillConnected(), 0.5)
    assert out == [SendPrefill(frozenset())]
    assert machine.armed_at(Deadline.PREFILL_WAIT) is None
    # what is left of the same wait, until a prefill answers
    out = machine.handle(PrefillUnavailable(), 0.6)
    assert out[-2:] == [WaitUntil(Deadline.PREFILL_WAIT, 1.0), WaitForPrefill(frozenset())]
    end = _ending(machine.handle(DeadlinePassed(Deadline.PREFILL_WAIT), 1.0))
    assert end.ending is Ending.REJECTED
    assert isinstance(end.failure, Failure) and end.failure.explain_no_prefill


def test_the_wait_for_a_prefill_is_bounded_by_the_request_and_cut_like_any() -> None:
    short = attrs.evolve(LIMITS, request_timeout_s=0.5)
    machine, out = _play([Arrived(), PrefillUnavailable()], limits=short)
    assert WaitUntil(Deadline.PREFILL_WAIT, 0.5) in out
    machine, _ = _play([Arrived(), PrefillUnavailable()])
    assert machine.handle(ClientGone(), 0.2) == [End(Ending.DISCONNECTED)]  # nothing held
    machine, _ = _play([Arrived(), PrefillUnavailable()])
    assert _reason(_ending(machine.handle(DrainCut(), 0.2)).failure) is Reason.SHUTTING_DOWN


def test_a_prefill_lost_is_waited_for_but_a_prefills_own_error_is_passed_on_at_once() -> None:
    # its link went down with the call out: a prefill (it, back, or another) may connect
    machine, out = _play([Arrived(), PrefillSent("p0"), PrefillLost("gone")])
    out = machine.handle(PrefillUnavailable(), 0.0)
    assert out[-1] == WaitForPrefill(frozenset())
    failed = PrefillFailed(WorkerFailure(500, "server_error", "boom"))
    machine, out = _play([Arrived(), PrefillSent("p0"), failed, PrefillUnavailable()])
    assert _ending(out).failure == failed.failure


def test_draining_and_a_full_queue_are_refused_at_once() -> None:
    _, out = _play([Arrived(draining=True)])
    assert _reason(_ending(out).failure) is Reason.SHUTTING_DOWN
    _, out = _play([Arrived(queue_full=True)])
    assert _reason(_ending(out).failure) is Reason.QUEUE_FULL
    assert ERRORS[Reason.QUEUE_FULL].status == 429


def test_a_decode_failing_before_its_first_token_is_replaced_while_prefill_holds_the_kv() -> None:
    machine, out = _play(
        [
            *HAPPY[:6],
            DecodeFailed("worker died", "decode_failed"),
        ]
    )
    assert isinstance(out[-1], WaitForDecode)
    assert dict(out[-1].exclude) == {"d0": 1}
    assert not [c for c in out if isinstance(c, ReleasePrefill)]  # prefill keeps it
    out = machine.handle(DecodeConnected(), 1.0)
    assert isinstance(out[-1], PlaceDecode) and dict(out[-1].exclude) == {"d0": 1}


def test_kv_no_decode_pulls_in_time_goes_again_from_a_new_prefill() -> None:
    refused = DecodeRejected("cannot reach KV endpoint", retryable=True, kv_source_failed=True)
    again = [DecodeStartSent("d1", 2), DecodeStartQueued(), DecodeAccepted()]
    machine, out = _play([*HAPPY[:5], refused, *again, DecodeFailed("died", "decode_failed")])
    assert isinstance(out[-1], WaitForDecode) and dict(out[-1].exclude) == {"d0": 1, "d1": 2}
    out = machine.handle(DeadlinePassed(Deadline.RECONNECT), 2.0)
    # a new leg of the handoff's: prefill's KV freed, the tokens delivered continued
    assert out == [
        ReleasePrefill("p0"),
        Migrate("handoff_failed", "d1"),
        SendPrefill(frozenset(), continuation=True, avoid=frozenset({"p0"})),
    ]
    out = machine.handle(PrefillSent("p1"), 2.0) + machine.handle(Prefilled(LEASE_S), 2.0)
    # the decode that failed itself stays excluded; the one prefill's KV failed may take it
    assert isinstance(out[-1], PlaceDecode) and dict(out[-1].exclude) == {"d1": 2}
    assert machine.migrations == ["handoff_failed"]


def test_decodes_that_failed_themselves_are_not_worth_a_new_prefill() -> None:
    # (nothing blamed prefill's KV: as before, a migration once a decode comes)
    machine, _ = _play([*HAPPY[:6], DecodeFailed("worker died", "decode_failed")])
    out = machine.handle(DeadlinePassed(Deadline.RECONNECT), 2.0)
    assert not [c for c in out if isinstance(c, SendPrefill)]
    assert isinstance(out[-1], WaitForDecode)
    machine, _ = _play([*HAPPY[:5], DecodeRejected("shutting down", retryable=True)])
    none_left = DecodeUnavailable(Failure(Reason.SERVICE_UNAVAILABLE, "no decode could"))
    assert _ending(machine.handle(none_left, 1.0)).failure == none_left.failure


def test_kv_no_decode_pulls_in_time_is_given_up_and_the_request_migrates() -> None:
    machine, out = _play(
        [*HAPPY[:6], DecodeFailed("worker died", "decode_failed")], limits=ONE_ROUND
    )
    out = machine.handle(DeadlinePassed(Deadline.RECONNECT), 2.0)
    assert out[0] == ReleasePrefill("p0")
    # (the wait is spent: a decode connected now still takes it)
    out += machine.handle(DecodeConnected(), 2.0)
    assert Migrate("decode_failed", "d0") in out
    assert isinstance(out[-1], SendPrefill) and out[-1].continuation


def test_a_decode_lost_before_its_first_token_is_waited_for_once() -> None:
    """A request started on a decode just before its loss was seen (its first token out,
    decode's not) ends with the streams the decode had started: the wait for a decode to
    pull prefill's KV and the migration's after it are one wait, from the loss."""
    early = [*HAPPY[:5], DecodeFailed("sent nothing", "link_timeout")]
    machine, out = _play(early, limits=ONE_ROUND)
    assert out[-2] == WaitUntil(Deadline.RECONNECT, 2.0) and isinstance(out[-1], WaitForDecode)
    out = machine.handle(DeadlinePassed(Deadline.RECONNECT), 2.0)
    assert out[0] == ReleasePrefill("p0") and isinstance(out[-1], WaitForDecode)
    # no second wait: what it had waited is the whole of it
    assert WaitUntil(Deadline.RECONNECT, 2.0) in out
    end = _ending(machine.handle(DeadlinePassed(Deadline.RECONNECT), 2.0))
    assert end.ending is Ending.FAILED
    assert end.failure == Failure(
        Reason.DECODE_FAILED, "decode failed: decode failed to start: sent nothing"
    )

    # a wait the KV lease cut short goes on for the rest of it, as a migration
    machine, out = _play(
        [Arrived(), PrefillSent("p0"), Prefilled(1.5), *early[3:]], limits=ONE_ROUND
    )
    assert WaitUntil(Deadline.RECONNECT, 0.5) in out
    out = machine.handle(DeadlinePassed(Deadline.RECONNECT), 0.5)
    assert out[0] == ReleasePrefill("p0")
    assert WaitUntil(Deadline.RECONNECT, 2.0) in out
    out = machine.handle(DecodeConnected(), 1.0)
    assert Migrate("link_timeout", "d0") in out


def test_without_the_first_token_out_an_early_failure_is_a_502() -> None:
    _, out = _play(
        [*HAPPY[:5], DecodeFailed("gone", "link_lost"), DeadlinePassed(Deadline.RECONNECT)],
        keep_tokens=False,
    )
    end = _ending(out)
    assert end.ending is Ending.FAILED  # the first token went out: the error is in-stream
    assert end.failure == Failure(
        Reason.DECODE_FAILED, "decode failed: decode failed to start: gone"
    )


def test_a_decode_lost_mid_stream_migrates_up_to_the_limit() -> None:
    lost = DecodeFailed("link lost", "link_lost", migratable=True)
    leg = [
        PrefillSent("p0"),
        Prefilled(LEASE_S),
        DecodeStartSent("d0", 1),
        DecodeStartQueued(),
        DecodeAccepted(),
        DecodeTokens(),
        lost,
        DecodeConnected(),
    ]
    machine, out = _play([Arrived(), *leg, *leg])
    assert machine.migrations == ["link_lost", "link_lost"]
    assert sum(isinstance(c, EmitFirstToken) for c in out) == 2  # each leg's prefill token
    out = machine.handle(PrefillSent("p1"), 1) + machine.handle(Prefilled(LEASE_S), 1)
    for event in leg[2:7]:
        out += machine.handle(event, 1)
    end = _ending(out)
    assert end.failure == Failure(Reason.DECODE_FAILED, "decode failed: link lost")
    # the stream had started: the error is an event in it
    assert isinstance(out[-2], StreamError)


def test_a_rejected_start_is_retried_and_no_room_may_retry_the_same() -> None:
    machine, out = _play([*HAPPY[:5], DecodeRejected("no room", retryable=True, exclude=False)])
    assert isinstance(out[-1], PlaceDecode) and dict(out[-1].exclude) == {}
    assert out[-1].retry
    out = machine.handle(DecodeStartSent("d0", 1), 0) + machine.handle(DecodeStartQueued(), 0)
    assert not [c for c in out if isinstance(c, EmitFirstToken)]  # once, whatever runs it
    out = machine.handle(DecodeRejected("mismatch", retryable=False, layout_mismatch=True), 0)
    assert out[0] == ReleasePrefill("p0")
    assert _ending(out).failure == Failure(
        Reason.INTERNAL, "prefill and decode cannot be paired: mismatch"
    )


def test_the_client_going_away_cleans_up_and_sends_nothing() -> None:
    machine, out = _play(HAPPY[:6])
    out = machine.handle(ClientGone(), 1)
    assert out == [AbortDecode("d0"), ReleasePrefill("p0"), End(Ending.DISCONNECTED)]


def test_a_stalled_client_is_hung_up_on() -> None:
    machine, out = _play(HAPPY[:7])
    out = machine.handle(ClientStalled(), 1)
    assert out[0] == AbortDecode("d0")
    assert not [c for c in out if isinstance(c, StreamError)]
    assert _reason(_ending(out).failure) is Reason.CLIENT_TOO_SLOW


def test_a_lease_ending_with_no_decode_room_goes_again_from_a_new_prefill() -> None:
    machine, out = _play([Arrived(), PrefillSent("p0"), Prefilled(LEASE_S)])
    out = machine.handle(DeadlinePassed(Deadline.KV_LEASE), LEASE_S - 1.0)
    # no token went out yet: the new leg's prefill samples the first one
    assert out == [
        ReleasePrefill("p0"),
        Migrate("handoff_failed", "-"),
        SendPrefill(frozenset(), continuation=True),
    ]
    out = machine.handle(PrefillSent("p1"), 20) + machine.handle(Prefilled(40.0), 20)
    out += machine.handle(DecodeStartSent("d0", 1), 21) + machine.handle(DecodeStartQueued(), 21)
    assert EmitFirstToken(final=False) in out


def test_the_handoffs_rounds_are_bounded() -> None:
    refused = DecodeRejected("cannot reach KV endpoint", retryable=True, kv_source_failed=True)
    none_left = DecodeUnavailable(Failure(Reason.SERVICE_UNAVAILABLE, "no decode could"))
    machine, out = _play([*HAPPY[:5], refused])
    # prefill's KV is to blame: no wait for a decode to connect, a new round is the hope
    assert isinstance(out[-1], PlaceDecode) and not out[-1].await_link
    out = machine.handle(none_left, 1.0)
    assert out[:2] == [ReleasePrefill("p0"), Migrate("handoff_failed", "d0")]
    # the prefill blamed is avoided; the decodes it failed on may take the new round
    assert out[-1] == SendPrefill(frozenset(), continuation=True, avoid=frozenset({"p0"}))
    rounds = 2  # (the round under way)
    while True:
        out = machine.handle(PrefillSent(f"p{rounds}"), 1.0)
        out += machine.handle(Prefilled(LEASE_S), 1.0)
        assert isinstance(out[-1], PlaceDecode) and dict(out[-1].exclude) == {}
        out = machine.handle(DecodeStartSent("d0", 1), 1.0)
        out += machine.handle(DecodeStartQueued(), 1.0) + machine.handle(refused, 1.0)
        out += machine.handle(none_left, 1.0)
        if machine.done:
            break
        rounds += 1
    assert rounds == LIMITS.handoff_attempts
    end = _ending(out)
    assert end.failure == none_left.failure and end.ending is Ending.FAILED
    assert machine.migrations == ["handoff_failed"] * (LIMITS.handoff_attempts - 1)


def test_a_handoff_round_is_not_a_migration_of_a_lost_decode() -> None:
    # the handoff's rounds have their bound; the migrations after a loss theirs
    refused = DecodeRejected("refused", retryable=True, kv_source_failed=True)
    none_left = DecodeUnavailable(Failure(Reason.SERVICE_UNAVAILABLE, "no decode could"))
    machine, _ = _play([*HAPPY[:5], refused, none_left])
    lost = DecodeFailed("link lost", "link_lost", migratable=True)
    leg = [PrefillSent("p1"), Prefilled(LEASE_S), DecodeStartSent("d1", 1), DecodeStartQueued()]
    leg += [DecodeAccepted(), DecodeTokens(), lost, DecodeConnected()]
    out: list[Command] = []
    for event in leg + leg:
        out += machine.handle(event, 3.0)
    assert machine.migrations == ["handoff_failed", "link_lost", "link_lost"]
    assert not machine.done


def test_without_kept_tokens_a_handoff_fails_as_before() -> None:
    # an n > 1 request: a new leg could not continue every choice
    none_left = DecodeUnavailable(Failure(Reason.SERVICE_UNAVAILABLE, "no decode could"))
    refused = DecodeRejected("refused", retryable=True, kv_source_failed=True)
    _, out = _play([*HAPPY[:5], refused, none_left], keep_tokens=False)
    assert _ending(out).failure == none_left.failure


def test_the_lease_bounds_the_wait_for_decode_room() -> None:
    machine, out = _play([Arrived(), PrefillSent("p0"), Prefilled(LEASE_S)], limits=ONE_ROUND)
    assert WaitUntil(Deadline.KV_LEASE, LEASE_S - 1.0) in out
    out = machine.handle(DeadlinePassed(Deadline.KV_LEASE), LEASE_S - 1.0)
    assert _ending(out).failure == Failure(
        Reason.SERVICE_UNAVAILABLE, "no decode capacity came free within the prefill KV lease"
    )


def test_a_stale_deadline_is_ignored() -> None:
    machine, out = _play([Arrived(), PrefillSent("p0"), Prefilled(LEASE_S)])
    assert machine.handle(DeadlinePassed(Deadline.PREFILL), 5.0) == []  # disarmed
    assert machine.handle(DeadlinePassed(Deadline.REQUEST), 5.0) == []  # not due yet


def test_finished_at_prefill() -> None:
    _, out = _play([Arrived(), PrefillSent("p0"), Prefilled(None)], streaming=False)
    assert [c for c in out if not isinstance(c, WaitUntil | SendPrefill)] == [
        EmitFirstToken(final=True),
        Finish(),
        End(Ending.OK),
    ]


@pytest.mark.parametrize("streaming", [True, False])
def test_a_migration_whose_prefill_finishes_the_answer_emits_that_last_token(
    streaming: bool,
) -> None:
    # the continuation's prefill samples the last token of the budget: no KV, no decode
    lost = DecodeFailed("link lost", "link_lost", migratable=True)
    leg = [PrefillSent("p0"), Prefilled(LEASE_S), DecodeStartSent("d0", 1), DecodeStartQueued()]
    leg += [DecodeAccepted(), DecodeTokens(), lost, DecodeConnected()]
    machine, out = _play([Arrived(), *leg, PrefillSent("p1"), Prefilled(None)], streaming=streaming)
    assert machine.migrations == ["link_lost"]
    assert [c for c in out if isinstance(c, EmitFirstToken)] == [
        EmitFirstToken(final=False),
        EmitFirstToken(final=True),
    ]
    assert out[-2:] == [Finish(), End(Ending.OK)]


def _connection(n: int) -> Hashable:
    return ("link", n)


# --- an engine whose decode regenerates every token (vLLM's connector, SGLang) ---------

ENGINE_HAPPY = [
    Arrived(),
    PrefillSent("p0"),
    Prefilled(None),  # no lease known: the engine's own timer frees what no decode pulls
    DecodeStartSent("d0", "d0"),
    DecodeStartQueued(),
    DecodeAccepted(),
    DecodeTokens(),
    DecodeTokens(final=True),
]


def test_an_engines_response_starts_with_decodes_first_batch() -> None:
    machine, out = _play(ENGINE_HAPPY[:5], regenerates=True)
    assert not [c for c in out if isinstance(c, EmitFirstToken)]
    assert not machine.headers_sent  # nothing went out: a failure now is the response
    assert machine.armed_at(Deadline.KV_LEASE) is None
    out = machine.handle(DecodeAccepted(), 0.0) + machine.handle(DecodeTokens(), 0.0)
    assert out == [ReleasePrefill("p0")]  # decode pulled the KV
    assert machine.headers_sent
    out = machine.handle(DecodeTokens(final=True), 0.0)
    assert [type(c) for c in out] == [Finish, End]


def test_an_engines_decode_failing_before_its_first_token_goes_again_from_a_new_prefill() -> None:
    machine, out = _play([*ENGINE_HAPPY[:6], DecodeFailed("decode answered 500")], regenerates=True)
    # prefill's KV is freed (no decode pulled it), and a new prefill is asked for
    assert out[-2:] == [ReleasePrefill("p0"), SendPrefill(frozenset())]
    out = machine.handle(PrefillSent("p0"), 1.0) + machine.handle(Prefilled(None), 1.0)
    # the decode it failed on stays excluded
    assert isinstance(out[-1], PlaceDecode) and dict(out[-1].exclude) == {"d0": "d0"}
    out = machine.handle(DecodeUnavailable(Failure(Reason.SERVICE_UNAVAILABLE, "none")), 1.0)
    assert _ending(out).ending is Ending.REJECTED


def test_an_engines_new_prefills_are_bounded_by_the_handoffs_rounds() -> None:
    failed = DecodeFailed("decode answered 500")
    machine, out = _play([*ENGINE_HAPPY[:6], failed], regenerates=True)
    for n in range(1, LIMITS.handoff_attempts):
        out = machine.handle(PrefillSent("p0"), 1.0) + machine.handle(Prefilled(None), 1.0)
        out += machine.handle(DecodeStartSent(f"d{n}", f"d{n}"), 1.0)
        out += machine.handle(DecodeStartQueued(), 1.0) + machine.handle(failed, 1.0)
    assert not [c for c in out if isinstance(c, Migrate)]  # the request is sent again
    end = _ending(out)
    assert end.failure == Failure(
        Reason.SERVICE_UNAVAILABLE,
        "no decode instance could take the request: decode failed to start: decode answered 500",
    )


def test_an_engines_4xx_from_decode_is_passed_on() -> None:
    four = WorkerFailure(400, "BadRequestError", "decode says no")
    _, out = _play(
        [*ENGINE_HAPPY[:5], DecodeRejected("decode says no", retryable=False, failure=four)],
        regenerates=True,
    )
    assert ReleasePrefill("p0") in out  # (its KV freed)
    end = _ending(out)
    assert end.ending is Ending.REJECTED and end.failure == four


def test_a_prefill_beside_its_decode_failing_aborts_decode_and_another_prefill_takes_it() -> None:
    machine, _ = _play(ENGINE_HAPPY[:6], regenerates=True)
    out = machine.handle(PrefillFailed(WorkerFailure(500, "server_error", "boom")), 0.0)
    assert out[0] == AbortDecode("d0")  # it waits for KV that will not come
    assert out[-1] == SendPrefill(frozenset({"p0"}), retry=True)
    # once decode produced a token, it had the KV: prefill's late failure changes nothing
    machine, _ = _play([*ENGINE_HAPPY[:7]], regenerates=True)
    assert machine.handle(PrefillLost("late"), 0.0) == []
    # a 4xx is the request's own
    bad = PrefillFailed(WorkerFailure(400, "invalid_request_error", "bad prompt"))
    machine, _ = _play(ENGINE_HAPPY[:5], regenerates=True)
    out = machine.handle(bad, 0.0)
    assert out[0] == AbortDecode("d0") and _ending(out).failure == bad.failure


def test_a_prefill_sampling_the_first_token_never_fails_beside_its_decode() -> None:
    machine, _ = _play(HAPPY[:6])
    with pytest.raises(MachineError, match="PrefillLost"):
        machine.handle(PrefillLost("?"), 0.0)
    with pytest.raises(ValueError, match="cannot migrate"):
        RequestMachine(LIMITS, streaming=True, keep_tokens=True, first_token_from_prefill=False)


def test_a_choice_run_again_alone_keeps_the_requests_limits() -> None:
    machine = RequestMachine(LIMITS, streaming=True, keep_tokens=False)
    reruns = machine.choice_reruns
    assert machine.choice_reruns is reruns  # (the machine's own, one for the request)
    # its decode failed: never on d0 again, and a new round of prefills (p0 is free again)
    assert reruns.failed(1, cut_off=False, decode="d0", prefill="p0") == RerunChoice(
        1, frozenset({"d0"})
    )
    for instance in ("p0", "p1", "p2"):  # prefills failing in a round
        send = reruns.next_prefill(1)
        assert send is not None and instance not in send.exclude
        reruns.prefill_sent(1, instance)
        assert reruns.prefill_failed(1, PrefillLost("gone"))
    assert reruns.next_prefill(1) is None  # LIMITS.prefill_attempts of them
    reruns.decode_refused(1, "d1", DecodeFailed("decode answered 500"))
    assert reruns.next_prefill(1) == SendChoicePrefill(1, frozenset())
    rerun = reruns.failed(1, cut_off=False, decode=None, prefill="p0")
    assert rerun == RerunChoice(1, frozenset({"d0", "d1"}))
    # a client too far behind, or the request's own failure, is not run again
    assert reruns.failed(2, cut_off=True, decode=None, prefill="p0") is None
    bad = PrefillFailed(WorkerFailure(400, "invalid_request_error", "bad prompt"))
    assert not reruns.prefill_failed(1, bad)
    assert reruns.failed(1, cut_off=False, decode=None, prefill="p0") is None


_RERUN_STEPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["failed", "cut_off", "prefill", "prefill_failed", "prefill_4xx", "decode"]
            + ["decode_failed", "decode_refused", "give_up"]
        ),
        st.integers(0, 2),  # the choice
        st.integers(0, 3),  # an instance
    ),
    max_size=40,
)


@settings(max_examples=examples(300), deadline=None)
@given(steps=_RERUN_STEPS)
def test_hypothesis_choice_reruns(steps: list[tuple[str, int, int]]) -> None:
    """Any order of what a rerun choice meets, against a model of what it may do: a decode
    it failed on is never its decode again, a round tries at most ``prefill_attempts``
    prefills and none twice, and a choice given up (its client too slow, its failure the
    request's own, no instance left) is never run again."""
    reruns = RequestMachine(LIMITS, streaming=True, keep_tokens=False).choice_reruns
    excluded: dict[int, set[str]] = {}
    tried: dict[int, set[str]] = {}
    given_up: set[int] = set()
    for kind, choice, n in steps:
        if kind in ("failed", "cut_off", "decode_failed"):
            decode = f"d{n}" if kind == "decode_failed" else None
            rerun = reruns.failed(choice, cut_off=kind == "cut_off", decode=decode, prefill="p0")
            if kind == "cut_off" or choice in given_up:
                assert rerun is None
                continue
            if choice not in excluded:
                excluded[choice], tried[choice] = set(), {"p0"}  # its first run's
            if decode is not None:
                excluded[choice].add(decode)
                tried[choice] = set()  # a new round
            assert rerun == RerunChoice(choice, frozenset(excluded[choice]))
        elif choice not in excluded:
            continue  # (only a choice run again goes on)
        elif kind == "prefill":
            send = reruns.next_prefill(choice)
            if len(tried[choice]) >= LIMITS.prefill_attempts:
                assert send is None
                continue
            assert send == SendChoicePrefill(choice, frozenset(tried[choice]))
            instance = next(f"p{k}" for k in range(n, n + 5) if f"p{k}" not in send.exclude)
            reruns.prefill_sent(choice, instance)
            tried[choice].add(instance)
        elif kind in ("prefill_failed", "prefill_4xx"):
            status = 400 if kind == "prefill_4xx" else 500
            failed = PrefillFailed(WorkerFailure(status, "error", "boom"))
            assert reruns.prefill_failed(choice, failed) == (status == 500)
            if status == 400:
                given_up.add(choice)
        elif kind in ("decode", "decode_refused"):
            if kind == "decode":
                reruns.decode_refused(choice, f"d{n}", DecodeFailed("lost"))
                excluded[choice].add(f"d{n}")
                tried[choice] = set()
            else:
                four = WorkerFailure(400, "invalid_request_error", "no")
                reruns.decode_refused(choice, f"d{n}", DecodeRejected("no", False, failure=four))
                given_up.add(choice)
        else:
            reruns.give_up(choice)
            given_up.add(choice)
