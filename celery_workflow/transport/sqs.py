"""SQS transport for Celery: the AWS World's queues, consumed by unmodified Celery workers.

A thin layer over :mod:`celery_workflow.transport.base` and
:class:`~celery_workflow._aws.broker_store.SQSBrokerStore` (the AWS backend's broker store): task queues are the AWS
World's SQS queues, Celery's events and remote control travel through Redis
(:class:`~celery_workflow._redis.store.RedisStore`) when ``AWSConfig(control_url="redis://…")`` is set.

Features
========
* Type: Virtual, asynchronous (Celery's event loop and its own prefork pool; the receivers' threads hand what
  they bring to the hub through its wake-up pipe).
* Supports Direct: Yes (task queues: the World's configured SQS queues, never created on the fly)
* Supports Topic, Fanout: with the control channel (Redis); without it, ``celery inspect``, remote control, events
  and Flower are off, and the transport says so when it connects.
* Supports Priority: No
* Delayed delivery: Yes. A plain task's ``countdown``/``eta`` becomes an SQS ``DelaySeconds`` (up to 15 minutes) or
  an EventBridge schedule (later, or on a FIFO queue); no worker holds an ETA past the visibility timeout.
* Leases: received messages are hidden for ``lease_seconds`` (their visibility timeout) and extended while the task
  runs, whatever the pool; ack deletes; ``reject(requeue=True)`` and shutdown make the message visible at once;
  ``reject()`` brings it back after a backoff doubling from 1 s up to 15 minutes (per receive).
* Workflow deliveries are the World's ``QUEUE#`` records: their ack is the World's (it deletes the record in the
  same transaction as the run's last write), early arrivals are sent again, expiries run in the transport.
* Receiving: long polls (``wait_time_seconds``, 5 s) per consumed queue, only while the worker has prefetch room, in
  batches of up to that room (10 at most): an idle worker makes 3600 / ``wait_time_seconds`` requests an hour per
  queue (720 at 5 s, 180 at 20 s). The queues poll side by side (an idle queue's long poll never keeps a busy one
  waiting) and the worker takes what they bring in turn. A closing connection waits for its polls to end and makes
  what they bring visible again, so a stopped worker leaves no message hidden.
* Purging: SQS allows one ``PurgeQueue`` per queue a minute; a purge within that minute finds one in progress and
  answers 0 (nothing removed by this call) with a warning that one is pending, never an error.

Connection String
=================
``Workflows(app, world=AWSWorld(...))`` sets it up; by hand:

.. code-block::

    broker_transport = "celery_workflow.transport.sqs:Transport"
    broker_url = "aws://"                                   # the World of WORKFLOW_* (AWSWorld.from_env())
    broker_transport_options = {"world": my_aws_world}      # or a World of your own

With ``aws://`` and no ``world`` option, the World is read from the environment when the connection opens. Kombu's
process-wide connection and producer pools (which Celery's remote control publishes through) know a connection by its
URL and options only, so a process that builds apps for two Worlds from the environment, one after the other, must
call ``kombu.pools.reset()`` in between or give each app its ``world`` (a World's options differ by its table).

Transport Options
=================
* ``world``: the :class:`~celery_workflow.world_sqs.AWSWorld` (default: ``AWSWorld.from_env()``).
* ``lease_seconds`` (60): the visibility timeout of received messages; kept extended while they are held.
* ``wait_time_seconds`` (5, 1 to 20): how long one ``ReceiveMessage`` long poll waits. Longer polls cost fewer
  requests when idle; a stopping worker waits for its polls to end (so nothing it received stays hidden).
* ``polling_interval`` (1.0), ``heartbeat_interval`` (5.0), ``gc_interval`` (10.0), ``consumer_timeout`` (60.0):
  as for our other transports; they concern the control channel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kombu.transport import TRANSPORT_ALIASES

from celery_workflow._aws.broker_store import LONG_POLL, SQSBrokerStore
from celery_workflow._backend.queue_contract import ControlStore
from celery_workflow.transport.base import BrokerStore, StoreChannel, StoreTransport
from celery_workflow.world_sqs import AWSWorld

__all__ = ["Channel", "Transport"]

log = logging.getLogger(__name__)

# `celery inspect conf` and Flower rebuild a Connection from the broker URL alone
TRANSPORT_ALIASES.setdefault("aws", "celery_workflow.transport.sqs:Transport")


class Channel(StoreChannel):
    """SQS channel: :class:`~celery_workflow.transport.base.StoreChannel` over the SQS store."""


class Transport(StoreTransport):
    """Kombu transport over the AWS World's SQS queues (``driver_type`` ``celery_workflow_sqs``)."""

    Channel = Channel

    can_parse_url = True
    default_port = None
    driver_type = "celery_workflow_sqs"
    driver_name = "boto3"
    #: SQS's backoff: doubling from 1 s per receive up to 15 minutes (the seed's).
    backoff_cap = 900.0

    def open_store(self) -> BrokerStore:
        options = self.client.transport_options or {}
        world = options.get("world")
        if world is None:
            world = AWSWorld.from_url(self.client.hostname or "aws://")
        if not isinstance(world, AWSWorld):
            raise TypeError(f"the SQS transport's 'world' option must be an AWSWorld, got {type(world).__name__}")
        control: ControlStore | None = None
        if world.config.control_url:
            from celery_workflow._redis.store import RedisStore

            control = RedisStore(world.config.control_url, prefix=f"celery_workflow:{world.config.table_name}:")
        else:
            log.warning(
                "SQS transport without a control channel: celery inspect, remote control, events and Flower are"
                " off (set AWSConfig(control_url='redis://…') to turn them on)"
            )
        wait = options.get("wait_time_seconds")
        return SQSBrokerStore(world, control, lease=self.lease_seconds, wait=LONG_POLL if wait is None else float(wait))

    @property
    def sqs_store(self) -> SQSBrokerStore:
        store = self.store
        assert isinstance(store, SQSBrokerStore)
        return store

    def world(self) -> Any:
        """The store's AWS World (the store owns it: not closed with the connection)."""
        return self.sqs_store.world

    def delivery_limit(self, queue: str) -> int | None:
        """On a task queue, one receive fewer than its redrive policy's ``maxReceiveCount`` (so the transport moves
        the message itself, failing its run and announcing it, before SQS would move it silently), and at most the
        ``max_deliveries`` options; no limit on a queue without a dead-letter queue (there is nowhere to move it)."""
        limit = super().delivery_limit(queue)
        store = self.sqs_store
        if not store.is_task_queue(queue):
            return limit
        receives = self._quietly("read a queue's redrive policy", store.world.dead_letters.max_receives, queue)
        if receives is None:
            return None
        return receives - 1 if limit is None else min(limit, receives - 1)

    def poll_limit(self) -> int:
        """The consumers' prefetch room (10 at most): one receive takes a batch."""
        return max(1, min(10, self._room()))

    def _room(self) -> int:
        """The prefetch room of the channels consuming task queues (a worker's remote-control channel has no
        prefetch limit, and its messages are in Redis: it must not make the receivers fetch more)."""
        store = self.sqs_store
        room = 0
        for channel in self.channels:
            if channel.closed or not any(store.is_task_queue(q) for q in channel._active_queues):
                continue
            estimate = channel.qos.can_consume_max_estimate()
            room += 10 if estimate is None else int(estimate)
        return room

    def watch_changes(self, wake: Callable[[], None]) -> Callable[[], None]:
        """On the event loop: the receivers (and the control channel's subscriber) wake the hub when they buffer a
        message; the hub's thread takes it from the buffer."""
        store = self.sqs_store
        store.on_change = wake
        store.change_token()  # starts the control channel's subscriber

        def unwatch() -> None:
            store.on_change = None

        return unwatch

    def consumable_queues(self) -> list[str]:
        queues = super().consumable_queues()
        if self._store is not None:
            self.sqs_store.set_demand(self._room() if queues else 0)
        return queues

    def close_connection(self, connection: Any) -> None:
        store = self._store
        if store is not None:
            self.sqs_store.close()
        super().close_connection(connection)
        if store is not None and self._store is store:
            self._store = None  # closed for good: a connection used again opens a new one

    def driver_version(self) -> str:
        import boto3

        return str(boto3.__version__)

    def as_uri(self, uri: str, include_password: bool = False, mask: str = "**") -> str:
        return uri

    @property
    def default_connection_params(self) -> dict[str, Any]:
        return {"hostname": "aws://"}
