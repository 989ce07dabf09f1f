"""Deliveries of the AWS World: ``QUEUE#`` records in DynamoDB, messages on SQS, schedules in EventBridge Scheduler
(not part of the public API; seed "Queue delivery").

A delivery is a ``QUEUE#<id>`` record holding its payload (the Celery message, zlib-compressed as ``payload_z`` when
that is smaller: a Celery message of ~1 KB then fits the one write unit a record's put and delete each cost), queue,
run and due time, written in the same transaction as the append that made it, and a message that points at the
record:

* due within 15 minutes: ``SendMessage`` (``DelaySeconds`` when due later than now), on a standard queue;
* due later, or delayed at all on a FIFO queue (:func:`scheduled`): a one-time schedule ``celery-workflow-<id>`` in
  the Scheduler group that sends the same body to the queue at the due time and is deleted after it runs (a re-send
  gets a name of its own, and a run's end deletes its pending schedules: :mod:`celery_workflow._aws.schedules`);
  without a Scheduler such a delivery is a :class:`~celery_workflow.errors.ConfigurationError`;
* FIFO queues: ``MessageGroupId`` = the run id (one delivery of a run at a time), ``MessageDeduplicationId`` = the
  delivery id; bodies carry a unique ``publish`` field so the content-based deduplication the Scheduler relies on
  never drops a second publication of the same delivery.

A run's start (the delivery ``create_run`` writes due now) has no record: its run's META holds it and its message
carries the payload (:mod:`celery_workflow._aws.starts`). Publishing is not atomic with the append. Each append that creates records also lists them in its run's ``outbox``
(in the same transaction); once published they leave it. A record left in an outbox (the writer died between its
commit and its publication) is published again when a delivery of that run is received again (a redelivery, or a
message whose record is gone) or when the run is started again: nothing waits forever on a message never sent.

Receiving (``accept``): a message whose body is not ours, or whose record is gone, is acknowledged; one that arrives
before its record is due is sent again with the remaining delay; an ``expire`` record runs the run's retention
expiry, or, when the run may not expire yet, stays (due when it may: :meth:`SQSQueue.defer`) and its message is
sent again. Otherwise the record's claim counter is bumped and the delivery is handed out with a receipt
``sqs|<queue>|<id>|<claim>|<receipt handle>``: ack, release, retry and extend act only while that claim is the
record's current one, so a stale receipt changes nothing even though SQS would honour an old receipt handle.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from celery_workflow import ids
from celery_workflow._aws.config import MAX_SQS_DELAY, AWSConfig, QueueConfig
from celery_workflow._aws.dynamo import Cancelled, ConditionFailed, Table
from celery_workflow._aws.items import from_item, to_item
from celery_workflow._aws.receipts import BODY_KEY, Receipt
from celery_workflow._aws.sqs_calls import SQSCalls
from celery_workflow._aws.starts import Start, Starts, start_of
from celery_workflow._aws.table import META, queue_pk, run_pk
from celery_workflow.dead_letters import DeadLetter
from celery_workflow.errors import ConfigurationError, WorldError
from celery_workflow.world import ClaimedDelivery, Delivery

if TYPE_CHECKING:
    from celery_workflow._aws.world import AWSWorld

__all__ = ["Receipt", "Record", "SQSQueue", "body_of", "scheduled"]

log = logging.getLogger("celery_workflow.aws")

#: The idempotency key of a run's wake-up due now: the run's ``META`` names the one queued and unclaimed
#: (``pending_wake``), and appends queue no other meanwhile (:mod:`celery_workflow._aws.append`).
WAKE_KEY = "wake"
#: A message that arrives at most this early is delivered anyway (SQS delays are whole seconds).
EARLY_TOLERANCE = timedelta(seconds=1)


@dataclass(frozen=True, slots=True)
class Record:
    """A ``QUEUE#`` record: one delivery (``kind`` ``delivery``) or a run's expiry (``kind`` ``expire``)."""

    id: str
    queue: str
    payload: bytes
    run_id: str | None
    due: datetime
    kind: str = "delivery"
    claim: int = 0
    idempotency_key: str | None = None
    marked: bool = False  # a wake-up its run's META names as pending (``pending_wake``): its claim clears that

    @classmethod
    def of(cls, delivery: Delivery, now: datetime) -> Record:
        due = ids.to_utc(delivery.not_before) if delivery.not_before is not None else now
        return cls(ids.ulid(), delivery.queue, bytes(delivery.payload), delivery.run_id, due, "delivery", 0,
                   delivery.idempotency_key)  # fmt: skip

    def item(self) -> dict[str, Any]:
        packed = zlib.compress(self.payload, 6)
        smaller = len(packed) < len(self.payload)
        return to_item(
            {
                "pk": queue_pk(self.id),
                "sk": META,
                "id": self.id,
                "queue": self.queue,
                "payload": None if smaller else self.payload,
                "payload_z": packed if smaller else None,
                "run_id": self.run_id,
                "due": ids.to_micros(self.due),
                "kind": self.kind,
                "claim": self.claim,
                "idempotency_key": self.idempotency_key,
                "marked": self.marked or None,
                "created_at": ids.to_micros(ids.utcnow()),
            }
        )

    @classmethod
    def from_item(cls, item: Mapping[str, Any]) -> Record:
        v = from_item(item)
        payload = zlib.decompress(v["payload_z"]) if "payload_z" in v else bytes(v.get("payload", b""))
        return cls(
            str(v["id"]), str(v["queue"]), payload, v.get("run_id"),
            ids.from_micros(int(v["due"])), str(v.get("kind", "delivery")), int(v.get("claim", 0)),
            v.get("idempotency_key"), bool(v.get("marked")),
        )  # fmt: skip

    def body(self) -> str:
        """The message that points at this record (a fresh ``publish`` id each time it is sent)."""
        return json.dumps({BODY_KEY: 1, "id": self.id, "run": self.run_id, "publish": ids.ulid()})


