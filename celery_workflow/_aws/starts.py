"""A run's start delivery on the AWS World: the pending run's ``META`` is its outbox (not part of the public API).

``create_run`` writes no ``QUEUE#`` record for the run's start (its delivery due now); the run's ``META`` carries it
instead, in the same put:

* ``start``: the start's delivery id, present until the start is acknowledged (the delivery's append that acks it
  removes it in its META update, which that append writes anyway; a plain :meth:`Starts.ack` in one ``UpdateItem``);
* ``start_queue`` and ``start_z`` (the delivery's payload, deflated against :data:`START_DICTIONARY`): present until
  the start's message is sent. The publication after the commit sends the message and removes them with the outbox
  clean-up it makes anyway, so the run's later META writes are not billed for the payload.

A start's payload is a Celery task message of about 960 bytes, which plain zlib brings to about 530: enough to take a
new run's META past 1 KB, which doubles the write units of its creation (a transactional put: 2 per KB) and of the
clean-up. Deflated with a preset dictionary (a Celery start message of the same shape), it takes about 120 bytes, and
a run with a small input stays within 1 KB (bench/RESULTS.md). The dictionary is part of the table's format: changing
it would need another attribute name.

The start's message carries the payload itself (``start: 1``, ``payload_z`` in base64), so its delivery needs no
record. A start whose message was never sent (its writer stopped between the commit and the send, or the send
failed) keeps ``start_z``: it is sent again by ``create_run`` retried with the same run id, and by the outbox sweep
(:meth:`Starts.sweep`, which a worker's upkeep runs every minute: :class:`OutboxSweeper`), which reads the pending
runs created in a window through the ``list`` index (status projected) and resends what their META still holds.

What the start's ``QUEUE#`` record gave its delivery, and what gives it now:

* **done or not**: a message whose record was gone was acknowledged unrun; a start message whose run's META has no
  ``start`` (or another id) is acknowledged unrun. :meth:`Starts.accept` reads META (one consistent ``GetItem``)
  where it updated the record's claim counter.
* **stale receipts**: a claim counter made a receipt of an earlier claim change nothing. A start has no counter:
  concurrent duplicate messages of one start both run, as two claims of one record always could (the second claim
  only made the first's receipt stale); the append's event-count condition refuses the plan of the one that comes
  second, so nothing is recorded twice, and whichever finishes first removes ``start``, after which the other's
  redelivery is acknowledged unrun. A stale receipt may still release or extend a message a duplicate holds
  (another delivery of a start whose work is idempotent), never delete a ``start`` whose work is not done.
* **attempts and dead letters**: the receipt's count is the message's ``ApproximateReceiveCount``; a dead-lettered
  start keeps ``start`` in META and its body keeps the payload, so a redrive runs it.
* **held wake-ups** (``World.hold_wakes``): the start's hold is META ``pending_wake`` = the receipt's id (the run
  id); the start's next receive ends it, as the next claim of a marked record did.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from celery_workflow import ids
from celery_workflow._aws.dynamo import ConditionFailed
from celery_workflow._aws.receipts import BODY_KEY, Receipt
from celery_workflow._aws.table import META, run_pk
from celery_workflow.events import RunStatus
from celery_workflow.world import ClaimedDelivery, Delivery

if TYPE_CHECKING:
    from celery_workflow._aws.queue import SQSQueue

__all__ = ["OutboxSweeper", "Start", "Starts", "start_of"]

log = logging.getLogger("celery_workflow.aws")

#: A start still unsent this long after its run's creation was left by a writer that stopped: the sweep sends it.
SWEEP_GRACE = timedelta(seconds=60)
#: How far back a worker's first sweep looks (later sweeps go on from where the previous one stopped).
SWEEP_HORIZON = timedelta(hours=1)
#: The accepted starts whose body a dead letter may need, kept per process.
KEPT_BODIES = 4096


#: The preset dictionary of a start's payload in META (a Celery start message; frozen: see the module docstring).
START_DICTIONARY = (
    b'{"body": "W1sid3J1bl8wMU05NkdIM1IwVzZWWDg5WkdHQU5SUUdZMiJdLCB7fSwgeyJjYWxsYmFja3MiOiBudWxsLCAiZXJyYm'
    b'Fja3MiOiBudWxsLCAiY2hhaW4iOiBudWxsLCAiY2hvcmQiOiBudWxsfV0=", "content-encoding": "utf-8", "content-t'
    b'ype": "application/json", "headers": {"lang": "py", "task": "workflow.workflow", "id": "dlv_01M96GK8'
    b'XGFNCCB75B1QBJKQ7W", "shadow": null, "eta": null, "expires": null, "group": null, "group_index": nul'
    b'l, "retries": 0, "timelimit": [null, null], "root_id": "dlv_01M96GK8XGFNCCB75B1QBJKQ7W", "parent_id"'
    b': null, "argsrepr": "[\'wrun_01M96GH3R0W6VX89ZGGANRQGY2\']", "kwargsrepr": "{}", "origin": "celery_wor'
    b'kflow", "ignore_result": true, "replaced_task_nesting": 0, "stamped_headers": null, "stamps": {}}, "'
    b'properties": {"correlation_id": "dlv_01M96GK8XGFNCCB75B1QBJKQ7W", "reply_to": "", "delivery_mode": 2'
    b', "priority": 0, "body_encoding": "base64", "delivery_tag": "53799d9d-5b01-4e0d-a8d6-5c1bbe8625d9", '
    b'"delivery_info": {"exchange": "", "routing_key": "celery"}}}'
)


def deflate(payload: bytes) -> bytes:
    """A start's payload as META keeps it: zlib against :data:`START_DICTIONARY`."""
    packer = zlib.compressobj(9, zdict=START_DICTIONARY)
    return packer.compress(payload) + packer.flush()


