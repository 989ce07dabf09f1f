"""The transition rules: how a batch of events is checked against a run's state and turned into the writes that keep
the log and its views (the single source every World applies; the records are :mod:`celery_workflow.events`).

A World appends a batch of events like this, inside one transaction (or one conditional DynamoDB transaction)::

    keys = rules.keys_of(new_events)                       # which rows the rules need to see
    snapshot = <read run row (locked), keys.steps/hooks/waits of the run, live owners of keys.tokens>
    plan = rules.plan_append(snapshot, new_events, now=..., expected_count=...)
    <write plan.events, plan.run, plan.steps, plan.hooks_inserted, plan.hooks_deleted, plan.waits,
     and, when plan.run_ended, delete every hook and wait of the run (releasing tokens)>

:func:`plan_append` raises a subclass of :class:`~celery_workflow.errors.EventRejected` when a rule refuses the batch;
nothing of the batch is written then. Rules (reference/vercel-workflow.md §3.1, pitfalls P1-P7, P12-P13):

* the run must exist (P13); ``expected_count``, when given, must equal the run's event count (:class:`StaleLog`);
* a terminal run takes no run event (:class:`RunTerminal`) except a repeated ``run_cancelled`` (a no-op), and no new
  step, hook or wait; a step may not start or retry on it, but a running step may still complete or fail;
* exactly one terminal event per run, step and wait (:class:`EntityTerminal`); entity creation is unique per
  (run, correlation id) (:class:`EntityExists`);
* ``step_started`` needs an existing, non-terminal step whose retry time has passed (:class:`TooEarly`); it counts the
  attempt and sets ``started_at`` only the first time;
* ``hook_created`` for a token owned by a live hook is written as ``hook_conflict`` instead; ``hook_received`` and
  ``hook_disposed`` need a live hook;
* a run's end deletes its hooks (releasing their tokens) and its waits; ``started_at`` is set once (P7);
* a repeated ``run_started`` on a running run is a no-op.

Token retention (DESIGN §3: "Run end deletes its hooks (tokens kept until token retention ends)"): a ``hook_created``
may carry ``token_retention_until`` (an ISO 8601 time with its offset, else :class:`EventInvalid`; see
:class:`~celery_workflow.event_data.HookCreatedData`). While its run lives the hook is like any other. The run's end deletes it all the same, but
when the retention ends after the run's end its token stays *retained* by the ended run until then
(:attr:`Plan.tokens_retained`; a hook disposed before, or in the batch that ends the run, releases its token at
once): a claim of it is written as ``hook_conflict`` naming the ended run, and once the retention has ended the claim
takes the token (:attr:`Plan.tokens_reclaimed`: the World replaces the old holding). A finished run does not expire
while it retains a token (:func:`expires_at`). A World keeps the retention ends of live hooks and of retained tokens
(its reads fill :attr:`Snapshot.retentions` and :attr:`Snapshot.retained`); the rules decide what they mean.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from celery_workflow import codec
from celery_workflow.errors import (
    EntityExists,
    EntityTerminal,
    EventInvalid,
    EventTooLarge,
    HookNotFound,
    PayloadError,
    PayloadTooLarge,
    RunNotFound,
    RunTerminal,
    StaleLog,
    StepNotFound,
    TooEarly,
    WaitNotFound,
)
from celery_workflow.event_data import (
    HookConflictData,
    HookCreatedData,
    PatchAppliedData,
    RunCompletedData,
    RunCreatedData,
    RunFailedData,
    StepCompletedData,
    StepCreatedData,
    StepFailedData,
    StepRetryingData,
    StepStartedData,
    WaitCreatedData,
)
from celery_workflow.events import (
    CHILD_EVENTS,
    HOOK_EVENTS,
    PATCH_EVENTS,
    RUN_END_STATUS,
    RUN_EVENTS,
    STEP_EVENTS,
    WAIT_EVENTS,
    Event,
    EventType,
    HookView,
    NewEvent,
    RunStatus,
    RunView,
    StepStatus,
    StepView,
    WaitStatus,
    WaitView,
)
from celery_workflow.ids import isoformat


@dataclass(frozen=True, slots=True)
class RetainedToken:
    """A token's retention: ``token``, claimed by hook ``hook_id`` of run ``run_id``, stays reserved after that run
    ends until ``until``. Describes a live hook that asked for it (:attr:`Snapshot.retentions`) or a token an ended
    run holds (:attr:`Snapshot.retained`, :attr:`Plan.tokens_retained`)."""

    run_id: str
    hook_id: str
    token: str
    until: datetime

    def holds(self, now: datetime) -> bool:
        """Whether the retention still reserves the token at ``now``."""
        return self.until > now


def retained_error(held: RetainedToken) -> HookNotFound:
    """What resuming a token an ended run retains raises: no live hook owns it (webhooks answer the same 404)."""
    return HookNotFound(
        f"token {held.token!r} belonged to a hook of run {held.run_id}, which has ended; the token stays reserved"
        f" until {isoformat(held.until)}"
    )


def expires_at(run: RunView, keep: timedelta | None, retained: Iterable[datetime] = ()) -> datetime | None:
    """When a run may be deleted by a retention of ``keep`` (None: runs are kept for good): ``keep`` after its end,
    and not before the end of any token retention it still holds (``retained``: their ends). None for a run that has
    not ended: pending and running runs never expire."""
    if keep is None or not run.status.terminal:
        return None
    ended = run.completed_at or run.updated_at
    return max([ended + keep, *retained])


@dataclass(frozen=True, slots=True)
class Keys:
    """The rows a batch's rules need: correlation ids of steps, hooks and waits, and hook tokens to check.
    ``ending``: the batch may end the run, so the World reads the retentions of all the run's live hooks too
    (:attr:`Snapshot.retentions`)."""

    steps: frozenset[str]
    hooks: frozenset[str]
    waits: frozenset[str]
    tokens: frozenset[str]
    ending: bool = False


@dataclass(slots=True)
class Snapshot:
    """What the World read, under the run's lock, before planning.

    ``steps``/``hooks``/``waits`` hold at least the rows of this run named by :func:`keys_of`; ``token_owners`` maps
    each token of :attr:`Keys.tokens` that a live hook (of any run) owns to that hook; ``created_hooks`` holds those
    of :attr:`Keys.hooks` that already have a ``hook_created`` or ``hook_conflict`` event (live or not), so a hook id
    is created once per run even after its hook was disposed.

    Token retention: ``retained`` maps each token of :attr:`Keys.tokens` that an ended run still holds (its hook is
    gone) to that holding, whether its retention has ended or not (the rules compare it with the batch's time);
    ``retentions`` maps, by hook id, the live hooks of this run that asked for a retention, at least all of them when
    :attr:`Keys.ending` (and those :attr:`Keys.hooks` names).
    """

    run: RunView | None
    steps: dict[str, StepView] = field(default_factory=dict)
    hooks: dict[str, HookView] = field(default_factory=dict)
    waits: dict[str, WaitView] = field(default_factory=dict)
    token_owners: dict[str, HookView] = field(default_factory=dict)
    created_hooks: set[str] = field(default_factory=set)
    retained: dict[str, RetainedToken] = field(default_factory=dict)
    retentions: dict[str, RetainedToken] = field(default_factory=dict)
    #: The run's parent link as its ``run_created`` records it (a child run; see
    #: :mod:`celery_workflow._backend.children`), and whether the World read it (``parent_known``: at least when
    #: :attr:`Keys.ending`). The rules do not look at it: the append template writes the parent's wake-up with the
    #: run's end.
    parent: Mapping[str, Any] | None = None
    parent_known: bool = False


@dataclass(slots=True)
class Plan:
    """What to write. Every field is the final state after the whole batch."""

    events: list[Event]
    run: RunView
    steps: dict[str, StepView] = field(default_factory=dict)  # upserts, by step id
    waits: dict[str, WaitView] = field(default_factory=dict)  # upserts, by wait id
    hooks_inserted: dict[str, HookView] = field(default_factory=dict)  # by hook id
    hooks_deleted: dict[str, HookView] = field(default_factory=dict)  # by hook id (release their tokens)
    run_ended: bool = False  # delete all hooks (release tokens but tokens_retained) and waits of the run
    retentions: dict[str, RetainedToken] = field(default_factory=dict)  # hooks_inserted asking for one, by hook id
    tokens_retained: dict[str, RetainedToken] = field(default_factory=dict)  # kept by the ended run, by token
    tokens_reclaimed: set[str] = field(default_factory=set)  # claimed once an ended run's retention ended

    @property
    def run_changed(self) -> bool:
        return bool(self.events)


def advance(snapshot: Snapshot, plan: Plan) -> Snapshot:
    """The snapshot once ``plan`` is written: what a World that read a run's *whole* state (every step, live hook
    and wait, and every created hook id) may keep to plan the run's next batch without reading it again.

    ``token_owners`` and ``retained`` are left empty: they describe other runs, and a batch that claims tokens must
    read them anew.
    """
    assert snapshot.run is not None
    hooks = {k: v for k, v in snapshot.hooks.items() if k not in plan.hooks_deleted}
    hooks.update(plan.hooks_inserted)
    created = set(snapshot.created_hooks)
    created.update(
        str(e.correlation_id) for e in plan.events if e.event_type in (EventType.HOOK_CREATED, EventType.HOOK_CONFLICT)
    )
    steps = {**snapshot.steps, **plan.steps}
    parent, known = snapshot.parent, snapshot.parent_known
    if plan.run_ended:
        return Snapshot(plan.run, steps, {}, {}, {}, created, parent=parent, parent_known=known)
    retentions = {k: v for k, v in snapshot.retentions.items() if k not in plan.hooks_deleted}
    retentions.update(plan.retentions)
    waits = {**snapshot.waits, **plan.waits}
    return Snapshot(
        plan.run, steps, hooks, waits, {}, created, retentions=retentions, parent=parent, parent_known=known
    )


def keys_of(new_events: Iterable[NewEvent]) -> Keys:
    steps: set[str] = set()
    hooks: set[str] = set()
    waits: set[str] = set()
    tokens: set[str] = set()
    for ev in new_events:
        cid = ev.correlation_id
        if cid is None:
            continue
        if ev.event_type in STEP_EVENTS:
            steps.add(cid)
        elif ev.event_type in HOOK_EVENTS:
            hooks.add(cid)
            if ev.event_type is EventType.HOOK_CREATED:
                tokens.add(ev.data_as(HookCreatedData).token)  # EventInvalid for a malformed one
        elif ev.event_type in WAIT_EVENTS:
            waits.add(cid)
    ending = any(ev.event_type in RUN_END_STATUS for ev in new_events)
    return Keys(frozenset(steps), frozenset(hooks), frozenset(waits), frozenset(tokens), ending)


def validate(ev: NewEvent) -> bytes:
    """Check an event's shape (its correlation id, and its data against its type's data class: ``ev.body``);
    return its encoded data (the World stores these bytes)."""
    if not isinstance(ev.event_type, EventType):
        raise EventInvalid(f"unknown event type {ev.event_type!r}")
    needs_cid = ev.event_type not in RUN_EVENTS
    if needs_cid and not (isinstance(ev.correlation_id, str) and ev.correlation_id):
        raise EventInvalid(f"{ev.event_type} needs a correlation id")
    if not needs_cid and ev.correlation_id is not None:
        raise EventInvalid(f"{ev.event_type} takes no correlation id")
    if ev.correlation_id is not None and len(ev.correlation_id) > 512:
        raise EventInvalid("correlation id longer than 512 characters")
    body = ev.body  # EventInvalid unless the data fits its type
    if isinstance(body, PatchAppliedData) and ev.correlation_id != f"patch:{body.change_id}":
        raise EventInvalid(
            f"patch_applied of change {body.change_id!r} needs the correlation id 'patch:{body.change_id}'"
        )
    try:
        return codec.dumps(dict(ev.data))
    except PayloadTooLarge as exc:
        raise EventTooLarge(f"{ev.event_type}: {exc}") from exc
    except PayloadError as exc:
        raise EventInvalid(f"{ev.event_type}: data is not JSON: {exc}") from exc


def new_run(run_id: str, data: Mapping[str, Any], now: datetime) -> tuple[RunView, Event]:
    """The view and slot-1 event of a new run (``data`` is ``run_created``'s data)."""
    if not isinstance(run_id, str) or not 0 < len(run_id) <= 200 or not run_id.isprintable():
        raise EventInvalid(f"invalid run id {run_id!r}: 1-200 printable characters")
    created = NewEvent(EventType.RUN_CREATED, None, data)
    validate(created)
    body = created.data_as(RunCreatedData)
    view = RunView(
        run_id=run_id,
        workflow_name=body.workflow_name,
        status=RunStatus.PENDING,
        input=body.input,
        queue=body.queue,
        created_at=now,
        updated_at=now,
        event_count=1,
    )
    return view, Event(run_id, 1, EventType.RUN_CREATED, None, dict(data), now)


def step_after(step: StepView | None, ev: NewEvent | Event, run_id: str, now: datetime) -> StepView:
    """The view of ``ev``'s step after ``ev``, a step event these rules accepted (``step`` is its view before, None
    for ``step_created``): the one transition the rules plan and a World that folds step views from its log (the
    AWS World) replays."""
    kind = ev.event_type
    if kind is EventType.STEP_CREATED:
        created = ev.data_as(StepCreatedData)
        return StepView(
            run_id=run_id,
            step_id=str(ev.correlation_id),
            step_name=created.step_name,
            status=StepStatus.PENDING,
            input=created.input,
            queue=created.queue,
            created_at=now,
            updated_at=now,
        )
    if step is None:
        raise StepNotFound(f"step {ev.correlation_id} of run {run_id} does not exist")
    if kind is EventType.STEP_STARTED:
        return dataclasses.replace(
            step,
            status=StepStatus.RUNNING,
            attempt=step.attempt + 1,
            owner=ev.data_as(StepStartedData).owner,
            started_at=step.started_at or now,
            retry_after=None,
            updated_at=now,
        )
    if kind is EventType.STEP_RETRYING:
        retrying = ev.data_as(StepRetryingData)
        return dataclasses.replace(
            step,
            status=StepStatus.PENDING,
            error=retrying.error,
            retry_after=retrying.retry_after,
            owner=None,
            updated_at=now,
        )
    if kind is EventType.STEP_COMPLETED:
        return dataclasses.replace(
            step,
            status=StepStatus.COMPLETED,
            output=ev.data_as(StepCompletedData).result,
            completed_at=now,
            updated_at=now,
        )
    failed = ev.data_as(StepFailedData)
    return dataclasses.replace(step, status=StepStatus.FAILED, error=failed.error, completed_at=now, updated_at=now)


def plan_append(
    snapshot: Snapshot,
    new_events: Sequence[NewEvent],
    *,
    now: datetime,
    expected_count: int | None = None,
    validated: bool = False,
) -> Plan:
    """Apply the transition rules to a batch. Raises :class:`EventRejected` subclasses; never writes.

    ``validated``: every event of the batch passed :func:`validate` already (a World's normalised batch)."""
    for ev in new_events:
        if not validated:
            validate(ev)
        if ev.event_type is EventType.RUN_CREATED:
            raise EventInvalid("run_created is written by create_run, not append")
        if ev.event_type is EventType.HOOK_CONFLICT:
            raise EventInvalid("hook_conflict is written by the World only")
    run = snapshot.run
    if run is None:
        raise RunNotFound()
    if expected_count is not None and run.event_count != expected_count:
        raise StaleLog(f"run {run.run_id} has {run.event_count} events, expected {expected_count}")
    state = _State(snapshot, now)
    for ev in new_events:
        state.apply(ev)
    return state.plan


class _State:
    def __init__(self, snapshot: Snapshot, now: datetime) -> None:
        assert snapshot.run is not None
        self.now = now
        self.steps = dict(snapshot.steps)
        self.hooks = dict(snapshot.hooks)
        self.waits = dict(snapshot.waits)
        self.token_owners = dict(snapshot.token_owners)
        self.created_hooks = set(snapshot.created_hooks)
        self.retained = dict(snapshot.retained)
        self.retentions = dict(snapshot.retentions)
        self.plan = Plan(events=[], run=snapshot.run)

    @property
    def run(self) -> RunView:
        return self.plan.run

    def _emit(self, ev: NewEvent, data: Mapping[str, Any] | None = None, event_type: EventType | None = None) -> None:
        run = self.run
        slot = run.event_count + 1
        self.plan.events.append(
            Event(run.run_id, slot, event_type or ev.event_type, ev.correlation_id, dict(data or ev.data), self.now)
        )
        self.plan.run = dataclasses.replace(run, event_count=slot, updated_at=self.now)

    def apply(self, ev: NewEvent) -> None:
        kind = ev.event_type
        if kind in RUN_EVENTS:
            self._run_event(ev)
        elif kind in STEP_EVENTS:
            self._step_event(ev)
        elif kind in HOOK_EVENTS:
            self._hook_event(ev)
        elif kind in WAIT_EVENTS:
            self._wait_event(ev)
        elif kind in PATCH_EVENTS:
            self._patch_event(ev)
        elif kind in CHILD_EVENTS:
            self._child_event(ev)
        else:  # a type without a rule is refused, never taken for another family's
            raise EventInvalid(f"no transition rule for event type {str(kind)!r}")

    # -- run ---------------------------------------------------------------------------------------------------------

    def _run_event(self, ev: NewEvent) -> None:
        run = self.run
        kind = ev.event_type
        if run.status.terminal:
            if kind is EventType.RUN_CANCELLED and run.status is RunStatus.CANCELLED:
                return  # idempotent: one terminal event per run
            raise RunTerminal(f"run {run.run_id} is {run.status}; cannot apply {kind}")
        if kind is EventType.RUN_STARTED:
            if run.status is RunStatus.RUNNING:
                return  # already started; started_at is kept (P7)
            self._emit(ev)
            self.plan.run = dataclasses.replace(
                self.run, status=RunStatus.RUNNING, started_at=run.started_at or self.now
            )
            return
        status = RUN_END_STATUS[kind]
        body = ev.body
        self._emit(ev)
        self.plan.run = dataclasses.replace(
            self.run,
            status=status,
            output=body.output if isinstance(body, RunCompletedData) else None,
            error=body.error if isinstance(body, RunFailedData) else None,
            completed_at=self.now,
        )
        self.plan.run_ended = True
        for hook_id, hook in list(self.hooks.items()):
            self.plan.hooks_deleted[hook_id] = hook
        self.plan.tokens_retained = {r.token: r for r in self.retentions.values() if r.holds(self.now)}
        self.plan.hooks_inserted.clear()
        self.plan.retentions.clear()
        self.retentions.clear()
        self.hooks.clear()
        self.waits.clear()
        self.plan.waits.clear()

    # -- steps -------------------------------------------------------------------------------------------------------

    def _step_event(self, ev: NewEvent) -> None:
        run = self.run
        kind = ev.event_type
        sid = str(ev.correlation_id)
        step = self.steps.get(sid)
        if kind is EventType.STEP_CREATED:
            if run.status.terminal:
                raise RunTerminal(f"run {run.run_id} is {run.status}; cannot create step {sid}")
            if step is not None:
                raise EntityExists(f"step {sid} already exists")
            self._emit(ev)
            self._put_step(step_after(None, ev, run.run_id, self.now))
            return
        if step is None:
            raise StepNotFound(f"step {sid} of run {run.run_id} does not exist")
        if step.status.terminal:
            raise EntityTerminal(f"step {sid} is already {step.status}")
        if kind is EventType.STEP_STARTED:
            if run.status.terminal:
                raise RunTerminal(f"run {run.run_id} is {run.status}; step {sid} may not start")
            if step.retry_after is not None and step.retry_after > self.now:
                raise TooEarly(
                    f"step {sid} may not start before {isoformat(step.retry_after)}", retry_after=step.retry_after
                )
            self._emit(ev, {**ev.data, "attempt": step.attempt + 1})
        elif kind is EventType.STEP_RETRYING:
            if run.status.terminal:
                raise RunTerminal(f"run {run.run_id} is {run.status}; step {sid} may not retry")
            self._emit(ev)
        else:
            self._emit(ev)
        self._put_step(step_after(step, ev, run.run_id, self.now))

    def _put_step(self, step: StepView) -> None:
        self.steps[step.step_id] = step
        self.plan.steps[step.step_id] = step

    # -- hooks -------------------------------------------------------------------------------------------------------

    def _hook_event(self, ev: NewEvent) -> None:
        run = self.run
        kind = ev.event_type
        hid = str(ev.correlation_id)
        hook = self.hooks.get(hid)
        if kind is EventType.HOOK_CREATED:
            if run.status.terminal:
                raise RunTerminal(f"run {run.run_id} is {run.status}; cannot create hook {hid}")
            if hook is not None or hid in self.created_hooks:
                raise EntityExists(f"hook {hid} already exists")
            self.created_hooks.add(hid)
            created = ev.data_as(HookCreatedData)
            token = created.token
            owner = self.token_owners.get(token)
            held = self.retained.get(token) if owner is None else None
            if owner is not None or (held is not None and held.holds(self.now)):
                holder = owner.run_id if owner is not None else held.run_id if held is not None else ""
                conflict = HookConflictData(token=token, conflicting_run_id=holder)
                self._emit(ev, conflict.to_data(), event_type=EventType.HOOK_CONFLICT)
                return
            if held is not None:  # its ended run's retention is over: the claim replaces that holding
                del self.retained[token]
                self.plan.tokens_reclaimed.add(token)
            self._emit(ev)
            view = HookView(
                run_id=run.run_id,
                hook_id=hid,
                token=token,
                created_at=self.now,
                metadata=created.metadata,
                is_webhook=created.is_webhook,
                respond_with=created.respond_with,
            )
            self.hooks[hid] = view
            self.token_owners[token] = view
            self.plan.hooks_inserted[hid] = view
            until = created.token_retention_until
            if until is not None:
                self.retentions[hid] = self.plan.retentions[hid] = RetainedToken(run.run_id, hid, token, until)
            return
        if hook is None:
            raise HookNotFound(f"hook {hid} of run {run.run_id} is not live")
        self._emit(ev)
        if kind is EventType.HOOK_DISPOSED:
            del self.hooks[hid]
            self.token_owners.pop(hook.token, None)
            self.retentions.pop(hid, None)  # a disposed hook releases its token at once
            self.plan.retentions.pop(hid, None)
            if self.plan.hooks_inserted.pop(hid, None) is None:
                self.plan.hooks_deleted[hid] = hook

    # -- waits -------------------------------------------------------------------------------------------------------

    def _wait_event(self, ev: NewEvent) -> None:
        run = self.run
        wid = str(ev.correlation_id)
        wait = self.waits.get(wid)
        if ev.event_type is EventType.WAIT_CREATED:
            if run.status.terminal:
                raise RunTerminal(f"run {run.run_id} is {run.status}; cannot create wait {wid}")
            if wait is not None:
                raise EntityExists(f"wait {wid} already exists")
            when = ev.data_as(WaitCreatedData).resume_at
            self._emit(ev)
            view = WaitView(run.run_id, wid, WaitStatus.WAITING, when, self.now)
        else:  # WAIT_COMPLETED
            if wait is None:
                raise WaitNotFound(f"wait {wid} of run {run.run_id} does not exist")
            if wait.status is WaitStatus.COMPLETED:
                raise EntityTerminal(f"wait {wid} is already completed")
            self._emit(ev)
            view = dataclasses.replace(wait, status=WaitStatus.COMPLETED, completed_at=self.now)
        self.waits[wid] = view
        self.plan.waits[wid] = view

    # -- patches -----------------------------------------------------------------------------------------------------

    def _patch_event(self, ev: NewEvent) -> None:
        """A ``patch_applied`` marker (its correlation id ``patch:<change_id>``, checked with its shape): on a live run
        only. It keeps no view;
        a repeated marker is written as it comes (the replay that writes it appends on the count it has read, and a
        replay reads the first)."""
        run = self.run
        if run.status.terminal:
            raise RunTerminal(f"run {run.run_id} is {run.status}; cannot apply {ev.event_type}")
        self._emit(ev)

    # -- child runs --------------------------------------------------------------------------------------------------

    def _child_event(self, ev: NewEvent) -> None:
        """``child_started`` (written by the parent's replay, conditioned on the count it read, so once per call
        site) and ``child_ended`` (written by the World with the child's end): on a live run only. Neither keeps a
        view: the parent's log is the record of its children. A terminal parent takes no ``child_ended``
        (:class:`RunTerminal`): the World then writes the child's end alone."""
        run = self.run
        if run.status.terminal:
            raise RunTerminal(f"run {run.run_id} is {run.status}; cannot apply {ev.event_type}")
        self._emit(ev)
