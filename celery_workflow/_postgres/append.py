"""How the Postgres World writes a batch (not part of the public API): the append template's steps, the reads under
lock, the writes and the snapshot cache.

:class:`PgAppend` gives :func:`celery_workflow._backend.template.append` its steps. An append is a
:class:`~celery_workflow._postgres.database.Script` transaction of two round trips: ``BEGIN`` and the reads of
:class:`LockedReads` (the run's row lock first), then, once :func:`celery_workflow.rules.plan_append` has applied the
rules, :func:`write_plan`, the deliveries, the ack and ``COMMIT``. The whole is retried by
:meth:`~celery_workflow._postgres.database.PgDatabase.run` on deadlocks, serialization failures and lost connections;
a retry first looks for the events its own ``write_id`` committed (a commit whose answer was lost).

:class:`SnapshotCache` makes it one round trip for the run a process is working on. A replay reads the run's whole
state (:meth:`~celery_workflow.world_pg.PostgresWorld.get_run_with_events`: the run, its log, every step, live hook
and wait); the World keeps it as a :class:`~celery_workflow.rules.Snapshot` and, after each batch it writes, the
snapshot that batch leads to (:func:`celery_workflow.rules.advance`). The next batch of that run is planned on the
kept snapshot (``Loaded.guess``) and sent as one script without ``BEGIN`` or ``COMMIT`` (one implicit transaction,
committed at the script's end): the run's ``UPDATE`` (it locks the row), the events, the other writes; a run's end
cleans up only the hooks, tokens and waits the kept snapshot says the run has.
Nothing of a run's own state changes without a new event, and the events' primary key ``(run_id, slot)`` refuses the
first slot of a batch planned on a stale snapshot (another process or thread appended meanwhile): that transaction
rolls back (:class:`~celery_workflow._backend.template.StaleSnapshot`) and the template plans the batch again on
fresh reads. Batches that claim hook tokens (their owners are other runs' state) and
batches that would write no event (nothing would refuse them) always read afresh.

Token retention (the rule is :mod:`celery_workflow.rules`; storage ``0004_token_retention.sql``): a token row keeps
the retention end its claiming ``hook_created`` asked for (``retain_until``). The reads give the rules the retentions
of the run's live hooks (every token row of the run is read under lock when the batch may end it; a kept snapshot
holds them) and, for each claimed token whose row has no live hook, that ended run's holding. A run's end deletes its
hooks and every token row of the run but those the plan retains (``Plan.tokens_retained``), which stay as the ended
run's holdings; a claim the rules let replace a holding whose retention is over (``Plan.tokens_reclaimed``) deletes
that row before writing its own. Disposing a hook releases its token at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from psycopg import errors as pg_errors

from celery_workflow import ids, rules
from celery_workflow._backend.broker import parse_receipt
from celery_workflow._backend.children import parent_data
from celery_workflow._backend.recent import Recent
from celery_workflow._backend.records import KEYS, MUTABLE, add_views, created_slots
from celery_workflow._backend.template import AppendRequest, Linked, Loaded, StaleSnapshot
from celery_workflow._postgres.listener import CHANNEL_RUNS, notify_sql
from celery_workflow._postgres.rows import (
    CODEC,
    COLUMNS,
    EVENT,
    HOOK_H,
    RUN,
    TABLE,
    TOKEN_LOCK_SPACE,
    event_row,
    insert_rows,
    insert_sql,
    token_lock_keys,
    update_sql,
)
from celery_workflow._postgres.script import Result, Script, commit_setting
from celery_workflow.events import Event, EventType

if TYPE_CHECKING:
    import psycopg

    from celery_workflow._postgres.world import PostgresWorld

__all__ = [
    "LockedReads",
    "PgAppend",
    "SnapshotCache",
    "WholeRun",
    "retained_until_sql",
    "write_plan",
]

R = TypeVar("R")


def retained_until_sql(tokens: str) -> str:
    """SQL for the end of the retention of the token held by the row ``tokens`` (an alias of
    ``celery_workflow_hook_tokens``): its ``retain_until``, copied from the claiming ``hook_created`` event's
    ``token_retention_until`` when the row was written; NULL when that hook asked for none."""
    return f"{tokens}.retain_until"


#: A token row's retention end when it has none (a leftover): over long ago.
_NO_RETENTION = datetime.min.replace(tzinfo=UTC)


def lock_tokens_sql(run_id: str, tokens: Sequence[str], ending: bool, disposed: Sequence[str]) -> tuple[str, Any]:
    """The statement that locks, in token order, the token rows a batch may claim or release (see LockedReads).

    Each row: the token row's ``run_id``, ``hook_id``, ``token``, ``created_at``, whether its hook is live, the end
    of its retention, then the hook's columns (NULL for a retained token, whose hook is gone)."""
    return (
        f"SELECT t.run_id, t.hook_id, t.token, t.created_at, h.hook_id IS NOT NULL, {retained_until_sql('t')},"
        f" {HOOK_H} FROM celery_workflow_hook_tokens AS t LEFT JOIN celery_workflow_hooks AS h"
        " ON h.run_id = t.run_id AND h.hook_id = t.hook_id"
        " WHERE t.token = ANY(%s) OR (t.run_id = %s AND (%s OR t.hook_id = ANY(%s)))"
        " ORDER BY t.token FOR UPDATE OF t",
        (sorted(tokens), run_id, ending, list(disposed)),
    )


