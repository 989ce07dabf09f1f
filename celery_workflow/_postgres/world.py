"""The Postgres World: workflow state in PostgreSQL, safe for many processes at once (seed ``postgres-world.txt``).

``PostgresWorld.open(url)`` opens and owns a connection pool; ``PostgresWorld(pool)`` uses a caller's
:class:`psycopg_pool.ConnectionPool` and leaves it open on :meth:`~PostgresWorld.close`. Both migrate the schema
(``sql/postgres/NNNN_*.sql`` under an advisory lock; a newer schema is refused with
:class:`~celery_workflow.errors.SchemaVersionError`). Tables (``0001_world.sql``, prefixed ``celery_workflow_``) go
to the connection's ``search_path``: ``runs`` (the run view plus ``event_count``), ``events`` keyed by
``(run_id, slot)``, ``steps``, ``hooks``, ``hook_tokens`` (its primary key makes a token single-owner), ``waits``,
``streams`` and ``stream_chunks``. The queue table (``0002_queue.sql``) belongs to
:class:`celery_workflow._postgres.queue.PostgresQueue`, which is also the storage of the Postgres Kombu transport.

Consistency (every write is one :meth:`~celery_workflow._postgres.database.PgDatabase.run` transaction, retried on deadlocks,
serialization failures and lost connections):

* An append locks the run row (``SELECT … FOR NO KEY UPDATE``: it excludes every other appender and the retention
  sweep, but not the foreign-key checks of stream writes), reads the rows :func:`~celery_workflow.events.keys_of`
  names into a :class:`~celery_workflow.events.Snapshot`, lets :func:`~celery_workflow.events.plan_append` apply the
  rules, and writes the events at the next slots, the views, hook and token rows, the run-end cleanup and the
  deliveries. Writers of one run are serialized across processes, slots are contiguous, a batch is all or nothing
  and a rejected batch writes nothing. A run's end sends ``pg_notify('celery_workflow_runs', run_id)`` at commit.
* Token locks: ``hook_created`` takes a two-key advisory lock per claimed token (a free token has no row to lock),
  in ascending key order, so exactly one concurrent claimant wins a free token. Then ONE statement locks, in token
  order, the token rows the batch may claim or release (the owners' rows of claimed tokens; every token of the run
  when the batch holds a run-ending event, else those of the hooks it disposes). Every append takes its locks in
  the same order (run row, advisory locks, token rows) and takes none afterwards, so hook claims across runs never
  deadlock. (A forced claim over a live owner, which would lock the owner's run too, is not modelled by
  :mod:`celery_workflow.events` yet.)
* Lost answers: each ``create_run``/``append`` call writes its events with a ``write_id`` of its own. When the
  connection is lost after the server committed (a retry of :meth:`~celery_workflow._postgres.database.PgDatabase.run`), the
  retry finds its events and returns them instead of applying the batch twice (an append that wrote no event, a
  no-op batch, is simply repeated: its deliveries may then be stored twice unless they carry idempotency keys).
* Waiters (:meth:`PostgresWorld.wait_for_terminal`, :meth:`PostgresWorld.read_stream` with ``wait``) take a mark of
  the per-process LISTEN connection before they check, and wait for a notification or ``poll_interval`` at most.

Retention (:meth:`PostgresWorld.sweep_expired`, :meth:`PostgresWorld.start_retention`) lives in
:mod:`celery_workflow._postgres.retention`, streams in :mod:`celery_workflow._postgres.streams`, configuration in
:mod:`celery_workflow._postgres.config`, row mapping in :mod:`celery_workflow._postgres.rows`. Timestamps come from this
process's clock (UTC, microseconds), as in the other Worlds; the queue's lease and due times use the server's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import ConnectionPool

from celery_workflow import events as rules
from celery_workflow import ids
from celery_workflow._backend.checks import check_deliveries, normalise
from celery_workflow._postgres.append import LockedReads, SnapshotCache, WholeRun, lock_tokens_sql, releases, write_plan
from celery_workflow._postgres.config import PostgresConfig, config_with, postgres_url
from celery_workflow._postgres.database import CHANNEL_RUNS, PgDatabase, Script
from celery_workflow._postgres.queue import PostgresQueue, parse_receipt
from celery_workflow._postgres.retention import RetentionSweeper, sweep_expired
from celery_workflow._postgres.rows import (
    COLUMNS,
    EVENT,
    HOOK,
    HOOK_H,
    RUN,
    STEP,
    WAIT,
    event,
    event_row,
    hook_view,
    insert_sql,
    row,
    run_view,
    step_view,
    wait_view,
)
from celery_workflow._postgres.streams import PgStreams
from celery_workflow.errors import (
    CeleryWorkflowError,
    EntityExists,
    HookNotFound,
    RunNotFound,
    StepNotFound,
    WorldError,
)
from celery_workflow.events import Event, EventType, HookView, NewEvent, RunStatus, RunView, StepView, WaitView
from celery_workflow.world import (
    AppendResult,
    BrokerSpec,
    ClaimedDelivery,
    Delivery,
    NewRun,
    Page,
    StreamPage,
)

__all__ = ["PostgresConfig", "PostgresWorld", "postgres_url"]

Conn = psycopg.Connection[Any]


class PostgresWorld:
    """A World in PostgreSQL: storage, queue (via :class:`~celery_workflow._postgres.queue.PostgresQueue`) and streams.

    Thread-safe; fork-safe when it owns its pool (:meth:`open`): a forked child opens its own connections.
    """

    def __init__(
        self,
        pool: ConnectionPool | PgDatabase,
        config: PostgresConfig | None = None,
        *,
        migrate: bool = True,
        **overrides: Any,
    ) -> None:
        """A World on a caller's pool (left open by :meth:`close`) or on a :class:`~celery_workflow._postgres.database.PgDatabase`
        (left open too: its owner closes it). ``overrides`` are :class:`PostgresConfig` fields."""
        self.config = config_with(config, overrides)
        self.poll_interval = self.config.poll_interval
        self.db = pool if isinstance(pool, PgDatabase) else PgDatabase(pool)
        self._owns_db = not isinstance(pool, PgDatabase)
        if migrate:
            self.db.migrate()
        #: The queue store (shared with the Postgres Kombu transport).
        self.queue = PostgresQueue(self.db)
        self.streams = PgStreams(self.db, self.poll_interval)
        self._snapshots = SnapshotCache()
        self._sweeper: RetentionSweeper | None = None

    @classmethod
    def open(
        cls, url: str, config: PostgresConfig | None = None, *, migrate: bool = True, **overrides: Any
    ) -> PostgresWorld:
        """A World with a pool of its own on ``url`` (closed by :meth:`close`)."""
        settings = config_with(config, overrides)
        db = PgDatabase.open(url, max_size=settings.concurrency + 5)
        try:
            world = cls(db, settings, migrate=migrate)
        except BaseException:
            db.close()
            raise
        world._owns_db = True
        return world

    def __repr__(self) -> str:
        return f"PostgresWorld({postgres_url(self.db.conninfo)!r})"

    # -- storage: writes -----------------------------------------------------------------------------------------

    def create_run(self, run: NewRun, deliveries: Sequence[Delivery] = ()) -> tuple[RunView, bool]:
        check_deliveries(deliveries)
        (created,) = normalise([NewEvent(EventType.RUN_CREATED, None, run.event_data())])
        view_, first = rules.new_run(run.run_id, created.data, ids.utcnow())  # EventInvalid before any round trip
        values = row("runs", view_)
        write_id = uuid.uuid4().hex

        def tx(conn: Conn) -> tuple[RunView, bool]:
            # One round trip: the run, its first event and its deliveries are inserted only if the run is new (the
            # event and the deliveries are conditional on the event row this call wrote), then the run as stored
            # and whether this call wrote it, which also answers a retry whose first commit lost its answer.
            script = Script(conn)
            script.begin()
            script.add(
                insert_sql("celery_workflow_runs", list(values)) + " ON CONFLICT DO NOTHING", tuple(values.values())
            )
            script.add(
                insert_sql("celery_workflow_events", COLUMNS["celery_workflow_events"]) + " ON CONFLICT DO NOTHING",
                event_row(first, write_id),
            )
            mine = "EXISTS (SELECT 1 FROM celery_workflow_events WHERE run_id = %(w_run)s AND slot = 1 AND write_id = %(w_id)s)"
            gate = {"w_run": run.run_id, "w_id": write_id}
            self.queue.add_inserts(script, deliveries, when=(mine, gate))
            stored = script.add(f"SELECT {RUN}, {mine} FROM celery_workflow_runs WHERE run_id = %(w_run)s", gate)
            script.add("COMMIT")
            found = script.send()[stored].one()
            if found is None:  # pragma: no cover - the row was inserted or existed in this transaction
                raise WorldError(f"run {run.run_id} kept appearing and disappearing")
            existing, written = run_view(found[:-1]), bool(found[-1])
            if not written and existing.workflow_name != run.workflow_name:
                raise EntityExists(
                    f"run {run.run_id} belongs to workflow {existing.workflow_name!r}, not {run.workflow_name!r}"
                )
            return existing, written

        return self.db.run(tx, what="create_run", transaction=False)

    def append(
        self,
        run_id: str,
        events: Sequence[NewEvent],
        *,
        expected_count: int | None = None,
        deliveries: Sequence[Delivery] = (),
        ack: str | None = None,
        durable: bool = True,
    ) -> AppendResult:
        """Append a batch (see the module docstring); ``ack`` deletes that claim in the same transaction, and
        ``durable=False`` commits with ``synchronous_commit = off`` (visible at once, on disk with the next durable
        commit)."""
        check_deliveries(deliveries)
        if ack is not None:
            parse_receipt(ack)  # a malformed receipt is a WorldError before anything is written
        batch = normalise(events)
        keys = rules.keys_of(batch)
        write_id = uuid.uuid4().hex
        attempts = 0

        def tx(conn: Conn) -> AppendResult:
            nonlocal attempts
            attempts += 1
            if attempts == 1 and not keys.tokens:
                kept = self._on_kept_snapshot(
                    conn,
                    run_id=run_id,
                    batch=batch,
                    expected_count=expected_count,
                    deliveries=deliveries,
                    ack=ack,
                    durable=durable,
                    write_id=write_id,
                )
                if kept is not None:
                    return kept
            # Two round trips: BEGIN and every read under the run's lock, then (rules applied here) every write
            # and COMMIT. A rule violation or a lost connection leaves the transaction to be rolled back.
            self._snapshots.forget(run_id)  # this path reads only what the batch names
            script = Script(conn)
            script.begin(synchronous_commit=None if durable else False)
            reads = LockedReads(script, run_id, keys, batch, retry_of=write_id if attempts > 1 else None)
            snapshot, done = reads.snapshot(script.send())
            if done:  # an earlier attempt committed before its connection was lost
                assert snapshot.run is not None
                return AppendResult(done, snapshot.run)
            plan = rules.plan_append(snapshot, batch, now=ids.utcnow(), expected_count=expected_count)
            self._finish(script, plan, write_id, deliveries, ack)
            script.send()
            return AppendResult(plan.events, plan.run)

        return self.db.run(tx, what="append", transaction=False)

    def _on_kept_snapshot(
        self,
        conn: Conn,
        *,
        run_id: str,
        batch: Sequence[NewEvent],
        expected_count: int | None,
        deliveries: Sequence[Delivery],
        ack: str | None,
        durable: bool,
        write_id: str,
    ) -> AppendResult | None:
        """The batch planned on this process's snapshot of the run and written in one round trip, or None when
        there is no usable snapshot or it proved stale (then nothing was written; see :mod:`celery_workflow._postgres.append`)."""
        kept = self._snapshots.get(run_id)
        if kept is None:
            return None
        try:
            plan = rules.plan_append(kept, batch, now=ids.utcnow(), expected_count=expected_count)
        except CeleryWorkflowError:  # maybe only the snapshot is stale: fresh reads decide
            self._snapshots.forget(run_id)
            return None
        if not plan.events:  # nothing would refuse a stale plan
            return None
        script = Script(conn)
        script.begin(synchronous_commit=None if durable else False)
        script.add("SELECT 1 FROM celery_workflow_runs WHERE run_id = %s FOR NO KEY UPDATE", (run_id,))
        ending, disposed = releases(batch)
        if ending or disposed:
            script.add(*lock_tokens_sql(run_id, [], ending, disposed))
        self._finish(script, plan, write_id, deliveries, ack)
        try:
            script.send()
        except (pg_errors.UniqueViolation, pg_errors.ForeignKeyViolation):
            conn.rollback()  # the snapshot was stale: another writer took the slot, or the run is gone
            self._snapshots.forget(run_id)
            return None
        self._snapshots.put(rules.advance(kept, plan))
        return AppendResult(plan.events, plan.run)

    def _finish(
        self, script: Script, plan: rules.Plan, write_id: str, deliveries: Sequence[Delivery], ack: str | None
    ) -> None:
        """Queue the plan's writes, the deliveries, the ack, the run-end notification and COMMIT."""
        write_plan(script, plan, write_id)
        self.queue.add_inserts(script, deliveries)
        if ack is not None:
            self.queue.add_delete_claim(script, ack)
        if plan.run_ended:
            script.add("SELECT pg_notify(%s, %s)", (CHANNEL_RUNS, plan.run.run_id))
        script.add("COMMIT")

    @staticmethod
    def _load_run(conn: Conn, run_id: str) -> RunView | None:
        stored = conn.execute(f"SELECT {RUN} FROM celery_workflow_runs WHERE run_id = %s", (run_id,)).fetchone()
        return None if stored is None else run_view(stored)

    @staticmethod
    def _require_run(conn: Conn, run_id: str) -> None:
        if conn.execute("SELECT 1 FROM celery_workflow_runs WHERE run_id = %s", (run_id,)).fetchone() is None:
            raise RunNotFound(f"run {run_id} does not exist")

    # -- storage: reads ------------------------------------------------------------------------------------------

    def get_run(self, run_id: str) -> RunView:
        found = self.db.run(lambda conn: self._load_run(conn, run_id), what="get_run", transaction=False)
        if found is None:
            raise RunNotFound(f"run {run_id} does not exist")
        return found

    def get_run_with_events(self, run_id: str) -> tuple[RunView, list[Event]]:
        """The run and its log, read with the run's whole state in one round trip; that state is kept for the
        run's next append (see :mod:`celery_workflow._postgres.append`)."""

        def tx(conn: Conn) -> tuple[rules.Snapshot | None, list[Event]]:
            script = Script(conn)
            reads = WholeRun(script, run_id)
            return reads.read(script.send())

        snapshot, log = self.db.run(tx, what="get_run_with_events", transaction=False)
        if snapshot is None or snapshot.run is None:
            raise RunNotFound(f"run {run_id} does not exist")
        self._snapshots.put(snapshot)
        return snapshot.run, log

    def list_runs(
        self,
        *,
        workflow: str | None = None,
        status: RunStatus | str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page[RunView]:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        where: list[str] = []
        params: list[Any] = []
        if workflow is not None:
            where.append("workflow_name = %s")
            params.append(workflow)
        if status is not None:
            where.append("status = %s")
            params.append(RunStatus(status).value)
        if cursor is not None:
            where.append("run_id < %s")
            params.append(cursor)
        sql = f"SELECT {RUN} FROM celery_workflow_runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY run_id DESC LIMIT %s"
        stored = self.db.run(
            lambda conn: conn.execute(sql, (*params, limit + 1)).fetchall(), what="list_runs", transaction=False
        )
        views = [run_view(r) for r in stored[:limit]]
        return Page(views, views[-1].run_id if len(stored) > limit else None)

    def list_events(self, run_id: str, *, after_slot: int = 0, limit: int | None = None) -> list[Event]:
        def tx(conn: Conn) -> list[Event]:
            stored = conn.execute(
                f"SELECT {EVENT} FROM celery_workflow_events WHERE run_id = %s AND slot > %s ORDER BY slot LIMIT %s",
                (run_id, after_slot, None if limit is None else max(limit, 0)),
            ).fetchall()
            if not stored:
                self._require_run(conn, run_id)
            return [event(r) for r in stored]

        return self.db.run(tx, what="list_events", transaction=False)

    def get_step(self, run_id: str, step_id: str) -> StepView:
        def tx(conn: Conn) -> StepView:
            stored = conn.execute(
                f"SELECT {STEP} FROM celery_workflow_steps WHERE run_id = %s AND step_id = %s", (run_id, step_id)
            ).fetchone()
            if stored is None:
                self._require_run(conn, run_id)
                raise StepNotFound(f"step {step_id} of run {run_id} does not exist")
            return step_view(stored)

        return self.db.run(tx, what="get_step", transaction=False)

    def _list(self, run_id: str, sql: str) -> list[Any]:
        def tx(conn: Conn) -> list[Any]:
            stored = conn.execute(sql, (run_id,)).fetchall()
            if not stored:
                self._require_run(conn, run_id)
            return stored

        return self.db.run(tx, what="listing", transaction=False)

    def list_steps(self, run_id: str) -> list[StepView]:
        stored = self._list(run_id, f"SELECT {STEP} FROM celery_workflow_steps WHERE run_id = %s ORDER BY created_slot")
        return [step_view(r) for r in stored]

    def get_hook_by_token(self, token: str) -> HookView:
        stored = self.db.run(
            lambda conn: conn.execute(
                f"SELECT {HOOK_H} FROM celery_workflow_hook_tokens AS t JOIN celery_workflow_hooks AS h"
                " ON h.run_id = t.run_id AND h.hook_id = t.hook_id WHERE t.token = %s",
                (token,),
            ).fetchone(),
            what="get_hook_by_token",
            transaction=False,
        )
        if stored is None:
            raise HookNotFound(f"no live hook owns token {token!r}")
        return hook_view(stored)

    def list_hooks(self, run_id: str) -> list[HookView]:
        stored = self._list(run_id, f"SELECT {HOOK} FROM celery_workflow_hooks WHERE run_id = %s ORDER BY created_slot")
        return [hook_view(r) for r in stored]

    def list_waits(self, run_id: str) -> list[WaitView]:
        stored = self._list(run_id, f"SELECT {WAIT} FROM celery_workflow_waits WHERE run_id = %s ORDER BY created_slot")
        return [wait_view(r) for r in stored]

    def wait_for_terminal(self, run_id: str, timeout: float | None) -> RunView:
        """Wait for the run's end: a NOTIFY on ``celery_workflow_runs`` wakes it; it re-checks every poll_interval."""
        if timeout is not None and timeout <= 0:
            return self.get_run(run_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        listener = self.db.listener
        while True:
            mark = listener.mark(CHANNEL_RUNS, run_id)
            current = self.get_run(run_id)
            left = self.poll_interval if deadline is None else min(self.poll_interval, deadline - time.monotonic())
            if current.status.terminal or left <= 0:
                return current
            listener.wait(CHANNEL_RUNS, mark, left, key=run_id)

    # -- queue (PostgresQueue) -----------------------------------------------------------------------------------

    def enqueue(self, deliveries: Sequence[Delivery]) -> list[bool]:
        check_deliveries(deliveries)
        return self.queue.enqueue(deliveries)

    def claim(self, queues: Sequence[str], *, limit: int = 1, lease: float = 60.0) -> list[ClaimedDelivery]:
        if lease <= 0:
            raise ValueError("lease must be positive")
        return self.queue.claim(queues, limit=limit, lease=lease)

    def ack(self, receipt: str) -> None:
        self.queue.ack(receipt)

    def release(self, receipt: str) -> None:
        self.queue.release(receipt)

    def retry_later(self, receipt: str, delay: float) -> None:
        self.queue.retry_later(receipt, delay)

    def extend(self, receipts: Sequence[str], lease: float) -> None:
        self.queue.extend(receipts, lease)

    # -- streams (PgStreams) -------------------------------------------------------------------------------------

    def write_stream(self, run_id: str, name: str, chunks: Sequence[bytes]) -> int:
        return self.streams.write(run_id, name, chunks)

    def close_stream(self, run_id: str, name: str) -> None:
        self.streams.close(run_id, name)

    def read_stream(
        self, run_id: str, name: str, *, start: int = 0, limit: int | None = None, wait: float = 0.0
    ) -> StreamPage:
        return self.streams.read(run_id, name, start=start, limit=limit, wait=wait)

    def list_streams(self, run_id: str) -> list[str]:
        return self.streams.names(run_id)

    # -- retention -----------------------------------------------------------------------------------------------

    def sweep_expired(self, now: datetime | None = None) -> int:
        """Delete the runs that ended longer ago than their workflow's retention; return how many (see
        :func:`celery_workflow._postgres.retention.sweep_expired`)."""
        return sweep_expired(self.db, self.config.retention, self.config.retentions, now=now)

    def start_retention(self, interval: float = 60.0) -> RetentionSweeper | None:
        """Sweep now and then every ``interval`` seconds in a daemon thread; None when no retention is configured.

        The sweeper stops with :meth:`close` (or its own :meth:`~RetentionSweeper.stop`). Calling this again while
        a sweeper runs returns that sweeper.
        """
        if not self.config.expires_runs:
            return None
        if self._sweeper is None or not self._sweeper.alive:
            self._sweeper = RetentionSweeper(self.sweep_expired, interval)
            self._sweeper.start()
        return self._sweeper

    # -- wiring --------------------------------------------------------------------------------------------------

    def broker(self) -> BrokerSpec:
        """The Postgres Kombu transport on this database (the same connection string, search_path included)."""
        return BrokerSpec(
            transport="celery_workflow.transport.postgres:Transport",
            url=postgres_url(self.db.conninfo),
            options={"lease_seconds": self.config.lease, "polling_interval": self.config.poll_interval},
        )

    def close(self) -> None:
        """Stop the retention sweeper and close the listener; close the pool only when :meth:`open` made it."""
        if self._sweeper is not None:
            self._sweeper.stop()
            self._sweeper = None
        if self._owns_db:
            self.db.close()
