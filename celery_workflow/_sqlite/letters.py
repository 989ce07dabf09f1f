"""The dead letters of the SQLite queue (:class:`~celery_workflow._backend.queue_contract.DeadLetterStore`; a part of
:class:`~celery_workflow._sqlite.queue.SQLiteQueue`): rows moved out of the queue table with their history."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_workflow import dead_letters as dead_letters_
from celery_workflow._backend.broker import (
    BROKER_QUEUES,
    DEAD_LETTER_COLUMNS,
    DEAD_LETTERS,
    QUEUE,
    dead_letters,
    parse_receipt,
)
from celery_workflow._sqlite.queue_base import Transactions, from_micros, marks
from celery_workflow.dead_letters import DeadLetter, cut_error
from celery_workflow.errors import DeadLetterNotFound

__all__ = ["DeadLetters"]

_Q = QUEUE
_QUEUES = BROKER_QUEUES
_DEAD = DEAD_LETTERS
_DEAD_COLUMNS = ", ".join(DEAD_LETTER_COLUMNS.split())


class DeadLetters:
    """The dead-letter table beside the queue table."""

    def __init__(self, tx: Transactions) -> None:
        self.tx = tx

    def dead_letter(self, receipt: str, *, reason: str, error: str | None = None) -> DeadLetter | None:
        """Move the claimed row to the dead letters with its history (``error`` becomes its last error when given);
        None when the receipt is stale."""
        row_id, attempts = parse_receipt(receipt)
        now = self.tx.now()
        with self.tx.write() as conn:
            rows = conn.execute(
                f"INSERT INTO {_DEAD} (message_id, queue, payload, run_id, attempts, reason, last_error,"
                " first_failed_at, last_failed_at, enqueued_at, dead_at, run_settled_at)"
                " SELECT id, queue, payload, run_id, attempts, ?, COALESCE(?, last_error), first_failed_at,"
                " last_failed_at, created_at, ?, CASE WHEN run_id IS NULL THEN ? END"
                f" FROM {_Q} WHERE id = ? AND attempts = ? AND lease_until IS NOT NULL RETURNING {_DEAD_COLUMNS}",
                (reason, cut_error(error), now, now, row_id, attempts),
            ).fetchall()
            if rows:
                conn.execute(f"DELETE FROM {_Q} WHERE id = ?", (row_id,))
        letters = dead_letters(rows, from_micros)
        return letters[0] if letters else None

    @staticmethod
    def _selection(ids: Sequence[int | str] | None, queue: str | None, alias: str = "") -> tuple[str, list[Any]]:
        where: list[str] = ["1 = 1"]
        params: list[Any] = []
        if ids is not None:
            where.append(f"{alias}id IN ({marks(ids)})")
            params.extend(dead_letters_.letter_id(i) for i in ids)
        if queue is not None:
            where.append(f"{alias}queue = ?")
            params.append(queue)
        return " AND ".join(where), params

    def list_dead_letters(
        self, *, queue: str | None = None, run_id: str | None = None, after: int | str = 0, limit: int = 100
    ) -> list[DeadLetter]:
        """Dead letters with ids above ``after``, oldest first (of ``queue`` / ``run_id`` when given)."""
        where, params = self._selection(None, queue)
        if run_id is not None:
            where += " AND run_id = ?"
            params.append(run_id)
        rows = self.tx.read(
            f"SELECT {_DEAD_COLUMNS} FROM {_DEAD} WHERE {where} AND id > ? ORDER BY id LIMIT ?",
            (*params, dead_letters_.letter_id(after), max(limit, 0)),
        )
        return dead_letters(rows, from_micros)

    def get_dead_letter(self, letter_id: int | str) -> DeadLetter:
        rows = self.tx.read(f"SELECT {_DEAD_COLUMNS} FROM {_DEAD} WHERE id = ?", (dead_letters_.letter_id(letter_id),))
        if not rows:
            raise DeadLetterNotFound(f"no dead letter {letter_id}")
        return dead_letters(rows, from_micros)[0]

    def unsettled_dead_letters(self, *, limit: int = 100) -> list[DeadLetter]:
        """Dead letters whose run has not been failed because of them yet, oldest first."""
        rows = self.tx.read(
            f"SELECT {_DEAD_COLUMNS} FROM {_DEAD} WHERE run_settled_at IS NULL ORDER BY id LIMIT ?", (max(limit, 0),)
        )
        return dead_letters(rows, from_micros)

    def settle_dead_letters(self, ids: Sequence[int | str]) -> None:
        """Record that the runs of these dead letters have been dealt with."""
        if not ids:
            return
        with self.tx.write() as conn:
            conn.execute(
                f"UPDATE {_DEAD} SET run_settled_at = ? WHERE id IN ({marks(ids)}) AND run_settled_at IS NULL",
                (self.tx.now(), *ids),
            )

    def redrive_dead_letters(self, ids: Sequence[int | str] | None = None, *, queue: str | None = None) -> int:
        """Put the selected dead letters back on their queues, due now with attempts reset, and delete them."""
        if ids is not None and not ids:
            return 0
        where, params = self._selection(ids, queue)
        aliased, _ = self._selection(ids, queue, "d.")
        now = self.tx.now()
        with self.tx.write() as conn:
            moved = conn.execute(
                f"INSERT INTO {_Q} (queue, payload, run_id, not_before, expires_at, created_at)"
                f" SELECT d.queue, d.payload, d.run_id, ?, ? + q.message_ttl_ms * 1000, ? FROM {_DEAD} AS d"
                f" LEFT JOIN {_QUEUES} AS q ON q.name = d.queue WHERE {aliased} ORDER BY d.id",
                (now, now, now, *params),
            ).rowcount
            conn.execute(f"DELETE FROM {_DEAD} WHERE {where}", params)
        return int(moved)

    def purge_dead_letters(self, ids: Sequence[int | str] | None = None, *, queue: str | None = None) -> int:
        if ids is not None and not ids:
            return 0
        where, params = self._selection(ids, queue)
        with self.tx.write() as conn:
            return int(conn.execute(f"DELETE FROM {_DEAD} WHERE {where}", params).rowcount)