@dataclass(slots=True)
class _Tx:
    """One attempt of an append on one connection: its script once the reads are sent, or the kept snapshot the
    batch is planned on."""

    conn: psycopg.Connection[Any]
    attempt: int
    script: Script | None = None
    kept: rules.Snapshot | None = None


class PgAppend:
    """The append template's steps for one :class:`~celery_workflow.world_pg.PostgresWorld`."""

    def __init__(self, world: PostgresWorld) -> None:
        self.world = world
        self.snapshots = SnapshotCache()

    def now(self) -> datetime:
        return ids.utcnow()

    def transaction(self, body: Callable[[_Tx], R], request: AppendRequest) -> R:
        attempts = 0

        def run(conn: psycopg.Connection[Any]) -> R:
            nonlocal attempts
            attempts += 1
            return body(_Tx(conn, attempts))

        return self.world.db.run(run, what="append", transaction=False)

    def load(self, tx: _Tx, request: AppendRequest, *, fresh: bool) -> Loaded:
        if request.ack is not None:
            parse_receipt(request.ack)  # a malformed receipt is a WorldError before anything is written
        run_id = request.run_id
        if not fresh and tx.attempt == 1 and not request.keys.tokens:
            kept = self.snapshots.get(run_id)
            if kept is not None:  # one round trip: lock, writes and COMMIT go together in write()
                tx.kept = kept
                return Loaded(kept, guess=True)
        # Two round trips: BEGIN and every read under the run's lock, then (rules applied by the template) every
        # write and COMMIT. A rule violation or a lost connection leaves the transaction to be rolled back.
        self.snapshots.forget(run_id)  # this path reads only what the batch names
        script = tx.script = Script(tx.conn)
        script.begin(synchronous_commit=None if request.durable else False)
        reads = LockedReads(script, request, retry_of=request.write_id if tx.attempt > 1 else None)
        snapshot, done = reads.snapshot(script.send())
        return Loaded(snapshot, written=done or None)

    def write(self, tx: _Tx, request: AppendRequest, plan: rules.Plan) -> None:
        if tx.kept is None:
            assert tx.script is not None
            self._finish(tx.script, request, plan)
            tx.script.add("COMMIT")
            tx.script.send()
            return
        # One round trip, one implicit transaction (the pipeline's Sync commits it): no BEGIN, no COMMIT. The run's
        # row is locked by its UPDATE, the first write (write_plan); only a batch that releases tokens locks them
        # after it, in the same order as LockedReads. The kept snapshot is the run's whole state, so a run that has
        # no hook or wait needs none of their cleanup.
        kept = tx.kept
        script = Script(tx.conn)
        if not request.durable:
            script.add(*commit_setting(False))
        hooks = bool(kept.hooks or plan.hooks_inserted)
        disposed = request.disposed_hooks
        if (request.ends_run and hooks) or disposed:
            script.add("SELECT 1 FROM celery_workflow_runs WHERE run_id = %s FOR NO KEY UPDATE", (request.run_id,))
            script.add(*lock_tokens_sql(request.run_id, [], request.ends_run, disposed))
        self._finish(script, request, plan, known=Known(hooks, bool(kept.waits or plan.waits)))
        try:
            script.send()
        except (pg_errors.UniqueViolation, pg_errors.DivisionByZero):
            # stale: another writer took the slot, or the run is gone (RUN_UPDATE)
            self.snapshots.forget(request.run_id)
            raise StaleSnapshot() from None
        self.snapshots.advance(kept, plan)

    def load_linked(self, tx: _Tx, request: AppendRequest) -> rules.Snapshot:
        """The parent's run row locked and read in the child's transaction, after the child's reads (a linked
        append is planned on fresh reads, so the transaction is open: ``tx.script``)."""
        assert tx.script is not None and tx.kept is None
        reads = LockedReads(tx.script, request, retry_of=None)
        snapshot, _ = reads.snapshot(tx.script.send())
        return snapshot

    def write_linked(self, tx: _Tx, request: AppendRequest, plan: rules.Plan, linked: Linked | None) -> None:
        if linked is None:
            self.write(tx, request, plan)
            return
        script = tx.script
        assert script is not None and tx.kept is None
        self._finish(script, request, plan)
        self._finish(script, linked.request, linked.plan)  # the parent's child_ended and wake-up, same COMMIT
        script.add("COMMIT")
        script.send()
        self.snapshots.forget(linked.request.run_id)

    def _finish(
        self,
        script: Script,
        request: AppendRequest,
        plan: rules.Plan,
        known: Known | None = None,
    ) -> None:
        """Queue the plan's writes, the deliveries, the ack and the run-end notification."""
        write_plan(script, plan, request.write_id, known)
        queue = self.world.store
        queue.add_inserts(script, request.deliveries)
        if request.ack is not None:
            queue.add_delete_claim(script, request.ack)
        if plan.run_ended:
            # the run id alone: any role that can connect may LISTEN, so a notification carries no data
            script.add(f"SELECT {notify_sql(CHANNEL_RUNS)}", (plan.run.run_id,))