def inflate(packed: bytes) -> bytes:
    """The payload :func:`deflate` packed (zlib.error when it is not one)."""
    unpacker = zlib.decompressobj(zdict=START_DICTIONARY)
    return unpacker.decompress(packed) + unpacker.flush()


@dataclass(frozen=True, slots=True)
class Start:
    """A run's start delivery (no record: its run's META holds it until its message is sent)."""

    id: str
    run_id: str
    queue: str
    payload: bytes

    @classmethod
    def of(cls, delivery: Delivery) -> Start:
        return cls(ids.ulid(), str(delivery.run_id), delivery.queue, bytes(delivery.payload))

    def attributes(self) -> dict[str, Any]:
        """The META attributes of an unsent start (typed)."""
        return {"start": {"S": self.id}, "start_queue": {"S": self.queue}, "start_z": {"B": deflate(self.payload)}}

    @classmethod
    def in_meta(cls, meta: Mapping[str, Any]) -> Start | None:
        """The unsent start a META item holds (typed attributes), if any."""
        if "start" not in meta or "start_z" not in meta or "start_queue" not in meta:
            return None
        return cls(
            meta["start"]["S"], meta["pk"]["S"][len("RUN#") :], meta["start_queue"]["S"],
            inflate(meta["start_z"]["B"]),
        )  # fmt: skip

    def body(self) -> str:
        """The start's message: the payload travels in it (a fresh ``publish`` id each time it is sent)."""
        packed = base64.b64encode(zlib.compress(self.payload, 6)).decode()
        return json.dumps(
            {BODY_KEY: 1, "id": self.id, "run": self.run_id, "publish": ids.ulid(), "start": 1, "payload_z": packed}
        )


def start_of(data: Mapping[str, Any]) -> tuple[str, str, bytes] | None:
    """``(start id, run id, payload)`` of a parsed message body that is a start's, else None."""
    if data.get("start") != 1 or not isinstance(data.get("run"), str) or not isinstance(data.get("payload_z"), str):
        return None
    try:
        payload = zlib.decompress(base64.b64decode(data["payload_z"]))
    except (ValueError, zlib.error):
        return None
    return str(data["id"]), str(data["run"]), payload


