"""SQLiteWorld: the World conformance suite on a per-test database file, plus what only a shared file can show."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_workflow import ids
from celery_workflow.errors import ConfigurationError, SchemaVersionError, WorldError
from celery_workflow.events import EventType, NewEvent, RunStatus
from celery_workflow.testing.conformance import WorldConformance
from celery_workflow.world import NewRun, World, open_world
from celery_workflow.world_sqlite import COLUMNS, SQLiteWorld


class TestSQLiteWorld(WorldConformance):
    @pytest.fixture
    def world(self, tmp_path: Path) -> Iterator[World]:
        w = SQLiteWorld(tmp_path / "world.db")
        yield w
        w.close()


def _new_run(world: SQLiteWorld, *, started: bool = True) -> str:
    run_id = ids.new_run_id()
    world.create_run(NewRun(run_id, "wf", {"args": [], "kwargs": {}}))
    if started:
        world.append(run_id, [NewEvent(EventType.RUN_STARTED)])
    return run_id


# -- several processes ---------------------------------------------------------------------------------------------

PROCESSES = 4
APPENDS = 25


def _append_steps(path: str, run_id: str, worker: int, start: multiprocessing.synchronize.Event) -> None:
    world = SQLiteWorld(path)
    start.wait(30)
    for i in range(APPENDS):
        world.append(
            run_id, [NewEvent(EventType.STEP_CREATED, f"p{worker}-{i}", {"step_name": "s", "input": {"args": []}})]
        )
    world.close()


def _end_run_later(path: str, run_id: str, delay: float) -> None:
    time.sleep(delay)
    world = SQLiteWorld(path)
    world.append(run_id, [NewEvent(EventType.RUN_COMPLETED, None, {"output": "from another process"})])
    world.close()


def test_processes_appending_to_one_run_leave_contiguous_slots(tmp_path: Path) -> None:
    world = SQLiteWorld(tmp_path / "w.db")
    run_id = _new_run(world)
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=_append_steps, args=(world.path, run_id, n, start)) for n in range(PROCESSES)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    log = world.list_events(run_id)
    assert [e.slot for e in log] == list(range(1, PROCESSES * APPENDS + 3))
    assert sorted(e.correlation_id or "" for e in log[2:]) == sorted(
        f"p{n}-{i}" for n in range(PROCESSES) for i in range(APPENDS)
    )
    assert world.get_run(run_id).event_count == PROCESSES * APPENDS + 2
    assert [s.step_id for s in world.list_steps(run_id)] == [e.correlation_id for e in log[2:]]


def test_wait_for_terminal_wakes_when_another_process_ends_the_run(tmp_path: Path) -> None:
    world = SQLiteWorld(tmp_path / "w.db", poll_interval=30.0)  # only a commit wakes the waiter in time
    run_id = _new_run(world)
    proc = multiprocessing.get_context("spawn").Process(target=_end_run_later, args=(world.path, run_id, 0.5))
    proc.start()
    try:
        started = time.monotonic()
        view = world.wait_for_terminal(run_id, 60)
        assert view.status is RunStatus.COMPLETED and view.output == "from another process"
        assert time.monotonic() - started < 20
    finally:
        proc.join(60)
    assert proc.exitcode == 0


# -- one file, two Worlds ------------------------------------------------------------------------------------------


def test_a_second_world_on_the_file_sees_the_first_ones_writes(tmp_path: Path) -> None:
    first = SQLiteWorld(tmp_path / "w.db")
    second = SQLiteWorld.from_url(f"sqlite:///{tmp_path / 'w.db'}")
    run_id = _new_run(first)
    first.write_stream(run_id, "s", [b"j1" + b'"x"'])
    assert second.get_run(run_id).status is RunStatus.RUNNING
    assert [e.slot for e in second.list_events(run_id)] == [1, 2]
    assert [c.data for c in second.read_stream(run_id, "s").chunks] == [b'j1"x"']
    second.append(run_id, [NewEvent(EventType.RUN_CANCELLED)])
    assert first.get_run(run_id).status is RunStatus.CANCELLED


def test_from_url_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    relative = SQLiteWorld.from_url("sqlite:///rel/w.db")
    assert relative.path == str(tmp_path / "rel" / "w.db")
    absolute = open_world(f"sqlite:///{tmp_path / 'abs.db'}", poll_interval=0.5)
    assert isinstance(absolute, SQLiteWorld)
    assert absolute.path == str(tmp_path / "abs.db") and absolute.poll_interval == 0.5
    for bad in ("sqlite://", "sqlite:///:memory:", "sqlite://host/x.db", "sqlite:///x.db?mode=ro", "postgres:///x"):
        with pytest.raises(ConfigurationError):
            SQLiteWorld.from_url(bad)


def test_broker_spec_names_the_sqlite_transport_on_the_same_file(tmp_path: Path) -> None:
    from celery_workflow.transport.sqlite import database_path

    world = SQLiteWorld(tmp_path / "with space%.db")
    spec = world.broker()
    assert spec.transport == "celery_workflow.transport.sqlite:Transport"
    assert spec.url.startswith("sqlite:////")
    assert database_path(spec.url) == world.path
    assert SQLiteWorld.from_url(spec.url).path == world.path


# -- schema --------------------------------------------------------------------------------------------------------


def test_newer_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "w.db"
    SQLiteWorld(path).close()
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO celery_workflow_schema_version VALUES (9999, '9999_future.sql', 0)")
    conn.commit()
    conn.close()
    with pytest.raises(SchemaVersionError):
        SQLiteWorld(path)


def test_deleting_a_run_cascades_to_everything_it_owns(tmp_path: Path) -> None:
    world = SQLiteWorld(tmp_path / "w.db")
    run_id = _new_run(world)
    world.append(
        run_id,
        [
            NewEvent(EventType.STEP_CREATED, "s", {"step_name": "s", "input": {}}),
            NewEvent(EventType.HOOK_CREATED, "h", {"token": "tok"}),
            NewEvent(EventType.WAIT_CREATED, "w", {"resume_at": ids.isoformat(ids.utcnow())}),
        ],
    )
    world.write_stream(run_id, "s", [b"b1x"])
    with world.db.transaction() as conn:
        conn.execute("DELETE FROM celery_workflow_runs WHERE run_id = ?", (run_id,))
        for table in COLUMNS:
            assert conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] == 0, table


def test_sqlite_errors_become_world_errors(tmp_path: Path) -> None:
    world = SQLiteWorld(tmp_path / "w.db")
    run_id = _new_run(world)
    world.write_stream(run_id, "s", [b"b1x"])
    with world.db.transaction() as conn:
        conn.execute("DROP TABLE celery_workflow_stream_chunks")
    with pytest.raises(WorldError) as info:
        world.write_stream(run_id, "s", [b"b1x"])
    assert isinstance(info.value.__cause__, sqlite3.Error)
    with pytest.raises(WorldError):
        world.read_stream(run_id, "s")


def test_a_new_database_file_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    """The file holds every run's inputs and outputs and the queue workers execute: 0600, whatever the umask, and
    SQLite's -wal and -shm files with it. An existing file keeps the mode its owner gave it."""
    old = os.umask(0o022)
    try:
        world = SQLiteWorld.from_url(f"sqlite:///{tmp_path / 'w.sqlite3'}")
        world.close()
    finally:
        os.umask(old)
    for name in ("w.sqlite3", "w.sqlite3-wal", "w.sqlite3-shm"):
        path = tmp_path / name
        if path.exists():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, name
    shared = tmp_path / "shared.sqlite3"
    shared.touch(mode=0o640)
    shared.chmod(0o640)
    SQLiteWorld.from_url(f"sqlite:///{shared}").close()
    assert stat.S_IMODE(shared.stat().st_mode) == 0o640
