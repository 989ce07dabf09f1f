"""PostgresWorld: the World conformance suite on a schema per test, plus what only a shared server can show.

Several processes on one run, 50 claimants of one token, hook claims across runs without deadlocks, schema checks
against the catalog, a caller's pool, NOTIFY wake-ups across processes, retention, and connections killed under the
World's feet. Every wait is on a condition with a deadline.
"""

from __future__ import annotations

import multiprocessing
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg_pool import ConnectionPool

from celery_workflow import Workflows, ids
from celery_workflow._backend.migrations import migrations
from celery_workflow._postgres.retention import sweep_expired
from celery_workflow._postgres.rows import COLUMNS
from celery_workflow._postgres.world import WAITER_RECHECK
from celery_workflow.errors import (
    ConfigurationError,
    HookNotFound,
    RunNotFound,
    RunTerminal,
    SchemaVersionError,
)
from celery_workflow.events import EventType, NewEvent, RunStatus, RunView
from celery_workflow.testing.conformance import WorldConformance
from celery_workflow.world import Delivery, NewRun, World, open_world
from celery_workflow.world_pg import PostgresConfig, PostgresWorld, postgres_url
from tests.integration.pg_fixtures import (  # noqa: F401
    admin_connection,
    pg_admin_fixture,
    pg_schema_fixture,
    pg_url_fixture,
    pg_world_fixture,
    schema_url,
    terminate_backends,
)

DEADLINE = 60.0
SPAWN = multiprocessing.get_context("spawn")


class TestPostgresWorld(WorldConformance):
    @pytest.fixture
    def world(self, pg_url: str) -> Iterator[World]:
        w = PostgresWorld.open(pg_url)
        yield w
        w.close()


# -- helpers -------------------------------------------------------------------------------------------------------


def _new_run(world: PostgresWorld, *, workflow: str = "wf", started: bool = True) -> str:
    run_id = ids.new_run_id()
    world.create_run(NewRun(run_id, workflow, {"args": [], "kwargs": {}}))
    if started:
        world.append(run_id, [NewEvent(EventType.RUN_STARTED)])
    return run_id


def _step(step_id: str) -> NewEvent:
    return NewEvent(EventType.STEP_CREATED, step_id, {"step_name": "s", "input": {"args": []}})


def _hook(hook_id: str, token: str) -> NewEvent:
    return NewEvent(EventType.HOOK_CREATED, hook_id, {"token": token})


def _end() -> NewEvent:
    return NewEvent(EventType.RUN_COMPLETED, None, {"output": None})


def _run_pair(*bodies: Callable[[], object]) -> list[object]:
    """Run the bodies in threads released together; each one's result or exception."""
    barrier = threading.Barrier(len(bodies))
    results: list[object] = [None] * len(bodies)

    def worker(i: int) -> None:
        barrier.wait(DEADLINE)
        try:
            results[i] = bodies[i]()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
        assert not t.is_alive(), "a writer hung"
    return results


def _until(probe: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.01)


def _join(procs: list[Any]) -> None:
    for p in procs:
        p.join(DEADLINE)
        assert p.exitcode == 0, f"process exited with {p.exitcode}"


def _rows_of_run(admin: psycopg.Connection[Any], schema: str, run_id: str) -> dict[str, int]:
    counts = {}
    for table in [*(name for name, columns in COLUMNS.items() if "run_id" in columns), "celery_workflow_queue"]:
        row = admin.execute(f'SELECT count(*) FROM "{schema}".{table} WHERE run_id = %s', (run_id,)).fetchone()
        assert row is not None
        counts[table] = int(row[0])
    return counts


# -- several processes ---------------------------------------------------------------------------------------------

PROCESSES = 4
APPENDS = 25


def _append_steps(url: str, run_id: str, worker: int, barrier: Any) -> None:
    world = PostgresWorld.open(url)
    barrier.wait(DEADLINE)
    for i in range(APPENDS):
        world.append(run_id, [_step(f"p{worker}-{i}")])
    world.close()


