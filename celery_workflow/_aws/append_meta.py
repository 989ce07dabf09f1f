"""The AWS World's append, continued (not part of the public API): what ``load`` learnt for ``write``
(:class:`AppendTx`) and the run's ``META`` update of an append (:func:`meta_update`): the view, live hooks, created
hook ids, outbox, pending wake-up and scheduled records, under the conditions that refuse a stale plan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery_workflow import ids, rules
from celery_workflow._aws.items import CODEC, RETENTION_PREFIX, item_size, run_item
from celery_workflow._aws.kept import Kept
from celery_workflow._aws.queue import WAKE_KEY, Receipt, Record, scheduled
from celery_workflow._aws.table import MAX_ITEM_BYTES, META, STREAMS, TTL_ATTRIBUTE, run_pk
from celery_workflow._backend.records import MUTABLE
from celery_workflow.errors import EventTooLarge
from celery_workflow.events import EventType

if TYPE_CHECKING:
    from celery_workflow._aws.world import AWSWorld

__all__ = ["AppendTx", "is_wake", "live_hooks", "meta_update", "schedule_clauses", "typed"]


@dataclass(slots=True)
class AppendTx:
    """What ``load`` learnt for ``write``, besides the snapshot."""

    hooks: dict[str, str] = field(default_factory=dict)  # the run's live hooks: id -> token
    retentions: dict[str, rules.RetainedToken] = field(default_factory=dict)  # theirs, by hook id (see rules)
    retained: dict[str, rules.RetainedToken] = field(default_factory=dict)  # claimed tokens ended runs retain
    waits: list[str] = field(default_factory=list)  # every wait of the run (read when the batch may end it)
    ack: Receipt | None = None  # the acked claim, when its record is still this claim's
    delete_message: Receipt | None = None  # the acked message, when its record is gone already
    stale_outbox: bool = False
    schedules: set[str] = field(default_factory=set)  # the run's records delivered through the Scheduler (META)
    pending_wake: str | None = None  # the run's queued, unclaimed wake-up (META ``pending_wake``), if any
    dropped_wake: bool = False  # this append's wake-up is left out for it
    holding: bool = False  # the acked delivery is the one ``pending_wake`` names: the append ends its hold
    kept: Kept | None = None  # the kept snapshot the batch is planned on (a guess), or advanced after a fresh read
    guess: bool = False  # planned on ``kept`` without reading (see celery_workflow._aws.kept)
    scheduled: set[str] = field(default_factory=set)  # the records this append sends through the Scheduler
    ttl: int | None = None  # a run end's time to live (epoch seconds) for the items it writes (see write)
    earlier: dict[str, int] | None = None  # the run's EVENT# items so far, with their sizes, when known (Kept.items)
    ttl_only: bool = False  # a run end that gives its earlier items its time to live: no expiry delivery
    written: dict[str, int] = field(default_factory=dict)  # the EVENT# items this append puts, with their sizes
    linked: AppendTx | None = None  # the parent's, in a linked append (a child's end that wakes its parent)


def meta_update(
    world: AWSWorld, tx: AppendTx, plan: rules.Plan, records: list[Record], write_id: str
) -> dict[str, Any]:
    """The META update: the run view, live hooks, created hook ids and the outbox, conditioned on the event count
    the plan started from (no event: only that the run still exists); an append of events names itself in
    ``write_id`` (see ``AWSAppend._committed``)."""
    run = plan.run
    table = world.table.name
    names: dict[str, str] = {}
    values: dict[str, Any] = {}
    sets: list[str] = []
    removes: list[str] = []

    def name(text: str) -> str:
        key = f"#n{len(names)}"
        names[key] = text
        return key

    def value(typed: dict[str, Any]) -> str:
        key = f":v{len(values)}"
        values[key] = typed
        return key

    condition = "attribute_exists(pk)"
    if plan.events:
        fields = CODEC.record("runs", run)
        size = item_size(run_item(run, hooks=live_hooks(tx, plan), record=fields))
        if size > MAX_ITEM_BYTES:
            raise EventTooLarge(
                f"run {run.run_id}'s view would be {size} bytes; DynamoDB stores at most {MAX_ITEM_BYTES}"
            )
        for column in MUTABLE["runs"]:
            if fields[column] is None:
                removes.append(name(column))
            else:
                sets.append(f"{name(column)} = {value(typed(fields[column]))}")
        if plan.run_ended:
            sets.append(f"{name('hooks')} = {value({'M': {}})}")
            removes += [name(RETENTION_PREFIX + hook_id) for hook_id in tx.retentions]
            if plan.tokens_retained:  # what the run's expiry waits for and deletes
                retained = {t: {"N": str(ids.to_micros(r.until))} for t, r in plan.tokens_retained.items()}
                sets.append(f"{name('retained')} = {value({'M': retained})}")
        else:
            for hook_id, hook in plan.hooks_inserted.items():
                sets.append(f"{name('hooks')}.{name(hook_id)} = {value({'S': hook.token})}")
            for hook_id, kept in plan.retentions.items():
                sets.append(f"{name(RETENTION_PREFIX + hook_id)} = {value({'N': str(ids.to_micros(kept.until))})}")
            for hook_id in plan.hooks_deleted:
                if hook_id not in plan.hooks_inserted:
                    removes.append(f"{name('hooks')}.{name(hook_id)}")
                    removes.append(name(RETENTION_PREFIX + hook_id))
        for e in plan.events:
            if e.event_type in (EventType.HOOK_CREATED, EventType.HOOK_CONFLICT):
                sets.append(f"{name('created_hooks')}.{name(str(e.correlation_id))} = {value({'BOOL': True})}")
        if tx.ttl is not None:
            sets.append(f"{name(TTL_ATTRIBUTE)} = {value({'N': str(tx.ttl)})}")
        condition = f"{name('event_count')} = {value({'N': str(plan.events[0].slot - 1)})}"
        sets.append(f"{name('write_id')} = {value({'S': write_id})}")
    for record in records:
        sets.append(f"{name('outbox')}.{name(record.id)} = {value({'N': str(ids.to_micros(ids.utcnow()))})}")
    if tx.ack is not None and tx.ack.start:  # the run's start is done (celery_workflow._aws.starts)
        removes.append(name("start"))
    # a wake-up is queued only while none is: the append that queues one marks the run, one that leaves its own
    # out holds only while the mark is the one it read (the claim that clears it comes before the log is read)
    # (a delivery that held the run's wake-ups ends the hold with its ack, on the condition that it still holds)
    wake = next((r for r in records if is_wake(r, run.run_id)), None)

    def still() -> str:  # the mark is still the one read
        return f"{name('pending_wake')} = {value({'S': str(tx.pending_wake)})}"

    if wake is not None:
        sets.append(f"{name('pending_wake')} = {value({'S': wake.id})}")
        free = still() if tx.holding else f"attribute_not_exists({name('pending_wake')})"
        condition = f"({condition}) AND {free}"
    elif tx.dropped_wake:
        condition = f"({condition}) AND {still()}"
    elif tx.holding:
        removes.append(name("pending_wake"))
        condition = f"({condition}) AND {still()}"
    if tx.guess and plan.run_ended:  # planned on a kept snapshot that has no scheduled record: it still has none
        condition = f"({condition}) AND attribute_not_exists({name('schedules')})"
    if tx.ttl_only:  # the earlier items it gives its time to live are all the run has: no stream was written since
        condition = f"({condition}) AND attribute_not_exists({name(STREAMS)})"
    adds, deletes = schedule_clauses(world, tx, plan, records, sets=sets, removes=removes, name=name, value=value)
    if not sets and not removes and not adds and not deletes:
        sets.append(f"{name('run_id')} = {value({'S': run.run_id})}")
    expression = ("SET " + ", ".join(sets) if sets else "") + (" REMOVE " + ", ".join(removes) if removes else "")
    expression += (" ADD " + ", ".join(adds) if adds else "") + (" DELETE " + ", ".join(deletes) if deletes else "")
    update: dict[str, Any] = {
        "TableName": table,
        "Key": {"pk": {"S": run_pk(run.run_id)}, "sk": {"S": META}},
        "UpdateExpression": expression.strip(),
        "ConditionExpression": condition,
        "ExpressionAttributeNames": names,
        "ExpressionAttributeValues": values,
        "ReturnValuesOnConditionCheckFailure": "ALL_OLD",  # a refused plan learns the run's state for free
    }
    return {"Update": update}


def schedule_clauses(
    world: AWSWorld,
    tx: AppendTx,
    plan: rules.Plan,
    records: list[Record],
    *,
    sets: list[str],
    removes: list[str],
    name: Callable[[str], str],
    value: Callable[[dict[str, Any]], str],
) -> tuple[list[str], list[str]]:
    """Keep the run's ``schedules`` (the ids of its records sent through the Scheduler) in the META update:
    the new ones added, the acked one taken out, all of them gone at the run's end (whose commit deletes their
    schedules and records: ``AWSAppend.write``). Adds to ``sets`` / ``removes``; returns the ADD and DELETE clauses.

    ADD and DELETE leave what other writers did meanwhile; an append that adds some and takes one out (a timer's
    delivery that sleeps again) cannot do both to one attribute, so it sets the whole set as ``load`` read it,
    conditioned on the event count (without events, it only adds: the acked id stays, and costs a lookup at the
    run's end)."""
    now = ids.utcnow()
    new = {r.id for r in records if r.kind == "delivery" and scheduled(r, world.queue_config(r.queue), now)}
    tx.scheduled = new
    acked = {tx.ack.id} & tx.schedules if tx.ack is not None else set()
    if plan.run_ended:
        if tx.schedules:
            removes.append(name("schedules"))
        return [], []
    if new and acked and plan.events:
        kept = (tx.schedules - acked) | new
        sets.append(f"{name('schedules')} = {value({'SS': sorted(kept)})}")
        return [], []
    if new:
        return [f"{name('schedules')} {value({'SS': sorted(new)})}"], []
    if acked:
        return [], [f"{name('schedules')} {value({'SS': sorted(acked)})}"]
    return [], []


def is_wake(record: Record, run_id: str) -> bool:
    """A wake-up of ``run_id`` due now (idempotency key ``wake``): one queued and unclaimed stands for any other. A
    wake-up of another run in the batch (a hand-over's, of the successor) is that run's and is never folded here."""
    return record.idempotency_key == WAKE_KEY and record.run_id == run_id


def live_hooks(tx: AppendTx, plan: rules.Plan) -> dict[str, str]:
    if plan.run_ended:
        return {}
    hooks = {k: v for k, v in tx.hooks.items() if k not in plan.hooks_deleted}
    hooks.update({k: h.token for k, h in plan.hooks_inserted.items()})
    return hooks


def typed(value: Any) -> Any:
    from celery_workflow._aws.items import attr

    return None if value is None else attr(value)
