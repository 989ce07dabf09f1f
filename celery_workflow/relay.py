"""The relay: workflow deliveries over the Celery app's own broker (``Workflows(app, world, broker="app")``).

The World stays the source of truth, as a transactional outbox: every delivery is written by the append that implies
it, with its due time, in the World's queue (the same :class:`~celery_workflow._backend.queue_contract.WorldQueue`
contract the World's own transports consume). The relay claims what is due with a lease
(:meth:`~celery_workflow.world.World.claim`) and publishes each delivery to the app's broker as an ordinary Celery
task message on its queue, with the claim's receipt in its headers; it never acks. The worker that handles the
message acks the World's row with its last append (the receipt rides in the message), or after the task returned
when there was nothing to write; a failed handling puts it back with a backoff (``World.retry_later``), as on the
World's transports.

* **Lost messages.** A message the broker loses (a purged queue, Redis without persistence) is published again when
  its lease in the World runs out: the row is claimable again and the relay claims it (``attempts + 1``, a new
  receipt). A worker holding a relayed message extends its lease while it has it (:func:`extend_held`), so a long
  step is not published twice. Each further claim of the same row is leased twice as long as the one before
  (:func:`lease_for`), so a backlog the broker holds longer than the lease is republished less and less often; past
  the World's delivery limit the row is dead-lettered and its run failed, as on every transport.
* **No delay in the broker.** Only due deliveries are claimed: a sleep of three months stays a row with a due time
  in the World, and survives any broker restart or ``celery purge``. Nothing is published with an ETA.
* **One relay at a time** per World and queue set, elected with a named lease (:class:`Election`,
  :class:`~celery_workflow._backend.queue_contract.Leases`: a heartbeat row beside the transport's consumers on
  SQLite and Postgres, held ``ELECTION_LEASE`` seconds and renewed every third of it). A World that keeps no leases
  (the AWS World) lets every relay run: two relays never publish the same claim, the election only saves work.
* **Wake-ups.** Between rounds the relay waits for the World's change notifications (the store's ``change_token`` /
  ``wait_for_change``: LISTEN/NOTIFY on Postgres, the file's data version on SQLite), at most until the next row is
  due or a lease runs out (``next_due``), and at most :data:`MAX_WAIT` seconds.
* **Broker down.** A publish that fails gives the round's unpublished claims back at once (``release``) and the
  relay waits, with a backoff, until the publisher says the broker answers again before it claims anything: an
  outage costs each delivery at most one delivery attempt.

What a crash can duplicate: a relay killed between publishing and the end of its round leaves its claims leased; they
are published again when their leases run out, while the first messages may still be delivered (at-least-once, as
on every transport; the runtime absorbs duplicates). Nothing is lost: a row leaves the World only by the ack of the
worker that handled it.

This module knows no Celery: :class:`Publisher` is what publishes (``celery_workflow.relay_celery`` builds the
Celery one).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from celery_workflow._backend.broker import backoff
from celery_workflow._backend.queue_contract import Leases
from celery_workflow.errors import PayloadError
from celery_workflow.world import ClaimedDelivery, World

__all__ = [
    "ELECTION_LEASE",
    "MAX_WAIT",
    "Election",
    "Publisher",
    "Relay",
    "Waker",
    "extend_held",
    "lease_for",
    "lease_name",
    "leases_of",
]

log = logging.getLogger("celery_workflow.relay")

#: Seconds an elected relay holds its election lease (renewed every third of it); a relay that died is replaced
#: after at most this long.
ELECTION_LEASE = 15.0
#: The longest the relay sleeps between two looks at the World, whatever woke it or not.
MAX_WAIT = 1.0
#: The longest a republished row is leased: the relay lease doubles per claim up to this many times the first.
LEASE_GROWTH_CAP = 64
#: Deliveries claimed and published per round.
BATCH = 100


class Publisher(Protocol):
    """Publishes claimed deliveries to the app's broker."""

    def publish(self, claimed: ClaimedDelivery) -> None:
        """Publish ``claimed`` (its payload, its queue, its receipt and attempts in the headers); raise when the broker
        did not take it."""
        ...

    def ready(self) -> bool:
        """Whether the broker answers now (asked only after a publish failed)."""
        ...

    def close(self) -> None: ...


def lease_name(queues: Sequence[str]) -> str:
    """The election lease of a relay of ``queues`` (the set, in any order)."""
    return "celery_workflow.relay:" + ",".join(sorted(set(queues)))