def test_processes_appending_to_one_run_leave_contiguous_slots(pg_url: str, pg_world: PostgresWorld) -> None:
    run_id = _new_run(pg_world)
    barrier = SPAWN.Barrier(PROCESSES + 1)
    procs = [SPAWN.Process(target=_append_steps, args=(pg_url, run_id, n, barrier)) for n in range(PROCESSES)]
    for p in procs:
        p.start()
    barrier.wait(DEADLINE)
    _join(procs)
    log = pg_world.list_events(run_id)
    assert [e.slot for e in log] == list(range(1, PROCESSES * APPENDS + 3))
    assert sorted(e.correlation_id or "" for e in log[2:]) == sorted(
        f"p{n}-{i}" for n in range(PROCESSES) for i in range(APPENDS)
    )
    assert pg_world.get_run(run_id).event_count == PROCESSES * APPENDS + 2
    assert [s.step_id for s in pg_world.list_steps(run_id)] == [e.correlation_id for e in log[2:]]


# -- hook tokens ---------------------------------------------------------------------------------------------------

CLAIM_PROCESSES = 5
CLAIM_THREADS = 10


def _claim_token(url: str, run_ids: list[str], token: str, barrier: Any, results: Any) -> None:
    world = PostgresWorld.open(url, concurrency=CLAIM_THREADS)

    def claim(run_id: str) -> None:
        barrier.wait(DEADLINE)
        try:
            (event,) = world.append(run_id, [_hook("h", token)]).events
            results.put((run_id, event.event_type.value))
        except Exception as exc:
            results.put((run_id, repr(exc)))

    threads = [threading.Thread(target=claim, args=(r,)) for r in run_ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
    world.close()


def test_fifty_claimants_of_a_free_token_have_one_winner(pg_url: str, pg_world: PostgresWorld) -> None:
    token = f"tok_{ids.ulid()}"
    runs = [_new_run(pg_world) for _ in range(CLAIM_PROCESSES * CLAIM_THREADS)]
    barrier = SPAWN.Barrier(len(runs) + 1)
    results = SPAWN.Queue()
    groups = [runs[i::CLAIM_PROCESSES] for i in range(CLAIM_PROCESSES)]
    procs = [SPAWN.Process(target=_claim_token, args=(pg_url, g, token, barrier, results)) for g in groups]
    for p in procs:
        p.start()
    barrier.wait(DEADLINE)
    outcome = dict(results.get(timeout=DEADLINE) for _ in runs)
    _join(procs)
    kinds = sorted(outcome.values())
    assert kinds == ["hook_conflict"] * (len(runs) - 1) + ["hook_created"], kinds
    (winner,) = [r for r, kind in outcome.items() if kind == "hook_created"]
    assert pg_world.get_hook_by_token(token).run_id == winner
    assert sum(len(pg_world.list_hooks(r)) for r in runs) == 1
    for run_id in runs:
        (event,) = pg_world.list_events(run_id, after_slot=2)
        assert event.event_type.value == outcome[run_id]
        if run_id != winner:
            assert event.data["conflicting_run_id"] == winner


def test_concurrent_hook_claims_across_runs_never_deadlock(
    pg_world: PostgresWorld, pg_schema: str, pg_admin: Any
) -> None:
    pg_world.db.retries = 1  # a deadlock (or any retryable failure) would surface as WorldError instead of a retry
    tokens = [f"tok{i}_{ids.ulid()}" for i in range(10)]
    runs = [_new_run(pg_world) for _ in range(8)]
    runs_lock = threading.Lock()
    stats = {"created": 0, "conflict": 0, "disposed": 0, "ended": 0}

    def body(worker: int) -> None:
        rnd = random.Random(worker)
        for round_ in range(25):
            with runs_lock:
                slot = rnd.randrange(len(runs))
                run_id = runs[slot]
            batch = [_hook(f"h{worker}-{round_}-{j}", t) for j, t in enumerate(rnd.sample(tokens, rnd.randint(1, 3)))]
            live = [h.hook_id for h in pg_world.list_hooks(run_id)]
            if live and rnd.random() < 0.5:
                batch.insert(rnd.randrange(len(batch) + 1), NewEvent(EventType.HOOK_DISPOSED, rnd.choice(live)))
            if rnd.random() < 0.1:
                batch.append(NewEvent(EventType.RUN_COMPLETED, None, {"output": None}))
            try:
                result = pg_world.append(run_id, batch)
            except HookNotFound:
                continue  # another worker disposed it first
            except RunTerminal:
                with runs_lock:
                    if runs[slot] == run_id:
                        runs[slot] = _new_run(pg_world)
                continue
            with runs_lock:
                for e in result.events:
                    key = {"hook_created": "created", "hook_conflict": "conflict", "hook_disposed": "disposed"}
                    stats[key.get(e.event_type.value, "ended")] += 1

    errors: list[BaseException] = []

    def guarded(worker: int) -> None:
        try:
            body(worker)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,), daemon=True) for i in range(16)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, DEADLINE - (time.monotonic() - started)))
    assert not any(t.is_alive() for t in threads), "hook claims did not finish in time"
    assert errors == []
    assert stats["created"] > 0 and stats["conflict"] > 0 and stats["disposed"] > 0, stats
    schema = pg_schema
    hooks, tokens_held, consistent = pg_admin.execute(
        f'SELECT (SELECT count(*) FROM "{schema}".celery_workflow_hooks),'
        f' (SELECT count(*) FROM "{schema}".celery_workflow_hook_tokens),'
        f' (SELECT count(*) FROM "{schema}".celery_workflow_hook_tokens AS t'
        f'  JOIN "{schema}".celery_workflow_hooks AS h USING (run_id, hook_id) WHERE h.token = t.token)'
    ).fetchone()
    assert hooks == tokens_held == consistent <= len(tokens)


