"""How the AWS World writes a batch (not part of the public API): the append template's steps on DynamoDB.

``load`` plans on what the delivery read of its run when this process kept it (:mod:`celery_workflow._aws.kept`:
no read before the append, only a ``BatchGetItem`` of views it does not hold yet); otherwise, or when that guess
was refused, it reads (one ``TransactGetItems``, or ``META`` first and then the rest) the run's ``META`` item (view,
event count, live hooks, created hook ids, outbox) and the items the batch names: its waits and hooks, the owners of
the tokens it claims, and the ``QUEUE#`` record it acks (plus, when the batch may end the run, every wait of the
run); the views of the steps it names come from the log up to META's event count (one ``Query``: steps have no
items). ``write`` sends ONE ``TransactWriteItems``: the ``META`` update conditioned on the event count ``load`` saw,
the batch's events as ONE item (``EVENT#<first slot>``, :mod:`celery_workflow._aws.log`; several when they exceed
400 KB), each changed hook, token and wait, the run-end cleanup, the new ``QUEUE#`` records (listed in the run's
outbox) and the deletion of the acked record (conditioned on its claim). A failed condition means another writer got
there first: the template's ``StaleSnapshot``, retried here with jittered backoff on fresh reads. The META update and the ack's
delete return the item as it was when refused (``ReturnValuesOnConditionCheckFailure=ALL_OLD``): a refused ack
tells a record acked already from one claimed again, and a refused META tells whether the refused batch was this
request's own lost commit (META names the last append in ``write_id``) without reading its events. After the commit the new
records are published (:mod:`celery_workflow._aws.queue`) and the acked message deleted.

Limits: at most 100 actions and 4 MB per transaction and 400 KB per item, checked before anything is sent
(:class:`~celery_workflow.errors.EventInvalid` / :class:`~celery_workflow.errors.EventTooLarge`). What one append of
the runtime may carry is declared as :data:`APPEND_LIMITS` (the World's ``append_limits``), an upper bound of what
``write`` counts: the runtime splits a larger batch (a fan-out) into appends within it. A run's end deletes every hook,
token and wait the run still has, which no batch names: what does not fit in its transaction beside the batch (tokens
first, then hooks, then waits) is deleted right after the commit (:meth:`AWSAppend.write`), so a run with many waits
or hooks still ends.

Retention: a run's end (of a workflow with a retention) writes the retention's end as the time to live
(``expires_at``) on every item it writes, and, when it was planned on the delivery's read of the log (the kept
snapshot knows every ``EVENT#`` item of the run, :attr:`~celery_workflow._aws.kept.Kept.items`) and no token is
retained, on the run's earlier items too (an ``Update`` each, conditioned on the item existing; the META update on
the run having no stream), with its whole cleanup in the same transaction: DynamoDB deletes the whole run, and no
expiry is queued. When that does not fit (100 actions, 4 MB counting each updated item whole) or the items are not
known, the end queues the seed's expiry (``QUEUE#expire-<runId>``) as before.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from celery_workflow import ids, rules
from celery_workflow._aws.append_actions import append_actions, transaction_size
from celery_workflow._aws.append_meta import AppendTx, is_wake, live_hooks
from celery_workflow._aws.dynamo import Cancelled, ConditionFailed
from celery_workflow._aws.items import (
    CODEC,
    from_item,
    retained_of,
    retentions_of,
    view_of,
)
from celery_workflow._aws.kept import OUTBOX_GRACE_MICROS, Kept, KeptSnapshots, known_items
from celery_workflow._aws.log import created_of, events_of, read_events, step_views
from celery_workflow._aws.queue import Receipt, Record
from celery_workflow._aws.table import (
    MAX_ACTIONS,
    MAX_ITEM_BYTES,
    META,
    event_sk,
    hook_pk,
    queue_pk,
    run_pk,
    token_pk,
    wait_sk,
)
from celery_workflow._backend.children import parent_data
from celery_workflow._backend.template import AppendRequest, Linked, Loaded, StaleSnapshot
from celery_workflow.errors import EventInvalid, WorldUnavailable
from celery_workflow.events import RUN_END_STATUS, EventType
from celery_workflow.world import AppendLimits

if TYPE_CHECKING:
    from celery_workflow._aws.world import AWSWorld

__all__ = ["APPEND_LIMITS", "MAX_TRANSACTION_BYTES", "RUN_END_ROOM", "AWSAppend"]

R = TypeVar("R")

#: Attempts of one append against concurrent writers of the same run (hot keys trade throughput for retries).
MAX_ATTEMPTS = 30
#: An outbox entry older than :data:`OUTBOX_GRACE_MICROS` was left by a writer that stopped: the next append of the
#: run publishes it.
#: DynamoDB's limit on the aggregate size of a transaction's items (4 MB), as this module measures it: every Put's
#: item, every Update's key and values, every Delete's key.
MAX_TRANSACTION_BYTES = 4_000_000
#: The actions a run-ending event is declared to cost: room in its transaction for the deletion of the run's live
#: hooks (and their tokens) and waits, which no batch names; what does not fit is deleted right after the commit.
RUN_END_ROOM = 50
#: What one append may carry, as ``write`` counts it (an upper bound of each): the META update, the ack's delete and
#: a run end's expiry record in every transaction; per event at most one item of the append's events (they share one,
#: several only past 400 KB) and the view, hook or token items it changes (a step event none: steps have no items; a
#: wait event 1, a hook's creation or disposal 2: the hook and its token); per delivery its ``QUEUE#`` record. Bytes:
#: the META item whole, each event's data once in the events' item and again in each view that copies it (a wait's,
#: a hook's and its token's) plus room for its other attributes, an update of an existing wait counted as the whole
#: item it may be; each delivery's payload plus its record's attributes.
APPEND_LIMITS = AppendLimits(
    max_actions=MAX_ACTIONS,
    max_bytes=MAX_TRANSACTION_BYTES,
    reserved_actions=3,
    reserved_bytes=MAX_ITEM_BYTES + 8 * 1024,
    event_actions={
        **{kind.value: 1 for kind in EventType if kind.value.startswith("step_")},
        **{kind.value: 2 for kind in EventType if kind.value.startswith("wait_")},
        **{kind.value: RUN_END_ROOM for kind in RUN_END_STATUS},
        EventType.RUN_STARTED.value: 1,
        EventType.HOOK_RECEIVED.value: 1,
    },
    default_event_actions=3,
    event_copies={
        EventType.HOOK_CREATED.value: 3,
        **{kind.value: 1 for kind in EventType if kind.value.startswith("step_")},
    },
    default_event_copies=2,
    event_overhead={EventType.WAIT_COMPLETED.value: MAX_ITEM_BYTES},
    default_event_overhead=8 * 1024,
    delivery_overhead=2 * 1024,
)


@dataclass(slots=True)
class _Prepared:
    """One run's part of a transaction: its actions, a run end's cleanup, its records and expiry, the ack's index."""

    actions: list[dict[str, Any]]
    cleanup: list[dict[str, Any]]
    records: list[Record]
    expiry: Record | None
    ack_index: int | None


