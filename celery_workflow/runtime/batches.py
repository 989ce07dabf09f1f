"""What one delivery writes, split into appends that fit the World's limits (:class:`~celery_workflow.world.AppendLimits`).

A workflow delivery writes its batch (a pending run's start, its inline steps' results, the creations its code made
since the last write, their deliveries, the run's end) as one append where the World takes any size (SQLite,
Postgres). A World with limits (DynamoDB: 100 actions and 4 MB per transaction) gets several appends instead, built by
:func:`split` and written in order by :func:`append_split`:

* events keep their order, so the log records the creations in the order the code made them: a pending run's
  ``run_started`` (first in the batch) is in the first append, and a redelivery after a crash between two appends
  replays into the creations already written (matched in order) and makes the rest (:class:`Replay` meets the first
  *k* creations in the log and finds the others new);
* a step's delivery travels in the append that holds that step's event (its ``step_created``, or the
  ``step_retrying`` it was queued with): a created step always has its delivery, on every World. Deliveries are
  paired by their idempotency key, ``step:<step id>`` (:func:`step_key`, what the dispatchers give step deliveries);
  every other delivery (a wake-up, a timer) goes with the last append;
* the last append is the delivery's last write: it alone acks the delivery and is durable; the appends before it
  need not be (they become durable with it).

Each append after the first is conditioned on the event count the one before it left. Another writer may append in
between (a step created by the first append already runs on another worker): when what it wrote is only steps'
progress or hooks' payloads (:data:`TOLERATED`), which cannot change what the rest of the batch means (the code made
those creations before it waited on anything it had not seen), the append is made again on the new count; anything
else (a creation, a run's end: another delivery of the run at work) raises :class:`~celery_workflow.errors.StaleLog`,
and the caller replays from the log, where the appends already written stay. The events returned then have a gap
(the other writer's events are not among them), which tells a replay to read the log again.

On a World whose queue does not deduplicate a run's wake-ups (:class:`~celery_workflow.world.WakeHolds`: standard
SQS), a split write that acks its delivery holds the run's wake-ups from its first append to its last (which ends the
hold in its own transaction): the results of the steps its first appends created wake no second delivery of the run
to replay beside it (both would restart each other from the whole log). The writer reads them itself: a result caught
up with between two appends makes its replay restart. A write that fails in between ends the hold before the replay
reads the log again; a writer that dies leaves it to its delivery's next claim.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field

from celery_workflow.errors import StaleLog, WorldError
from celery_workflow.events import Event, EventType, NewEvent
from celery_workflow.world import AppendLimits, Delivery, World, append_limits, wake_holds

__all__ = ["MAX_CATCH_UPS", "TOLERATED", "Chunk", "append_split", "split", "step_key"]

#: What other writers may append between two appends of one split batch without changing what the rest means.
TOLERATED = frozenset(
    {
        EventType.STEP_STARTED,
        EventType.STEP_COMPLETED,
        EventType.STEP_FAILED,
        EventType.STEP_RETRYING,
        EventType.HOOK_RECEIVED,
        EventType.HOOK_DISPOSED,
    }
)
#: How many times one append of a split batch is made again on a count other writers moved, before the batch gives
#: up (StaleLog: the caller replays from the log, keeping what was written).
MAX_CATCH_UPS = 200

_STEP_KEY = "step:"


def step_key(step_id: str) -> str:
    """The idempotency key of a step's delivery, by which :func:`split` keeps it with the step's event."""
    return _STEP_KEY + step_id


@dataclass(slots=True)
class Chunk:
    """One append of a split batch."""

    events: list[NewEvent] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)


@dataclass(slots=True)
class _Unit:
    """What must go in one append: an event and the deliveries paired with it (or a delivery alone)."""

    events: list[NewEvent]
    deliveries: list[Delivery]
    actions: int
    size: int


def split(events: Sequence[NewEvent], deliveries: Sequence[Delivery], limits: AppendLimits) -> list[Chunk]:
    """``events`` and ``deliveries`` as appends within ``limits`` (see the module docstring), in write order.

    One chunk when the whole fits. An event whose cost alone exceeds the limits gets an append of its own (the World
    refuses it with its own error). Chunks are filled from the last one back, so the last (the ack) is full and the
    first holds what is left over.
    """
    if limits.unlimited:
        return [Chunk(list(events), list(deliveries))]
    units = _units(events, deliveries, limits)
    total = (
        limits.reserved_actions + sum(u.actions for u in units),
        limits.reserved_bytes + sum(u.size for u in units),
    )
    if limits.fits(*total):
        return [Chunk(list(events), list(deliveries))]
    groups: list[list[_Unit]] = [[]]  # from the last append back, each group's units last first
    actions, size = limits.reserved_actions, limits.reserved_bytes
    for unit in reversed(units):
        if groups[-1] and not limits.fits(actions + unit.actions, size + unit.size):
            groups.append([])
            actions, size = limits.reserved_actions, limits.reserved_bytes
        groups[-1].append(unit)
        actions, size = actions + unit.actions, size + unit.size
    chunks = []
    for group in reversed(groups):
        group.reverse()
        chunks.append(Chunk([e for u in group for e in u.events], [d for u in group for d in u.deliveries]))
    return chunks


def _units(events: Sequence[NewEvent], deliveries: Sequence[Delivery], limits: AppendLimits) -> list[_Unit]:
    """Each event with the deliveries paired with it (by :func:`step_key`), then each other delivery alone."""
    last_of: dict[str, int] = {}
    for i, ev in enumerate(events):
        if ev.correlation_id is not None:
            last_of[ev.correlation_id] = i
    paired: list[list[Delivery]] = [[] for _ in events]
    tail: list[Delivery] = []
    for d in deliveries:
        key = d.idempotency_key
        index = last_of.get(key[len(_STEP_KEY) :]) if key is not None and key.startswith(_STEP_KEY) else None
        if index is None:
            tail.append(d)
        else:
            paired[index].append(d)
    units: list[_Unit] = []
    for ev, dels in zip(events, paired, strict=True):
        actions, size = limits.event_cost(ev)
        for d in dels:
            a, s = limits.delivery_cost(d)
            actions, size = actions + a, size + s
        units.append(_Unit([ev], dels, actions, size))
    return units + [_Unit([], [d], *limits.delivery_cost(d)) for d in tail]


def append_split(
    world: World,
    run_id: str,
    events: Sequence[NewEvent],
    deliveries: Sequence[Delivery],
    *,
    expected_count: int | None,
    ack: str | None,
    durable: bool,
    last_durable: bool,
) -> list[Event]:
    """Write ``events`` and ``deliveries`` as the appends :func:`split` makes of them for ``world``'s limits; the
    events written, in slot order (with a gap where another writer appended in between, see the module docstring).

    The first append is conditioned on ``expected_count`` (None: none), each later one on the count the one before
    it left. ``ack`` and ``last_durable`` apply to the last append, ``durable`` to those before it. The World's
    errors are raised as they are (StaleLog from the first append: the caller's view of the log is stale).
    """
    chunks = split(events, deliveries, append_limits(world))
    holds = wake_holds(world) if len(chunks) > 1 and ack is not None else None
    held = holds is not None and ack is not None and holds.hold_wakes(run_id, ack)
    try:
        return _append_chunks(
            world, run_id, chunks, expected=expected_count, ack=ack, durable=durable, last_durable=last_durable
        )
    except BaseException:
        if held and holds is not None and ack is not None:  # before the replay reads the log again
            with suppress(WorldError):  # else the delivery is retried, and its next claim ends the hold
                holds.release_wakes(run_id, ack)
        raise


def _append_chunks(
    world: World,
    run_id: str,
    chunks: list[Chunk],
    *,
    expected: int | None,
    ack: str | None,
    durable: bool,
    last_durable: bool,
) -> list[Event]:
    written: list[Event] = []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        catch_ups = 0
        while True:
            try:
                result = world.append(
                    run_id,
                    chunk.events,
                    expected_count=expected,
                    deliveries=chunk.deliveries,
                    ack=ack if last else None,
                    durable=last_durable if last else durable,
                )
                break
            except StaleLog:
                if i == 0 or expected is None or catch_ups >= MAX_CATCH_UPS:
                    raise
                catch_ups += 1
                moved = world.list_events(run_id, after_slot=expected)
                if any(ev.event_type not in TOLERATED for ev in moved):
                    raise
                if moved:
                    expected = moved[-1].slot
        written.extend(result.events)
        expected = result.run.event_count
    return written