def test_crossed_claims_and_releases_do_not_deadlock(pg_world: PostgresWorld) -> None:
    """Each run claims the other's token while ending (so releasing its own): the token locks must not cross."""
    pg_world.db.retries = 1  # a deadlock would surface as WorldError
    for round_ in range(20):
        first, second = _new_run(pg_world), _new_run(pg_world)
        tokens = [f"tok{round_}a_{ids.ulid()}", f"tok{round_}b_{ids.ulid()}"]
        pg_world.append(first, [_hook("mine", tokens[0])])
        pg_world.append(second, [_hook("mine", tokens[1])])
        results = _run_pair(
            partial(pg_world.append, first, [_hook("theirs", tokens[1]), _end()]),
            partial(pg_world.append, second, [_hook("theirs", tokens[0]), _end()]),
        )
        assert not any(isinstance(r, Exception) for r in results), results
        for token in tokens:
            with pytest.raises(HookNotFound):
                pg_world.get_hook_by_token(token)


# -- schema --------------------------------------------------------------------------------------------------------


def test_newer_schema_version_is_refused(pg_url: str, pg_schema: str, pg_admin: Any) -> None:
    PostgresWorld.open(pg_url).close()
    pg_admin.execute(f"INSERT INTO \"{pg_schema}\".celery_workflow_schema_version VALUES (9999, '9999_future.sql')")
    with pytest.raises(SchemaVersionError):
        PostgresWorld.open(pg_url)
    with ConnectionPool(pg_url, min_size=1, max_size=2) as pool, pytest.raises(SchemaVersionError):
        PostgresWorld(pool)