def lease_for(lease: float, attempts: int) -> float:
    """How long the ``attempts``-th claim of a row is leased: ``lease``, doubled for each claim before it (the broker
    lost the message, or still holds it in a backlog), up to :data:`LEASE_GROWTH_CAP` times ``lease``."""
    return lease * min(2.0 ** min(max(attempts - 1, 0), 32), LEASE_GROWTH_CAP)


def leases_of(world: World) -> Leases | None:
    """Where ``world`` keeps named leases: its queue store, or the World itself; None when it keeps none."""
    store = getattr(world, "store", None)
    if isinstance(store, Leases):
        return store
    if isinstance(world, Leases):
        return world
    return None


def _holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass
class Election:
    """One relay at a time per World and queue set: a named lease renewed every third of ``seconds``."""

    leases: Leases | None
    name: str
    seconds: float = ELECTION_LEASE
    holder: str = field(default_factory=_holder)
    clock: Callable[[], float] = time.monotonic
    _renewed: float | None = None

    def hold(self) -> bool:
        """Whether this relay holds the lease now (renewing it when a third of it has passed)."""
        if self.leases is None:
            return True
        now = self.clock()
        if self._renewed is not None and now - self._renewed < self.seconds / 3:
            return True
        try:
            held = self.leases.hold_lease(self.name, self.holder, self.seconds)
        except Exception as exc:  # the World unreachable: not elected until it answers
            log.warning("relay %s: cannot renew its election lease (%s)", self.name, exc)
            held = False
        was = self._renewed is not None
        self._renewed = now if held else None
        if held and not was:
            log.info("relay %s: elected (%s)", self.name, self.holder)
        elif was and not held:
            log.warning("relay %s: lost its election lease", self.name)
        return held

    def drop(self) -> None:
        if self.leases is not None and self._renewed is not None:
            self._renewed = None
            try:
                self.leases.drop_lease(self.name, self.holder)
            except Exception as exc:
                log.warning("relay %s: cannot drop its election lease (%s)", self.name, exc)


class Waker:
    """How the relay waits for something to do: the World's change notifications and next due time when it offers
    them (its queue store's, or its own), else polling every ``poll`` seconds."""

    def __init__(self, world: World, queues: Sequence[str], *, poll: float | None = None) -> None:
        self.queues = list(queues)
        store = getattr(world, "store", None)
        source: Any = store if callable(getattr(store, "wait_for_change", None)) else world
        self._changes = source if callable(getattr(source, "wait_for_change", None)) else None
        self._due_source: Any = store if callable(getattr(store, "next_due", None)) else world
        self.poll = min(MAX_WAIT, poll if poll is not None else float(getattr(world, "poll_interval", MAX_WAIT)))

    def token(self) -> Any:
        if self._changes is None:
            return None
        try:
            return self._changes.change_token()
        except Exception:
            return None

    def next_due(self) -> float | None:
        """Epoch seconds at which the next row of the queues becomes claimable, when the World can tell."""
        next_due = getattr(self._due_source, "next_due", None)
        if not callable(next_due):
            return None
        try:
            due = next_due(self.queues)
        except Exception:
            return None
        if isinstance(due, datetime):
            return due.timestamp()
        return float(due) if isinstance(due, int | float) else None

    def wait(self, token: Any, timeout: float) -> None:
        """Sleep up to ``timeout`` seconds, less when the World changes after ``token`` was taken."""
        timeout = max(0.0, min(timeout, MAX_WAIT))
        if timeout <= 0:
            return
        if self._changes is None or token is None:
            time.sleep(min(timeout, self.poll))
            return
        try:
            self._changes.wait_for_change(token, timeout)
        except Exception:
            time.sleep(min(timeout, self.poll))


