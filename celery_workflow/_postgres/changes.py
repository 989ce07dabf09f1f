"""Change notification of the Postgres queue (a part of :class:`~celery_workflow._postgres.queue.PostgresQueue`): the
marks and waits of the queue channel of the process's LISTEN connection, no query."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from celery_workflow._postgres.database import PgDatabase
from celery_workflow._postgres.listener import CHANNEL_QUEUE

__all__ = ["Changes"]


class Changes:
    """What a consumer waits on: notifications of the queue channel, per queue or per key."""

    def __init__(self, db: PgDatabase) -> None:
        self.db = db

    def change_token(self, queues: Sequence[str] | None = None) -> Any:
        """A mark of the queue notifications seen so far (of ``queues``, or of any queue); take it before checking.

        Reconnections of the listener also count as a change (notifications may have been lost meanwhile).
        """
        listener = self.db.listener
        if queues is None:
            return (listener.mark(CHANNEL_QUEUE), None)
        return (listener.mark(CHANNEL_QUEUE), {q: listener.mark(CHANNEL_QUEUE, q) for q in dict.fromkeys(queues)})

    def wait_for_change(self, token: Any, timeout: float) -> bool:
        """Block until a queue notification after ``token`` (for one of its queues), or ``timeout`` seconds pass.

        A notification on another queue wakes this thread only to compare in-memory counters; no query runs.
        """
        listener = self.db.listener
        anything, marks = token
        if marks is None:
            return listener.wait(CHANNEL_QUEUE, anything, timeout)
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            current = listener.mark(CHANNEL_QUEUE)  # before comparing: a later notification ends the wait below
            if any(listener.mark(CHANNEL_QUEUE, q) != mark for q, mark in marks.items()):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            listener.wait(CHANNEL_QUEUE, current, left)

    def mark(self, key: str) -> Any:
        """The notification mark of one key of the queue channel (a queue's name, or a key :meth:`poke` wakes)."""
        return self.db.listener.mark(CHANNEL_QUEUE, key)

    def carried(self, key: str) -> str | None:
        """What the last notification of ``key`` carried after the queue's name (a row id, see ``NOTIFY_ROW``)."""
        return self.db.listener.carried(CHANNEL_QUEUE, key)

    def poke(self, key: str) -> None:
        """Wake this process's waiters on ``key`` as a notification would (no database round trip, no NOTIFY)."""
        self.db.listener.poke(CHANNEL_QUEUE, key)
