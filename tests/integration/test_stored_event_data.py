"""Typed event data at the read edge (issue #28, item 4): a stored event whose data does not fit its type's data
class, or whose type this version does not know, is a typed error when a World reads it back (SQLite, Postgres);
fields a newer version added are read past and kept."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_workflow import codec
from celery_workflow.errors import EventUnreadable, UnknownEventType
from celery_workflow.event_data import StepStartedData
from celery_workflow.events import EventType, NewEvent
from celery_workflow.world import NewRun, World
from celery_workflow.world_sqlite import SQLiteWorld
from tests.integration.pg_fixtures import (  # noqa: F401
    admin_connection,
    pg_schema_fixture,
    pg_url_fixture,
)

#: Rewrites one stored event: (run id, slot, event type, data).
Rewrite = Callable[[str, int, str, dict[str, Any]], None]


@pytest.fixture(params=["sqlite", "postgres"])
def stored(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[World, Rewrite]]:
    if request.param == "sqlite":
        path = tmp_path / "world.db"
        world: World = SQLiteWorld(path)

        def rewrite(run_id: str, slot: int, kind: str, data: dict[str, Any]) -> None:
            import sqlite3

            with sqlite3.connect(path) as conn:
                conn.execute(
                    "UPDATE celery_workflow_events SET event_type = ?, data = ? WHERE run_id = ? AND slot = ?",
                    (kind, codec.dumps(data), run_id, slot),
                )

        yield world, rewrite
        world.close()
        return
    schema = request.getfixturevalue("pg_schema")
    from celery_workflow.world_pg import PostgresWorld

    world = PostgresWorld.open(request.getfixturevalue("pg_url"))

    def rewrite_pg(run_id: str, slot: int, kind: str, data: dict[str, Any]) -> None:
        with admin_connection() as admin:
            admin.execute(
                f'UPDATE "{schema}".celery_workflow_events SET event_type = %s, data = %s'
                " WHERE run_id = %s AND slot = %s",
                (kind, codec.dumps(data), run_id, slot),
            )

    yield world, rewrite_pg
    world.close()


def _run(world: World) -> str:
    run, _ = world.create_run(NewRun("wrun_stored", "wf", {"args": [], "kwargs": {}}))
    world.append(
        run.run_id,
        [
            NewEvent(EventType.RUN_STARTED),
            NewEvent(EventType.STEP_CREATED, "s", {"step_name": "s", "input": {}}),
            NewEvent(EventType.STEP_STARTED, "s", {"owner": "d"}),
        ],
    )
    return run.run_id


def test_stored_data_that_does_not_fit_its_type_is_unreadable(stored: tuple[World, Rewrite]) -> None:
    world, rewrite = stored
    run_id = _run(world)
    rewrite(run_id, 3, "step_created", {"input": {}})  # step_name missing
    with pytest.raises(EventUnreadable, match=r"event 3 of run wrun_stored \(step_created\).*'step_name'"):
        world.list_events(run_id)
    with pytest.raises(EventUnreadable):
        world.get_run_with_events(run_id)
    rewrite(run_id, 3, "step_created", {"step_name": ["s"], "input": {}})  # of another type
    with pytest.raises(EventUnreadable, match="must be a string"):
        world.list_events(run_id)


def test_a_stored_event_of_a_type_this_version_does_not_know_is_a_typed_error(
    stored: tuple[World, Rewrite],
) -> None:
    world, rewrite = stored
    run_id = _run(world)
    rewrite(run_id, 4, "step_cancelled", {})
    with pytest.raises(UnknownEventType, match="'step_cancelled'"):
        world.list_events(run_id)


def test_fields_a_newer_version_added_are_read_past_and_kept(stored: tuple[World, Rewrite]) -> None:
    world, rewrite = stored
    run_id = _run(world)
    rewrite(run_id, 4, "step_started", {"owner": "d", "attempt": 1, "host": "worker-7"})
    started = world.list_events(run_id)[-1]
    assert started.body == StepStartedData(owner="d", attempt=1)
    assert started.data == {"owner": "d", "attempt": 1, "host": "worker-7"}
