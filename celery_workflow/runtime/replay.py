"""Replay: run a workflow function from the top against its event log.

Every step, sleep and hook call gets a deterministic correlation id from its call site: ``step:<name>:<n>`` (the
n-th call of that step in this run), ``wait:<n>``, ``hook:<n>``. Entity creations in the log must be met in the same
order by the code; the first mismatch (or a creation the code never reaches, or a step called with other arguments)
is a divergence, reported instead of guessed at.

When replay reaches a step with no result it runs it inline (the fast path: ``step_created`` + ``step_started`` in
one conditional append, the body, then ``step_completed``; the first step of a new run may start unwritten, its
creation and start riding with the delivery's next write, and so may any quick step on a World that wants batched
appends, see :meth:`Replay._run_inline` and :mod:`.holding`) unless the step must be
its own delivery: it was started as a future, it declares another queue, it must wait for a retry, or the delivery
is past its time budget. A call that cannot finish now raises :class:`Suspend` (a ``BaseException``, so user
``except Exception`` blocks cannot swallow it); the handler then writes the pending creations and deliveries in one
append.

This module does no I/O of its own: every read and write goes through the :class:`~.control.Effects` the handler
passes in; the exceptions that unwind a replay live beside that protocol in :mod:`.control`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from random import Random
from typing import Any

from celery_workflow import codec
from celery_workflow.errors import EventInvalid, PayloadError, RunTimedOut, StepFailed
from celery_workflow.event_data import (
    HookCreatedData,
    PatchAppliedData,
    RunCreatedData,
    RunStartedData,
    StepCompletedData,
    StepCreatedData,
    StepFailedData,
    StepStartedData,
    WaitCompletedData,
    WaitCreatedData,
)
from celery_workflow.events import CREATION_EVENTS, Event, EventType, NewEvent, RunStatus, RunView
from celery_workflow.ids import isoformat
from celery_workflow.runtime import context, hooks, steps
from celery_workflow.runtime.context import Hook, StepFuture, Webhook, WorkflowMetadata
from celery_workflow.runtime.control import (
    Diverged,
    Effects,
    Outcome,
    Refused,
    Restart,
    Suspend,
    TimedOut,
    WorldFault,
    brief,
    guarded,
)
from celery_workflow.runtime.registry import Registry, StepDef, WorkflowDef
from celery_workflow.runtime.steps import error_info
from celery_workflow.world import DEFAULT_MAX_PAYLOAD, Delivery

#: How often a forced hook claim takes its token over before it gives up (each time another run claimed it first).
MAX_TAKEOVERS = 3


#: The ``code`` of the ``run_failed`` of a run that passed its deadline.
RUN_TIMED_OUT = "RUN_TIMED_OUT"


def _is_successor(cid: str | None) -> bool:
    """Whether ``cid`` names the re-claim of a forced hook (``hook:<n>~<k>``), matched by id rather than order."""
    return cid is not None and cid.startswith("hook:") and "~" in cid


@dataclass(slots=True)
class _InlineNew:
    sdef: StepDef
    created: NewEvent


@dataclass(slots=True)
class Replay:
    run: RunView
    wdef: WorkflowDef
    registry: Registry
    effects: Effects
    events: list[Event]
    base_url: str | None = None
    #: the World's ``max_payload``: the largest step input and run output this replay lets through
    max_payload: int = DEFAULT_MAX_PAYLOAD
    # derived state
    by_cid: dict[str, list[Event]] = field(default_factory=dict)
    creations: list[Event] = field(default_factory=list)
    #: creation data of forced hooks, by the id of their first claim (see _current)
    forced: dict[str, HookCreatedData] = field(default_factory=dict)
    cursor: int = 0
    count: int = 0
    _clock: datetime = field(init=False)
    _rng: Random | None = field(default=None, init=False)
    counters: dict[str, int] = field(default_factory=dict)
    pending: list[NewEvent] = field(default_factory=list)
    pending_deliveries: list[Delivery] = field(default_factory=list)
    inline_new: dict[str, _InlineNew] = field(default_factory=dict)
    open_waits: dict[str, datetime] = field(default_factory=dict)
    #: what each patched() call of this replay answered, in the order they were met
    patches: dict[str, bool] = field(default_factory=dict)
    #: when the run times out (recorded in its ``run_created``), None without a deadline
    deadline: datetime | None = field(default=None, init=False)
    #: a child run's link to its parent (recorded in its ``run_created``), handed on by ``continue_as_new``
    parent: Mapping[str, Any] | None = field(default=None, init=False)
    #: events written with the next write: a pending run's ``run_started``, completions of inline steps, the creation
    #: and start of held steps
    deferred: list[NewEvent] = field(default_factory=list)
    #: when the oldest step start held in ``deferred`` began (None: none held)
    held_since: datetime | None = field(default=None, init=False)
    _metadata: WorkflowMetadata = field(init=False)

    def __post_init__(self) -> None:
        started = self.run.started_at or self.run.created_at
        self._clock = started
        self._metadata = WorkflowMetadata(self.run.run_id, self.run.workflow_name, started, self.base_url)
        loaded, self.events = self.events, []
        self.count = 0
        first = loaded[0].body if loaded else None
        if isinstance(first, RunCreatedData):
            self.deadline, self.parent = first.deadline, first.parent
        self._absorb(loaded, written_by_us=False)
        if self.run.status is RunStatus.PENDING:
            self.deferred.append(NewEvent.of(RunStartedData()))

    @property
    def rng(self) -> Random:
        """The run's deterministic random numbers (seeded by the run id, made on first use: seeding costs more
        than most replays of a short run)."""
        if self._rng is None:
            self._rng = Random(self.run.run_id)
        return self._rng

    @property
    def clock(self) -> datetime:
        """The replay clock. Reading it writes deferred events first, so it is the same on every replay."""
        if self.deferred:
            self.write([])
        return self._clock

    @property
    def metadata(self) -> WorkflowMetadata:
        if self.deferred:
            self.write([])
        return self._metadata

    # -- log bookkeeping -------------------------------------------------------------------------------------------

    def _absorb(self, new: Sequence[Event], *, written_by_us: bool = True) -> None:
        for ev in new:
            if ev.slot != self.count + 1:
                raise Restart()
            self.count = ev.slot
            self.events.append(ev)
            if ev.correlation_id is not None:
                self.by_cid.setdefault(ev.correlation_id, []).append(ev)
            if ev.event_type in CREATION_EVENTS and not _is_successor(ev.correlation_id):
                self.creations.append(ev)
                if written_by_us:
                    self.cursor = len(self.creations)

    def _advance(self, ev: Event) -> None:
        self._clock = max(self._clock, ev.created_at)

    def _next_id(self, prefix: str) -> str:
        n = self.counters.get(prefix, 0) + 1
        self.counters[prefix] = n
        return f"{prefix}:{n}"

    def _match(self, cid: str) -> Event | None:
        """The log's creation event for ``cid`` if the log has reached it, checking the order; None if new."""
        if self.cursor < len(self.creations):
            ev = self.creations[self.cursor]
            if ev.correlation_id != cid:
                raise Diverged(
                    f"the event log has {ev.event_type} {ev.correlation_id!r} at slot {ev.slot},"
                    f" but the workflow code now calls {cid!r} there" + self._guard_hint(repr(cid))
                )
            self.cursor += 1
            return ev
        return None

    def _of(self, cid: str, kind: EventType) -> list[Event]:
        return [e for e in self.by_cid.get(cid, ()) if e.event_type is kind]

    def write(
        self, extra: Sequence[NewEvent], deliveries: Sequence[Delivery] = (), *, final: bool = False
    ) -> list[Event]:
        """Write deferred events, pending creations and ``extra``, conditionally on the count this replay has seen.

        When another writer moved the log, deferred step results are still recorded (on their own) before the
        replay restarts, so no finished step runs again.
        """
        batch = [*self.deferred, *self.pending, *extra]
        dels = [*self.pending_deliveries, *deliveries]
        try:
            written = guarded(lambda: self.effects.append(batch, dels, conditional=True, final=final))
        except Restart:
            results = self._results()
            if results:
                guarded(lambda: self.effects.append(results, [], conditional=False))
            raise
        except WorldFault:
            # the delivery will be retried: keep the results of the steps that ran, if the World takes them now
            # (a World that stays down takes nothing, and those steps run again, as after a crash)
            results = self._results()
            if results:
                try:
                    self.effects.append(results, [], conditional=False)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException:  # best effort: the error the write met is the one raised
                    pass
            raise
        self.deferred.clear()
        self.pending.clear()
        self.pending_deliveries.clear()
        self.held_since = None
        self._absorb(written)
        self._observe(written)
        return written

    def _results(self) -> list[NewEvent]:
        """The deferred results of steps whose start is in the log (a step that started unwritten, a held start, has
        no ``step_started`` to record a result on)."""
        unwritten = {ev.correlation_id for ev in self.deferred if ev.event_type is EventType.STEP_STARTED}
        return [
            ev
            for ev in self.deferred
            if ev.event_type is EventType.STEP_COMPLETED and ev.correlation_id not in unwritten
        ]

    def discard(self) -> None:
        """Forget everything this replay meant to write (the World refused it as malformed): what is written next
        is only the run's failure."""
        self.deferred.clear()
        self.pending.clear()
        self.pending_deliveries.clear()
        self.inline_new.clear()
        self.open_waits.clear()
        self.held_since = None

    def _write_now(self, extra: Sequence[NewEvent], deliveries: Sequence[Delivery] = ()) -> list[Event]:
        """Write at the next slot whatever the count (terminal step events: protected by the one-terminal rule)."""
        if any(ev.event_type in (EventType.RUN_STARTED, EventType.STEP_STARTED) for ev in self.deferred):
            self.write([])  # a run's start and held step starts go first, conditionally
        batch = [*self.deferred, *extra]
        written = guarded(lambda: self.effects.append(batch, list(deliveries), conditional=False))
        self.deferred.clear()
        self.held_since = None
        self._absorb(written)
        self._observe(written)
        return written

    def _observe(self, written: Sequence[Event]) -> None:
        """Advance the clock over the results and start this replay wrote, as replaying them will."""
        for ev in written:
            if ev.event_type is EventType.RUN_STARTED:
                self._clock = ev.created_at
                self._metadata = WorkflowMetadata(self.run.run_id, self.run.workflow_name, ev.created_at, self.base_url)
            elif ev.event_type is EventType.STEP_COMPLETED:
                self._advance(ev)

    # -- running ---------------------------------------------------------------------------------------------------

    def execute(self) -> Outcome:
        token = context.enter_replay(self)
        try:
            try:
                self.check_deadline()
                args, kwargs = self.wdef.signature.decode_args(self.run.input)
                value = self.wdef.func(*args, **kwargs)
            except TimedOut:
                return self._timed_out()
            except Suspend:
                self._check_consumed()
                if self._past_deadline():
                    return self._timed_out()
                return Outcome("suspended")
            except context.ContinueAsNew as cont:
                self._check_consumed()
                try:
                    successor_input = self.wdef.signature.encode_args(cont.args_, cont.kwargs_)
                    codec.check_size(successor_input, self.max_payload, f"the input of workflow {self.wdef.name}")
                except PayloadError as exc:
                    return Outcome("failed", error=error_info(exc))
                return Outcome("continued", output=successor_input)
            except Diverged as exc:
                return Outcome("diverged", error={"type": "ReplayDivergence", "message": exc.message})
            except Refused as refused:
                self.discard()
                return Outcome("failed", error=error_info(refused.error))
            except Exception as exc:
                self._check_consumed()
                return Outcome("failed", error=error_info(exc))
            self._check_consumed()
            try:
                output = codec.to_json(value)
                codec.check_size(output, self.max_payload, f"the output of workflow {self.wdef.name}")
            except PayloadError as exc:
                return Outcome("failed", error=error_info(exc))
            return Outcome("completed", output=output)
        except Diverged as exc:
            return Outcome("diverged", error={"type": "ReplayDivergence", "message": exc.message})
        finally:
            context.exit_replay(token)

    # -- deadlines -------------------------------------------------------------------------------------------------

    def _past_deadline(self) -> bool:
        return self.deadline is not None and self.effects.wall_now() >= self.deadline

    def check_deadline(self) -> None:
        """Raise :class:`TimedOut` once the run is past its deadline: checked when a delivery starts, before a step
        is scheduled or run and a sleep created, and when the run would suspend."""
        if self._past_deadline():
            raise TimedOut()

    def _timed_out(self) -> Outcome:
        """The run fails with RunTimedOut. What was about to be created (steps, sleeps, hooks, their deliveries) is
        dropped; results of steps that ran are still written with the failure."""
        self.pending.clear()
        self.pending_deliveries.clear()
        self.inline_new.clear()
        self.open_waits.clear()
        assert self.deadline is not None
        exc = RunTimedOut(
            f"run {self.run.run_id} of workflow {self.wdef.name} passed its deadline {isoformat(self.deadline)}",
            run_id=self.run.run_id,
        )
        error = {"type": f"{RunTimedOut.__module__}.{RunTimedOut.__qualname__}", "message": str(exc)}
        return Outcome("failed", error=error, code=RUN_TIMED_OUT)

    def _check_consumed(self) -> None:
        if self.cursor < len(self.creations):
            ev = self.creations[self.cursor]
            raise Diverged(
                f"the event log has {ev.event_type} {ev.correlation_id!r} at slot {ev.slot},"
                " which the workflow code no longer reaches" + self._guard_hint(f"the removal of {ev.correlation_id!r}")
            )

    def _guard_hint(self, change: str) -> str:
        """What a divergence message adds: the change to guard with ``patched()``, and the last guard this replay
        met (a guard whose old branch no longer does what the old code did shows there)."""
        hint = (
            f"; if the workflow code changed while this run was in flight, guard the change ({change}) with"
            ' `if patched("<change-id>"): <new code> else: <old code>` (see docs/workflow-changes.md)'
        )
        if self.patches:
            change_id, applied = next(reversed(self.patches.items()))
            hint += f"; the last patched() check before it was {change_id!r}, {applied} for this run"
        return hint

    # -- versioned code --------------------------------------------------------------------------------------------

    def patched(self, change_id: str) -> bool:
        """Whether this run takes the new path of the change ``change_id``: True if its log records the change
        (``patch_applied``), or if the run reaches the call past everything its log has created and has not ended
        (the code from here on is new to it: the marker is written with the replay's next write, so every replay
        after agrees); False for a run whose log goes on past this point without the marker (it was recorded by
        code before the change). The answer is kept for the rest of the replay: a change checked twice is the same
        change."""
        if not isinstance(change_id, str) or not change_id:
            got = "an empty string" if isinstance(change_id, str) else type(change_id).__name__
            raise EventInvalid(f"patched() takes a non-empty string change id, not {got}")
        if change_id in self.patches:
            return self.patches[change_id]
        cid = f"patch:{change_id}"
        applied = bool(self._of(cid, EventType.PATCH_APPLIED)) or any(ev.correlation_id == cid for ev in self.pending)
        if not applied and self.cursor >= len(self.creations) and not self.run.status.terminal:
            self.pending.append(NewEvent.of(PatchAppliedData(change_id=change_id), cid))
            applied = True
        self.patches[change_id] = applied
        return applied

    # -- steps -----------------------------------------------------------------------------------------------------

    def start_step(
        self, sdef: StepDef, args: Sequence[Any], kwargs: Mapping[str, Any], *, inline: bool
    ) -> StepFuture[Any]:
        cid = self._next_id(f"step:{sdef.name}")
        data_input = sdef.signature.encode_args(args, kwargs)
        ev = self._match(cid)
        if ev is None:
            self.check_deadline()
            codec.check_size(data_input, self.max_payload, f"the input of step {sdef.name}")
            queued = (
                not inline
                or (sdef.queue is not None and sdef.queue != self.run.queue)
                or sdef.timeout is not None  # run where the worker's time limits apply
                or not self.effects.inline_allowed()
            )
            data = StepCreatedData(
                step_name=sdef.name,
                input=data_input,
                mode="queued" if queued else "inline",
                # where its deliveries go (the step view and the inspector show it)
                queue=sdef.queue if queued else None,
            )
            created = NewEvent.of(data, cid)
            if queued:
                self.pending.append(created)
                self.pending_deliveries.append(self.effects.step_delivery(sdef, cid, None))
            else:
                self.inline_new[cid] = _InlineNew(sdef, created)
        else:
            body = ev.body
            if not isinstance(body, StepCreatedData) or body.step_name != sdef.name:
                raise Diverged(f"slot {ev.slot} holds {ev.event_type} {cid!r}, not the creation of step {sdef.name}")
            if body.input != data_input:
                raise Diverged(
                    f"step {cid!r} is called with other arguments than the event log records (slot {ev.slot}):"
                    f" the log has {brief(body.input)}, the code now passes {brief(data_input)};"
                    " pass values from now()/random()/uuid4() or step results instead of nondeterministic ones"
                )
        return StepFuture(self, cid, sdef.signature.returns)

    def step_done(self, cid: str) -> bool:
        return bool(self._of(cid, EventType.STEP_COMPLETED) or self._of(cid, EventType.STEP_FAILED))

    def step_result(self, cid: str, hint: Any) -> Any:
        done = self._terminal(cid)
        if done is not None:
            return self._consume_terminal(done, hint)
        new = self.inline_new.pop(cid, None)
        if new is not None:
            return self._run_inline(cid, new.sdef, new.created.data_as(StepCreatedData).input, [new.created], hint)
        events = self.by_cid.get(cid, [])
        created = events[0].body if events else None
        if not isinstance(created, StepCreatedData):
            raise Suspend()  # created in this replay as a queued step: its delivery is pending
        if created.mode != "inline":
            raise Suspend()  # its own delivery runs it and then wakes the run
        last = events[-1].body
        if last.TYPE is EventType.STEP_RETRYING:
            raise Suspend()  # handed to a delayed step delivery
        if isinstance(last, StepStartedData) and last.owner != self.effects.delivery_id:
            raise Suspend()  # another delivery runs it; if that one dies, its redelivery resumes the step
        sdef = self.registry.step(created.step_name)
        return self._run_inline(cid, sdef, created.input, [], hint)

    def _terminal(self, cid: str) -> Event | None:
        for ev in self.by_cid.get(cid, ()):
            if ev.event_type in (EventType.STEP_COMPLETED, EventType.STEP_FAILED):
                return ev
        return None

    def _consume_terminal(self, ev: Event, hint: Any) -> Any:
        self._advance(ev)
        body = ev.body
        if isinstance(body, StepCompletedData):
            return codec.from_json(body.result, hint)
        created = self.by_cid[str(ev.correlation_id)][0].body
        raise StepFailed(
            step_id=str(ev.correlation_id),
            step_name=created.step_name if isinstance(created, StepCreatedData) else "",
            error=dict(ev.data_as(StepFailedData).error),
        )

    def _run_inline(self, cid: str, sdef: StepDef, data_input: Any, create: list[NewEvent], hint: Any) -> Any:
        self.check_deadline()  # no attempt starts past the run's deadline
        started_ev = NewEvent.of(StepStartedData(owner=self.effects.delivery_id), cid)
        new = [*create, started_ev]
        hold = bool(create) and self._may_hold(sdef, new)
        if create and not hold and self.held_since is not None and self._may_hold(sdef, new, fresh=True):
            self.write([])  # the held batch is full or old: written on its own, this step starts the next one
            hold = self._may_hold(sdef, new)
        if hold:
            # The step's creation and start ride with the delivery's next write: one round trip and one transaction
            # fewer. The first step of a run nothing has written to yet keeps the owner rule without the write (no
            # other delivery of a pending run exists to race this one to the step, only this delivery's own
            # redelivery, which owns the step anyway). A step held on a World that wants batched appends gives it
            # up: a duplicate delivery may run it too, and the conditional append records one of them (see
            # .holding). The step is new either way, so this is attempt 1.
            self.deferred.extend([*create, started_ev])
            attempt, started_at = 1, self.effects.wall_now()
            if self.held_since is None:
                self.held_since = started_at
        else:
            started = self.write([*create, started_ev])[-1]
            attempt, started_at = started.data_as(StepStartedData).attempt, started.created_at
        crash_loop = steps.exceeded_starts(sdef, cid, attempt)
        if crash_loop is not None:
            return self._consume_terminal(self._write_now([crash_loop])[-1], hint)
        outcome = guarded(lambda: self.effects.execute_step(sdef, cid, data_input, attempt, started_at))
        event, when = steps.record(sdef, cid, outcome, attempt, self.effects.wall_now())
        if event.event_type is EventType.STEP_COMPLETED and self.effects.defer_writes:
            self.deferred.append(event)  # written with the next write; the clock moves then
            return codec.from_json(outcome.result, hint)
        if when is None:
            return self._consume_terminal(self._write_now([event])[-1], hint)
        self._write_now([event], [self.effects.step_delivery(sdef, cid, when)])
        raise Suspend()

    def _may_hold(self, sdef: StepDef, new: Sequence[NewEvent], *, fresh: bool = False) -> bool:
        """Whether ``sdef``'s creation and start (``new``) may wait for the delivery's next write: nothing but
        deferred events waits to be written, and either this delivery has written nothing yet to a pending run (its
        only deferred event is the run's start) and the effects let the first step start unwritten, or the effects
        let it join the batch of held steps (``fresh``: a batch of its own, the held one written first)."""
        if not self.effects.defer_writes or self.pending or self.pending_deliveries:
            return False
        if fresh:
            return self.effects.may_batch_start(sdef, new, None)
        if len(self.deferred) == 1 and self.deferred[0].event_type is EventType.RUN_STARTED:
            return self.effects.may_hold_start(sdef)
        return self.effects.may_batch_start(sdef, [*self.deferred, *new], self.held_since)

    # -- sleeps ----------------------------------------------------------------------------------------------------

    def sleep(self, seconds: float) -> None:
        cid = self._next_id("wait")
        ev = self._match(cid)
        if ev is None:
            self.check_deadline()
            resume_at = self.clock + timedelta(seconds=max(0.0, seconds))
            created = NewEvent.of(WaitCreatedData(resume_at=resume_at), cid)
            if resume_at <= self.effects.wall_now():
                written = self.write([created, NewEvent.of(WaitCompletedData(), cid)])
                self._advance(written[-1])
                return
            self.pending.append(created)
            self.open_waits[cid] = resume_at
            raise Suspend()
        if ev.event_type is not EventType.WAIT_CREATED:
            raise Diverged(f"slot {ev.slot} holds {ev.event_type} {cid!r}, not a sleep")
        completed = self._of(cid, EventType.WAIT_COMPLETED)
        if completed:
            self._advance(completed[0])
            return
        resume_at = ev.data_as(WaitCreatedData).resume_at
        if resume_at <= self.effects.wall_now():
            written = self.write([NewEvent.of(WaitCompletedData(), cid)])
            self._advance(written[-1])
            return
        self.open_waits[cid] = resume_at
        raise Suspend()

    # -- hooks -----------------------------------------------------------------------------------------------------

    def create_hook(
        self,
        *,
        token: str | None,
        metadata: Any,
        payload_type: Any,
        force: bool = False,
        token_retention: timedelta | datetime | None = None,
    ) -> Hook[Any]:
        cid, tok, _ = hooks.claim(
            self, token, metadata, is_webhook=False, respond_with=None, force=force, retention=token_retention
        )
        return Hook(self, cid, tok, payload_type)

    def create_webhook(
        self,
        *,
        token: str | None,
        respond_with: Mapping[str, Any] | str | None,
        many: bool = False,
        keep_credentials: bool = False,
        token_retention: timedelta | datetime | None = None,
    ) -> Webhook:
        cid, tok, data = hooks.claim(
            self,
            token,
            None,
            is_webhook=True,
            respond_with=respond_with,
            options=(many, keep_credentials),
            retention=token_retention,
        )
        # A webhook recorded before ``many`` existed has no flag: it behaves as many (see HookCreatedData.webhook_options).
        return Webhook(self, cid, tok, self.base_url, many=data.webhook_options[0] if data is not None else True)

    def hook_next(self, cid: str, consumed: int) -> tuple[Any, int]:
        return hooks.next_payload(self, cid, consumed)

    def hook_dispose(self, cid: str) -> None:
        hooks.dispose(self, cid)
