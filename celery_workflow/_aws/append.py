"""How the AWS World writes a batch (not part of the public API): the append template's steps on DynamoDB.

``load`` reads (one ``TransactGetItems``, or ``META`` first and then the rest) the run's ``META`` item (view, event count, live hooks, created
hook ids, outbox) and the items the batch names: its steps, waits and hooks, the owners of the tokens it claims, and
the ``QUEUE#`` record it acks (plus, when the batch may end the run, every wait of the run). ``write`` sends ONE
``TransactWriteItems``: the ``META`` update conditioned on the event count ``load`` saw, each event, each changed
step, hook, token and wait, the run-end cleanup, the new ``QUEUE#`` records (listed in the run's outbox) and the
deletion of the acked record (conditioned on its claim). A failed condition means another writer got there first:
the template's ``StaleSnapshot``, retried here with jittered backoff on fresh reads. After the commit the new
records are published (:mod:`celery_workflow._aws.queue`) and the acked message deleted.

Limits: at most 100 actions and 4 MB per transaction and 400 KB per item, checked before anything is sent
(:class:`~celery_workflow.errors.EventInvalid` / :class:`~celery_workflow.errors.EventTooLarge`). What one append of
the runtime may carry is declared as :data:`APPEND_LIMITS` (the World's ``append_limits``), an upper bound of what
``write`` counts: the runtime splits a larger batch (a fan-out) into appends within it. A run's end deletes every hook,
token and wait the run still has, which no batch names: what does not fit in its transaction beside the batch (tokens
first, then hooks, then waits) is deleted right after the commit (:meth:`AWSAppend.write`), so a run with many waits
or hooks still ends.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from celery_workflow import ids, rules
from celery_workflow._aws.dynamo import Cancelled, ConditionFailed
from celery_workflow._aws.items import (
    CODEC,
    RETENTION_PREFIX,
    event_item,
    from_item,
    hook_item,
    item_size,
    retained_item,
    retained_of,
    retentions_of,
    run_item,
    token_item,
    value_size,
    view_item,
    view_of,
)
from celery_workflow._aws.queue import WAKE_KEY, Receipt, Record, scheduled
from celery_workflow._aws.table import (
    MAX_ACTIONS,
    MAX_ITEM_BYTES,
    META,
    event_sk,
    hook_pk,
    queue_pk,
    run_pk,
    step_sk,
    token_pk,
    wait_sk,
)
from celery_workflow._backend.records import MUTABLE, created_slots
from celery_workflow._backend.template import AppendRequest, Loaded, StaleSnapshot
from celery_workflow.errors import EventInvalid, EventTooLarge, WorldUnavailable
from celery_workflow.events import RUN_END_STATUS, EventType
from celery_workflow.world import AppendLimits

if TYPE_CHECKING:
    from celery_workflow._aws.world import AWSWorld

__all__ = ["APPEND_LIMITS", "MAX_TRANSACTION_BYTES", "RUN_END_ROOM", "AWSAppend", "update_action"]

R = TypeVar("R")

#: Attempts of one append against concurrent writers of the same run (hot keys trade throughput for retries).
MAX_ATTEMPTS = 30
#: An outbox entry older than this was left by a writer that stopped: the next append of the run publishes it.
OUTBOX_GRACE_MICROS = 60_000_000
#: DynamoDB's limit on the aggregate size of a transaction's items (4 MB), as this module measures it: every Put's
#: item, every Update's key and values, every Delete's key.
MAX_TRANSACTION_BYTES = 4_000_000
#: The actions a run-ending event is declared to cost: room in its transaction for the deletion of the run's live
#: hooks (and their tokens) and waits, which no batch names; what does not fit is deleted right after the commit.
RUN_END_ROOM = 50
#: What one append may carry, as ``write`` counts it (an upper bound of each): the META update, the ack's delete and
#: a run end's expiry record in every transaction; per event its item and the view, hook or token items it changes
#: (a step or wait event 2, a hook's creation or disposal 3: the hook and its token); per delivery its ``QUEUE#``
#: record. Bytes: the META item whole, each event's data twice (its item and the view that copies it; three times for
#: a hook: the hook and its token) plus room for the items' other attributes, an update of an existing view counted
#: as the whole item it may be; each delivery's payload plus its record's attributes.
APPEND_LIMITS = AppendLimits(
    max_actions=MAX_ACTIONS,
    max_bytes=MAX_TRANSACTION_BYTES,
    reserved_actions=3,
    reserved_bytes=MAX_ITEM_BYTES + 8 * 1024,
    event_actions={
        **{kind.value: 2 for kind in EventType if kind.value.startswith(("step_", "wait_"))},
        **{kind.value: RUN_END_ROOM for kind in RUN_END_STATUS},
        EventType.RUN_STARTED.value: 1,
        EventType.HOOK_RECEIVED.value: 1,
    },
    default_event_actions=3,
    event_copies={EventType.HOOK_CREATED.value: 3},
    default_event_copies=2,
    event_overhead={
        kind.value: MAX_ITEM_BYTES
        for kind in (
            EventType.STEP_STARTED,
            EventType.STEP_COMPLETED,
            EventType.STEP_FAILED,
            EventType.STEP_RETRYING,
            EventType.WAIT_COMPLETED,
        )
    },
    default_event_overhead=8 * 1024,
    delivery_overhead=2 * 1024,
)


@dataclass(slots=True)
class _Tx:
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


def update_action(table: str, key: dict[str, str], values: dict[str, Any], condition: str) -> dict[str, Any]:
    """A transaction ``Update`` that sets ``values`` (a None value removes the attribute) under ``condition``."""
    names: dict[str, str] = {}
    attrs: dict[str, Any] = {}
    sets, removes = [], []
    for i, (name, value) in enumerate(values.items()):
        names[f"#a{i}"] = name
        if value is None:
            removes.append(f"#a{i}")
        else:
            attrs[f":a{i}"] = value
            sets.append(f"#a{i} = :a{i}")
    expression = ("SET " + ", ".join(sets) if sets else "") + (" REMOVE " + ", ".join(removes) if removes else "")
    update: dict[str, Any] = {
        "TableName": table,
        "Key": {k: {"S": v} for k, v in key.items()},
        "UpdateExpression": expression.strip(),
        "ConditionExpression": condition,
        "ExpressionAttributeNames": names,
    }
    if attrs:
        update["ExpressionAttributeValues"] = attrs
    return {"Update": update}


class AWSAppend:
    """The append template's steps for one :class:`~celery_workflow._aws.world.AWSWorld`."""

    def __init__(self, world: AWSWorld) -> None:
        self.world = world

    def now(self) -> datetime:
        return ids.utcnow()

    def transaction(self, body: Callable[[_Tx], R], request: AppendRequest) -> R:
        delay = 0.01
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                return body(_Tx())
            except StaleSnapshot:
                if attempt == MAX_ATTEMPTS:
                    break
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 0.5)
        raise WorldUnavailable(
            f"run {request.run_id}: the append kept conflicting with other writers ({MAX_ATTEMPTS} attempts)"
        )

    # -- reads -------------------------------------------------------------------------------------------------------

    def load(self, tx: _Tx, request: AppendRequest, *, fresh: bool) -> Loaded:
        world, run_id, keys = self.world, request.run_id, request.keys
        receipt = Receipt.parse(request.ack) if request.ack is not None else None  # malformed: before any read
        world.queue.check(request.deliveries)
        pk = run_pk(run_id)
        wanted: list[dict[str, str]] = []
        wanted += [{"pk": pk, "sk": step_sk(s)} for s in keys.steps]
        wanted += [{"pk": pk, "sk": wait_sk(w)} for w in keys.waits]
        wanted += [{"pk": hook_pk(run_id, h), "sk": META} for h in keys.hooks]
        wanted += [{"pk": token_pk(t), "sk": META} for t in keys.tokens]
        if receipt is not None:
            wanted.append({"pk": queue_pk(receipt.id), "sk": META})
        read = world.table.get_snapshot({"pk": pk, "sk": META}, wanted)
        found = {(item["pk"]["S"], item["sk"]["S"]): item for item in read}
        meta = found.get((pk, META))
        if meta is None:
            return Loaded(rules.Snapshot(None))
        stored = from_item(meta)
        snapshot = rules.Snapshot(CODEC.run(stored))
        tx.hooks = dict(stored.get("hooks") or {})
        tx.retentions = snapshot.retentions = retentions_of(run_id, meta)
        created = set(stored.get("created_hooks") or {})
        snapshot.created_hooks = created & set(keys.hooks)
        outbox = stored.get("outbox") or {}
        tx.schedules = set(stored.get("schedules") or ())
        tx.pending_wake = stored.get("pending_wake")
        tx.stale_outbox = any(int(t) < ids.to_micros(ids.utcnow()) - OUTBOX_GRACE_MICROS for t in outbox.values())
        for s in keys.steps:
            if (item := found.get((pk, step_sk(s)))) is not None:
                snapshot.steps[s] = view_of("steps", item)
        for w in keys.waits:
            if (item := found.get((pk, wait_sk(w)))) is not None:
                snapshot.waits[w] = view_of("waits", item)
        for h in keys.hooks:
            if (item := found.get((hook_pk(run_id, h), META))) is not None and h in tx.hooks:
                snapshot.hooks[h] = view_of("hooks", item)
        for t in keys.tokens:
            if (item := found.get((token_pk(t), META))) is not None:
                if (held := retained_of(item)) is not None:
                    tx.retained[t] = snapshot.retained[t] = held
                else:
                    snapshot.token_owners[t] = view_of("hooks", item)
        if request.ends_run:
            tx.waits = [from_item(i)["wait_id"] for i in world.table.partition(pk, "WAIT#", what="Query (waits)")]
        if receipt is not None:
            record = found.get((queue_pk(receipt.id), META))
            if record is None:
                tx.delete_message = receipt  # acked already (or never recorded): only the message is left
            elif Record.from_item(record).claim == receipt.claim:
                tx.ack = receipt
        return Loaded(snapshot)

    # -- the write ---------------------------------------------------------------------------------------------------

    def write(self, tx: _Tx, request: AppendRequest, plan: rules.Plan) -> None:
        world = self.world
        now = ids.utcnow()
        records = [Record.of(d, now) for d in request.deliveries]
        # the acked delivery held the run's wake-ups (a split write, World.hold_wakes): this commit ends the hold
        tx.holding = tx.ack is not None and tx.pending_wake == tx.ack.id
        if tx.pending_wake is not None and not tx.holding:  # a wake-up queued that no worker took yet reads this too
            kept = [r for r in records if not is_wake(r, request.run_id)]
            tx.dropped_wake, records = len(kept) < len(records), kept
        else:
            records = [replace(r, marked=True) if is_wake(r, request.run_id) else r for r in records]
        expiry = world.expiry_record(plan) if plan.run_ended else None
        actions, cleanup = self._actions(tx, request, plan, [*records, *([expiry] if expiry else [])])
        ack_index = None
        if tx.ack is not None:
            ack_index = len(actions)
            actions.append(
                {
                    "Delete": {
                        "TableName": world.table.name,
                        "Key": {"pk": {"S": queue_pk(tx.ack.id)}, "sk": {"S": META}},
                        "ConditionExpression": "claim = :claim",
                        "ExpressionAttributeValues": {":claim": {"N": str(tx.ack.claim)}},
                    }
                }
            )
        if len(actions) > MAX_ACTIONS:
            raise EventInvalid(
                f"this append of run {request.run_id} needs {len(actions)} DynamoDB actions; one transaction takes"
                f" at most {MAX_ACTIONS} (fewer events or deliveries per batch: see the World's append_limits)"
            )
        room = MAX_ACTIONS - len(actions)
        actions += cleanup[:room]
        size = transaction_size(actions)
        if size > MAX_TRANSACTION_BYTES:
            raise EventInvalid(
                f"this append of run {request.run_id} holds {size} bytes; one DynamoDB transaction takes at most"
                f" {MAX_TRANSACTION_BYTES} (fewer or smaller events per batch: see the World's append_limits)"
            )
        try:
            world.table.transact("TransactWriteItems (append)", actions)
        except Cancelled as exc:
            if ack_index is not None and exc.conditions_failed == [ack_index]:
                tx.ack = None  # claimed again since load: the receipt is stale, the append goes on without the ack
                self.write(tx, request, plan)
                return
            if not self._committed(request, plan):
                raise StaleSnapshot() from None
        self._clean_up(cleanup[room:])
        if plan.run_ended and tx.schedules:  # no timer of a finished run fires later
            world.schedules.cancel(request.run_id, sorted(tx.schedules - {tx.ack.id if tx.ack else ""}))
        published = [*records, *([expiry] if expiry else [])]
        if published:
            world.queue.publish(request.run_id, published)
        for done in (tx.ack, tx.delete_message):
            if done is not None:
                if not done.esm:  # an event source mapping's message: the mapping deletes it once reported done
                    world.queue.delete_message(done.queue, done.handle)
                world.queue.settled(done)
        if tx.stale_outbox:
            world.queue.republish(request.run_id)

    def _clean_up(self, deletes: list[dict[str, Any]]) -> None:
        """The deletes of a run's end that did not fit in its transaction (the run has ended: nothing reads these
        items as the run's any more; a token is deleted only while it is still this run's hook's). A crash before
        they are done leaves them until the run expires (DESIGN: a run's end deletes its hooks and waits)."""
        table = self.world.table
        for d in deletes:
            if "Put" in d:  # a token the ended run retains (see rules)
                try:
                    table.call("PutItem (retained token)", table.client.put_item, **d["Put"])
                except ConditionFailed:
                    pass  # another run's hook owns the token now
        plain = [d["Delete"]["Key"] for d in deletes if "Delete" in d and "ConditionExpression" not in d["Delete"]]
        if plain:
            table.delete_each(plain)
        for d in deletes:
            action = d.get("Delete")
            if action is None or "ConditionExpression" not in action:
                continue
            key = {k: v["S"] for k, v in action["Key"].items()}
            try:
                table.delete(
                    key,
                    ConditionExpression=action["ConditionExpression"],
                    ExpressionAttributeValues=action["ExpressionAttributeValues"],
                )
            except ConditionFailed:
                pass  # another run's hook owns the token now

    def _committed(self, request: AppendRequest, plan: rules.Plan) -> bool:
        """Whether this very request committed already: a retry of a transaction whose answer was lost finds its
        own first event (tagged with the request's ``write_id``) and must not apply the batch twice."""
        if not plan.events:
            return False
        first = self.world.table.get({"pk": run_pk(request.run_id), "sk": event_sk(plan.events[0].slot)})
        return first is not None and from_item(first).get("write_id") == request.write_id

    def _actions(
        self, tx: _Tx, request: AppendRequest, plan: rules.Plan, records: list[Record]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The transaction's actions, and a run end's deletes of the hooks, tokens and waits the run still has
        (tokens first, then hooks, then waits: as many go in the transaction as fit, the rest right after it)."""
        table = self.world.table.name
        run = plan.run
        pk = run_pk(run.run_id)
        actions: list[dict[str, Any]] = []
        cleanup: list[dict[str, Any]] = []

        def put(item: dict[str, Any], condition: str | None = None, values: dict[str, Any] | None = None) -> None:
            size = item_size(item)
            if size > MAX_ITEM_BYTES:
                raise EventTooLarge(
                    f"an item of {size} bytes exceeds DynamoDB's {MAX_ITEM_BYTES} bytes ({item['sk']['S']} of {item['pk']['S']})"
                )
            action: dict[str, Any] = {"TableName": table, "Item": item}
            if condition:
                action["ConditionExpression"] = condition
            if values:
                action["ExpressionAttributeValues"] = values
            actions.append({"Put": action})

        def delete(
            key: dict[str, str],
            condition: str | None = None,
            values: dict[str, Any] | None = None,
            *,
            to: list[dict[str, Any]] = actions,
        ) -> None:
            action: dict[str, Any] = {"TableName": table, "Key": {k: {"S": v} for k, v in key.items()}}
            if condition:
                action["ConditionExpression"] = condition
            if values:
                action["ExpressionAttributeValues"] = values
            to.append({"Delete": action})

        actions.append(self._meta_update(tx, plan, records))
        if not plan.events:
            for record in records:
                put(record.item())
            return actions, cleanup
        for e in plan.events:
            put(event_item(e, request.write_id), "attribute_not_exists(pk)")
        created = created_slots(plan.events)
        for table_name, items, kind in (
            ("steps", plan.steps, EventType.STEP_CREATED),
            ("waits", plan.waits, EventType.WAIT_CREATED),
        ):
            for item_id, view in items.items():
                slot = created.get((kind, item_id))
                if slot is not None:
                    put(view_item(table_name, view, slot), "attribute_not_exists(pk)")
                    continue
                values = CODEC.record(table_name, view, created_slot=None)
                sk = step_sk(item_id) if table_name == "steps" else wait_sk(item_id)
                changed = {c: _typed(values[c]) for c in MUTABLE[table_name]}
                actions.append(update_action(table, {"pk": pk, "sk": sk}, changed, "attribute_exists(pk)"))
        released = {hook.token: hook_id for hook_id, hook in plan.hooks_deleted.items()}  # token -> its hook here
        deleted = set(plan.hooks_deleted)
        if plan.run_ended:  # every live hook of the run goes, not only those the batch named
            released.update({token: hook_id for hook_id, token in tx.hooks.items()})
            deleted.update(tx.hooks)
        moved: set[str] = set()
        for hook_id, hook in plan.hooks_inserted.items():
            slot = created[(EventType.HOOK_CREATED, hook_id)]
            put(hook_item(hook, slot), "attribute_not_exists(pk)")
            previous = released.get(hook.token)
            held = tx.retained.get(hook.token) if hook.token in plan.tokens_reclaimed else None
            if held is not None:  # an ended run's retention is over: replace its holding, as it was read
                put(
                    token_item(hook, slot),
                    "run_id = :r AND hook_id = :h AND retained_until = :u",
                    {":r": {"S": held.run_id}, ":h": {"S": held.hook_id}, ":u": {"N": str(ids.to_micros(held.until))}},
                )
            elif previous is None:
                put(token_item(hook, slot), "attribute_not_exists(pk)")
            else:  # a token released and claimed again in one batch: one write of its item
                moved.add(hook.token)
                put(
                    token_item(hook, slot),
                    "run_id = :r AND hook_id = :h",
                    {":r": {"S": run.run_id}, ":h": {"S": previous}},
                )
        # a run's end: its hooks, tokens and waits, however many, go to the cleanup (see write); the tokens the rules
        # retain become the ended run's holdings instead (a hook of this very batch has no token item yet)
        gone = cleanup if plan.run_ended else actions
        for kept in plan.tokens_retained.values():
            action: dict[str, Any] = {
                "TableName": table,
                "Item": retained_item(kept),
                "ConditionExpression": "attribute_not_exists(pk) OR (run_id = :r AND hook_id = :h)",
                "ExpressionAttributeValues": {":r": {"S": run.run_id}, ":h": {"S": kept.hook_id}},
            }
            cleanup.append({"Put": action})
        for token, hook_id in released.items():
            if token not in moved and token not in plan.tokens_retained:
                delete(
                    {"pk": token_pk(token), "sk": META},
                    "attribute_not_exists(pk) OR (run_id = :r AND hook_id = :h)",
                    {":r": {"S": run.run_id}, ":h": {"S": hook_id}},
                    to=gone,
                )
        for hook_id in sorted(deleted):
            delete({"pk": hook_pk(run.run_id, hook_id), "sk": META}, to=gone)
        if plan.run_ended:
            for wait_id in tx.waits:
                if wait_id not in plan.waits:
                    delete({"pk": pk, "sk": wait_sk(wait_id)}, to=gone)
        for record in records:
            put(record.item())
        return actions, cleanup

    def _meta_update(self, tx: _Tx, plan: rules.Plan, records: list[Record]) -> dict[str, Any]:
        """The META update: the run view, live hooks, created hook ids and the outbox, conditioned on the event count
        the plan started from (no event: only that the run still exists)."""
        run = plan.run
        table = self.world.table.name
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
            size = item_size(run_item(run, hooks=_live_hooks(tx, plan), record=fields))
            if size > MAX_ITEM_BYTES:
                raise EventTooLarge(
                    f"run {run.run_id}'s view would be {size} bytes; DynamoDB stores at most {MAX_ITEM_BYTES}"
                )
            for column in MUTABLE["runs"]:
                if fields[column] is None:
                    removes.append(name(column))
                else:
                    sets.append(f"{name(column)} = {value(_typed(fields[column]))}")
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
            condition = f"{name('event_count')} = {value({'N': str(plan.events[0].slot - 1)})}"
        for record in records:
            sets.append(f"{name('outbox')}.{name(record.id)} = {value({'N': str(ids.to_micros(ids.utcnow()))})}")
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
        adds, deletes = self._schedules(tx, plan, records, sets=sets, removes=removes, name=name, value=value)
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
        }
        return {"Update": update}

    def _schedules(
        self,
        tx: _Tx,
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
        schedules and records: :meth:`write`). Adds to ``sets`` / ``removes``; returns the ADD and DELETE clauses.

        ADD and DELETE leave what other writers did meanwhile; an append that adds some and takes one out (a timer's
        delivery that sleeps again) cannot do both to one attribute, so it sets the whole set as ``load`` read it,
        conditioned on the event count (without events, it only adds: the acked id stays, and costs a lookup at the
        run's end)."""
        now = ids.utcnow()
        new = {r.id for r in records if r.kind == "delivery" and scheduled(r, self.world.queue_config(r.queue), now)}
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


def transaction_size(actions: list[dict[str, Any]]) -> int:
    """The aggregate size of a transaction's items as :data:`MAX_TRANSACTION_BYTES` measures it: every Put's item,
    every Update's key and values, every Delete's key."""
    total = 0
    for action in actions:
        ((kind, body),) = action.items()
        if kind == "Put":
            total += item_size(body["Item"])
        else:
            total += item_size(body["Key"]) + sum(
                value_size(v) for v in body.get("ExpressionAttributeValues", {}).values()
            )
    return total


def _live_hooks(tx: _Tx, plan: rules.Plan) -> dict[str, str]:
    if plan.run_ended:
        return {}
    hooks = {k: v for k, v in tx.hooks.items() if k not in plan.hooks_deleted}
    hooks.update({k: h.token for k, h in plan.hooks_inserted.items()})
    return hooks


def _typed(value: Any) -> Any:
    from celery_workflow._aws.items import attr

    return None if value is None else attr(value)