def parse_body(text: str) -> dict[str, Any] | None:
    """One of our message bodies, parsed; None for a body that is not ours."""
    try:
        data = json.loads(text)
    except (TypeError, ValueError):
        return None
    if not isinstance(data, dict) or data.get(BODY_KEY) != 1 or not isinstance(data.get("id"), str):
        return None
    return data


def body_of(text: str) -> tuple[str, str | None] | None:
    """``(record id, run id)`` of one of our message bodies (a start's: its start id), or None for a body that is not
    ours."""
    data = parse_body(text)
    if data is None:
        return None
    run = data.get("run")
    return data["id"], run if isinstance(run, str) else None


class SQSQueue(SQSCalls):
    """The queue facet of an :class:`~celery_workflow._aws.world.AWSWorld`."""

    #: How many receipts settled by an append this process remembers (see :meth:`settled`).
    SETTLED_KEPT = 4096

    def __init__(self, world: AWSWorld, sqs: Any) -> None:
        self.world = world
        self.sqs = sqs
        # claims settled by this process's appends, oldest first; single dict operations need no lock
        self._settled: dict[str, None] = {}
        #: Runs' start deliveries, which have no record (celery_workflow._aws.starts).
        self.starts = Starts(self)

    def settled(self, r: Receipt) -> None:
        """Remember that an append acked this claim (record deleted in its transaction, message deleted after), so
        the transport's or the Lambda handler's ack that follows costs no second delete of either."""
        self._settled[str(r)] = None
        if r.start:
            self.starts.settled(r)
        if len(self._settled) > self.SETTLED_KEPT:
            try:
                self._settled.pop(next(iter(self._settled)), None)
            except (RuntimeError, StopIteration):  # another thread changed it meanwhile: trim next time
                pass

    def _was_settled(self, r: Receipt) -> bool:
        """Whether an append of this process settled the claim (forgotten once asked)."""
        return self._settled.pop(str(r), False) is None

    @property
    def config(self) -> AWSConfig:
        return self.world.config

    @property
    def table(self) -> Table:
        return self.world.table

    # -- publishing --------------------------------------------------------------------------------------------------

    def check(self, deliveries: Iterable[Delivery]) -> None:
        """Refuse, before anything is written, a delivery this config cannot publish: an unknown queue, or a delay
        the queue cannot take without a Scheduler."""
        now = ids.utcnow()
        for d in deliveries:
            self.world.queue_config(d.queue)  # an unknown queue raises
            if self.config.scheduler is None and d.not_before is not None:
                delay = ids.to_utc(d.not_before) - now
                if delay > MAX_SQS_DELAY:
                    raise ConfigurationError(
                        f"a delivery due in {delay} needs the Scheduler (SQS delays stop at 15 minutes); configure"
                        " AWSConfig(scheduler=…)"
                    )

    def publish(self, run_id: str, records: Sequence[Record], start: Start | None = None) -> None:
        """Send the messages of records an append of ``run_id`` wrote (and of the run's start, which ``create_run``
        wrote in META), then take them out of its outbox."""
        now = ids.utcnow()
        for record in records:
            self.send(record, now=now)
        if start is not None:
            self.starts.send(start)
        self.clear_outbox(run_id, [r.id for r in records], start=start is not None)

    def send(self, record: Record, *, now: datetime | None = None) -> None:
        """Put one record's message on its queue now or later (see the module docstring)."""
        queue = self.world.queue_config(record.queue)
        moment = now or ids.utcnow()
        group = record.run_id or record.id
        if scheduled(record, queue, moment):
            self.world.schedules.create(record, queue, group)
            return
        delay = (record.due - moment).total_seconds()
        self.send_body(record.queue, record.body(), delay=delay, group=group, dedup=record.id)

    def republish(self, run_id: str) -> int:
        """Publish again what the run's outbox still holds (its writer died before sending it): the records it
        lists, and a pending run's start (:mod:`celery_workflow._aws.starts`); how many messages."""
        meta = self.table.get({"pk": run_pk(run_id), "sk": META})
        if meta is None:
            return 0
        return self.republish_meta(run_id, meta, starts=meta.get("status", {}).get("S") == "pending")

    def republish_meta(self, run_id: str, meta: Mapping[str, Any], *, starts: bool = False) -> int:
        """:meth:`republish` on the run's META as read (typed). ``starts``: whether an unsent start is sent too (a
        start that ran already only lost its clean-up). What was sent leaves META in one update."""
        outbox = sorted(from_item(meta).get("outbox") or {})
        start = starts and self.starts.resend(meta)
        records: list[Record] = []
        if outbox:
            found = self.table.get_many([{"pk": queue_pk(i), "sk": META} for i in outbox])
            records = [Record.from_item(item) for item in found]
            for record in records:
                self.send(record)
        self.clear_outbox(run_id, outbox, start=start)
        if records:
            log.warning("run %s: published %d delivery(ies) left unsent by a writer that stopped", run_id, len(records))
        return int(start) + len(records)

    def clear_outbox(self, run_id: str, record_ids: Sequence[str], *, start: bool = False) -> None:
        """Take published records out of the run's outbox, and a sent start's payload out of META (best effort: a
        leftover is only published again)."""
        if not record_ids and not start:
            return
        names = {f"#o{i}": rid for i, rid in enumerate(record_ids)}
        paths = [f"outbox.{n}" for n in names] + (["start_queue", "start_z"] if start else [])
        try:
            self.table.update(
                "UpdateItem (outbox)",
                Key={"pk": {"S": run_pk(run_id)}, "sk": {"S": META}},
                UpdateExpression="REMOVE " + ", ".join(paths),
                ConditionExpression="attribute_exists(pk)",
                **({"ExpressionAttributeNames": names} if names else {}),
            )
        except (ConditionFailed, WorldError) as exc:  # the run is gone, or DynamoDB is busy: leftovers are harmless
            log.debug("cannot clear the outbox of run %s: %s", run_id, exc)

    # -- the World's queue methods -----------------------------------------------------------------------------------

    def enqueue(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """Write the records, then send their messages. SQS standard queues do not deduplicate: always True."""
        self.check(deliveries)
        now = ids.utcnow()
        records = [Record.of(d, now) for d in deliveries]
        for start in range(0, len(records), 25):
            self.table.transact("TransactWriteItems (enqueue)", [
                {"Put": {"TableName": self.table.name, "Item": r.item()}} for r in records[start : start + 25]
            ])  # fmt: skip
        for record in records:
            self.send(record, now=now)
        return [True] * len(records)

    def claim(self, queues: Sequence[str], *, limit: int, lease: float) -> list[ClaimedDelivery]:
        """Receive up to ``limit`` messages from the queues in turn and accept them (see :meth:`accept`)."""
        out: list[ClaimedDelivery] = []
        for name in dict.fromkeys(queues):
            while len(out) < limit:
                messages = self.receive(name, limit=limit - len(out), wait=0, lease=lease)
                if not messages:
                    break
                for message in messages:
                    count = int(message.get("Attributes", {}).get("ApproximateReceiveCount", "1"))
                    claimed = self.accept(name, message["ReceiptHandle"], message.get("Body", ""), count)
                    if claimed is not None:
                        out.append(claimed)
        return out

    def accept(
        self, queue: str, handle: str, body: str, receive_count: int, *, esm: bool = False
    ) -> ClaimedDelivery | None:
        """Take one received message: None when it was handled here and acknowledged (not ours, record gone, early,
        an expiry), else the claimed delivery. ``esm``: a Lambda event source mapping's message, which the mapping
        deletes once the handler reports it done (acknowledging it here deletes nothing, and its receipt says so)."""

        def done() -> None:
            if not esm:
                self.delete_message(queue, handle)

        data = parse_body(body)
        if data is None:
            log.warning("acknowledging a message on %r that is not a celery_workflow delivery: %.200r", queue, body)
            done()
            return None
        start = start_of(data)
        if start is not None:  # a run's start: no record (celery_workflow._aws.starts)
            return self.starts.accept(queue, handle, body, start, receive_count, esm=esm)
        record_id, run = data["id"], data.get("run")
        run_id = run if isinstance(run, str) else None
        try:
            item = self.table.update(
                "UpdateItem (claim)",
                Key={"pk": {"S": queue_pk(record_id)}, "sk": {"S": META}},
                UpdateExpression="SET claim = claim + :one",
                ConditionExpression="attribute_exists(pk)",
                ExpressionAttributeValues={":one": {"N": "1"}},
                ReturnValues="ALL_NEW",
            )
        except ConditionFailed:
            if run_id is not None:  # done already; its writer may have died before sending what it queued
                self.republish(run_id)
            done()
            return None
        record = Record.from_item(item)
        if record.kind == "expire":
            deferred = self.world.expire_run(record)
            if deferred is None:
                self.table.delete({"pk": queue_pk(record.id), "sk": META})
            else:
                self.defer(record, deferred)
            done()
            return None
        now = ids.utcnow()
        if record.due - now > EARLY_TOLERANCE:  # arrived early (a long delay in steps of 15 minutes)
            self.send(record, now=now)
            done()
            return None
        if receive_count > 1 and record.run_id is not None:
            self.republish(record.run_id)
        if record.marked:
            self.unmark_wake(record)
        receipt = Receipt(queue, record.id, record.claim, handle, esm)
        return ClaimedDelivery(str(receipt), queue, record.payload, receive_count, record.run_id)

    def unmark_wake(self, record: Record) -> None:
        """The run's wake-up is taken: the next append that wakes the run queues one again. Done before the delivery
        reads the run's log, so whatever an append finds this mark on, that read sees."""
        try:
            self.table.update(
                "UpdateItem (wake taken)",
                Key={"pk": {"S": run_pk(record.run_id or "")}, "sk": {"S": META}},
                UpdateExpression="REMOVE pending_wake",
                ConditionExpression="pending_wake = :id",
                ExpressionAttributeValues={":id": {"S": record.id}},
            )
        except ConditionFailed:
            pass  # another wake-up's mark, or none (the run's first delivery; a redelivery)

    def hold_wakes(self, run_id: str, receipt: str) -> bool:
        """Hold the run's wake-ups for a claimed delivery writing a split batch (``World.hold_wakes``): its record
        becomes the run's ``pending_wake``, so appends leave their wake-ups out, and is ``marked``, so its next claim
        (a redelivery after its writer died) ends the hold as any taken wake-up's does; the append that acks it ends
        the hold in its transaction (:mod:`celery_workflow._aws.append`). One transaction, both conditioned: the run
        has no other wake-up pending, and the claim is still the record's."""
        try:
            r = Receipt.parse(receipt)
        except WorldError:
            return False
        if r.start:
            return self.starts.hold(run_id, r)
        table = self.table.name
        try:
            self.table.transact("TransactWriteItems (hold wake-ups)", [
                {"Update": {
                    "TableName": table, "Key": {"pk": {"S": run_pk(run_id)}, "sk": {"S": META}},
                    "UpdateExpression": "SET pending_wake = :id",
                    "ConditionExpression": "attribute_exists(pk) AND"
                                           " (attribute_not_exists(pending_wake) OR pending_wake = :id)",
                    "ExpressionAttributeValues": {":id": {"S": r.id}},
                }},
                {"Update": {
                    "TableName": table, "Key": {"pk": {"S": queue_pk(r.id)}, "sk": {"S": META}},
                    "UpdateExpression": "SET marked = :yes", "ConditionExpression": "claim = :claim",
                    "ExpressionAttributeValues": {":yes": {"BOOL": True}, ":claim": {"N": str(r.claim)}},
                }},
            ])  # fmt: skip
        except Cancelled:
            return False
        return True

    def release_wakes(self, run_id: str, receipt: str) -> None:
        """End a hold of :meth:`hold_wakes` (nothing when it is over: acked, claimed again, or never held)."""
        try:
            record_id = Receipt.parse(receipt).id
        except WorldError:
            return
        try:
            self.table.update(
                "UpdateItem (release wake-ups)",
                Key={"pk": {"S": run_pk(run_id)}, "sk": {"S": META}},
                UpdateExpression="REMOVE pending_wake",
                ConditionExpression="pending_wake = :id",
                ExpressionAttributeValues={":id": {"S": record_id}},
            )
        except ConditionFailed:
            pass

    def defer(self, record: Record, due: datetime) -> None:
        """Keep a claimed record for later: make it due at ``due`` and send its message again (an expiry that came
        before its run may expire). The record stays, so the message sent now finds it; a record claimed again
        since (a duplicate message) is left to that claim."""
        try:
            self.table.update(
                "UpdateItem (defer)",
                Key={"pk": {"S": queue_pk(record.id)}, "sk": {"S": META}},
                UpdateExpression="SET due = :due",
                ConditionExpression="claim = :claim",
                ExpressionAttributeValues={":due": {"N": str(ids.to_micros(due))}, ":claim": {"N": str(record.claim)}},
            )
        except ConditionFailed:
            return
        self.send(replace(record, due=due))

    def ack(self, receipt: str) -> None:
        """Delete the record (unless someone claimed it since) and the message (an event source mapping's message:
        the mapping deletes it)."""
        r = Receipt.parse(receipt)
        if self._was_settled(r):
            return
        if r.start:
            self.starts.ack(r)
            return
        if self.delete_record(r) and not r.esm:
            self.delete_message(r.queue, r.handle)

    def delete_record(self, r: Receipt) -> bool:
        """Delete the record of this claim; False when another claim holds it (the receipt is stale)."""
        try:
            self.table.delete(
                {"pk": queue_pk(r.id), "sk": META},
                ConditionExpression="attribute_not_exists(pk) OR claim = :claim",
                ExpressionAttributeValues={":claim": {"N": str(r.claim)}},
            )
        except ConditionFailed:
            return False
        return True

    def dead_letter(self, receipt: str, *, reason: str, error: str | None = None) -> DeadLetter | None:
        """Move the claimed message to its queue's dead-letter queue (its record stays, so a redrive finds it);
        None when the claim is stale or the queue has no dead-letter queue (then nothing moved)."""
        r = Receipt.parse(receipt)
        if r.start:
            return self.starts.dead_letter(r, reason=reason, error=error)  # type: ignore[no-any-return]
        found = self.table.get_many([{"pk": queue_pk(r.id), "sk": META}])
        if not found:
            return None
        record = Record.from_item(found[0])
        if record.claim != r.claim:
            return None
        return self.world.dead_letters.move(
            r.queue, r.handle, record.body(), reason=reason, attempts=record.claim, run_id=record.run_id,
            payload=record.payload, error=error,
        )  # fmt: skip

    def held(self, receipts: Sequence[Receipt]) -> list[Receipt]:
        """The receipts whose claim is still their record's current one (a start's: whose start is not done)."""
        starts = self.starts.held([r for r in receipts if r.start])
        receipts = [r for r in receipts if not r.start]
        if not receipts:
            return starts
        found = self.table.get_many([{"pk": queue_pk(r.id), "sk": META} for r in receipts])
        claims = {item["id"]["S"]: int(item.get("claim", {"N": "0"})["N"]) for item in found}
        return [r for r in receipts if claims.get(r.id) == r.claim] + starts

    def set_visibility(self, receipts: Sequence[str], seconds: float) -> None:
        """Change the visibility of the messages of the claims that are still their records' current ones."""
        for r in self.held([Receipt.parse(text) for text in receipts]):
            self.change_visibility(r.queue, r.handle, seconds)


def scheduled(record: Record, queue: QueueConfig, now: datetime) -> bool:
    """Whether ``record``'s message goes through the Scheduler when sent at ``now``: due more than 15 minutes later,
    or later at all on a FIFO queue (FIFO queues take no per-message delay)."""
    delay = record.due - now
    return delay > MAX_SQS_DELAY or (queue.fifo and delay >= EARLY_TOLERANCE)