def test_worlds_opening_together_migrate_once(pg_url: str, pg_schema: str, pg_admin: Any) -> None:
    results: list[object] = [None] * 4
    barrier = threading.Barrier(4)

    def open_one(i: int) -> None:
        barrier.wait(DEADLINE)
        try:
            PostgresWorld.open(pg_url).close()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=open_one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
    assert results == [None] * 4
    rows = pg_admin.execute(f'SELECT version FROM "{pg_schema}".celery_workflow_schema_version').fetchall()
    assert sorted(r[0] for r in rows) == [m.version for m in migrations("postgres")]


# -- pools, configuration, wiring ----------------------------------------------------------------------------------


def test_a_callers_pool_is_left_open(pg_url: str) -> None:
    with ConnectionPool(pg_url, min_size=1, max_size=4) as pool:
        world = PostgresWorld(pool, poll_interval=0.05)
        run_id = _new_run(world)
        assert world.wait_for_terminal(run_id, 0.01).status is RunStatus.RUNNING  # opens the listener too
        world.close()
        assert not pool.closed
        with pool.connection() as conn:
            assert conn.execute("SELECT count(*) FROM celery_workflow_runs").fetchone() == (1,)
        again = PostgresWorld(pool, PostgresConfig(poll_interval=0.5))
        assert again.get_run(run_id).status is RunStatus.RUNNING and again.poll_interval == 0.5
        again.close()
        assert not pool.closed


def test_configuration_and_open_world(pg_url: str) -> None:
    world = open_world(pg_url, poll_interval=0.5, lease=5.0, retention=timedelta(days=3))
    try:
        assert isinstance(world, PostgresWorld)
        assert world.poll_interval == 0.5 and world.config.retention == timedelta(days=3)
        assert world.config.concurrency == 10 and world.config.routes == {}
        spec = world.broker()
        assert spec.transport == "celery_workflow.transport.postgres:Transport"
        assert dict(spec.options) == {"lease_seconds": 5.0, "polling_interval": 0.5}
        assert spec.url.startswith("postgresql://") and "search_path" in spec.url
        assert psycopg.conninfo.conninfo_to_dict(spec.url) == psycopg.conninfo.conninfo_to_dict(pg_url)
    finally:
        world.close()
    with pytest.raises(ConfigurationError):
        PostgresWorld.open(pg_url, no_such_setting=1)
    routed = PostgresWorld.open(pg_url, routes={"nightly": "backfill"})
    try:  # the config's routes are not silently ignored: Workflows applies them
        assert Workflows(Celery("routed"), world=routed, broker="app").routes == {"nightly": "backfill"}
    finally:
        routed.close()
    for bad in ({"poll_interval": 0}, {"concurrency": 0}, {"lease": -1.0}, {"retention": timedelta(0)}):
        with pytest.raises(ConfigurationError):
            PostgresConfig(**bad)


@pytest.mark.parametrize(
    "conninfo",
    [
        "host=127.0.0.1 port=5432 user=postgres dbname=postgres options='-csearch_path=cw_x' application_name=a",
        "host=/var/run/postgresql user=me password='p@ss word' dbname='my db'",
        "host=h1,h2 port=5432,5433 dbname=x",
        "postgres://u@[::1]:5432/db?options=-csearch_path%3Ds",
    ],
)
def test_postgres_url_keeps_every_parameter(conninfo: str) -> None:
    url = postgres_url(conninfo)
    assert url.startswith("postgresql://")
    assert psycopg.conninfo.conninfo_to_dict(url) == psycopg.conninfo.conninfo_to_dict(conninfo)


# -- notifications -------------------------------------------------------------------------------------------------


def _complete_run(url: str, run_id: str, go: Any) -> None:
    world = PostgresWorld.open(url)
    go.wait(DEADLINE)
    world.append(run_id, [NewEvent(EventType.RUN_COMPLETED, None, {"output": "from another process"})])
    world.close()


def _watch_waits(world: PostgresWorld) -> threading.Event:
    """An event set when a waiter of ``world`` blocks on its listener."""
    listener = world.db.listener
    waiting = threading.Event()
    original = listener.wait

    def wait(channel: str, mark: tuple[int, int], timeout: float, key: str | None = None) -> bool:
        waiting.set()
        return original(channel, mark, timeout, key=key)

    listener.wait = wait  # type: ignore[method-assign]
    return waiting


