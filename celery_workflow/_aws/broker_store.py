"""The store behind the SQS transport: task queues on SQS (through the AWS World), the control channel in Redis.

:class:`SQSBrokerStore` is a :class:`~celery_workflow._backend.queue_contract.BrokerStore`, so the SQS transport
(:mod:`celery_workflow.transport.sqs`) is the same Kombu code as our other transports
(:mod:`celery_workflow.transport.base`). It lives in the AWS backend, beside the :mod:`.queue` it builds on, and
imports no transport. It routes by queue:

* **task queues** are the AWS World's queues (Celery's default queue is ``queue_url``, a routed queue name its
  ``queues[name].url``). A name the World does not know is refused: queues come from Terraform, never created on
  the fly. A plain Celery message due within 15 minutes goes to SQS as it is (``DelaySeconds`` for a countdown);
  one due later, or delayed on a FIFO queue, becomes a ``QUEUE#`` record published through the Scheduler, like a
  workflow delivery. Received messages are the World's to accept (records: early arrivals sent again, expiries run,
  gone records acknowledged) or plain ones; their receipts say which (``sqs|…`` records, whose ack is the World's;
  ``raw|<queue>|<handle>`` plain messages).
* **control queues** (``*.pidbox`` remote control and replies, ``celeryev.*`` events) and every exchange and binding
  live in a :class:`~celery_workflow._backend.queue_contract.ControlStore` (the transport gives it a
  :class:`~celery_workflow._redis.store.RedisStore` when ``AWSConfig(control_url=…)`` is set). Without it, direct
  routing to the task queues is kept in process memory and a control queue is refused with an error that says how to
  turn remote control on or off.

Receiving long-polls: one thread per consumed task queue waits up to ``wait`` seconds (:data:`LONG_POLL` unless the
transport's ``wait_time_seconds`` option says otherwise) in ``ReceiveMessage``, only while the consumer has prefetch
room, and asks for at most that room (10 at a time), so an idle worker costs one request per queue every few seconds
and a busy one takes batches. The queues' receivers poll side by side, as kombu's own SQS transport does: SQS has no
receive across queues, and a long poll cannot be cut short, so an idle queue's poll must never keep another queue
from being polled (a room shared between them was held by whichever poll took it, and a busy queue waited out the
idle one's poll, or was never polled at all). Received messages wait in a small local buffer for the consuming
thread's next poll, which takes them from the queues in turn (kombu's round-robin cycle); the change token the
transport waits on moves when a receiver buffers a message or Redis announces a control message (and
:attr:`SQSBrokerStore.on_change` wakes the hub of a worker on Celery's event loop). Polls side by side
can bring a little more than the room (at most one room per other queue): those wait in the buffer, their visibility
extended with the messages the consumer holds (:meth:`SQSBrokerStore.extend`), and are given back if consuming stops.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any

from celery_workflow import ids
from celery_workflow._aws.config import MAX_SQS_DELAY
from celery_workflow._aws.queue import EARLY_TOLERANCE, body_of
from celery_workflow._aws.world import AWSWorld
from celery_workflow._backend.broker import Binding, QueuedMessage, backoff
from celery_workflow._backend.queue_contract import BindingRow, ControlStore
from celery_workflow.dead_letters import DeadLetter
from celery_workflow.errors import ConfigurationError, WorldError
from celery_workflow.world import ClaimedDelivery, Delivery

__all__ = ["LONG_POLL", "SQSBrokerStore", "is_control_queue"]

log = logging.getLogger(__name__)

#: How long one SQS long poll waits (ReceiveMessage's WaitTimeSeconds, at most 20). A message SQS hands to a poll
#: whose process has gone stays hidden for its visibility timeout, so a closing transport waits for its polls to
#: end (and gives back what they bring): 5 s bounds that wait, at 720 requests an hour per idle queue.
LONG_POLL = 5.0
#: The longest a rejected message waits on a queue without a dead-letter queue (SQS's longest delay, 15 minutes).
MAX_SQS_BACKOFF = 900.0
#: The largest plain message sent as it is (SQS takes 256 KiB with attributes); a larger one goes through a record.
MAX_RAW_BODY = 250_000


def is_control_queue(name: str) -> bool:
    """Celery's remote-control (``<node>.celery.pidbox``, ``<id>.reply.celery.pidbox``) and event
    (``celeryev.<id>``) queues."""
    return name.endswith(".pidbox") or name.startswith("celeryev.")


class _Receiver(threading.Thread):
    """Long-polls one SQS task queue into the store's buffer while the consumer has room."""

    def __init__(self, store: SQSBrokerStore, queue: str) -> None:
        super().__init__(name=f"celery_workflow-sqs-{queue}", daemon=True)
        self.store = store
        self.queue = queue
        self.stopped = threading.Event()

    def run(self) -> None:
        store = self.store
        while not self.stopped.is_set():
            want = store._room_for(self.queue)
            if want == 0:
                continue
            try:
                messages = store.world.queue.receive(self.queue, limit=want, wait=store.wait, lease=store.lease)
            except Exception as exc:  # the consumer sees nothing new; try again shortly
                log.warning("cannot receive from SQS queue %r (%s); retrying", self.queue, exc)
                self.stopped.wait(1.0)
                continue
            for message in messages:
                try:
                    claimed = store._accept(self.queue, message)
                except Exception:
                    log.exception(
                        "cannot accept a message of %r; it comes back after its visibility timeout", self.queue
                    )
                    continue
                if claimed is not None:
                    if self.stopped.is_set() or self.queue not in store._consumed:
                        store.release(claimed.receipt)
                    else:
                        store._buffered(claimed)


