"""The AWS World's kept snapshots: appends planned on what the delivery read (not part of the public API).

A delivery reads its run before it replays it (:meth:`~celery_workflow._aws.world.AWSWorld.get_run_with_events`: the
``META`` item, then the log up to META's event count). That read is kept as a :class:`Kept`: the run's view, its live
hooks and their tokens, created hook ids, token retentions, scheduled records and pending wake-up (all from META),
every step's view (folded from the log: there are no step items, :func:`celery_workflow._aws.log.step_views`) and
which waits exist (their ``wait_created`` events). The delivery's appends are planned on it
(``Loaded.guess``) instead of a ``TransactGetItems`` before each: wait and hook views a batch names that the kept
snapshot does not hold yet are read with one consistent ``BatchGetItem`` after it, which is no older than the META
read. After each write the kept snapshot is advanced by the plan
(:func:`celery_workflow.rules.advance`), so a run's inline steps read nothing more.

Why a stale kept snapshot never commits: the META update is conditioned on the event count it was planned on, and
every change of a run's own state (view, steps, waits, hooks, retentions, created hooks) appends events; the
pending wake-up is conditioned wherever the write depends on it; the scheduled records matter only at a run's end,
which is conditioned on the run having none (:attr:`Kept.schedules` must be empty for a guess); the acked record's
delete is conditioned on its claim. A refused guess (``ConditionalCheckFailed``, the items returned with
``ReturnValuesOnConditionCheckFailure=ALL_OLD``) is re-planned on fresh reads by the template. Batches that claim
hook tokens (other runs' state) always read afresh, and a kept snapshot is taken out while an append uses it, so a
refused one is never used twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from celery_workflow import ids, rules
from celery_workflow._aws.items import CODEC, from_item, retentions_of
from celery_workflow._aws.log import step_views
from celery_workflow._aws.table import CREATED, STREAMS
from celery_workflow._backend.children import parent_data
from celery_workflow._backend.recent import Recent
from celery_workflow.events import Event, EventType

__all__ = ["Kept", "KeptSnapshots"]

#: An outbox entry older than this was left by a writer that stopped (the append module's grace, in µs).
OUTBOX_GRACE_MICROS = 60_000_000


@dataclass(slots=True)
class Kept:
    """What a delivery read of its run, kept to plan its appends on (see the module docstring)."""

    snapshot: rules.Snapshot  # the run, the views known so far, created hook ids, retentions
    hooks: dict[str, str]  # live hooks: id -> token (META ``hooks``)
    waits: set[str] = field(default_factory=set)  # every wait of the run (WAIT# items)
    schedules: frozenset[str] = frozenset()  # records sent through the Scheduler (META ``schedules``)
    pending_wake: str | None = None  # META ``pending_wake``
    #: The run's partition items written so far besides META, WAIT# and the stream items (its ``EVENT#`` items), by
    #: sort key, with their sizes: what a run's end gives its time to live (:data:`celery_workflow._aws.table.
    #: TTL_ATTRIBUTE`) in its own transaction instead of an expiry's deletes. None when not known: a run an earlier
    #: version created (it may have ``STEP#`` items), or one with streams (META ``streams``).
    items: dict[str, int] | None = None

    @classmethod
    def read(cls, meta: Mapping[str, Any], log: Iterable[Event], items: Mapping[str, int] | None = None) -> Kept | None:
        """From a run's META item and its log up to META's event count (``items``: the sort keys and sizes of the
        log's items, as :func:`celery_workflow._aws.log.read_events` read them); None when it must not be kept (an
        ended run, or an outbox a stopped writer left, which the fresh path publishes)."""
        stored = from_item(meta)
        run = CODEC.run(stored)
        if run.status.terminal:
            return None
        outbox = stored.get("outbox") or {}
        if any(int(t) < ids.to_micros(ids.utcnow()) - OUTBOX_GRACE_MICROS for t in outbox.values()):
            return None
        events = list(log)
        # a child run's link to its parent (its run_created, slot 1): its end's append wakes the parent
        snapshot = rules.Snapshot(run, parent=parent_data(events[:1]), parent_known=True)
        snapshot.created_hooks = set(stored.get("created_hooks") or {})
        snapshot.retentions = retentions_of(run.run_id, meta)
        kept = cls(snapshot, {str(k): str(v) for k, v in (stored.get("hooks") or {}).items()})
        kept.schedules = frozenset(str(s) for s in stored.get("schedules") or ())
        kept.pending_wake = stored.get("pending_wake")
        kept.items = known_items(meta, items)
        snapshot.steps = step_views(events)  # every step: a batch naming one needs no read
        for e in events:
            if e.event_type is EventType.WAIT_CREATED and e.correlation_id is not None:
                kept.waits.add(e.correlation_id)
        return kept

    def missing(self, keys: rules.Keys) -> tuple[list[str], list[str]]:
        """The waits and live hooks ``keys`` names that exist but whose views are not held: to read (every step's
        view is held)."""
        s = self.snapshot
        return (
            sorted(k for k in keys.waits if k in self.waits and k not in s.waits),
            sorted(k for k in keys.hooks if k in self.hooks and k not in s.hooks),
        )

    def advanced(
        self,
        plan: rules.Plan,
        hooks: dict[str, str],
        schedules: frozenset[str],
        wake: str | None,
        written: Mapping[str, int] | None = None,
    ) -> Kept:
        """The kept snapshot once ``plan`` is written (its live hooks, scheduled records and pending wake-up as the
        write left them; ``written``: the ``EVENT#`` items it put, by sort key with their sizes)."""
        kept = Kept(rules.advance(self.snapshot, plan), hooks, set(self.waits), schedules, wake)
        kept.waits.update(plan.waits)
        if self.items is not None and written is not None:
            kept.items = {**self.items, **written}
        return kept


def known_items(meta: Mapping[str, Any], items: Mapping[str, int] | None) -> dict[str, int] | None:
    """The ``EVENT#`` items of a run (``items``, as its log read found them) when they are all of its partition's items
    that a run's end must give its time to live besides its waits: the run was created by a version that writes no
    ``STEP#`` items (META ``run_created``, :mod:`celery_workflow._aws.table`) and has no stream (META ``streams``).
    None otherwise."""
    if items is None or CREATED not in meta or STREAMS in meta:
        return None
    return dict(items)


class KeptSnapshots:
    """The kept snapshots of the runs this process works on (bounded, thread-safe): :meth:`take` hands one to a
    single append, which gives back the advanced one after its write."""

    def __init__(self, size: int = 1024) -> None:
        self._runs: Recent[str, Kept] = Recent(size)

    def put(self, kept: Kept) -> None:
        run = kept.snapshot.run
        if run is None:
            return
        if run.status.terminal:
            self._runs.pop(run.run_id)
        else:
            self._runs.put(run.run_id, kept)

    def take(self, run_id: str) -> Kept | None:
        return self._runs.pop(run_id)

    def forget(self, run_id: str) -> None:
        self._runs.pop(run_id)

    def __len__(self) -> int:
        return len(self._runs)
