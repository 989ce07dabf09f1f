"""How the SQLite World writes a batch (not part of the public API): the template's reads and write.

The :func:`celery_workflow._backend.template.append` template runs :meth:`SQLiteAppend.load` and
:meth:`SQLiteAppend.write` inside one ``BEGIN IMMEDIATE`` transaction: the write lock taken at ``BEGIN`` serialises
the writers of every process, so what ``load`` reads is what ``write`` writes over.

Token retention (:mod:`celery_workflow.rules`): a token row carries the retention end its hook asked for
(``retain_until``) and references its run, not its hook (``0006_token_rows_outlive_hooks.sql``), so the rows the rules
retain outlive the run's end; a row whose hook is gone is a token its ended run retains (read into
``Snapshot.retained``, replaced by the claim that finds its retention over).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, TypeVar

from celery_workflow import ids, rules
from celery_workflow._backend.children import parent_data
from celery_workflow._backend.records import KEYS, MUTABLE, add_views, created_slots
from celery_workflow._backend.template import AppendRequest, Linked, Loaded
from celery_workflow._sqlite.rows import (
    CODEC,
    COLUMNS,
    EVENT,
    HOOK_BY_TOKEN,
    RETAINED_BY_TOKEN,
    RUN,
    chunked,
    insert,
    marks,
    retained_token,
    update,
)
from celery_workflow.events import Event, EventType, RunView

if TYPE_CHECKING:
    from celery_workflow._sqlite.world import SQLiteWorld

__all__ = ["SQLiteAppend", "insert_events", "load_run"]

R = TypeVar("R")


def load_run(conn: sqlite3.Connection, run_id: str) -> RunView | None:
    row = conn.execute(f"SELECT {RUN} FROM celery_workflow_runs WHERE run_id = ?", (run_id,)).fetchone()
    return None if row is None else CODEC.run(row)


def insert_events(conn: sqlite3.Connection, new: Sequence[Event]) -> None:
    conn.executemany(
        f"INSERT INTO celery_workflow_events ({EVENT}) VALUES ({marks(6)})", [CODEC.event_record(e) for e in new]
    )


class SQLiteAppend:
    """The backend-specific parts of the append template for one :class:`SQLiteWorld`."""

    def __init__(self, world: SQLiteWorld) -> None:
        self.world = world

    def now(self) -> datetime:
        return ids.utcnow()

    def transaction(self, body: Callable[[sqlite3.Connection], R], request: AppendRequest) -> R:
        # WAL with synchronous=NORMAL never waits for fsync at commit: request.durable has nothing to relax
        with self.world.transaction() as conn:
            return body(conn)

    def load(self, conn: sqlite3.Connection, request: AppendRequest, *, fresh: bool) -> Loaded:
        run_id, keys = request.run_id, request.keys
        snapshot = rules.Snapshot(load_run(conn, run_id))
        if snapshot.run is None:
            return Loaded(snapshot)
        for table, wanted in (("steps", keys.steps), ("hooks", keys.hooks), ("waits", keys.waits)):
            columns = ", ".join(COLUMNS[f"celery_workflow_{table}"])
            for part in chunked(wanted):
                sql = (
                    f"SELECT {columns} FROM celery_workflow_{table} WHERE run_id = ?"
                    f" AND {KEYS[table]} IN ({marks(len(part))})"
                )
                add_views(snapshot, table, (CODEC.view(table, row) for row in conn.execute(sql, (run_id, *part))))
        for part in chunked(keys.hooks):
            for (hook_id,) in conn.execute(
                "SELECT correlation_id FROM celery_workflow_events WHERE run_id = ?"
                f" AND event_type IN ('hook_created', 'hook_conflict') AND correlation_id IN ({marks(len(part))})",
                (run_id, *part),
            ):
                snapshot.created_hooks.add(hook_id)
        for part in chunked(keys.tokens):
            for row in conn.execute(HOOK_BY_TOKEN.format(f"IN ({marks(len(part))})"), part):
                hook = CODEC.hook(row)
                snapshot.token_owners[hook.token] = hook
            for row in conn.execute(RETAINED_BY_TOKEN.format(f"IN ({marks(len(part))})"), part):
                held = retained_token(row)
                snapshot.retained[held.token] = held
        if keys.ending:  # the retentions of the run's live hooks (whose tokens its end may keep)
            for hook_id, token, until in conn.execute(
                "SELECT hook_id, token, retain_until FROM celery_workflow_hook_tokens WHERE run_id = ?"
                " AND retain_until IS NOT NULL",
                (run_id,),
            ):
                snapshot.retentions[hook_id] = rules.RetainedToken(run_id, hook_id, token, ids.from_micros(until))
            # a child run's end wakes its parent: the link its run_created records
            first = conn.execute(f"SELECT {EVENT} FROM celery_workflow_events WHERE run_id = ? AND slot = 1", (run_id,))
            snapshot.parent = parent_data([CODEC.event(row) for row in first])
            snapshot.parent_known = True
        return Loaded(snapshot)

    def write(self, conn: sqlite3.Connection, request: AppendRequest, plan: rules.Plan) -> None:
        write_plan(conn, plan)
        store = self.world.store
        store.insert(conn, request.deliveries)
        if request.ack is not None:
            store.delete_claim(conn, request.ack)

    def load_linked(self, conn: sqlite3.Connection, request: AppendRequest) -> rules.Snapshot:
        return self.load(conn, request, fresh=True).snapshot

    def write_linked(
        self, conn: sqlite3.Connection, request: AppendRequest, plan: rules.Plan, linked: Linked | None
    ) -> None:
        self.write(conn, request, plan)
        if linked is not None:  # the same transaction: the child's end and the parent's wake-up commit together
            self.write(conn, linked.request, linked.plan)


def write_plan(conn: sqlite3.Connection, plan: rules.Plan) -> None:
    """The writes of ``plan``: events, views, hook and token rows, and the run-end cleanup."""
    if not plan.events:
        return  # a no-op batch (a repeated run_started or run_cancelled) changes nothing
    run = plan.run
    created = created_slots(plan.events)
    insert_events(conn, plan.events)
    update(conn, "celery_workflow_runs", CODEC.record("runs", run), MUTABLE["runs"], ("run_id",))
    for table, items, kind in (
        ("steps", plan.steps, EventType.STEP_CREATED),
        ("waits", plan.waits, EventType.WAIT_CREATED),
    ):
        key = KEYS[table]
        for item in items.values():
            slot = created.get((kind, getattr(item, key)))
            row = CODEC.record(table, item, created_slot=slot)
            if slot is None:
                update(conn, f"celery_workflow_{table}", row, MUTABLE[table], ("run_id", key))
            else:
                insert(conn, f"celery_workflow_{table}", row)
    # A token row references its run, not its hook (0006): deleting a hook releases its token by deleting its row.
    for hook_id, hook in plan.hooks_deleted.items():
        gone = (hook.run_id, hook_id)
        conn.execute("DELETE FROM celery_workflow_hook_tokens WHERE run_id = ? AND hook_id = ?", gone)
        conn.execute("DELETE FROM celery_workflow_hooks WHERE run_id = ? AND hook_id = ?", gone)
    for part in chunked(plan.tokens_reclaimed):  # held by ended runs whose retention is over
        conn.execute(f"DELETE FROM celery_workflow_hook_tokens WHERE token IN ({marks(len(part))})", part)
    for hook_id, hook in plan.hooks_inserted.items():
        insert(
            conn,
            "celery_workflow_hooks",
            CODEC.record("hooks", hook, created_slot=created[(EventType.HOOK_CREATED, hook_id)]),
        )
        retention = plan.retentions.get(hook_id)
        conn.execute(
            "INSERT INTO celery_workflow_hook_tokens (token, run_id, hook_id, created_at, retain_until)"
            " VALUES (?, ?, ?, ?, ?)",
            (hook.token, hook.run_id, hook_id, CODEC.store_time(hook.created_at),
             None if retention is None else CODEC.store_time(retention.until)),
        )  # fmt: skip
    if plan.run_ended:
        # every token row of the run goes, but those the rules retain (their hooks may be of this very batch)
        conn.execute("DELETE FROM celery_workflow_hook_tokens WHERE run_id = ?", (run.run_id,))
        conn.executemany(
            "INSERT INTO celery_workflow_hook_tokens (token, run_id, hook_id, created_at, retain_until)"
            " VALUES (?, ?, ?, ?, ?)",
            [(t.token, t.run_id, t.hook_id, CODEC.store_time(plan.run.updated_at), CODEC.store_time(t.until))
             for t in plan.tokens_retained.values()],
        )  # fmt: skip
        conn.execute("DELETE FROM celery_workflow_hooks WHERE run_id = ?", (run.run_id,))
        conn.execute("DELETE FROM celery_workflow_waits WHERE run_id = ?", (run.run_id,))
