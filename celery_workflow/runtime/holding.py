"""Batched step starts: when a quick inline step of a running run may start unwritten on a World whose appends are
paid for one by one (``AppendLimits.batch_steps``, the AWS World).

Without it a delivery writes each new inline step's ``step_created`` + ``step_started`` (with the previous step's
deferred result) before the step's body runs: about one append per step. With it, a step known to be quick (its body
took less than :data:`~.effects.HOLD_START_BELOW` the last time it ran in this process) is *held*: its creation,
start and result wait in the replay's deferred events and go with the delivery's next write (a suspension, a step
that is not held, a failure or retry, reading the replay clock, the run's end). The held batch is bounded:

* in time, :data:`BATCH_WINDOW` of wall time since the oldest held start: past it the next step's start is written
  with everything held, so a crash re-runs at most about that much work;
* in size, :data:`MAX_HELD_STEPS` steps, and what the World's ``append_limits`` let one append carry (with room for
  the step's result): a batch that would not fit one append is written now, which costs no append more than
  writing it later would.

What a held step gives up is the owner rule's write: its start is in no log, so no delivery sees it running. A
crash (or a World fault) before the batch is written re-runs every held step on the redelivery; a duplicate
delivery of the same run may run the same held steps at the same time. The batch's append is conditional on the
event count its replay saw, so only one of them is recorded: the other's write is refused (``Restart``), the results
of its held steps are dropped (a result cannot be recorded without its step's start) and it replays the log that
won. A step body may therefore run twice; a step is never recorded twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from celery_workflow.event_data import StepCompletedData
from celery_workflow.events import EventType, NewEvent
from celery_workflow.world import AppendLimits

#: How long the oldest held start may wait unwritten (wall time) before the next step's start is written.
BATCH_WINDOW = timedelta(seconds=1)

#: At most this many held steps in one batch.
MAX_HELD_STEPS = 32

#: What a step's result adds to a batch, counted for room (its size is not known before the body runs).
_RESULT = NewEvent.of(StepCompletedData(result=None), "step:room:1")


class Costs:
    """What each event adds to an append under ``limits``, measured once per event (a batch is checked again for
    every step that would join it: measuring its events each time would encode them again and again)."""

    def __init__(self, limits: AppendLimits) -> None:
        self.limits = limits
        self._known: dict[int, tuple[NewEvent, tuple[int, int]]] = {}

    def of(self, event: NewEvent) -> tuple[int, int]:
        known = self._known.get(id(event))
        if known is not None and known[0] is event:
            return known[1]
        cost = self.limits.event_cost(event)
        self._known[id(event)] = (event, cost)
        return cost

    def fits(self, events: Sequence[NewEvent]) -> bool:
        actions, size = self.limits.reserved_actions, self.limits.reserved_bytes
        for event in events:
            cost = self.of(event)
            actions, size = actions + cost[0], size + cost[1]
        return self.limits.fits(actions, size)


def may_batch(costs: Costs, unwritten: Sequence[NewEvent], oldest: datetime | None, now: datetime) -> bool:
    """Whether a new quick step may be held beside ``unwritten`` (the deferred events with its own creation and start
    last): the World asks for batched steps, the oldest held start (``oldest``, None if none) is younger than
    :data:`BATCH_WINDOW` at ``now``, and the batch, with the step's result, stays within :data:`MAX_HELD_STEPS` and
    one append of the World's limits."""
    if not costs.limits.batch_steps:
        return False
    if oldest is not None and now - oldest >= BATCH_WINDOW:
        return False
    if sum(1 for ev in unwritten if ev.event_type is EventType.STEP_STARTED) > MAX_HELD_STEPS:
        return False
    return costs.fits([*unwritten, _RESULT])