class SQSBrokerStore:
    """Task queues on SQS through ``world``, control traffic on ``control`` (Redis) when there is one."""

    def __init__(
        self, world: AWSWorld, control: ControlStore | None = None, *, lease: float = 60.0, wait: float = LONG_POLL
    ) -> None:
        if not 1 <= wait <= 20:
            raise ConfigurationError(f"an SQS long poll waits 1 to 20 seconds (wait_time_seconds), not {wait!r}")
        self.world = world
        self.control = control
        self.lease = lease
        self.wait = float(wait)
        self._cond = threading.Condition()
        self._version = 0
        #: Called (from a receiver's or the control channel's thread) after each change the token counts: how the
        #: transport on Celery's event loop hands buffered messages to the hub's thread (its wake-up pipe).
        self.on_change: Callable[[], None] | None = None
        self._buffer: dict[str, deque[ClaimedDelivery]] = {}
        self._demand = 0  # messages the consumer can take now (its prefetch room)
        self._turn = 0  # where the next receive starts in the cycle of task queues (round-robin)
        self._receivers: dict[str, _Receiver] = {}
        self._consumed: set[str] = set()
        self._closed = False  # closed: no receiver starts again (its long poll would outlive the process)
        self._stopping: list[_Receiver] = []  # stopped receivers whose last poll may still be in flight
        self._raw_held: dict[str, tuple[str, int]] = {}  # plain messages held: receipt -> (body, receive count)
        # without a control channel: direct routing state, in this process only
        self._exchanges: dict[str, str] = {}
        self._bindings: dict[tuple[str, str, str], Binding] = {}
        if control is not None:
            control.on_change = self._bump

    # -- routing by queue --------------------------------------------------------------------------------------------

    def is_task_queue(self, name: str) -> bool:
        return name in self.world.queue_names

    def _control_for(self, name: str) -> ControlStore:
        """The control store, for a queue that is not a task queue; a clear error for one that can be neither."""
        if is_control_queue(name):
            if self.control is None:
                raise ConfigurationError(
                    f"queue {name!r} is Celery's remote control or events: on SQS they need a control channel,"
                    " AWSConfig(control_url='redis://…'); or turn them off (worker_enable_remote_control = False,"
                    " worker_send_task_events = False)"
                )
            return self.control
        known = sorted(self.world.queue_names)
        raise ConfigurationError(
            f"queue {name!r} is not one of the AWS World's SQS queues {known}: queues come from its config (the"
            " Terraform module's queues), never created on the fly"
        )

    def _held_control(self) -> ControlStore:
        """The control store, for a control message's receipt (``ctl|…``: only the control store hands those out)."""
        if self.control is None:
            raise WorldError("a control message's receipt, but this SQS store has no control channel (control_url)")
        return self.control

    # -- wake-ups ----------------------------------------------------------------------------------------------------

    def _bump(self) -> None:
        with self._cond:
            self._version += 1
            self._cond.notify_all()
        self._changed()

    def _changed(self) -> None:
        on_change = self.on_change
        if on_change is not None:
            on_change()

    def change_token(self) -> int:
        if self.control is not None:
            self.control.change_token()  # starts its subscriber
        with self._cond:
            return self._version

    def wait_for_change(self, token: Any, timeout: float) -> bool:
        with self._cond:
            return bool(self._cond.wait_for(lambda: self._version != token, max(timeout, 0.0)))

    # -- receiving ---------------------------------------------------------------------------------------------------

    def set_demand(self, room: int) -> None:
        """How many messages the consumer can take now (its prefetch room): receivers ask SQS for no more."""
        with self._cond:
            self._demand = max(0, room)
            self._cond.notify_all()

    def _room_for(self, queue: str) -> int:
        """How many messages ``queue``'s receiver may ask for now: the consumer's room less what is buffered (10 at
        most); 0 after waiting (a little) for room. The polls of other queues do not count: each queue polls on its
        own, so an idle queue's long poll holds nothing another queue needs (see the module docstring)."""
        with self._cond:
            buffered = sum(len(b) for b in self._buffer.values())
            want = min(10, self._demand - buffered)
            if want <= 0 or queue not in self._consumed:
                self._cond.wait(1.0)
                return 0
            return want

    def _buffered(self, claimed: ClaimedDelivery) -> None:
        with self._cond:
            self._buffer.setdefault(claimed.queue, deque()).append(claimed)
            self._version += 1
            self._cond.notify_all()
        self._changed()

    def _accept(self, queue: str, message: Mapping[str, Any]) -> ClaimedDelivery | None:
        count = int(message.get("Attributes", {}).get("ApproximateReceiveCount", "1"))
        handle, body = str(message["ReceiptHandle"]), str(message.get("Body", ""))
        if body_of(body) is not None:  # a record's message: the World's to accept
            return self.world.queue.accept(queue, handle, body, count)
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if not isinstance(data, dict) or "properties" not in data:
            log.warning("deleting a message on %r that is neither a Kombu message nor a delivery: %.200r", queue, body)
            self.world.queue.delete_message(queue, handle)
            return None
        receipt = f"raw|{queue}|{handle}"
        with self._cond:
            self._raw_held[receipt] = (body, count)  # to move it to the dead-letter queue, should it come to that
        return ClaimedDelivery(receipt, queue, body.encode(), count, None)

    def _ensure_receiver(self, queue: str) -> None:
        if self._closed:
            return
        receiver = self._receivers.get(queue)
        if receiver is None or not receiver.is_alive():
            receiver = self._receivers[queue] = _Receiver(self, queue)
            receiver.start()

    def receive(
        self, queues: Sequence[str], *, no_ack: Collection[str] = (), limit: int = 1, lease: float = 60.0
    ) -> list[ClaimedDelivery]:
        """Buffered messages of the task queues among ``queues`` and due control messages, ``limit`` in all."""
        tasks = [q for q in dict.fromkeys(queues) if self.is_task_queue(q)]
        controls = [q for q in dict.fromkeys(queues) if not self.is_task_queue(q)]
        out: list[ClaimedDelivery] = []
        if controls and self.control is not None:
            out += [self._wrap(c) for c in self.control.receive(controls, no_ack=no_ack, limit=limit, lease=lease)]
        with self._cond:
            self._consumed.update(tasks)
            taken = self._take(tasks, limit - len(out))
            self._demand = max(0, self._demand - len(taken))  # the room they fill, until the transport says again
            out += taken
        for queue in tasks:
            self._ensure_receiver(queue)
        return out

    def _take(self, queues: Sequence[str], limit: int) -> list[ClaimedDelivery]:
        """Up to ``limit`` buffered messages, one queue after another (under the lock): a cycle over ``queues`` that
        goes on, at the next receive, after the queue that gave the last message, so a busy queue never keeps
        another's messages waiting (kombu's ``FairCycle``)."""
        out: list[ClaimedDelivery] = []
        if not queues:
            return out
        start = self._turn % len(queues)
        order = [*queues[start:], *queues[:start]]
        while len(out) < limit:
            given = False
            for i, queue in enumerate(order):
                buffer = self._buffer.get(queue)
                if buffer and len(out) < limit:
                    out.append(buffer.popleft())
                    self._turn = start + i + 1
                    given = True
            if not given:
                break
        return out

    @staticmethod
    def _wrap(claimed: ClaimedDelivery) -> ClaimedDelivery:
        return ClaimedDelivery(
            f"ctl|{claimed.receipt}", claimed.queue, claimed.payload, claimed.attempts, claimed.run_id
        )

    def poll(
        self, queues: Sequence[str], *, no_ack: Collection[str] = (), limit: int = 1, lease: float = 60.0
    ) -> tuple[list[ClaimedDelivery], dict[str, float]]:
        """:meth:`receive`, and when each queue has its next message due: control queues as Redis says, a task queue
        with messages still buffered at once (they came in before this poll's change token: no later change would
        wake the transport for them)."""
        claims = self.receive(queues, no_ack=no_ack, limit=limit, lease=lease)
        controls = [q for q in queues if not self.is_task_queue(q)]
        due = self.control.due_times(controls) if controls and self.control is not None else {}
        with self._cond:
            due.update({q: 0.0 for q in queues if self._buffer.get(q)})
        return claims, due

    def stop_consuming(self, queues: Sequence[str], *, wait: bool = False) -> None:
        """Stop receiving ``queues`` and give back what was buffered for them (visible again at once); ``wait``:
        also wait for the polls in flight to end (what they bring is given back too)."""
        with self._cond:
            self._consumed.difference_update(queues)
            held = [c for q in queues for c in self._buffer.pop(q, deque())]
            self._cond.notify_all()
        for queue in queues:
            receiver = self._receivers.pop(queue, None)
            if receiver is not None:
                receiver.stopped.set()
                self._stopping.append(receiver)
        for claimed in held:
            self.release(claimed.receipt)
        if wait:  # every stopped receiver still polling, those of earlier cancels included
            for receiver in list(self._stopping):
                if receiver is not threading.current_thread():
                    receiver.join(self.wait + 5.0)
            self._stopping = [r for r in self._stopping if r.is_alive()]

    def close(self) -> None:
        """Stop the receivers (waiting for their polls, so no message is left hidden) and the control channel; no
        receiver starts afterwards: a long poll begun by a closing worker would be answered after it exited, and
        the message it took would stay hidden for its visibility timeout."""
        self._closed = True
        self.stop_consuming(list(self._receivers), wait=True)  # and waits for receivers cancelled earlier
        if self.control is not None:
            self.control.close()

    # -- settling ----------------------------------------------------------------------------------------------------

    def _raw(self, receipt: str) -> tuple[str, str]:
        _, queue, handle = receipt.split("|", 2)
        return queue, handle

    def _let_go(self, receipt: str) -> tuple[str, int] | None:
        with self._cond:
            return self._raw_held.pop(receipt, None)

    def ack(self, receipt: str) -> None:
        if receipt.startswith("ctl|"):
            self._held_control().ack(receipt[4:])
        elif receipt.startswith("raw|"):
            self._let_go(receipt)
            self.world.queue.delete_message(*self._raw(receipt))
        else:
            self.world.ack(receipt)

    def dead_letter(self, receipt: str, *, reason: str, error: str | None = None) -> DeadLetter | None:
        """Move the message to its queue's SQS dead-letter queue (see :mod:`celery_workflow._aws.dead_letters`).
        A queue without one keeps the message, backed off as SQS would (None: nothing moved); a control message
        (remote control, events) is dropped, as AMQP drops a rejected message without a dead-letter exchange."""
        if receipt.startswith("ctl|"):
            self._held_control().ack(receipt[4:])
            return None
        letters = self.world.dead_letters
        if receipt.startswith("raw|"):
            queue, handle = self._raw(receipt)
            held = self._let_go(receipt)
            if held is None or letters.target(queue) is None:
                self.retry_later(receipt, backoff(held[1] if held else 1, cap=MAX_SQS_BACKOFF))
                return None
            body, count = held
            return letters.move(
                queue, handle, body, reason=reason, attempts=count, run_id=None, payload=body.encode(), error=error
            )
        letter = self.world.dead_letter(receipt, reason=reason, error=error)
        if letter is None and letters.target(receipt.split("|", 2)[1]) is None:
            self.retry_later(receipt, MAX_SQS_BACKOFF)
        return letter

    def release(self, receipt: str) -> None:
        self.retry_later(receipt, 0.0)

    def retry_later(self, receipt: str, delay: float, *, error: str | None = None) -> None:
        """Make the message visible again in ``delay`` seconds (SQS keeps no error: ``error`` is not stored)."""
        self._let_go(receipt)
        if receipt.startswith("ctl|"):
            if delay > 0:
                self._held_control().retry_later(receipt[4:], delay)
            else:
                self._held_control().release(receipt[4:])
        elif receipt.startswith("raw|"):
            queue, handle = self._raw(receipt)
            self.world.queue.change_visibility(queue, handle, delay)
        else:
            self.world.retry_later(receipt, delay)

    def extend(self, receipts: Sequence[str], lease: float) -> None:
        """Extend the leases of ``receipts`` (the messages the consumer holds) and of the messages waiting in the
        buffer (received beside the room, see the module docstring): they are hidden for the same visibility timeout,
        and wait only while the consumer holds messages."""
        with self._cond:
            buffered = [c.receipt for b in self._buffer.values() for c in b]
        receipts = list(dict.fromkeys([*receipts, *buffered]))
        control = [r[4:] for r in receipts if r.startswith("ctl|")]
        if control:
            self._held_control().extend(control, lease)
        for receipt in receipts:
            if receipt.startswith("raw|"):
                self.world.queue.change_visibility(*self._raw(receipt), lease)
        records = [r for r in receipts if r.startswith("sqs|")]
        if records:
            self.world.extend(records, lease)

    # -- publishing --------------------------------------------------------------------------------------------------

    def put(
        self,
        queue: str,
        payload: bytes,
        *,
        not_before: float | None = None,
        run_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> bool:
        if not self.is_task_queue(queue):
            return bool(
                self._control_for(queue).put(
                    queue, payload, not_before=not_before, run_id=run_id, idempotency_key=idempotency_key
                )
            )
        config = self.world.queue_config(queue)
        due = None if not_before is None else ids.from_micros(round(not_before * 1_000_000))
        delay = timedelta(0) if due is None else due - ids.utcnow()
        if delay > MAX_SQS_DELAY or (config.fifo and delay >= EARLY_TOLERANCE) or len(payload) > MAX_RAW_BODY:
            # a record, published like a workflow delivery (through the Scheduler when due later)
            self.world.queue.enqueue([Delivery(queue, bytes(payload), run_id, due, idempotency_key)])
            return True
        body = bytes(payload).decode()
        properties = (json.loads(body).get("properties") or {}) if config.fifo else {}
        self.world.queue.send_body(
            queue,
            body,
            delay=delay.total_seconds(),
            group=properties.get("MessageGroupId") or run_id,
            dedup=properties.get("MessageDeduplicationId"),
        )
        return True

    def put_fanout(self, exchange: str, payload: bytes, *, not_before: float | None = None) -> int:
        """A copy on every queue bound to ``exchange``: SQS has no fanout, so the copies are made here (task queues
        get one message each, control queues theirs in Redis)."""
        queues = sorted({b.queue for b in self.bindings(exchange)})
        for queue in queues:
            self.put(queue, payload, not_before=not_before)
        return len(queues)

    # -- queues ------------------------------------------------------------------------------------------------------

    def size(self, queue: str) -> int:
        if self.is_task_queue(queue):
            return self.world.queue.approximate_size(queue)
        return int(self._control_for(queue).size(queue))

    def purge(self, queue: str) -> int:
        if self.is_task_queue(queue):
            return self.world.queue.purge(queue)
        return int(self._control_for(queue).purge(queue))

    def peek(self, queues: Sequence[str] | None = None) -> list[QueuedMessage]:
        """Control messages only: SQS cannot show messages without receiving them."""
        if self.control is None:
            return []
        names = None if queues is None else [q for q in queues if not self.is_task_queue(q)]
        return list(self.control.peek(names))

    def declare_queue(
        self,
        name: str,
        *,
        durable: bool = True,
        exclusive: bool = False,
        auto_delete: bool = False,
        expires: float | None = None,
        message_ttl: float | None = None,
    ) -> None:
        if self.is_task_queue(name):
            return  # it exists: the World's config names it
        self._control_for(name).declare_queue(
            name, durable=durable, exclusive=exclusive, auto_delete=auto_delete, expires=expires,
            message_ttl=message_ttl,
        )  # fmt: skip

    def has_queue(self, name: str) -> bool:
        if self.is_task_queue(name):
            return True
        return self.control is not None and bool(self.control.has_queue(name))

    def queue_info(self, name: str) -> dict[str, Any] | None:
        if self.is_task_queue(name) or self.control is None:
            return None
        info: dict[str, Any] | None = self.control.queue_info(name)
        return info

    def queues(self) -> list[str]:
        return sorted({*self.world.queue_names, *(self.control.queues() if self.control is not None else [])})

    def delete_queue(self, name: str) -> int:
        if self.is_task_queue(name):
            raise ConfigurationError(f"queue {name!r} is one of the AWS World's SQS queues: delete it with Terraform")
        return int(self._control_for(name).delete_queue(name))

    # -- exchanges and bindings --------------------------------------------------------------------------------------

    def declare_exchange(
        self,
        name: str,
        type: str,
        *,
        durable: bool = True,
        auto_delete: bool = False,
        arguments: Mapping[str, Any] | None = None,
    ) -> None:
        if self.control is not None:
            self.control.declare_exchange(name, type, durable=durable, auto_delete=auto_delete, arguments=arguments)
        else:
            self._exchanges[name] = type

    def exchange_type(self, name: str) -> str | None:
        if self.control is not None:
            found: str | None = self.control.exchange_type(name)
            return found
        return self._exchanges.get(name)

    def exchanges(self) -> list[str]:
        return list(self.control.exchanges()) if self.control is not None else sorted(self._exchanges)

    def delete_exchange(self, name: str) -> None:
        if self.control is not None:
            self.control.delete_exchange(name)
            return
        self._exchanges.pop(name, None)
        for key in [k for k in self._bindings if k[0] == name]:
            del self._bindings[key]

    def bind(self, exchange: str, routing_key: str, pattern: str | None, queue: str) -> None:
        if not self.is_task_queue(queue):
            self._control_for(queue)  # refuses an unknown queue clearly
        if self.control is not None:
            self.control.bind(exchange, routing_key, pattern, queue)
        else:
            self._bindings[(exchange, routing_key or "", queue)] = Binding(exchange, routing_key or "", pattern, queue)

    def unbind(self, exchange: str, routing_key: str, queue: str) -> None:
        if self.control is not None:
            self.control.unbind(exchange, routing_key, queue)
        else:
            self._bindings.pop((exchange, routing_key or "", queue), None)

    def bindings(self, exchange: str | None = None) -> list[BindingRow]:
        if self.control is not None:
            return list(self.control.bindings(exchange))
        return [b for b in self._bindings.values() if exchange is None or b.exchange == exchange]

    # -- liveness and collection -------------------------------------------------------------------------------------

    def touch(self, consumer: str, queues: Sequence[str]) -> list[str]:
        controls = [q for q in queues if not self.is_task_queue(q)]
        if not controls or self.control is None:
            return []
        return list(self.control.touch(consumer, controls))

    def drop_consumer(self, consumer: str, queues: Sequence[str]) -> list[str]:
        tasks = [q for q in queues if self.is_task_queue(q)]
        if tasks:
            self.stop_consuming(tasks)
        controls = [q for q in queues if not self.is_task_queue(q)]
        if not controls or self.control is None:
            return []
        return list(self.control.drop_consumer(consumer, controls))

    def consumers(self) -> dict[str, int]:
        return dict(self.control.consumers()) if self.control is not None else {}

    def gc(self, *, consumer_timeout: float = 60.0) -> dict[str, int]:
        if self.control is None:
            return {"queues": 0, "consumers": 0, "messages": 0}
        return dict(self.control.gc(consumer_timeout=consumer_timeout))