@dataclass(slots=True)
class _Part:
    tx: AppendTx
    request: AppendRequest
    plan: rules.Plan
    prepared: _Prepared


class AWSAppend:
    """The append template's steps for one :class:`~celery_workflow._aws.world.AWSWorld`."""

    def __init__(self, world: AWSWorld) -> None:
        self.world = world
        #: What deliveries read of their runs, to plan their appends on (celery_workflow._aws.kept).
        self.kept = KeptSnapshots()

    def now(self) -> datetime:
        return ids.utcnow()

    def transaction(self, body: Callable[[AppendTx], R], request: AppendRequest) -> R:
        delay = 0.01
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                return body(AppendTx())
            except StaleSnapshot:
                if attempt == MAX_ATTEMPTS:
                    break
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 0.5)
        raise WorldUnavailable(
            f"run {request.run_id}: the append kept conflicting with other writers ({MAX_ATTEMPTS} attempts)"
        )

    # -- reads -------------------------------------------------------------------------------------------------------

    def load(self, tx: AppendTx, request: AppendRequest, *, fresh: bool) -> Loaded:
        world, run_id, keys = self.world, request.run_id, request.keys
        receipt = Receipt.parse(request.ack) if request.ack is not None else None  # malformed: before any read
        world.queue.check(request.deliveries)
        pk = run_pk(run_id)
        kept = self.kept.take(run_id)  # one append at a time plans on it; the write gives back the advanced one
        if kept is not None and not fresh and request.batch and not keys.tokens and not kept.schedules:
            return self._guess(tx, request, kept, receipt)
        wanted: list[dict[str, str]] = []
        wanted += [{"pk": pk, "sk": wait_sk(w)} for w in keys.waits]
        wanted += [{"pk": hook_pk(run_id, h), "sk": META} for h in keys.hooks]
        wanted += [{"pk": token_pk(t), "sk": META} for t in keys.tokens]
        if receipt is not None and not receipt.start:  # a start has no record: META says whether it is done
            wanted.append({"pk": queue_pk(receipt.id), "sk": META})
        if request.ends_run:  # a child run's end wakes its parent: the link its run_created records (an earlier
            wanted.append({"pk": pk, "sk": event_sk(1)})  # version's EVENT#1; this one's is in META, mostly)
        read = world.table.get_snapshot({"pk": pk, "sk": META}, wanted)
        found = {(item["pk"]["S"], item["sk"]["S"]): item for item in read}
        meta = found.get((pk, META))
        if meta is None:
            return Loaded(rules.Snapshot(None))
        stored = from_item(meta)
        run = CODEC.run(stored)
        snapshot = rules.Snapshot(run)
        if kept is not None and kept.snapshot.run is not None and kept.snapshot.run.event_count == run.event_count:
            tx.kept = kept  # still the run's state: advanced after this write
            tx.earlier = known_items(meta, kept.items)  # unless a stream was written since
        tx.hooks = dict(stored.get("hooks") or {})
        tx.retentions = snapshot.retentions = retentions_of(run_id, meta)
        created = set(stored.get("created_hooks") or {})
        snapshot.created_hooks = created & set(keys.hooks)
        outbox = stored.get("outbox") or {}
        tx.schedules = set(stored.get("schedules") or ())
        tx.pending_wake = stored.get("pending_wake")
        tx.stale_outbox = any(int(t) < ids.to_micros(ids.utcnow()) - OUTBOX_GRACE_MICROS for t in outbox.values())
        if keys.steps:  # no step items: the views the log gives (kept, or read up to META's event count)
            views = tx.kept.snapshot.steps if tx.kept is not None else self._step_views(run_id, run.event_count, meta)
            snapshot.steps.update({s: views[s] for s in keys.steps if s in views})
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
        if request.ends_run:  # run_created: in META, or (earlier versions, a large one) slot 1 begins EVENT#1
            inline = created_of(meta)
            first = found.get((pk, event_sk(1)))
            head = [inline] if inline is not None else events_of(first)[:1] if first is not None else []
            snapshot.parent = parent_data(head)
            snapshot.parent_known = True
            tx.waits = [from_item(i)["wait_id"] for i in world.table.partition(pk, "WAIT#", what="Query (waits)")]
        if receipt is not None and receipt.start:
            if "start" in meta:
                tx.ack = receipt  # its META update removes ``start`` (celery_workflow._aws.starts)
            else:
                tx.delete_message = receipt  # done already (a duplicate of the start): only the message is left
        elif receipt is not None:
            record = found.get((queue_pk(receipt.id), META))
            if record is None:
                tx.delete_message = receipt  # acked already (or never recorded): only the message is left
            elif Record.from_item(record).claim == receipt.claim:
                tx.ack = receipt
        if tx.kept is not None:  # what was read joins what was kept
            tx.kept.snapshot.steps.update(snapshot.steps)
            tx.kept.snapshot.waits.update(snapshot.waits)
            tx.kept.snapshot.hooks.update(snapshot.hooks)
        return Loaded(snapshot)

    def _guess(self, tx: AppendTx, request: AppendRequest, kept: Kept, receipt: Receipt | None) -> Loaded:
        """Plan on the kept snapshot: read only the views the batch names that it does not hold (consistently, after
        the META read it was made from), assume the acked claim is still the record's (its delete is conditioned on
        it), and let the write's conditions refuse a stale guess (see celery_workflow._aws.kept)."""
        run_id = request.run_id
        waits, hooks = kept.missing(request.keys)
        keys = [{"pk": run_pk(run_id), "sk": wait_sk(w)} for w in waits]
        keys += [{"pk": hook_pk(run_id, h), "sk": META} for h in hooks]
        snapshot = kept.snapshot
        for item in self.world.table.get_many(keys) if keys else ():
            if item["sk"]["S"].startswith("WAIT#"):
                view = view_of("waits", item)
                snapshot.waits[view.wait_id] = view
            else:
                view = view_of("hooks", item)
                snapshot.hooks[view.hook_id] = view
        tx.kept, tx.guess = kept, True
        tx.earlier = kept.items  # the META update is conditioned on the run still having no stream
        tx.hooks = dict(kept.hooks)
        tx.retentions = dict(snapshot.retentions)
        tx.schedules = set(kept.schedules)
        tx.pending_wake = kept.pending_wake
        if request.ends_run:
            tx.waits = sorted(kept.waits | set(snapshot.waits))
        tx.ack = receipt
        return Loaded(snapshot, guess=True)

    def _step_views(self, run_id: str, count: int, meta: dict[str, Any]) -> dict[str, Any]:
        """Every step's view, from the run's log up to event ``count`` (``meta``'s, read before: the log's events up
        to it are the ones it counts)."""
        return step_views(read_events(self.world.table, run_id, limit=count, meta=meta))

    def _keep(self, tx: AppendTx, request: AppendRequest, plan: rules.Plan, records: list[Record]) -> None:
        """Give back the kept snapshot, advanced by the written plan."""
        if tx.kept is None or plan.run_ended:
            return
        acked = {tx.ack.id} if tx.ack is not None else set()
        schedules = frozenset((tx.schedules - acked) | tx.scheduled)
        wake = next((r.id for r in records if r.marked), None)
        if wake is None:
            wake = None if tx.holding else tx.pending_wake
        self.kept.put(tx.kept.advanced(plan, live_hooks(tx, plan), schedules, wake, tx.written))

    # -- the write ---------------------------------------------------------------------------------------------------

    def write(self, tx: AppendTx, request: AppendRequest, plan: rules.Plan) -> None:
        self._send([_Part(tx, request, plan, self._prepare(tx, request, plan))], lambda: self.write(tx, request, plan))

    def load_linked(self, tx: AppendTx, request: AppendRequest) -> rules.Snapshot:
        """The parent's META read fresh (its write is conditioned on the event count read here)."""
        tx.linked = AppendTx()
        return self.load(tx.linked, request, fresh=True).snapshot

    def write_linked(self, tx: AppendTx, request: AppendRequest, plan: rules.Plan, linked: Linked | None) -> None:
        """The child's end and the parent's ``child_ended``, META update and wake-up record: ONE transaction."""
        if linked is None or tx.linked is None:
            self.write(tx, request, plan)
            return
        ptx = tx.linked
        parts = [
            _Part(tx, request, plan, self._prepare(tx, request, plan)),
            _Part(ptx, linked.request, linked.plan, self._prepare(ptx, linked.request, linked.plan)),
        ]
        self._send(parts, lambda: self.write_linked(tx, request, plan, linked))

    def _prepare(self, tx: AppendTx, request: AppendRequest, plan: rules.Plan, *, ttl_only: bool = True) -> _Prepared:
        """One run's part of a transaction: its records, actions, run-end cleanup and ack. A run's end gives every
        item of the run its time to live in this transaction and queues no expiry when it may (``ttl_only``, and see
        :meth:`_ttl_only`); else it writes its time to live on what it writes and queues the expiry (the seed's)."""
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
        # the run's end writes its time to live on the items it writes: DynamoDB deletes them for free once the
        # retention is over; a run that retains tokens is left to its expiry's explicit deletes (they need its META)
        tx.ttl = math.ceil(expiry.due.timestamp()) if expiry is not None and not plan.tokens_retained else None
        # and on the items written before, when it knows them all: then no expiry is queued (DynamoDB deletes all)
        tx.ttl_only = ttl_only and tx.ttl is not None and tx.earlier is not None
        if tx.ttl_only:
            expiry = None
        tx.written = {}
        actions, cleanup = append_actions(self.world, tx, request, plan, [*records, *([expiry] if expiry else [])])
        ack_index = None
        if tx.ack is not None and not tx.ack.start:  # a start's ack is its META update's (append_meta)
            ack_index = len(actions)
            actions.append(
                {
                    "Delete": {
                        "TableName": world.table.name,
                        "Key": {"pk": {"S": queue_pk(tx.ack.id)}, "sk": {"S": META}},
                        "ConditionExpression": "claim = :claim",
                        "ExpressionAttributeValues": {":claim": {"N": str(tx.ack.claim)}},
                        "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
                    }
                }
            )
        return _Prepared(actions, cleanup, records, expiry, ack_index)

    def _send(self, parts: list[_Part], again: Callable[[], None]) -> None:
        """Send the parts' actions as one transaction (the first part's run-end cleanup in the room left), then do
        each part's after-commit work; ``again``: the write once more, without an ack that went stale. A run's end
        that gives its earlier items its time to live needs its whole cleanup and those updates in the transaction
        (DynamoDB's 100 actions and 4 MB, counting each updated item whole): when they do not fit, the part is
        prepared again the seed's way (its expiry queued)."""
        world = self.world
        for i, part in enumerate(parts):
            if part.tx.ttl_only and not _fits(parts):
                parts[i] = _Part(part.tx, part.request, part.plan,
                                 self._prepare(part.tx, part.request, part.plan, ttl_only=False))  # fmt: skip
        first = parts[0]
        tx, request, plan, prepared = first.tx, first.request, first.plan, first.prepared
        actions = [a for part in parts for a in part.prepared.actions]
        if len(actions) > MAX_ACTIONS:
            raise EventInvalid(
                f"this append of run {request.run_id} needs {len(actions)} DynamoDB actions; one transaction takes"
                f" at most {MAX_ACTIONS} (fewer events or deliveries per batch: see the World's append_limits)"
            )
        room = MAX_ACTIONS - len(actions)
        actions += prepared.cleanup[:room]
        size = transaction_size(actions)
        if size > MAX_TRANSACTION_BYTES:
            raise EventInvalid(
                f"this append of run {request.run_id} holds {size} bytes; one DynamoDB transaction takes at most"
                f" {MAX_TRANSACTION_BYTES} (fewer or smaller events per batch: see the World's append_limits)"
            )
        ack_index = prepared.ack_index
        try:
            world.table.transact("TransactWriteItems (append)", actions)
        except Cancelled as exc:
            if ack_index is not None and exc.conditions_failed == [ack_index]:
                # claimed again since (the receipt is stale), or acked already (only the message is left): the
                # append goes on without the ack; the record as it was came with the refusal (ALL_OLD)
                if exc.items[ack_index] is None:
                    tx.delete_message = tx.ack
                tx.ack = None
                again()
                return
            if not self._committed(request, plan, exc.items[0] if 0 in exc.conditions_failed else None):
                for part in parts[1:]:  # the parent's kept snapshot, if it took one, is not the run's state now
                    part.tx.kept = None
                raise StaleSnapshot() from None
        for part in parts:
            self._keep(part.tx, part.request, part.plan, part.prepared.records)
        self._clean_up(prepared.cleanup[room:])
        for part in parts:
            ptx, preq, pplan, prep = part.tx, part.request, part.plan, part.prepared
            if pplan.run_ended and ptx.schedules:  # no timer of a finished run fires later
                world.schedules.cancel(preq.run_id, sorted(ptx.schedules - {ptx.ack.id if ptx.ack else ""}))
            published = [*prep.records, *([prep.expiry] if prep.expiry else [])]
            if published:
                world.queue.publish(preq.run_id, published)
            for done in (ptx.ack, ptx.delete_message):
                if done is not None:
                    if not done.esm:  # an event source mapping's message: the mapping deletes it once reported done
                        world.queue.delete_message(done.queue, done.handle)
                    world.queue.settled(done)
            if ptx.stale_outbox:
                world.queue.republish(preq.run_id)

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

    def _committed(self, request: AppendRequest, plan: rules.Plan, meta: dict[str, Any] | None) -> bool:
        """Whether this very request committed already: a retry of a transaction whose answer was lost finds its
        own first event (tagged with the request's ``write_id``) and must not apply the batch twice. ``meta``: the
        run's META as the refused condition found it (ALL_OLD), when that was the refusal: a run whose event count
        is below the batch's last slot cannot hold the batch; one whose count is that slot was last written by the
        append that holds it (``write_id``, which names that append): neither needs a read to say so."""
        if not plan.events:
            return False
        if meta is not None:
            count = int(meta.get("event_count", {}).get("N", "0"))
            last = plan.events[-1].slot
            if count < last:
                return False
            if count == last:
                return bool(meta.get("write_id", {}).get("S") == request.write_id)
        first = self.world.table.get({"pk": run_pk(request.run_id), "sk": event_sk(plan.events[0].slot)})
        return first is not None and from_item(first).get("write_id") == request.write_id


def _fits(parts: list[_Part]) -> bool:
    """Whether the parts' actions and the first part's whole run-end cleanup fit in one transaction, each item a
    run's end gives its time to live counted whole (an update's item is the transaction's as much as a put's)."""
    actions = [a for part in parts for a in part.prepared.actions] + parts[0].prepared.cleanup
    if any(part.prepared.cleanup for part in parts[1:]):
        return False  # pragma: no cover - only the first part of a linked write ends a run
    earlier = sum(sum((p.tx.earlier or {}).values()) for p in parts if p.tx.ttl_only)
    return len(actions) <= MAX_ACTIONS and transaction_size(actions) + earlier <= MAX_TRANSACTION_BYTES
