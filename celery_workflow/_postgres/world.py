"""The Postgres World: workflow state in PostgreSQL, safe for many processes at once (seed ``postgres-world.txt``).

``PostgresWorld.open(url)`` opens and owns a connection pool; ``PostgresWorld(pool)`` uses a caller's
:class:`psycopg_pool.ConnectionPool` and leaves it open on :meth:`~PostgresWorld.close`. Both migrate the schema
(``sql/postgres/NNNN_*.sql`` under an advisory lock; a newer schema is refused with
:class:`~celery_workflow.errors.SchemaVersionError`). Tables (``0001_world.sql``, prefixed ``celery_workflow_``) go
to the connection's ``search_path``: ``runs`` (the run view plus ``event_count``), ``events`` keyed by
``(run_id, slot)``, ``steps``, ``hooks``, ``hook_tokens`` (its primary key makes a token single-owner; a row may
outlive its hook while the token is retained, ``0004_token_retention.sql``), ``waits``, ``streams`` and
``stream_chunks``. The queue table (``0002_queue.sql``) belongs to
:class:`celery_workflow._postgres.queue.PostgresQueue`, which is also the storage of the Postgres Kombu transport.

Consistency (every write is one :meth:`~celery_workflow._postgres.database.PgDatabase.run` transaction, retried on
deadlocks, serialization failures and lost connections):

* An append follows the template of :mod:`celery_workflow._backend.template` (steps in
  :mod:`celery_workflow._postgres.append`): it locks the run row (``SELECT … FOR NO KEY UPDATE``: it excludes every
  other appender and the retention sweep, but not the foreign-key checks of stream writes), reads the rows
  :func:`~celery_workflow.rules.keys_of` names into a :class:`~celery_workflow.rules.Snapshot`, lets
  :func:`~celery_workflow.rules.plan_append` apply the rules, and writes the events at the next slots, the views,
  hook and token rows, the run-end cleanup, the deliveries and the ack. Writers of one run are serialized across processes, slots are contiguous, a batch is all or nothing
  and a rejected batch writes nothing. A run's end sends ``pg_notify('celery_workflow_runs', run_id)`` at commit.
* Token locks: ``hook_created`` takes a two-key advisory lock per claimed token (a free token has no row to lock),
  in ascending key order, so exactly one concurrent claimant wins a free token. Then ONE statement locks, in token
  order, the token rows the batch may claim or release (the owners' rows of claimed tokens; every token of the run
  when the batch holds a run-ending event, else those of the hooks it disposes). Every append takes its locks in
  the same order (run row, advisory locks, token rows) and takes none afterwards, so hook claims across runs never
  deadlock. A forced claim (``create_hook(token, force=True)``) takes no second run's lock either: it is two
  single-run appends, a ``hook_disposed`` (with ``taken_by``) in the owner's log and then the taker's claim of the
  freed token (see "Forced hook claims" in ``docs/design-notes.md``), so the seed's run locks in run-id order are
  never needed.
* Lost answers: each ``create_run``/``append`` call writes its events with a ``write_id`` of its own. When the
  connection is lost after the server committed (a retry of
  :meth:`~celery_workflow._postgres.database.PgDatabase.run`), the retry finds its events and returns them instead of applying the batch twice (an append that wrote no event, a
  no-op batch, is simply repeated: its deliveries may then be stored twice unless they carry idempotency keys).
* Waiters (:meth:`PostgresWorld.wait_for_terminal`, :meth:`PostgresWorld.read_stream` with ``wait``) take a mark of
  the per-process LISTEN connection before they check, and wait for a notification or ``poll_interval`` at most.

Retention (:meth:`PostgresWorld.sweep_expired`, :meth:`PostgresWorld.start_retention`) lives in
:mod:`celery_workflow._postgres.retention`, streams in :mod:`celery_workflow._postgres.streams`, configuration in
:mod:`celery_workflow._postgres.config`, row mapping in :mod:`celery_workflow._postgres.rows`. Timestamps come from
this process's clock (UTC, microseconds), as in the other Worlds; the queue's lease and due times use the server's.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from celery_workflow import ids, rules
from celery_workflow._backend import template
from celery_workflow._backend.base import StoreQueue, StoreStreams, TemplateWorld
from celery_workflow._backend.listing import RunFilter
from celery_workflow._backend.recent import Recent
from celery_workflow._backend.schedules_sql import SQLSchedules
from celery_workflow._backend.waiting import wait_until
from celery_workflow._postgres.append import PgAppend, SnapshotCache, WholeRun, retained_until_sql
from celery_workflow._postgres.config import PostgresConfig, config_with, postgres_url
from celery_workflow._postgres.database import PgDatabase
from celery_workflow._postgres.listener import CHANNEL_RUNS
from celery_workflow._postgres.queue import PostgresQueue
from celery_workflow._postgres.retention import RetentionSweeper, sweep_expired
from celery_workflow._postgres.rows import (
    CODEC,
    COLUMNS,
    EVENT,
    HOOK,
    HOOK_H,
    RUN,
    STEP,
    WAIT,
    event_row,
    insert_sql,
)
from celery_workflow._postgres.script import Script, query
from celery_workflow._postgres.streams import PgStreams
from celery_workflow.errors import HookNotFound, RunNotFound, StepNotFound, WorldError
from celery_workflow.events import Event, HookView, RunView, StepView, WaitView
from celery_workflow.world import (
    DEFAULT_MAX_PAYLOAD,
    BrokerSpec,
    Capabilities,
    Delivery,
    NewRun,
    Page,
    Upkeep,
)

__all__ = ["PostgresConfig", "PostgresWorld", "postgres_url"]

Conn = psycopg.Connection[Any]


#: The longest a waiter for a run's end goes without re-reading it when no notification comes (seconds).
WAITER_RECHECK = 5.0


def _execute(conn: Conn, sql: str, params: Sequence[Any]) -> tuple[list[Any], int]:
    cursor = conn.execute(sql, tuple(params))
    return (cursor.fetchall() if cursor.description else []), cursor.rowcount


class PostgresWorld(TemplateWorld, StoreQueue, StoreStreams):
    """A World in PostgreSQL: storage, queue (via :class:`~celery_workflow._postgres.queue.PostgresQueue`) and
    streams.

    Thread-safe; fork-safe when it owns its pool (:meth:`open`): a forked child opens its own connections.
    """

    capabilities = Capabilities()
    queue_names: frozenset[str] | None = None  # the queue table takes any name
    #: The largest value it stores: the event-data limit less the event's other fields (a row holds no more).
    max_payload: int = DEFAULT_MAX_PAYLOAD
    store: PostgresQueue
    _steps: PgAppend

    def __init__(
        self,
        pool: ConnectionPool | PgDatabase,
        config: PostgresConfig | None = None,
        *,
        migrate: bool = True,
        **overrides: Any,
    ) -> None:
        """A World on a caller's pool (left open by :meth:`close`) or on a
        :class:`~celery_workflow._postgres.database.PgDatabase` (left open too: its owner closes it; it keeps its own
        ``unavailable_timeout``). ``overrides`` are :class:`PostgresConfig` fields."""
        self.config = config_with(config, overrides)
        self.poll_interval = self.config.poll_interval
        self.routes = self.config.routes
        self.base_url = self.config.base_url  # Workflows builds webhook URLs from it unless given its own
        self.db = (
            pool
            if isinstance(pool, PgDatabase)  # it keeps its own unavailable_timeout
            else PgDatabase(pool, unavailable_timeout=self.config.unavailable_timeout)
        )
        self._owns_db = not isinstance(pool, PgDatabase)
        if migrate:
            self.db.migrate()
        #: The queue store (shared with the Postgres Kombu transport).
        self.store = PostgresQueue(self.db)
        self.streams = PgStreams(self.db, self.poll_interval)
        self._steps = PgAppend(self)
        #: The schedules (table ``celery_workflow_schedules``, :mod:`celery_workflow.schedules`).
        self.schedule_store = SQLSchedules(self._schedules_tx, _execute, CODEC, "%s")
        self._sweeper: RetentionSweeper | None = None
        # the runs this process created lately while listening for runs' ends: the listener's mark taken before
        # each creation and the view create_run answered (see wait_for_terminal)
        self._created: Recent[str, tuple[tuple[int, int], RunView]] = Recent()

    @classmethod
    def open(
        cls, url: str, config: PostgresConfig | None = None, *, migrate: bool = True, **overrides: Any
    ) -> PostgresWorld:
        """A World with a pool of its own on ``url`` (closed by :meth:`close`)."""
        settings = config_with(config, overrides)
        # until a worker says how many deliveries this process runs: concurrency plus room for other calls
        db = PgDatabase.open(url, max_size=settings.concurrency + 5, unavailable_timeout=settings.unavailable_timeout)
        try:
            world = cls(db, settings, migrate=migrate)
        except BaseException:
            db.close()
            raise
        world._owns_db = True
        return world

    def _schedules_tx(self, body: Callable[[Any], Any], write: bool) -> Any:
        return self.db.run(body, what="schedules", transaction=write)

    def __repr__(self) -> str:
        return f"PostgresWorld({postgres_url(self.db.conninfo)!r})"

    @property
    def snapshots(self) -> SnapshotCache:
        """The runs' states this process keeps to plan their next appends (see :mod:`celery_workflow._postgres.append`)."""
        return self._steps.snapshots

    # -- storage: writes -----------------------------------------------------------------------------------------

    def create_run(self, run: NewRun, deliveries: Sequence[Delivery] = ()) -> tuple[RunView, bool]:
        view, first = template.prepare_run(run, deliveries, ids.utcnow())  # EventInvalid before any round trip
        values = CODEC.record("runs", view)
        write_id = uuid.uuid4().hex
        before = self.db.listening_mark(CHANNEL_RUNS, run.run_id)  # see wait_for_terminal

        def tx(conn: Conn) -> tuple[RunView, bool]:
            # One round trip, one implicit transaction: the run, its first event and its deliveries are inserted
            # only if the run is new (the event and the deliveries are conditional on the event row this call
            # wrote), then the run as stored and whether this call wrote it, which also answers a retry whose first
            # commit lost its answer.
            script = Script(conn)
            script.add(
                insert_sql("celery_workflow_runs", list(values)) + " ON CONFLICT DO NOTHING", tuple(values.values())
            )
            script.add(
                insert_sql("celery_workflow_events", COLUMNS["celery_workflow_events"]) + " ON CONFLICT DO NOTHING",
                event_row(first, write_id),
            )
            mine = (
                "EXISTS (SELECT 1 FROM celery_workflow_events"
                " WHERE run_id = %(w_run)s AND slot = 1 AND write_id = %(w_id)s)"
            )
            gate = {"w_run": run.run_id, "w_id": write_id}
            self.store.add_inserts(script, deliveries, when=(mine, gate), hand_off=True)  # a new run: no duplicate
            stored = script.add(f"SELECT {RUN}, {mine} FROM celery_workflow_runs WHERE run_id = %(w_run)s", gate)
            found = script.send()[stored].one()
            if found is None:  # pragma: no cover - the row was inserted or existed in this transaction
                raise WorldError(f"run {run.run_id} kept appearing and disappearing")
            if bool(found[-1]):
                return view, True  # what this call stored (no need to decode it back)
            return template.existing_run(CODEC.run(found[:-1]), run)

        stored, created = self.db.run(tx, what="create_run", transaction=False)
        if created and before is not None:
            self._created.put(run.run_id, (before, stored))
        return stored, created

    # -- storage: reads ------------------------------------------------------------------------------------------

    def _one(self, what: str, sql: str, params: Sequence[Any]) -> Any:
        """The first row of one statement (one round trip), or None."""
        return self.db.run(lambda conn: query(conn, sql, params).one(), what=what, transaction=False)

    def _rows(self, what: str, sql: str, params: Sequence[Any], run_id: str | None = None) -> list[Any]:
        """The rows of one statement; RunNotFound when there are none and ``run_id`` names no run."""

        def tx(conn: Conn) -> list[Any]:
            stored = query(conn, sql, params).rows
            if not stored and run_id is not None:
                found = query(conn, "SELECT 1 FROM celery_workflow_runs WHERE run_id = %s", (run_id,)).one()
                if found is None:
                    raise RunNotFound(f"run {run_id} does not exist")
            return stored

        return self.db.run(tx, what=what, transaction=False)

    def get_run(self, run_id: str) -> RunView:
        found = self._one("get_run", f"SELECT {RUN} FROM celery_workflow_runs WHERE run_id = %s", (run_id,))
        if found is None:
            raise RunNotFound(f"run {run_id} does not exist")
        return CODEC.run(found)

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
        self.snapshots.put(snapshot)
        return snapshot.run, log

    def runs_listed(self, wanted: RunFilter) -> Page[RunView]:
        rows = self._rows("list_runs", *wanted.sql(RUN, "celery_workflow_runs", "%s", CODEC.store_time))
        return wanted.page([CODEC.run(r) for r in rows])

    def list_events(self, run_id: str, *, after_slot: int = 0, limit: int | None = None) -> list[Event]:
        stored = self._rows(
            "list_events",
            f"SELECT {EVENT} FROM celery_workflow_events WHERE run_id = %s AND slot > %s ORDER BY slot LIMIT %s",
            (run_id, after_slot, None if limit is None else max(limit, 0)),
            run_id,
        )
        return [CODEC.event(r) for r in stored]

    def get_step(self, run_id: str, step_id: str) -> StepView:
        stored = self._rows(
            "get_step",
            f"SELECT {STEP} FROM celery_workflow_steps WHERE run_id = %s AND step_id = %s",
            (run_id, step_id),
            run_id,
        )
        if not stored:
            raise StepNotFound(f"step {step_id} of run {run_id} does not exist")
        return CODEC.step(stored[0])

    def list_steps(self, run_id: str) -> list[StepView]:
        sql = f"SELECT {STEP} FROM celery_workflow_steps WHERE run_id = %s ORDER BY created_slot"
        return [CODEC.step(r) for r in self._rows("list_steps", sql, (run_id,), run_id)]

    def get_hook_by_token(self, token: str) -> HookView:
        """The live hook owning ``token``; HookNotFound if none. A token retained after its run ended (see
        :mod:`celery_workflow._postgres.append`) is not live: the error says so, and until when."""
        stored = self._one(
            "get_hook_by_token",
            f"SELECT t.run_id, {retained_until_sql('t')}, h.hook_id IS NOT NULL, {HOOK_H}"
            " FROM celery_workflow_hook_tokens AS t LEFT JOIN celery_workflow_hooks AS h"
            " ON h.run_id = t.run_id AND h.hook_id = t.hook_id WHERE t.token = %s",
            (token,),
        )
        if stored is None:
            raise HookNotFound(f"no live hook owns token {token!r}")
        run_id, retained_until, live, *hook = stored
        if not live:
            if retained_until is not None:
                held = rules.RetainedToken(run_id, "", token, retained_until)
                if held.holds(ids.utcnow()):
                    raise rules.retained_error(held)
            raise HookNotFound(f"no live hook owns token {token!r}")
        return CODEC.hook(hook)

    def list_hooks(self, run_id: str) -> list[HookView]:
        sql = f"SELECT {HOOK} FROM celery_workflow_hooks WHERE run_id = %s ORDER BY created_slot"
        return [CODEC.hook(r) for r in self._rows("list_hooks", sql, (run_id,), run_id)]

    def list_waits(self, run_id: str) -> list[WaitView]:
        sql = f"SELECT {WAIT} FROM celery_workflow_waits WHERE run_id = %s ORDER BY created_slot"
        return [CODEC.wait(r) for r in self._rows("list_waits", sql, (run_id,), run_id)]

    def wait_for_terminal(self, run_id: str, timeout: float | None) -> RunView:
        """Wait for the run's end: the NOTIFY on ``celery_workflow_runs`` its last append sends wakes it (a lost
        LISTEN connection wakes every waiter when it is back). It re-checks only every :data:`WAITER_RECHECK`
        seconds otherwise: re-reading every ``poll_interval`` cost each waiting client four reads a second, so the
        reads (and commits) per step grew with the number of runs in flight and their latency."""
        listener = self.db.listener
        # A run this process created while it listened already needs no first look: the mark taken before its
        # creation catches its end, however soon it comes, and the view create_run answered stands for the rest.
        known = self._created.pop(run_id) if timeout is None or timeout > 0 else None

        def mark() -> tuple[int, int]:
            return known[0] if known is not None else listener.mark(CHANNEL_RUNS, run_id)

        def read() -> RunView:
            nonlocal known
            if known is not None:
                view, known = known[1], None
                return view
            return self.get_run(run_id)  # the run's end NOTIFY carries its id alone (no data to any listener)

        return wait_until(
            read,
            lambda view: view.status.terminal,
            timeout=timeout,
            poll_interval=max(self.poll_interval, WAITER_RECHECK),
            mark=mark,
            wait=lambda mark, left: listener.wait(CHANNEL_RUNS, mark, left, key=run_id),
        )

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

    def start_upkeep(self) -> Upkeep | None:
        """The World's upkeep in a worker: retention sweeps when a retention is configured (:meth:`start_retention`)."""
        return self.start_retention()

    # -- wiring --------------------------------------------------------------------------------------------------

    def broker(self) -> BrokerSpec:
        """The Postgres Kombu transport on this database (the same connection string, search_path included)."""
        return BrokerSpec(
            transport="celery_workflow.transport.postgres:Transport",
            url=postgres_url(self.db.conninfo),
            options={"lease_seconds": self.config.lease, "polling_interval": self.config.poll_interval},
            defaults={"worker_concurrency": self.config.concurrency},  # `celery worker -c N` overrides it
        )

    def size_pool(self, deliveries: int) -> None:
        """Size the pool of this process for ``deliveries`` run at once, plus one connection for a call beside
        them (a worker tells each process: see :mod:`celery_workflow.worker_setup`). A caller's pool is left as it
        is."""
        if self._owns_db:
            self.db.resize(max(deliveries, 1) + 1)

    def close(self) -> None:
        """Stop the retention sweeper and close the listener; close the pool only when :meth:`open` made it."""
        if self._sweeper is not None:
            self._sweeper.stop()
            self._sweeper = None
        if self._owns_db:
            self.db.close()