class Starts:
    """The start deliveries of an :class:`~celery_workflow._aws.queue.SQSQueue` (see the module docstring)."""

    def __init__(self, queue: SQSQueue) -> None:
        self.queue = queue
        # accepted starts' bodies and payloads by receipt (a dead letter needs them: no record holds them)
        self._bodies: dict[str, tuple[str, bytes]] = {}

    @property
    def table(self) -> Any:
        return self.queue.table

    # -- sending ---------------------------------------------------------------------------------------------------

    def send(self, start: Start) -> None:
        self.queue.send_body(start.queue, start.body(), group=start.run_id, dedup=start.id)

    def resend(self, meta: Mapping[str, Any]) -> bool:
        """Send the start META still holds unsent; whether there was one (the caller takes it out of META:
        :meth:`SQSQueue.republish_meta <celery_workflow._aws.queue.SQSQueue.republish_meta>`)."""
        start = Start.in_meta(meta)
        if start is None:
            return False
        self.send(start)
        log.warning("run %s: sent its start, left unsent by a writer that stopped", start.run_id)
        return True

    # -- receiving -------------------------------------------------------------------------------------------------

    def accept(
        self, queue: str, handle: str, body: str, found: tuple[str, str, bytes], receive_count: int, *, esm: bool
    ) -> ClaimedDelivery | None:
        """A start's message: None when its run is gone or its start done already (the message acknowledged), else
        the delivery (its receipt names the run; its claim is the receive count)."""
        start_id, run_id, payload = found
        meta = self.table.get({"pk": run_pk(run_id), "sk": META})
        if meta is None or meta.get("start", {}).get("S") != start_id:  # gone, or done already
            if meta is not None:
                self.queue.republish_meta(run_id, meta)
            if not esm:
                self.queue.delete_message(queue, handle)
            return None
        receipt = Receipt(queue, run_id, receive_count, handle, esm, start=True)
        if meta.get("pending_wake", {}).get("S") == receipt.id:  # its hold of the run's wake-ups ends (see hold)
            self.queue.release_wakes(run_id, str(receipt))
        if receive_count > 1:
            self.queue.republish_meta(run_id, meta)
        self._bodies[str(receipt)] = (body, payload)
        if len(self._bodies) > KEPT_BODIES:
            try:
                self._bodies.pop(next(iter(self._bodies)), None)
            except (RuntimeError, StopIteration):
                pass
        return ClaimedDelivery(str(receipt), queue, payload, receive_count, run_id)

    def ack(self, r: Receipt) -> None:
        """The start is done: ``start`` leaves META (nothing when it left already), then the message goes."""
        self._bodies.pop(str(r), None)
        try:
            self.table.update(
                "UpdateItem (start done)",
                Key={"pk": {"S": run_pk(r.id)}, "sk": {"S": META}},
                UpdateExpression="REMOVE #s",
                ConditionExpression="attribute_exists(#s)",
                ExpressionAttributeNames={"#s": "start"},
            )
        except ConditionFailed:
            pass
        if not r.esm:
            self.queue.delete_message(r.queue, r.handle)

    def settled(self, r: Receipt) -> None:
        self._bodies.pop(str(r), None)

    def held(self, receipts: Sequence[Receipt]) -> list[Receipt]:
        """The start receipts whose start is not done yet."""
        if not receipts:
            return []
        found = self.table.get_many([{"pk": run_pk(r.id), "sk": META} for r in receipts])
        open_ = {item["pk"]["S"][len("RUN#") :] for item in found if "start" in item}
        return [r for r in receipts if r.id in open_]

    def hold(self, run_id: str, r: Receipt) -> bool:
        """``World.hold_wakes`` for a start: META ``pending_wake`` names it while the start is not done."""
        try:
            self.table.update(
                "UpdateItem (hold wake-ups)",
                Key={"pk": {"S": run_pk(run_id)}, "sk": {"S": META}},
                UpdateExpression="SET pending_wake = :id",
                ConditionExpression="attribute_exists(#s) AND (attribute_not_exists(pending_wake) OR pending_wake = :id)",
                ExpressionAttributeNames={"#s": "start"},
                ExpressionAttributeValues={":id": {"S": r.id}},
            )
        except ConditionFailed:
            return False
        return True

    def dead_letter(self, r: Receipt, *, reason: str, error: str | None) -> Any:
        """Move the start's message to the dead-letter queue (``start`` stays in META, so a redrive runs it); None
        when this process did not accept it or the start is done."""
        kept = self._bodies.pop(str(r), None)
        if kept is None or not self.held([r]):
            return None
        body, payload = kept
        return self.queue.world.dead_letters.move(
            r.queue, r.handle, body, reason=reason, attempts=r.claim, run_id=r.id, payload=payload, error=error
        )

    # -- the sweep -------------------------------------------------------------------------------------------------

    def sweep(self, since: datetime, until: datetime | None = None) -> int:
        """Send what the pending runs created between ``since`` and ``until`` (default: :data:`SWEEP_GRACE` ago) left
        unsent: their start, and outbox entries older than the append's grace (through the ``list`` index, which
        projects ``status``, then their META by consistent ``BatchGetItem``). How many runs had something sent."""
        until = until or ids.utcnow() - SWEEP_GRACE
        lo, hi = f"{ids.to_micros(since):016d}", f"{ids.to_micros(until):016d}"
        items = self.table.query(
            "Query (outbox sweep)",
            IndexName="list",
            KeyConditionExpression="list_pk = :k AND list_sk BETWEEN :lo AND :hi",
            FilterExpression="#s = :p",
            ExpressionAttributeNames={"#s": "status"},
            ExpressionAttributeValues={
                ":k": {"S": "RUNS"}, ":lo": {"S": lo}, ":hi": {"S": hi}, ":p": {"S": RunStatus.PENDING.value},
            },
        )  # fmt: skip
        runs = [item["pk"]["S"][len("RUN#") :] for item in items]
        sent = 0
        for start in range(0, len(runs), 100):
            for meta in self.table.get_many([{"pk": run_pk(r), "sk": META} for r in runs[start : start + 100]]):
                if meta.get("status", {}).get("S") != RunStatus.PENDING.value:
                    continue
                run_id = meta["pk"]["S"][len("RUN#") :]
                if self.queue.republish_meta(run_id, meta, starts=True):
                    sent += 1
        return sent


