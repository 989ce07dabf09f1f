"""The one sequence every World follows to write: the append template (and its sibling for ``create_run``).

:meth:`World.append <celery_workflow.world.World.append>` is the same everywhere::

    request = AppendRequest.build(...)          # check the deliveries, normalise the events, find their keys
    with <one atomic unit of the backend>:      # a transaction, a lock, a conditional DynamoDB transaction
        loaded = load(request)                  # the run and the rows the keys name (Snapshot), under the run's lock
        plan = rules.plan_append(...)          # the rules: one source for every World
        write(request, plan)                    # events, views, hooks, tokens, deliveries and the ack, atomically
    return AppendResult(plan.events, plan.run)

:func:`append` runs that sequence; a World provides only the three backend-specific parts (:class:`AppendSteps`):
``transaction`` (run a body atomically, retrying what its backend retries), ``load`` and ``write``. Two refinements
cover every backend we have:

* **Optimistic snapshots.** ``load`` may answer from a snapshot it did not read under a lock (a kept copy of the
  run's state, or a plain read of a store without locks, like DynamoDB) and say so (``Loaded.guess``). Its ``write``
  must then be refused by the store when the snapshot was stale (a primary key on the event slot, a condition on
  the event count) and raise :class:`StaleSnapshot`; the template then plans again on fresh reads. A rule that
  refuses a batch planned on a guess, or a plan that writes no event (nothing would refuse it), also leads to fresh
  reads: only a fresh snapshot may reject a batch.
* **Linked appends.** An append that ends a child run also writes its parent's ``child_ended`` and wake-up
  (:mod:`.children`) in the same atomic unit: a World whose steps are :class:`LinkedSteps` loads the parent under
  its lock in the same transaction (after the child's) and writes both plans in one ``write_linked`` (every built-in
  World). A World without them gets the parent's append right after the child's, a second transaction (see
  :func:`append`).
* **Lost answers.** ``load`` may find that an earlier attempt of this very request already committed (a retry after
  a connection lost at commit; ``request.write_id`` tags what a request writes) and return those events
  (``Loaded.written``): the request is answered without applying the batch twice.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, Protocol, TypeVar

from celery_workflow import rules
from celery_workflow._backend.checks import check_deliveries, normalise
from celery_workflow._backend.children import ParentLink, ended_event, parsed, wake_delivery
from celery_workflow.errors import CeleryWorkflowError, EntityExists, NotFound, RunTerminal
from celery_workflow.events import RUN_END_STATUS, Event, EventType, NewEvent, RunView
from celery_workflow.world import AppendResult, Delivery, NewRun

__all__ = [
    "AppendRequest",
    "AppendSteps",
    "Linked",
    "LinkedSteps",
    "Loaded",
    "StaleSnapshot",
    "append",
    "existing_run",
    "prepare_run",
]

Tx = TypeVar("Tx")
R = TypeVar("R")


class StaleSnapshot(Exception):
    """Raised by :meth:`AppendSteps.write` when the store refused a plan made on a stale snapshot (nothing was
    written); the template plans the batch again on fresh reads."""


@dataclass(frozen=True, slots=True)
class AppendRequest:
    """One call of ``append``, checked and normalised before anything is read."""

    run_id: str
    batch: list[NewEvent]
    keys: rules.Keys
    expected_count: int | None = None
    deliveries: Sequence[Delivery] = ()
    ack: str | None = None
    durable: bool = True
    #: Tags what this request writes, so a retry can recognise its own committed write.
    write_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def build(
        cls,
        run_id: str,
        events: Sequence[NewEvent],
        *,
        expected_count: int | None = None,
        deliveries: Sequence[Delivery] = (),
        ack: str | None = None,
        durable: bool = True,
    ) -> AppendRequest:
        """Check the deliveries and normalise the events (EventInvalid, ValueError, TypeError before any read)."""
        check_deliveries(deliveries)
        batch = normalise(events)
        return cls(run_id, batch, rules.keys_of(batch), expected_count, tuple(deliveries), ack, durable)

    @property
    def ends_run(self) -> bool:
        """Whether the batch may end its run (a World may need to lock or release every token of the run)."""
        return any(e.event_type in RUN_ENDING for e in self.batch)

    @property
    def disposed_hooks(self) -> list[str]:
        """The hooks the batch disposes (their tokens are released)."""
        return sorted({str(e.correlation_id) for e in self.batch if e.event_type is EventType.HOOK_DISPOSED})


#: Events after which a run may end.
RUN_ENDING = frozenset(RUN_END_STATUS)


@dataclass(slots=True)
class Loaded:
    """What ``load`` found: the snapshot to plan on, whether it is a guess, and events an earlier attempt of this
    request committed (then nothing is planned)."""

    snapshot: rules.Snapshot
    guess: bool = False
    written: list[Event] | None = None


class AppendSteps(Protocol, Generic[Tx]):
    """The backend-specific parts of an append."""

    def transaction(self, body: Callable[[Tx], R], request: AppendRequest) -> R:
        """Run ``body`` in one atomic unit of the store (retrying what the store retries) and return its result."""
        ...

    def load(self, tx: Tx, request: AppendRequest, *, fresh: bool) -> Loaded:
        """The snapshot the rules need: the run and the rows ``request.keys`` names, read under the run's lock
        (or a guess, see :class:`Loaded`). ``fresh``: a guess proved wrong, read the store."""
        ...

    def write(self, tx: Tx, request: AppendRequest, plan: rules.Plan) -> None:
        """Store the plan, ``request.deliveries`` and the ack of ``request.ack`` atomically with the load (raise
        :class:`StaleSnapshot` if the store refuses a plan made on a guess)."""
        ...

    def now(self) -> datetime:
        """The time the batch's events carry."""
        ...


