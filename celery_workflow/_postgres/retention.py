"""Retention of the Postgres World: deleting runs that ended longer ago than their workflow's retention.

Guarantees (seed "Retention"):

* Only runs that completed, failed or were cancelled expire, when ``completed_at`` is older than ``now`` minus their
  workflow's retention (``retentions[workflow]``, else ``retention``; ``None`` keeps forever). Pending and running
  runs never expire.
* Runs go in batches of :data:`BATCH`. Each batch is ONE statement: it picks the runs, oldest end first,
  ``FOR UPDATE SKIP LOCKED`` (so every worker sharing the database sweeps at once without waiting on each other, and
  a run being appended to is skipped until the next sweep), deletes their queued deliveries, their events, steps,
  hooks, the tokens they hold and their waits (those tables have no foreign key to the run:
  ``0005_append_tables_without_run_keys.sql``), and then the runs, whose streams and chunks go with them through
  ``ON DELETE CASCADE``. Nothing is appended to an ended run, so the statement's snapshot sees every row it deletes.
  A batch is all or nothing. Sweeps repeat until a batch finds fewer runs than :data:`BATCH`.
* A run that still holds a token whose retention has not ended (a hook's ``token_retention_until``, see
  :mod:`celery_workflow._postgres.append`) is kept until it ends (seed: "A run with a hook whose token retention has
  not ended is kept until it ends"); the sweep after that deletes it, and its token rows with it. The retention's end
  is compared with the sweep's ``now`` (this process's clock, as every time the World writes).

:class:`RetentionSweeper` runs the sweep at start and then every interval in a daemon thread; errors are logged and
the next sweep tries again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

import psycopg

from celery_workflow import ids
from celery_workflow._postgres.append import retained_until_sql
from celery_workflow._postgres.database import PgDatabase

__all__ = ["BATCH", "RetentionSweeper", "sweep_expired"]

log = logging.getLogger("celery_workflow.postgres.retention")

#: Runs deleted per statement.
BATCH = 100

#: The tables of a run's rows without a foreign key to it (``0005_append_tables_without_run_keys.sql``), by their
#: names after ``celery_workflow_``: the sweep deletes their rows itself.
RUN_TABLES = ("events", "steps", "hook_tokens", "hooks", "waits")

#: The queue table of :mod:`celery_workflow._postgres.queue` (``0002_queue.sql``): deliveries carry their run's id.
QUEUE_TABLE = "celery_workflow_queue"

_RUN_ROWS = "".join(
    f", {table} AS (DELETE FROM celery_workflow_{table} WHERE run_id IN (SELECT run_id FROM doomed))"
    for table in RUN_TABLES
)

_SWEEP = f"""
WITH cutoffs (workflow_name, cutoff) AS (
    SELECT * FROM unnest(%(names)s::text[], %(cutoffs)s::timestamptz[])
), doomed AS (
    SELECT r.run_id FROM celery_workflow_runs AS r LEFT JOIN cutoffs AS c ON c.workflow_name = r.workflow_name
    WHERE r.completed_at IS NOT NULL AND r.status IN ('completed', 'failed', 'cancelled')
      AND r.completed_at < CASE WHEN c.workflow_name IS NULL THEN %(default)s::timestamptz ELSE c.cutoff END
      AND NOT EXISTS (
          SELECT 1 FROM celery_workflow_hook_tokens AS t
          WHERE t.run_id = r.run_id AND {retained_until_sql("t")} > %(now)s::timestamptz
      )
    ORDER BY r.completed_at
    LIMIT %(batch)s
    FOR UPDATE OF r SKIP LOCKED
), deliveries AS (
    -- the queue's run_id has the database's default collation: compare in it, so its run_id index serves
    DELETE FROM {QUEUE_TABLE} WHERE run_id IN (SELECT run_id COLLATE "default" FROM doomed)
){_RUN_ROWS}
DELETE FROM celery_workflow_runs WHERE run_id IN (SELECT run_id FROM doomed)
"""


def sweep_expired(
    db: PgDatabase,
    retention: timedelta | None,
    retentions: Mapping[str, timedelta | None],
    *,
    now: datetime | None = None,
    batch: int = BATCH,
) -> int:
    """Delete every expired run (see the module docstring); return the number of runs deleted."""
    if retention is None and all(v is None for v in retentions.values()):
        return 0
    at = ids.to_utc(now) if now is not None else ids.utcnow()
    names = sorted(retentions)
    params: dict[str, Any] = {
        "names": names,
        "cutoffs": [None if (keep := retentions[n]) is None else at - keep for n in names],
        "default": None if retention is None else at - retention,
        "now": at,
        "batch": batch,
    }

    def one_batch(conn: psycopg.Connection[Any]) -> int:
        return int(conn.execute(_SWEEP, params).rowcount)

    total = 0
    while True:
        deleted = db.run(one_batch, what="retention sweep")
        total += deleted
        if deleted < batch:
            return total


class RetentionSweeper:
    """Calls ``sweep`` at start and then every ``interval`` seconds in a daemon thread until :meth:`stop`."""

    def __init__(self, sweep: Callable[[], int], interval: float = 60.0) -> None:
        if not interval > 0:
            raise ValueError("interval must be positive")
        self.sweep = sweep
        self.interval = interval
        self.sweeps = 0  # completed sweeps (successful or not), for tests and monitoring
        self.deleted = 0  # runs deleted by this sweeper
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="celery_workflow-retention", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the thread to stop and wait up to ``timeout`` seconds for a sweep in progress to finish."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.deleted += self.sweep()
            except Exception:
                log.exception("retention sweep failed; trying again in %.0f s", self.interval)
            self.sweeps += 1
            self._stop.wait(self.interval)