class OutboxSweeper:
    """A worker's upkeep on the AWS World: :meth:`Starts.sweep` at start and then every ``interval`` seconds in a
    daemon thread, each sweep going on from where the previous one stopped (the first one looks
    :data:`SWEEP_HORIZON` back); errors are logged and the next sweep tries again."""

    def __init__(self, starts: Starts, interval: float = 60.0, *, horizon: timedelta = SWEEP_HORIZON) -> None:
        if not interval > 0:
            raise ValueError("interval must be positive")
        self.starts = starts
        self.interval = interval
        self.sweeps = 0  # completed sweeps (successful or not), for tests and monitoring
        self.sent = 0  # runs this sweeper sent something of
        self._since = ids.utcnow() - horizon
        self._last: float | None = None  # when tick last swept (monotonic)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="celery_workflow-outbox", daemon=True)

    def start(self) -> OutboxSweeper:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def sweep_once(self) -> int:
        until = ids.utcnow() - SWEEP_GRACE
        if until <= self._since:
            return 0
        sent = self.starts.sweep(self._since, until)
        self._since = until
        return sent

    def tick(self) -> int:
        """Sweep when the last sweep of :meth:`tick` is ``interval`` seconds ago (or none was): for a caller without a
        thread of its own (the Lambda queue handler calls it after its batches)."""
        now = time.monotonic()
        if self._last is not None and now - self._last < self.interval:
            return 0
        self._last = now
        sent = self.sweep_once()
        self.sent += sent
        self.sweeps += 1
        return sent

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sent += self.sweep_once()
            except Exception:
                log.exception("outbox sweep failed; trying again in %.0f s", self.interval)
            self.sweeps += 1
            self._stop.wait(self.interval)