#: The run's row, written first by every batch (the UPDATE locks it). Without the run (deleted by the retention sweep
#: after the batch was planned on a kept snapshot) the statement fails with ``division_by_zero``, and with it the
#: transaction: the tables a batch writes have no foreign key to the run (``0005_append_tables_without_run_keys.sql``),
#: so this is what keeps a batch from writing rows of a run that is not there.
RUN_UPDATE = (
    f"WITH updated AS ({update_sql('celery_workflow_runs', MUTABLE['runs'], ('run_id',))} RETURNING 1)"
    " SELECT 1 / count(*) FROM updated"
)


@dataclass(frozen=True, slots=True)
class Known:
    """What a plan made on the run's whole state knows of it: whether it has hooks (and so token rows) and waits.
    Without it (a plan made on partial reads) a run's end cleans up as if it had both."""

    hooks: bool
    waits: bool


def write_plan(
    script: Script,
    plan: rules.Plan,
    write_id: str,
    known: Known | None = None,
) -> dict[str, Any] | None:
    """Queue the writes of ``plan`` on ``script``: the run's row first (its UPDATE locks it, if nothing did
    before), the events (their primary key refuses a slot someone else took), then the views, hook and token rows
    and the run-end cleanup (only of what the run has, when ``known`` says). The rows of the tokens the plan
    reclaims (locked by :class:`LockedReads`) are deleted before the claim. Returns the run's record as written
    (None: nothing is)."""
    if not plan.events:
        return None  # a no-op batch (a repeated run_started or run_cancelled) changes nothing
    run = plan.run
    created = created_slots(plan.events)
    run_record = CODEC.record("runs", run)
    script.add(RUN_UPDATE, (*(run_record[c] for c in MUTABLE["runs"]), run.run_id))
    # one INSERT per MAX_INSERT_ROWS events: a statement takes at most 65,535 parameters (a fan-out of 10,000 steps)
    insert_rows(
        script,
        "celery_workflow_events",
        COLUMNS["celery_workflow_events"],
        [event_row(e, write_id) for e in plan.events],
    )
    for table, items, kind in (
        ("steps", plan.steps, EventType.STEP_CREATED),
        ("waits", plan.waits, EventType.WAIT_CREATED),
    ):
        key = KEYS[table]
        for item in items.values():
            slot = created.get((kind, getattr(item, key)))
            values = CODEC.record(table, item, created_slot=slot)
            if slot is None:
                script.add(
                    update_sql(TABLE[table], MUTABLE[table], ("run_id", key)),
                    (*(values[c] for c in MUTABLE[table]), values["run_id"], values[key]),
                )
            else:
                script.add(insert_sql(TABLE[table], list(values)), tuple(values.values()))
    # Token rows go before their hooks: the rows of ended runs' holdings the batch reclaims (the rules found their
    # retention over), then a run's end keeps those the plan retains, a disposal releases at once. LockedReads
    # locked them already.
    if plan.tokens_reclaimed:
        script.add(
            "DELETE FROM celery_workflow_hook_tokens AS t WHERE t.token = ANY(%s) AND NOT EXISTS"
            " (SELECT 1 FROM celery_workflow_hooks AS h WHERE h.run_id = t.run_id AND h.hook_id = t.hook_id)",
            (sorted(plan.tokens_reclaimed),),
        )
    if plan.run_ended:
        retained = sorted(plan.tokens_retained)
        if known is None or known.hooks or retained:
            script.add(
                "DELETE FROM celery_workflow_hook_tokens WHERE run_id = %s AND NOT token = ANY(%s)",
                (run.run_id, retained),
            )
            for kept in plan.tokens_retained.values():  # a hook of this very batch has no row yet
                script.add(
                    "INSERT INTO celery_workflow_hook_tokens (token, run_id, hook_id, created_at, retain_until)"
                    " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (token) DO NOTHING",
                    (kept.token, kept.run_id, kept.hook_id, run.updated_at, kept.until),
                )
            script.add("DELETE FROM celery_workflow_hooks WHERE run_id = %s", (run.run_id,))
        if known is None or known.waits:
            script.add("DELETE FROM celery_workflow_waits WHERE run_id = %s", (run.run_id,))
    elif plan.hooks_deleted:
        disposed = (run.run_id, sorted(plan.hooks_deleted))
        script.add("DELETE FROM celery_workflow_hook_tokens WHERE run_id = %s AND hook_id = ANY(%s)", disposed)
        script.add("DELETE FROM celery_workflow_hooks WHERE run_id = %s AND hook_id = ANY(%s)", disposed)
    for hook_id, hook in plan.hooks_inserted.items():
        values = CODEC.record("hooks", hook, created_slot=created[(EventType.HOOK_CREATED, hook_id)])
        script.add(insert_sql("celery_workflow_hooks", list(values)), tuple(values.values()))
        retention = plan.retentions.get(hook_id)
        script.add(
            "INSERT INTO celery_workflow_hook_tokens (token, run_id, hook_id, created_at, retain_until)"
            " VALUES (%s, %s, %s, %s, %s)",
            (hook.token, hook.run_id, hook_id, hook.created_at, None if retention is None else retention.until),
        )
    return run_record