class Relay:
    """Publishes the due deliveries of ``queues`` from ``world`` to the app's broker through ``publisher`` (see the
    module docstring). :meth:`round` does one round; :meth:`serve` rounds until ``stop`` is set."""

    def __init__(
        self,
        world: World,
        queues: Sequence[str],
        publisher: Publisher,
        *,
        lease: float = 300.0,
        election: Election | None = None,
        batch: int = BATCH,
    ) -> None:
        if not queues:
            raise ValueError("a relay needs at least one queue")
        if lease <= 0:
            raise ValueError("lease must be positive")
        self.world = world
        self.queues = sorted(set(queues))
        self.publisher = publisher
        self.lease = lease
        self.batch = batch
        self.election = election or Election(
            leases_of(world), lease_name(self.queues), seconds=min(ELECTION_LEASE, max(lease, 1.0))
        )
        self.waker = Waker(world, self.queues)
        #: Deliveries published since start (what tests and the bench read).
        self.published = 0
        self._failures = 0
        self._beats = _Heartbeat(world, self.queues, self.election.holder, self.election.seconds)

    def round(self) -> int:
        """Claim the due deliveries (up to the batch) and publish them; the number published. After a failed
        publish, nothing is claimed until the publisher is ready again."""
        if self._failures and not self.publisher.ready():
            self._failures += 1
            return 0
        claims = self.world.claim(self.queues, limit=self.batch, lease=self.lease)
        done = 0
        for index, claim in enumerate(claims):
            try:
                longer = lease_for(self.lease, claim.attempts)
                if longer > self.lease:
                    self.world.extend([claim.receipt], longer)
                self.publisher.publish(claim)
            except PayloadError as exc:  # not a task message: the World's delivery limit dead-letters it in the end
                log.error("relay: %s", exc)
                self.world.retry_later(claim.receipt, backoff(claim.attempts), error=str(exc))
                continue
            except Exception as exc:
                self._failures += 1
                log.warning(
                    "relay: cannot publish delivery %s to queue %r (%s); giving back %d claim(s)",
                    claim.receipt,
                    claim.queue,
                    exc,
                    len(claims) - index,
                )
                for unpublished in claims[index:]:
                    try:
                        self.world.release(unpublished.receipt)
                    except Exception as again:  # its lease runs out instead
                        log.warning("relay: cannot give back %s (%s)", unpublished.receipt, again)
                break
            done += 1
        else:
            self._failures = 0
        self.published += done
        return done

    def serve(self, stop: threading.Event) -> None:
        """Round after round until ``stop`` is set: elected first, then woken by the World's changes, its next due
        time, or :data:`MAX_WAIT`. A World error is logged and retried after a backoff; the election lease is given
        up at the end."""
        errors = 0
        try:
            while not stop.is_set():
                if not self.election.hold():
                    self._beats.stop()
                    stop.wait(min(self.election.seconds / 3, MAX_WAIT * 5))
                    continue
                self._beats.beat()
                token = self.waker.token()
                try:
                    published = self.round()
                    errors = 0
                except Exception as exc:
                    errors += 1
                    delay = backoff(errors, base=0.5, cap=30.0)
                    log.warning("relay: round failed (%s); again in %.1f s", exc, delay)
                    stop.wait(delay)
                    continue
                if self._failures:
                    stop.wait(backoff(self._failures, base=0.5, cap=30.0))
                    continue
                if published >= self.batch:
                    continue  # more may be due already
                due = self.waker.next_due()
                timeout = MAX_WAIT if due is None else due - time.time()
                self.waker.wait(token, max(timeout, 0.02))  # never spin on a row due but not claimable yet
        finally:
            self._beats.stop()
            self.election.drop()


class _Heartbeat:
    """The elected relay shows as the consumer of its queues in the World's queue store, when the store records
    consumers (SQLite, Postgres), so ``runs list``, ``runs show`` and the inspector tell a run whose queue nobody
    relays (``worker_setup.unserved``); it also collects the heartbeats of relays that died (the store's ``gc``), as
    the transports' workers do on ``broker="world"``."""

    GC_EVERY = 60.0

    def __init__(self, world: World, queues: Sequence[str], holder: str, seconds: float) -> None:
        store = getattr(world, "store", None)
        self.store = store if callable(getattr(store, "touch", None)) else None
        self.queues, self.holder, self.every = list(queues), holder, seconds / 3
        self._touched: float | None = None
        self._collected = time.monotonic()

    def beat(self) -> None:
        if self.store is None:
            return
        now = time.monotonic()
        try:
            if self._touched is None or now - self._touched >= self.every:
                self.store.touch(self.holder, self.queues)
                self._touched = now
            if now - self._collected >= self.GC_EVERY and callable(getattr(self.store, "gc", None)):
                self._collected = now
                self.store.gc(consumer_timeout=self.GC_EVERY)
        except Exception as exc:
            log.warning("relay: cannot record its heartbeat (%s)", exc)

    def stop(self) -> None:
        if self.store is None or self._touched is None:
            return
        self._touched = None
        try:
            self.store.drop_consumer(self.holder, self.queues)
        except Exception as exc:
            log.warning("relay: cannot drop its heartbeat (%s)", exc)


def extend_held(world: World, receipts: Sequence[str], lease: float) -> None:
    """Extend the World leases of relayed deliveries a worker holds (reserved or running), so the relay does not
    publish them again while they are handled; stale receipts change nothing."""
    if receipts:
        world.extend(list(receipts), lease)
