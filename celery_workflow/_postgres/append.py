"""How the Postgres World writes a batch (not part of the public API): reads under lock, writes, snapshot cache.

An append is a :class:`~celery_workflow._postgres.database.Script` transaction of two round trips: ``BEGIN`` and the reads of
:class:`LockedReads` (the run's row lock first), then, once :func:`celery_workflow.events.plan_append` has applied the
rules, :func:`write_plan` and ``COMMIT``.

:class:`SnapshotCache` makes it one round trip for the run a process is working on. A replay reads the run's whole
state (:meth:`~celery_workflow.world_pg.PostgresWorld.get_run_with_events`: the run, its log, every step, live hook
and wait); the World keeps it as a :class:`~celery_workflow.events.Snapshot` and, after each batch it writes, the
snapshot that batch leads to (:func:`celery_workflow.events.advance`). The next batch of that run is planned on the
kept snapshot and sent as one script: ``BEGIN``, the run's row lock, the writes, ``COMMIT``. Nothing of a run's own
state changes without a new event, and the events' primary key ``(run_id, slot)`` refuses the first slot of a batch
planned on a stale snapshot (another process or thread appended meanwhile): that transaction rolls back and the
batch is planned again on fresh reads. Batches that claim hook tokens (their owners are other runs' state) and
batches that would write no event (nothing would refuse them) always read afresh.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from celery_workflow import events as rules
from celery_workflow._postgres.database import Result, Script
from celery_workflow._postgres.rows import (
    COLUMNS,
    EVENT,
    HOOK_H,
    RUN,
    RUN_MUTABLE,
    STEP_MUTABLE,
    TOKEN_LOCK_SPACE,
    WAIT_MUTABLE,
    event,
    event_row,
    hook_view,
    insert_sql,
    row,
    run_view,
    token_lock_keys,
    update_sql,
    view,
)
from celery_workflow.events import Event, EventType, NewEvent

__all__ = ["LockedReads", "SnapshotCache", "write_plan"]

#: Events after which the run may end (its tokens are then locked up front, see LockedReads).
RUN_ENDING = frozenset({EventType.RUN_COMPLETED, EventType.RUN_FAILED, EventType.RUN_CANCELLED})
TABLE = {"steps": "celery_workflow_steps", "hooks": "celery_workflow_hooks", "waits": "celery_workflow_waits"}


def lock_tokens_sql(run_id: str, tokens: Sequence[str], ending: bool, disposed: Sequence[str]) -> tuple[str, Any]:
    """The statement that locks, in token order, the token rows a batch may claim or release (see LockedReads)."""
    return (
        f"SELECT {HOOK_H} FROM celery_workflow_hook_tokens AS t JOIN celery_workflow_hooks AS h"
        " ON h.run_id = t.run_id AND h.hook_id = t.hook_id"
        " WHERE t.token = ANY(%s) OR (t.run_id = %s AND (%s OR t.hook_id = ANY(%s)))"
        " ORDER BY t.token FOR UPDATE OF t",
        (sorted(tokens), run_id, ending, list(disposed)),
    )


def releases(batch: Sequence[NewEvent]) -> tuple[bool, list[str]]:
    """Whether a batch may end its run, and the hooks it disposes: the token rows it must lock."""
    ending = any(e.event_type in RUN_ENDING for e in batch)
    disposed = sorted({str(e.correlation_id) for e in batch if e.event_type is EventType.HOOK_DISPOSED})
    return ending, disposed


def write_plan(script: Script, plan: rules.Plan, write_id: str) -> None:
    """Queue the writes of ``plan`` on ``script``: the events first (their primary key refuses a slot someone else
    took), then the views, hook and token rows and the run-end cleanup."""
    if not plan.events:
        return  # a no-op batch (a repeated run_started or run_cancelled) changes nothing
    run = plan.run
    created = {(e.event_type, e.correlation_id): e.slot for e in plan.events if e.event_type in rules.CREATION_EVENTS}
    script.add(
        insert_sql("celery_workflow_events", COLUMNS["celery_workflow_events"], rows=len(plan.events)),
        [value for e in plan.events for value in event_row(e, write_id)],
    )
    values = row("runs", run)
    script.add(
        update_sql("celery_workflow_runs", RUN_MUTABLE, ("run_id",)),
        (*(values[c] for c in RUN_MUTABLE), run.run_id),
    )
    for table, items, mutable, key, kind in (
        ("steps", plan.steps, STEP_MUTABLE, "step_id", EventType.STEP_CREATED),
        ("waits", plan.waits, WAIT_MUTABLE, "wait_id", EventType.WAIT_CREATED),
    ):
        for item in items.values():
            slot = created.get((kind, getattr(item, key)))
            values = row(table, item, created_slot=slot)
            if slot is None:
                script.add(
                    update_sql(TABLE[table], mutable, ("run_id", key)),
                    (*(values[c] for c in mutable), values["run_id"], values[key]),
                )
            else:
                script.add(insert_sql(TABLE[table], list(values)), tuple(values.values()))
    # Deleting a hook releases its token (hook_tokens references hooks ON DELETE CASCADE); the token rows were
    # locked by _Reads already.
    if plan.run_ended:
        script.add("DELETE FROM celery_workflow_hooks WHERE run_id = %s", (run.run_id,))
        script.add("DELETE FROM celery_workflow_waits WHERE run_id = %s", (run.run_id,))
    elif plan.hooks_deleted:
        script.add(
            "DELETE FROM celery_workflow_hooks WHERE run_id = %s AND hook_id = ANY(%s)",
            (run.run_id, sorted(plan.hooks_deleted)),
        )
    for hook_id, hook in plan.hooks_inserted.items():
        values = row("hooks", hook, created_slot=created[(EventType.HOOK_CREATED, hook_id)])
        script.add(insert_sql("celery_workflow_hooks", list(values)), tuple(values.values()))
        script.add(
            "INSERT INTO celery_workflow_hook_tokens (token, run_id, hook_id, created_at) VALUES (%s, %s, %s, %s)",
            (hook.token, hook.run_id, hook_id, hook.created_at),
        )


class LockedReads:
    """The reads of an append, queued on its :class:`Script` after ``BEGIN``: everything the rules need, under locks.

    Lock order, the same in every transaction, so that no two appends wait on each other in a cycle: the run row
    (``FOR NO KEY UPDATE``), then one advisory lock per claimed token (ascending keys; a free token has no row to
    lock), then, in ONE statement in token order, the token rows of the claimed tokens and of the tokens the batch
    may release (every token of the run when the batch holds a run-ending event, else those of the hooks it
    disposes). The writes take no further token lock. The server runs the statements in order, each with a fresh
    snapshot, so every read after the run's lock sees the state under that lock.
    """

    def __init__(
        self, script: Script, run_id: str, keys: rules.Keys, batch: Sequence[NewEvent], *, retry_of: str | None
    ) -> None:
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
        self.entities: list[tuple[str, str, int]] = []
        for table, key, wanted in (
            ("steps", "step_id", keys.steps),
            ("hooks", "hook_id", keys.hooks),
            ("waits", "wait_id", keys.waits),
        ):
            if wanted:
                columns = ", ".join(COLUMNS[TABLE[table]])
                sql = f"SELECT {columns} FROM {TABLE[table]} WHERE run_id = %s AND {key} = ANY(%s)"
                self.entities.append((table, key, script.add(sql, (run_id, sorted(wanted)))))
        self.created = (
            script.add(
                "SELECT correlation_id FROM celery_workflow_events WHERE run_id = %s"
                " AND event_type IN ('hook_created', 'hook_conflict') AND correlation_id = ANY(%s)",
                (run_id, sorted(keys.hooks)),
            )
            if keys.hooks
            else None
        )
        ending, disposed = releases(batch)
        self.tokens: int | None = None
        if keys.tokens or ending or disposed:
            for lock_key in token_lock_keys(keys.tokens):
                script.add("SELECT pg_advisory_xact_lock(%s, %s)", (TOKEN_LOCK_SPACE, lock_key))
            self.tokens = script.add(*lock_tokens_sql(run_id, sorted(keys.tokens), ending, disposed))

    def snapshot(self, results: list[Result]) -> tuple[rules.Snapshot, list[Event]]:
        """The snapshot the rules need, and the events an earlier attempt of this very append wrote (if any)."""
        stored_run = results[self.run].one()
        snapshot = rules.Snapshot(None if stored_run is None else run_view(stored_run))
        if snapshot.run is None:
            return snapshot, []
        done = [] if self.written is None else [event(r) for r in results[self.written].rows]
        found: dict[str, dict[str, Any]] = {"steps": snapshot.steps, "hooks": snapshot.hooks, "waits": snapshot.waits}
        for table, key, index in self.entities:
            for stored in results[index].rows:
                item = view(table, stored)
                found[table][getattr(item, key)] = item
        if self.created is not None:
            snapshot.created_hooks.update(hook_id for (hook_id,) in results[self.created].rows)
        if self.tokens is not None:
            for stored in results[self.tokens].rows:
                hook = hook_view(stored)
                if hook.token in self.keys.tokens:
                    snapshot.token_owners[hook.token] = hook
        return snapshot, done


class SnapshotCache:
    """The whole state of the runs this process works on, as of their last read or write here (thread-safe, bounded).

    A kept snapshot is only a guess at the run's state: every write planned on it is refused by the events' primary
    key when the guess is stale (see the module docstring). Terminal runs are not kept.
    """

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._runs: OrderedDict[str, rules.Snapshot] = OrderedDict()

    def get(self, run_id: str) -> rules.Snapshot | None:
        with self._lock:
            found = self._runs.get(run_id)
            if found is not None:
                self._runs.move_to_end(run_id)
            return found

    def put(self, snapshot: rules.Snapshot) -> None:
        run = snapshot.run
        if run is None:
            return
        with self._lock:
            if run.status.terminal:
                self._runs.pop(run.run_id, None)
                return
            self._runs[run.run_id] = snapshot
            self._runs.move_to_end(run.run_id)
            while len(self._runs) > self.size:
                self._runs.popitem(last=False)

    def forget(self, run_id: str) -> None:
        with self._lock:
            self._runs.pop(run_id, None)

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
        script.add("COMMIT")

    def read(self, results: list[Result]) -> tuple[rules.Snapshot | None, list[Event]]:
        stored = results[self.run].one()
        if stored is None:
            return None, []
        log = [event(r) for r in results[self.log].rows]
        snapshot = rules.Snapshot(run_view(stored))
        found: dict[str, dict[str, Any]] = {"steps": snapshot.steps, "hooks": snapshot.hooks, "waits": snapshot.waits}
        keys = {"steps": "step_id", "hooks": "hook_id", "waits": "wait_id"}
        for table, index in self.tables.items():
            for r in results[index].rows:
                item = view(table, r)
                found[table][getattr(item, keys[table])] = item
        snapshot.created_hooks.update(
            str(e.correlation_id) for e in log if e.event_type in (EventType.HOOK_CREATED, EventType.HOOK_CONFLICT)
        )
        return snapshot, log