class LockedReads:
    """The reads of an append, queued on its :class:`Script` after ``BEGIN``: everything the rules need, under locks.

    Lock order, the same in every transaction, so that no two appends wait on each other in a cycle: the run row
    (``FOR NO KEY UPDATE``), then one advisory lock per claimed token (ascending keys; a free token has no row to
    lock), then, in ONE statement in token order, the token rows of the claimed tokens and of the tokens the batch
    may release (every token of the run when the batch holds a run-ending event, else those of the hooks it
    disposes). The writes take no further token lock. The server runs the statements in order, each with a fresh
    snapshot, so every read after the run's lock sees the state under that lock.
    """

    def __init__(self, script: Script, request: AppendRequest, *, retry_of: str | None) -> None:
        run_id, keys = request.run_id, request.keys
        self.keys = keys
        self.run = script.add(f"SELECT {RUN} FROM celery_workflow_runs WHERE run_id = %s FOR NO KEY UPDATE", (run_id,))
        self.written = (
            script.add(
                f"SELECT {EVENT} FROM celery_workflow_events WHERE run_id = %s AND write_id = %s ORDER BY slot",
                (run_id, retry_of),
            )
            if retry_of is not None
            else None
        )
        self.entities: list[tuple[str, int]] = []
        for table, wanted in (("steps", keys.steps), ("hooks", keys.hooks), ("waits", keys.waits)):
            if wanted:
                columns = ", ".join(COLUMNS[TABLE[table]])
                sql = f"SELECT {columns} FROM {TABLE[table]} WHERE run_id = %s AND {KEYS[table]} = ANY(%s)"
                self.entities.append((table, script.add(sql, (run_id, sorted(wanted)))))
        self.created = (
            script.add(
                "SELECT correlation_id FROM celery_workflow_events WHERE run_id = %s"
                " AND event_type IN ('hook_created', 'hook_conflict') AND correlation_id = ANY(%s)",
                (run_id, sorted(keys.hooks)),
            )
            if keys.hooks
            else None
        )
        ending, disposed = request.ends_run, request.disposed_hooks
        # a child run's end wakes its parent: the link its run_created records (in the same round trip)
        self.first = (
            script.add(f"SELECT {EVENT} FROM celery_workflow_events WHERE run_id = %s AND slot = 1", (run_id,))
            if ending
            else None
        )
        self.tokens: int | None = None
        if keys.tokens or ending or disposed:
            for lock_key in token_lock_keys(keys.tokens):
                script.add("SELECT pg_advisory_xact_lock(%s, %s)", (TOKEN_LOCK_SPACE, lock_key))
            self.tokens = script.add(*lock_tokens_sql(run_id, sorted(keys.tokens), ending, disposed))

    def snapshot(self, results: list[Result]) -> tuple[rules.Snapshot, list[Event]]:
        """The snapshot the rules need, and the events an earlier attempt of this very append wrote (if any)."""
        stored_run = results[self.run].one()
        snapshot = rules.Snapshot(None if stored_run is None else CODEC.run(stored_run))
        if snapshot.run is None:
            return snapshot, []
        done = [] if self.written is None else [CODEC.event(r) for r in results[self.written].rows]
        for table, index in self.entities:
            add_views(snapshot, table, (CODEC.view(table, stored) for stored in results[index].rows))
        if self.created is not None:
            snapshot.created_hooks.update(hook_id for (hook_id,) in results[self.created].rows)
        if self.first is not None:
            snapshot.parent = parent_data([CODEC.event(r) for r in results[self.first].rows])
            snapshot.parent_known = True
        if self.tokens is not None:
            own = snapshot.run.run_id
            for run_id, hook_id, token, _created, live, retained_until, *stored in results[self.tokens].rows:
                until = _NO_RETENTION if retained_until is None else retained_until.astimezone(UTC)
                if live and run_id == own and retained_until is not None:  # what the run's end may retain
                    snapshot.retentions[hook_id] = rules.RetainedToken(run_id, hook_id, token, until)
                if token not in self.keys.tokens:
                    continue
                if live:
                    snapshot.token_owners[token] = CODEC.hook(stored)
                else:  # an ended run's holding: the rules compare its end with the batch's time
                    snapshot.retained[token] = rules.RetainedToken(run_id, hook_id, token, until)
        return snapshot, done


