"""Standing claims: a message inserted while a consumer waits idle is handed to it by the insert itself.

A consumer of the Postgres transport that polled its queues and found nothing to claim leaves a **standing claim**
(table ``celery_workflow_standing_claims``, migration ``0006``): its token, the queues it consumes (acknowledged
ones), its lease and a serial. An insert of one message due now (:data:`~.queue_sql.INSERT_HANDOFF`) takes the
oldest such claim of its queue, in the same statement, and stores the message already leased to that consumer
(attempts 1), as a claim would have; its notification is keyed by the claim's token and names the claim's serial and
the message's row id, nothing more (any role that can connect may LISTEN on the channel: notifications carry ids,
never data). The consumer, woken by that notification alone, reads the row by its key (:data:`~.queue_sql.FETCH_HANDED`,
one read, no write): the claim's update, the wake-up of every other consumer of the queue and the race between them
are gone from the path from a producer's commit to a running task.

Rules that keep every message delivered:

* **One message per claim.** The insert records the row it handed over (``assigned_id``); a claim with one is
  never taken again. The consumer registers again only when it would find nothing to claim, so it never holds more
  than its prefetch room.
* **Registered where a poll would find nothing**: by the poll that found nothing, in the same statement (a message
  committed before the claim is visible was either seen by that poll or is announced on its queue: the consumer's
  change token, taken before the poll, ends its wait; one inserted after finds the claim), or by the ack that frees
  the consumer's room, in the ack's round trip, when nothing was announced on its queues since its last look and
  that look left nothing due (the transport's ``ack``; between one-at-a-time messages, no poll runs at all).
* **Left as it is by a look that nothing prompted** (the polling interval, a due time): an idle consumer writes
  nothing; if that look claims something after all, the claim is withdrawn then.
* **Withdrawn before any other claim** (a later poll, a claim by notification), in the same round trip as that
  claim, and on its own when the consumer leaves its queues (at the cancel or channel close, not at its next turn:
  nothing may drain it again), the worker stops or the connection closes: the withdrawal waits for a producer
  handing a message over at that moment, and a message handed over whose notification has not arrived is released
  as never claimed (attempts back to 0) and claimable at once, by this poll or anyone's.
* **Alive, or passed over.** Each process's LISTEN connection holds a session-level advisory lock
  (:data:`~.listener.ALIVE_LOCK`); a producer takes a shared lock on it to check that the claim's consumer is still
  there (it cannot while the consumer's connection lives). A consumer killed while registered is passed over at
  once, and garbage collection deletes its claim. Only the rare message handed over in the moment before a kill is
  delivered again when its lease (the consumer's) runs out, as for any message a killed worker held.
* **Messages free to skip deduplication, due now, inserted alone.** Messages with an idempotency key to deduplicate
  against a pending one (``put``), delayed ones and inserts of several messages at once are stored and announced as
  before.
* **Fetched only while still the claim's**: the read checks that the claim of that serial holds the row and that the
  row is leased as the hand-off left it; otherwise (released, or claimed again after its lease ran out) the consumer
  polls as usual.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from celery_workflow._backend.broker import claimed
from celery_workflow._postgres import queue_sql as stmt
from celery_workflow._postgres.queue_base import Statements
from celery_workflow.world import ClaimedDelivery

if TYPE_CHECKING:
    from celery_workflow._postgres.queue import PostgresQueue

__all__ = ["Registration", "StandingClaim", "StandingClaims", "parse_handoff"]


@dataclass(frozen=True, slots=True)
class Registration:
    """One standing claim as its poll registers it: whose (token), which (serial), on which queues, and the object id
    of the advisory lock that shows its process alive."""

    token: str
    serial: int
    queues: tuple[str, ...]
    lock_key: int

    def params(self) -> dict[str, Any]:
        """The parameters of the statements that register it (queue_sql.REGISTER)."""
        return {"token": self.token, "standing": list(self.queues), "serial": self.serial, "lock_key": self.lock_key}


def parse_handoff(carried: str, serial: int) -> int | None:
    """The row id a hand-off notification named (``serial\\nid`` after the claim's token) to the claim of ``serial``;
    None for one of an earlier claim of the same consumer, or anything else."""
    parts = carried.split("\n")
    if len(parts) != 2 or parts[0] != str(serial) or not parts[1].isdigit():
        return None
    return int(parts[1])


class StandingClaim:
    """A consuming connection's standing claims, one at a time (the transport's side of the protocol).

    :meth:`offer` makes the registration a poll (or an ack) carries; :meth:`registered` records that it was made;
    :meth:`take` fetches what was handed to it; :meth:`withdrawal` / :meth:`withdrawn` end it in the round trip of
    another claim, :meth:`withdraw` on its own. The transport serialises the calls (its consumer thread, and the
    threads that ack).
    """

    def __init__(self, store: PostgresQueue) -> None:
        self.store = store
        #: The claim's key: its row, and the key of its notifications (which the consumer waits on).
        self.token = f"celery_workflow.standing:{uuid.uuid4().hex}"
        self._serial = 0
        self._live: Registration | None = None

    @property
    def live(self) -> Registration | None:
        """The registration that may be handed a message now (None: none, or its message was taken)."""
        return self._live

    def offer(self, queues: Sequence[str]) -> Registration | None:
        """A new registration on ``queues`` for a poll to make, or None (no queue, or this process's LISTEN
        connection holds no lock to show it alive: it is reconnecting)."""
        lock_key = self.store.db.listener.lock_key
        if not queues or lock_key is None:
            return None
        self._serial += 1
        return Registration(self.token, self._serial, tuple(queues), lock_key)

    def registered(self, registration: Registration) -> None:
        self._live = registration

    def take(self) -> ClaimedDelivery | None:
        """The message handed to the live registration, if its notification has arrived: read by its row id (the
        claim is used up, whether the row is still the claim's or not; a failed read leaves it live, to withdraw)."""
        live = self._live
        if live is None:
            return None
        carried = self.store.carried(self.token)
        row_id = None if carried is None else parse_handoff(carried, live.serial)
        if row_id is None:
            return None
        handed = self.store.fetch_handed(live.token, live.serial, row_id)
        self._live = None
        return handed

    def withdrawal(self) -> str | None:
        """The token to withdraw in the round trip of the next claim, when a registration is live; once that round
        trip succeeded, :meth:`withdrawn` (until then the registration counts as live: a failed round trip leaves it
        standing in the database, and the next claim withdraws it again)."""
        return None if self._live is None else self._live.token

    def withdrawn(self) -> None:
        self._live = None

    def withdraw(self, *, forget: bool = False) -> None:
        """Withdraw the live registration now (a message handed to it that this consumer never saw is released);
        ``forget``: and delete the claim's row (the connection closes)."""
        live = self._live is not None
        if live or forget:
            self.store.withdraw(self.token, release=live, forget=forget)
        self._live = None


class StandingClaims:
    """The store's side of standing claims (a part of :class:`~celery_workflow._postgres.queue.PostgresQueue`): a
    claim by notification, the read of a handed-off message, the withdrawal. Registering rides on a poll or an ack
    (:class:`~celery_workflow._postgres.deliveries.Deliveries`)."""

    def __init__(self, sql: Statements) -> None:
        self.sql = sql

    def claim_notified(
        self, queue: str, row_id: int, *, lease: float = 60.0, withdraw: str | None = None
    ) -> list[ClaimedDelivery]:
        """Lease the row a notification of ``queue`` announced (see ``NOTIFY_ROW``), if it is still claimable and no
        other claim has it: one index lookup by key, where :meth:`poll` looks through every queue. The caller knows
        it is the queue's only claimable row (else it must :meth:`poll`, which claims the oldest first).
        ``withdraw``: as in :meth:`poll`."""
        rows = self.sql.rows(
            "claim", stmt.CLAIM_NOTIFIED, commit_mode="lazy", id=row_id, queue=queue, lease=timedelta(seconds=lease),
            before=() if withdraw is None else stmt.WITHDRAWAL, token=withdraw,
        )  # fmt: skip
        return [claimed(r[0], r[1], r[2], r[3], r[4]) for r in rows]

    def fetch_handed(self, token: str, serial: int, row_id: int) -> ClaimedDelivery | None:
        """The message handed to the standing claim ``token`` of ``serial`` (row ``row_id``, as its notification
        named it), while it is still that claim's and leased as the hand-off left it; None otherwise. One read by
        key, no write (see ``queue_sql.FETCH_HANDED``)."""
        rows = self.sql.rows("fetch a handed-off message", stmt.FETCH_HANDED, token=token, serial=serial, id=row_id)
        return claimed(rows[0][0], rows[0][1], rows[0][2], rows[0][3], rows[0][4]) if rows else None

    def withdraw(self, token: str, *, release: bool = True, forget: bool = False) -> None:
        """End the standing claim ``token`` (see :mod:`.standing`): no longer offered; ``release``: a message handed
        to it goes back to its queue as never claimed; ``forget``: its row is deleted too."""
        statements = [
            *(stmt.WITHDRAWAL if release else stmt.WITHDRAWAL[:1]),
            *([stmt.FORGET_STANDING] if forget else []),
        ]
        self.sql.rows(
            "withdraw a standing claim", statements[-1], commit_mode="lazy", before=statements[:-1], token=token
        )