def test_wait_for_terminal_wakes_on_a_notify_from_another_process(pg_url: str) -> None:
    world = PostgresWorld.open(pg_url, poll_interval=30.0)  # only the NOTIFY wakes the waiter in time
    try:
        run_id = _new_run(world)
        go = SPAWN.Event()
        proc = SPAWN.Process(target=_complete_run, args=(pg_url, run_id, go))
        proc.start()
        waiting = _watch_waits(world)
        got: queue.Queue[Any] = queue.Queue()
        waiter = threading.Thread(target=lambda: got.put(world.wait_for_terminal(run_id, DEADLINE)), daemon=True)
        waiter.start()
        assert waiting.wait(DEADLINE)
        woken_from = time.monotonic()
        go.set()
        view = got.get(timeout=DEADLINE)
        assert view.status is RunStatus.COMPLETED and view.output == "from another process"
        assert time.monotonic() - woken_from < 20  # well before the 30 s poll
        _join([proc])
    finally:
        world.close()


def count_reads(world: PostgresWorld) -> list[str]:
    """The run ids ``world.get_run`` is called with from now on."""
    reads: list[str] = []
    original = world.get_run

    def counting(run_id: str) -> RunView:
        reads.append(run_id)
        return original(run_id)

    world.get_run = counting  # type: ignore[method-assign]
    return reads


def test_a_waiter_for_a_runs_end_does_not_reread_it_every_poll_interval(pg_url: str) -> None:
    """Its end is notified: waiting clients do not poll the run (their reads would grow with the runs in flight)."""
    world = PostgresWorld.open(pg_url, poll_interval=0.05)
    try:
        run_id = _new_run(world)
        reads = count_reads(world)
        assert world.wait_for_terminal(run_id, 1.0).status is not RunStatus.COMPLETED
        assert len(reads) <= 2  # the first look and the last; not one per 50 ms
    finally:
        world.close()


@pytest.mark.parametrize("output", [{"total": 3, "note": "é ✓"}, "x" * 2000])
def test_a_runs_end_notify_wakes_its_waiter_which_reads_it(pg_url: str, output: Any) -> None:
    """A run's end NOTIFY names the run (nothing else: anyone who can connect may listen): the waiter it wakes reads
    the run once and returns it as stored, well before its periodic re-check."""
    world, other = PostgresWorld.open(pg_url), PostgresWorld.open(pg_url)
    try:
        run_id = _new_run(world)
        reads = count_reads(world)
        waited: list[RunView] = []
        waiter = threading.Thread(target=lambda: waited.append(world.wait_for_terminal(run_id, 10.0)))
        waiter.start()
        deadline = time.monotonic() + 5
        while not reads and time.monotonic() < deadline:  # the waiter's first look (it found the run running)
            time.sleep(0.005)
        ended_at = time.monotonic()
        other.append(run_id, [NewEvent(EventType.RUN_COMPLETED, None, {"output": output})])
        waiter.join(10)
        assert time.monotonic() - ended_at < WAITER_RECHECK  # woken by the NOTIFY, not by the re-check
        ended = waited[0]
        assert ended == other.get_run(run_id)  # every field, as stored
        assert ended.output == output and ended.status is RunStatus.COMPLETED
        assert len(reads) == 2  # the first look, and the read its end's NOTIFY prompted
    finally:
        world.close()
        other.close()