class SnapshotCache:
    """The whole state of the runs this process works on, as of their last read or write here (thread-safe, bounded).

    A kept snapshot is only a guess at the run's state: every write planned on it is refused by the events' primary
    key when the guess is stale (see the module docstring). Terminal runs are not kept.
    """

    def __init__(self, size: int = 1024) -> None:
        self._runs: Recent[str, rules.Snapshot] = Recent(size)

    def get(self, run_id: str) -> rules.Snapshot | None:
        return self._runs.get(run_id)

    def put(self, snapshot: rules.Snapshot) -> None:
        run = snapshot.run
        if run is None:
            return
        if run.status.terminal:
            self._runs.pop(run.run_id)
        else:
            self._runs.put(run.run_id, snapshot)

    def advance(self, kept: rules.Snapshot, plan: rules.Plan) -> None:
        """Keep the snapshot ``plan`` leads to from ``kept`` (not computed when the plan ends the run)."""
        if plan.run.status.terminal:
            self._runs.pop(plan.run.run_id)
        else:
            self.put(rules.advance(kept, plan))

    def forget(self, run_id: str) -> None:
        self._runs.pop(run_id)

    def __len__(self) -> int:
        return len(self._runs)


class WholeRun:
    """The reads of a run's whole state, queued on a :class:`Script` in one REPEATABLE READ transaction: the run,
    its log, and every step, live hook and wait (what :class:`SnapshotCache` keeps)."""

    def __init__(self, script: Script, run_id: str) -> None:
        script.begin("ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        self.run = script.add(f"SELECT {RUN} FROM celery_workflow_runs WHERE run_id = %s", (run_id,))
        self.log = script.add(f"SELECT {EVENT} FROM celery_workflow_events WHERE run_id = %s ORDER BY slot", (run_id,))
        self.tables = {
            table: script.add(f"SELECT {', '.join(COLUMNS[name])} FROM {name} WHERE run_id = %s", (run_id,))
            for table, name in TABLE.items()
        }
        self.retentions = script.add(
            "SELECT hook_id, token, retain_until FROM celery_workflow_hook_tokens WHERE run_id = %s"
            " AND retain_until IS NOT NULL",
            (run_id,),
        )
        script.add("COMMIT")

    def read(self, results: list[Result]) -> tuple[rules.Snapshot | None, list[Event]]:
        stored = results[self.run].one()
        if stored is None:
            return None, []
        log = [CODEC.event(r) for r in results[self.log].rows]
        snapshot = rules.Snapshot(CODEC.run(stored), parent=parent_data(log[:1]), parent_known=True)
        for table, index in self.tables.items():
            add_views(snapshot, table, (CODEC.view(table, r) for r in results[index].rows))
        snapshot.created_hooks.update(
            str(e.correlation_id) for e in log if e.event_type in (EventType.HOOK_CREATED, EventType.HOOK_CONFLICT)
        )
        stored_run_id = snapshot.run.run_id if snapshot.run is not None else ""
        for hook_id, token, until in results[self.retentions].rows:
            if hook_id in snapshot.hooks:  # a live hook's (an ended run's holdings are no longer its state)
                snapshot.retentions[hook_id] = rules.RetainedToken(stored_run_id, hook_id, token, until.astimezone(UTC))
        return snapshot, log
