"""The dead letters of the Postgres queue (:class:`~celery_workflow._backend.queue_contract.DeadLetterStore`; a part of
:class:`~celery_workflow._postgres.queue.PostgresQueue`): rows moved out of the queue table with their history."""

from __future__ import annotations

from collections.abc import Sequence

from celery_workflow import dead_letters as dead_letters_
from celery_workflow._backend.broker import dead_letters, parse_receipt
from celery_workflow._postgres import queue_sql as stmt
from celery_workflow._postgres.queue_base import Statements, utc
from celery_workflow.dead_letters import DeadLetter, cut_error
from celery_workflow.errors import DeadLetterNotFound

__all__ = ["DeadLetters"]


class DeadLetters:
    """The dead-letter table beside the queue table."""

    def __init__(self, sql: Statements) -> None:
        self.sql = sql

    def dead_letter(self, receipt: str, *, reason: str, error: str | None = None) -> DeadLetter | None:
        """Move the claimed row to the dead letters with its history (``error`` becomes its last error when given);
        None when the receipt is stale. On disk when this returns."""
        row_id, attempts = parse_receipt(receipt)
        rows = self.sql.rows(
            "dead-letter", stmt.DEAD_LETTER, commit_mode="disk", id=row_id, attempts=attempts, reason=reason,
            error=cut_error(error),
        )  # fmt: skip
        letters = dead_letters(rows, utc)
        return letters[0] if letters else None

    def list_dead_letters(
        self, *, queue: str | None = None, run_id: str | None = None, after: int | str = 0, limit: int = 100
    ) -> list[DeadLetter]:
        """Dead letters with ids above ``after``, oldest first (of ``queue`` / ``run_id`` when given)."""
        rows = self.sql.rows(
            "list dead letters",
            f"SELECT {stmt.DEAD_COLUMNS} FROM {stmt.DEAD} WHERE {stmt.DEAD_SELECTION}"
            " AND (%(run_id)s::text IS NULL OR run_id = %(run_id)s) AND id > %(after)s ORDER BY id LIMIT %(limit)s",
            ids=None, queue=queue, run_id=run_id, after=dead_letters_.letter_id(after), limit=max(limit, 0),
        )  # fmt: skip
        return dead_letters(rows, utc)

    def get_dead_letter(self, letter_id: int | str) -> DeadLetter:
        rows = self.sql.rows(
            "get dead letter",
            f"SELECT {stmt.DEAD_COLUMNS} FROM {stmt.DEAD} WHERE id = %(id)s",
            id=dead_letters_.letter_id(letter_id),
        )
        if not rows:
            raise DeadLetterNotFound(f"no dead letter {letter_id}")
        return dead_letters(rows, utc)[0]

    def unsettled_dead_letters(self, *, limit: int = 100) -> list[DeadLetter]:
        """Dead letters whose run has not been failed because of them yet, oldest first."""
        rows = self.sql.rows(
            "unsettled dead letters",
            f"SELECT {stmt.DEAD_COLUMNS} FROM {stmt.DEAD} WHERE run_settled_at IS NULL ORDER BY id LIMIT %(limit)s",
            limit=max(limit, 0),
        )
        return dead_letters(rows, utc)

    def settle_dead_letters(self, ids: Sequence[int | str]) -> None:
        """Record that the runs of these dead letters have been dealt with."""
        if ids:
            self.sql.rowcount(
                "settle dead letters",
                f"UPDATE {stmt.DEAD} SET run_settled_at = {stmt.NOW}"
                " WHERE id = ANY(%(ids)s::bigint[]) AND run_settled_at IS NULL",
                ids=[dead_letters_.letter_id(i) for i in ids],
            )

    def redrive_dead_letters(self, ids: Sequence[int | str] | None = None, *, queue: str | None = None) -> int:
        """Put the selected dead letters back on their queues, due now with attempts reset, and delete them."""
        if ids is not None and not ids:
            return 0
        chosen = None if ids is None else [dead_letters_.letter_id(i) for i in ids]
        return len(self.sql.rows("redrive dead letters", stmt.REDRIVE, commit_mode="disk", ids=chosen, queue=queue))

    def purge_dead_letters(self, ids: Sequence[int | str] | None = None, *, queue: str | None = None) -> int:
        if ids is not None and not ids:
            return 0
        chosen = None if ids is None else [dead_letters_.letter_id(i) for i in ids]
        return self.sql.rowcount(
            "purge dead letters", f"DELETE FROM {stmt.DEAD} WHERE {stmt.DEAD_SELECTION}", ids=chosen, queue=queue
        )