def test_a_run_created_while_listening_is_waited_for_without_a_first_look(pg_url: str) -> None:
    """A process that listens already and creates a run needs no first read to wait for its end: the mark taken
    before the creation catches an end that came before the wait began (no 5 s recheck): the run is read once, when
    its end's NOTIFY says it ended."""
    world, other = PostgresWorld.open(pg_url), PostgresWorld.open(pg_url)
    try:
        world.wait_for_terminal(_new_run(world), 0.01)  # now listening
        reads = count_reads(world)
        early = _new_run(world, started=False)
        other.append(early, [NewEvent(EventType.RUN_CANCELLED, None, {})])  # ends before anyone waits
        started = time.monotonic()
        assert world.wait_for_terminal(early, 10.0).status is RunStatus.CANCELLED
        assert time.monotonic() - started < WAITER_RECHECK and reads == [early]  # read once, after its NOTIFY
        late = _new_run(world, started=False)
        assert world.wait_for_terminal(late, 0.05).status is RunStatus.PENDING
        assert reads == [early, late]  # only the look when the wait timed out; none before waiting
    finally:
        world.close()
        other.close()


def test_read_stream_wakes_on_a_notify_from_another_world(pg_url: str) -> None:
    reader = PostgresWorld.open(pg_url, poll_interval=30.0)
    writer = PostgresWorld.open(pg_url)
    try:
        run_id = _new_run(writer)
        waiting = _watch_waits(reader)
        got: queue.Queue[Any] = queue.Queue()
        thread = threading.Thread(target=lambda: got.put(reader.read_stream(run_id, "s", wait=DEADLINE)), daemon=True)
        thread.start()
        assert waiting.wait(DEADLINE)
        woken_from = time.monotonic()
        writer.write_stream(run_id, "s", [b'j1"hi"'])
        page = got.get(timeout=DEADLINE)
        assert [c.data for c in page.chunks] == [b'j1"hi"'] and time.monotonic() - woken_from < 20
    finally:
        reader.close()
        writer.close()


# -- retention -----------------------------------------------------------------------------------------------------


def _ended(world: PostgresWorld, workflow: str, kind: EventType = EventType.RUN_COMPLETED) -> str:
    run_id = _new_run(world, workflow=workflow)
    data = {"error": {"message": "x"}} if kind is EventType.RUN_FAILED else {}
    world.append(run_id, [NewEvent(kind, None, data)])
    return run_id


def test_retention_deletes_only_expired_ended_runs(pg_url: str, pg_schema: str, pg_admin: Any) -> None:
    world = PostgresWorld.open(
        pg_url, retention=timedelta(days=1), retentions={"wf.short": timedelta(hours=1), "wf.keep": None}
    )
    try:
        default = _ended(world, "wf.default")
        short = _ended(world, "wf.short", EventType.RUN_FAILED)
        keep = _ended(world, "wf.keep", EventType.RUN_CANCELLED)
        running = _new_run(world, workflow="wf.short")
        pending = _new_run(world, workflow="wf.default", started=False)
        full = _new_run(world, workflow="wf.default")
        world.append(
            full,
            [
                _step("s"),
                _hook("h", f"tok_{ids.ulid()}"),
                NewEvent(EventType.WAIT_CREATED, "w", {"resume_at": ids.isoformat(ids.utcnow())}),
            ],
        )
        world.write_stream(full, "out", [b'j1"a"', b'j1"b"'])
        world.append(full, [NewEvent(EventType.RUN_COMPLETED, None, {"output": 1})])
        world.enqueue([Delivery("q", b"late", run_id=full), Delivery("q", b"other", run_id=running)])
        live_token = f"tok_{ids.ulid()}"
        world.append(running, [_step("s"), _hook("h", live_token)])
        world.write_stream(running, "out", [b'j1"r"'])
        assert sum(_rows_of_run(pg_admin, pg_schema, full).values()) > 5
        before = _rows_of_run(pg_admin, pg_schema, running)

        now = ids.utcnow()
        assert world.sweep_expired(now + timedelta(minutes=30)) == 0
        assert world.sweep_expired(now + timedelta(hours=2)) == 1
        with pytest.raises(RunNotFound):
            world.get_run(short)
        assert world.sweep_expired(now + timedelta(days=2)) == 2
        for gone in (short, default, full):
            with pytest.raises(RunNotFound):
                world.get_run(gone)
            assert set(_rows_of_run(pg_admin, pg_schema, gone).values()) == {0}, gone
        for kept in (keep, running, pending):
            assert world.get_run(kept).run_id == kept
        assert _rows_of_run(pg_admin, pg_schema, running) == before
        assert world.get_hook_by_token(live_token).run_id == running
        assert world.sweep_expired(now + timedelta(days=3650)) == 0
    finally:
        world.close()


