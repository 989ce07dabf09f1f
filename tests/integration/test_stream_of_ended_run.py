"""Reading a finished run's unclosed stream returns at once on both SQL Worlds (issue #26, item 19): ``Run.stream``
waited ``20 * poll_interval`` for a chunk nobody would write (5 s on Postgres, 1 s on SQLite by default) before it
looked at the run. Here the Worlds poll every second, so that wait would be 20 s: the test's timeout (10 s) is what
fails it, not a timing threshold."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from celery_workflow import Workflows, get_writable
from celery_workflow.testing import LocalWorker
from celery_workflow.world import World
from celery_workflow.world_sqlite import SQLiteWorld


@pytest.fixture(params=["sqlite", "postgres"])
def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[World]:
    if request.param == "sqlite":
        opened: World = SQLiteWorld(tmp_path / "world.db", poll_interval=1.0)
    else:
        from celery_workflow.world_pg import PostgresWorld
        from tests.integration import pg_fixtures  # skips when the server is unreachable

        with pg_fixtures.fresh_schema() as schema:
            opened = PostgresWorld.open(pg_fixtures.schema_url(schema), poll_interval=1.0)
            yield opened
            opened.close()
        return
    yield opened
    opened.close()


@pytest.mark.timeout(10)
def test_a_finished_runs_unclosed_stream_is_read_without_waiting(world: World) -> None:
    wf = Workflows(Celery("streams"), world=world, broker="app")

    @wf.step
    def note(text: str) -> None:
        get_writable("notes").write(text)  # never closed

    @wf.workflow
    def noting() -> str:
        note("first")
        note("second")
        return "done"

    run = noting.start()
    LocalWorker(wf).run_until_complete(run)
    assert run.result(timeout=5) == "done"
    assert list(run.stream("notes", timeout=30)) == ["first", "second"]
    assert list(run.stream("notes", start=2, timeout=30)) == []
    assert world.read_stream(run.id, "notes", start=2, wait=30).chunks == []