@dataclass(frozen=True, slots=True)
class Linked:
    """The parent's part of a linked append: its request (``child_ended`` and the wake-up) and its plan."""

    request: AppendRequest
    plan: rules.Plan


class LinkedSteps(AppendSteps[Tx], Protocol):
    """Steps of a World that writes a child's end and its parent's wake-up in one transaction."""

    def load_linked(self, tx: Tx, request: AppendRequest) -> rules.Snapshot:
        """The parent's snapshot, read under its lock in the transaction ``tx`` (after the child's reads)."""
        ...

    def write_linked(self, tx: Tx, request: AppendRequest, plan: rules.Plan, linked: Linked | None) -> None:
        """:meth:`AppendSteps.write`, with the parent's plan and request written in the same atomic unit."""
        ...


def links_runs(world: AppendSteps[Any]) -> bool:
    """Whether ``world``'s steps write a linked append in one transaction (:class:`LinkedSteps`)."""
    return callable(getattr(world, "load_linked", None)) and callable(getattr(world, "write_linked", None))


def parent_request(link: ParentLink, plan: rules.Plan, durable: bool) -> AppendRequest | None:
    """The parent's append that ``plan`` (ending a child) calls for, or None (the child handed over)."""
    ended = ended_event(link, plan.run, plan.events)
    if ended is None:
        return None
    return AppendRequest.build(link.run_id, [ended], deliveries=[wake_delivery(link)], durable=durable)


def plan_parent(snapshot: rules.Snapshot, request: AppendRequest, now: datetime) -> rules.Plan | None:
    """The parent's plan, or None when the parent takes no ``child_ended`` (it ended, or is gone)."""
    try:
        return rules.plan_append(snapshot, request.batch, now=now, validated=True)
    except (RunTerminal, NotFound):
        return None


def append(
    world: AppendSteps[Any], request: AppendRequest, read_link: Callable[[], ParentLink | None] | None = None
) -> AppendResult:
    """Apply ``request`` through ``world``'s steps (see the module docstring). A batch that ends a child run writes
    its parent's part too: the run's link comes from the snapshot (``Snapshot.parent``, read by ``load`` with the
    run, at no cost of its own), or from ``read_link`` for a World whose ``load`` does not read it."""
    after: list[AppendRequest] = []

    def attempt(fresh: bool) -> AppendResult:
        def body(tx: Any) -> AppendResult:
            after.clear()
            loaded = world.load(tx, request, fresh=fresh)
            run = loaded.snapshot.run
            if loaded.written is not None and run is not None:
                return AppendResult(loaded.written, run)
            try:
                plan = rules.plan_append(
                    loaded.snapshot,
                    request.batch,
                    now=world.now(),
                    expected_count=request.expected_count,
                    validated=True,  # by normalise, when the request was built
                )
            except CeleryWorkflowError:
                if loaded.guess:
                    raise StaleSnapshot() from None  # maybe only the guess is wrong: fresh reads decide
                raise
            if loaded.guess and not plan.events:
                raise StaleSnapshot()
            wake = _wake_of(loaded.snapshot, plan, request, read_link) if plan.run_ended else None
            if wake is None:
                world.write(tx, request, plan)
            elif loaded.guess:
                raise StaleSnapshot()  # the parent is read under the transaction: plan on fresh reads
            elif links_runs(world):
                steps: LinkedSteps[Any] = world  # type: ignore[assignment]
                parent = plan_parent(steps.load_linked(tx, wake), wake, world.now())
                steps.write_linked(tx, request, plan, None if parent is None else Linked(wake, parent))
            else:
                world.write(tx, request, plan)
                after.append(wake)
            return AppendResult(plan.events, plan.run)

        return world.transaction(body, request)

    try:
        result = attempt(fresh=False)
    except StaleSnapshot:
        result = attempt(fresh=True)
    for wake in after:  # a World without linked appends: the parent's, right after (a second transaction)
        try:
            append(world, wake)
        except (RunTerminal, NotFound):
            pass
    return result


def _wake_of(
    snapshot: rules.Snapshot,
    plan: rules.Plan,
    request: AppendRequest,
    read_link: Callable[[], ParentLink | None] | None,
) -> AppendRequest | None:
    """The parent's append the end of the run in ``plan`` calls for, if the run is a child run."""
    unread = read_link is not None and not snapshot.parent_known
    link = read_link() if read_link is not None and unread else parsed(snapshot.parent)
    return None if link is None else parent_request(link, plan, request.durable)


def prepare_run(run: NewRun, deliveries: Sequence[Delivery], now: datetime) -> tuple[RunView, Event]:
    """The checks of ``create_run`` before any read: the deliveries, the ``run_created`` event (normalised like any
    event) and the run id; returns the new run's view and its slot-1 event."""
    check_deliveries(deliveries)
    (created,) = normalise([NewEvent(EventType.RUN_CREATED, None, run.event_data())])
    return rules.new_run(run.run_id, created.data, now)


def existing_run(existing: RunView, run: NewRun) -> tuple[RunView, bool]:
    """What ``create_run`` answers when the run already exists: ``(existing, False)``, or EntityExists when the
    run id belongs to another workflow."""
    if existing.workflow_name != run.workflow_name:
        raise EntityExists(
            f"run {run.run_id} belongs to workflow {existing.workflow_name!r}, not {run.workflow_name!r}"
        )
    return existing, False