def test_retention_sweeps_in_batches_and_concurrently(pg_world: PostgresWorld) -> None:
    for _ in range(3):
        _ended(pg_world, "wf")
    later = ids.utcnow() + timedelta(days=2)
    assert sweep_expired(pg_world.db, timedelta(days=1), {}, now=later, batch=2) == 3  # batches of 2, 1
    expired = [_ended(pg_world, "wf") for _ in range(40)]
    counts: list[int] = []
    barrier = threading.Barrier(4)

    def sweep() -> None:
        barrier.wait(DEADLINE)
        counts.append(sweep_expired(pg_world.db, timedelta(days=1), {}, now=later, batch=5))

    threads = [threading.Thread(target=sweep) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
    assert len(counts) == 4 and sum(counts) == len(expired)
    assert pg_world.list_runs(workflow="wf").items == []


def test_start_retention_sweeps_in_the_background(pg_url: str, pg_schema: str, pg_admin: Any) -> None:
    plain = PostgresWorld.open(pg_url)
    assert plain.start_retention() is None  # no retention configured
    plain.close()
    world = PostgresWorld.open(pg_url, retention=timedelta(days=1))
    try:
        old = _ended(world, "wf")
        recent = _ended(world, "wf")
        pg_admin.execute(
            f"UPDATE \"{pg_schema}\".celery_workflow_runs SET completed_at = now() - interval '2 days'"
            " WHERE run_id = %s",
            (old,),
        )
        sweeper = world.start_retention(interval=0.05)
        assert sweeper is not None and world.start_retention() is sweeper
        _until(lambda: sweeper.deleted == 1, "the background sweep")
        _until(lambda: sweeper.sweeps >= 3, "repeated sweeps")
        assert world.get_run(recent).status is RunStatus.COMPLETED
        with pytest.raises(RunNotFound):
            world.get_run(old)
        sweeper.stop()
        assert not sweeper.alive
    finally:
        world.close()


# -- lost connections ----------------------------------------------------------------------------------------------


def test_killed_connections_lose_nothing(pg_url: str, pg_schema: str, pg_admin: Any) -> None:
    world = PostgresWorld.open(pg_url, poll_interval=0.1)
    try:
        run_id = _new_run(world)
        assert world.wait_for_terminal(run_id, 0.01).status is RunStatus.RUNNING  # the listener connects
        killed = 0
        for i in range(30):
            if i in (10, 20):
                killed += terminate_backends(pg_admin, pg_schema)
            world.append(run_id, [_step(f"s{i}")])
        assert killed >= 2
        # killed in the middle of a transaction: the append waits for the run lock an outsider holds
        with admin_connection() as locker:
            with locker.transaction():
                locker.execute(
                    f'SELECT 1 FROM "{pg_schema}".celery_workflow_runs WHERE run_id = %s FOR UPDATE', (run_id,)
                )
                done: queue.Queue[object] = queue.Queue()

                def append() -> None:
                    try:
                        done.put(world.append(run_id, [_step("blocked")]))
                    except Exception as exc:
                        done.put(exc)

                thread = threading.Thread(target=append, daemon=True)
                thread.start()

                def blocked() -> bool:
                    row = pg_admin.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'",
                        (pg_schema,),
                    ).fetchone()
                    return row is not None and row[0] == 1

                _until(blocked, "the append waiting for the run lock")
                assert terminate_backends(pg_admin, pg_schema) >= 1
            result = done.get(timeout=DEADLINE)
        assert not isinstance(result, Exception), result
        world.append(run_id, [NewEvent(EventType.RUN_COMPLETED, None, {"output": "ok"})])
        assert world.wait_for_terminal(run_id, DEADLINE).status is RunStatus.COMPLETED
        log = world.list_events(run_id)
        assert [e.slot for e in log] == list(range(1, 35))
        assert [e.correlation_id for e in log[2:-1]] == [f"s{i}" for i in range(30)] + ["blocked"]
    finally:
        world.close()


def test_a_commit_whose_answer_was_lost_is_not_applied_twice(
    pg_world: PostgresWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection dies after COMMIT reached the server: the retry finds its own write instead of repeating it."""
    pool = pg_world.db.pool
    real = pool.connection
    lose = [0]

    @contextmanager
    def connection(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with real(*args, **kwargs) as conn:
            yield conn
        if lose[0] > 0:
            lose[0] -= 1
            raise psycopg.OperationalError("server closed the connection unexpectedly (simulated, after COMMIT)")

    monkeypatch.setattr(pool, "connection", connection)
    run_id = _new_run(pg_world)
    token = f"tok_{ids.ulid()}"
    pg_world.append(run_id, [_hook("h", token), _step("s"), NewEvent(EventType.STEP_STARTED, "s")])
    lose[0] = 1
    received = pg_world.append(
        run_id,
        [NewEvent(EventType.HOOK_RECEIVED, "h", {"payload": 1})],
        deliveries=[Delivery("q-lost-answer", b"wake", run_id=run_id)],
    )
    assert lose[0] == 0 and [(e.event_type, e.slot) for e in received.events] == [(EventType.HOOK_RECEIVED, 6)]
    lose[0] = 1
    done = pg_world.append(run_id, [NewEvent(EventType.STEP_COMPLETED, "s", {"result": 2})])  # no EntityTerminal
    assert lose[0] == 0 and [e.event_type for e in done.events] == [EventType.STEP_COMPLETED]
    lose[0] = 1
    other = ids.new_run_id()
    view, created = pg_world.create_run(NewRun(other, "wf", {"args": [], "kwargs": {}}))
    assert lose[0] == 0 and created and view.run_id == other
    lose[0] = 1
    assert pg_world.write_stream(run_id, "out", [b'j1"a"', b'j1"b"']) == 2
    assert lose[0] == 0 and pg_world.write_stream(run_id, "out", [b'j1"c"']) == 3
    assert [c.index for c in pg_world.read_stream(run_id, "out").chunks] == [0, 1, 2]
    kinds = [e.event_type for e in pg_world.list_events(run_id)]
    assert kinds.count(EventType.HOOK_RECEIVED) == 1 and kinds.count(EventType.STEP_COMPLETED) == 1
    assert [d.payload for d in pg_world.claim(["q-lost-answer"], limit=10)] == [b"wake"]


def test_every_setting_of_the_config_is_used(pg_url: str) -> None:
    """base_url builds webhook URLs (unless Workflows has its own), routes route, concurrency sizes the pool."""
    from celery_workflow import create_webhook
    from celery_workflow.testing import LocalWorker

    world = PostgresWorld.open(
        pg_url, base_url="https://hooks.example.com/v1/workflow", routes={"nightly": "backfill"}, concurrency=3
    )
    try:
        assert world.db.pool.max_size == 3 + 5
        wf = Workflows(Celery("pg-config"), world=world, broker="app", queues=["celery", "backfill"])
        assert wf.routes == {"nightly": "backfill"}

        @wf.workflow
        def hooked() -> str:
            return create_webhook(token="cfg-hook").url

        run = hooked.start()
        LocalWorker(wf).run_until_complete(run)
        assert run.result() == "https://hooks.example.com/v1/workflow/webhooks/cfg-hook"
    finally:
        world.close()
