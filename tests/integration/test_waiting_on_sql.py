"""``Run.waiting_on`` on the SQL Worlds, whose queue stores know their consumers (issue #30, item 5): a run whose
queue nobody consumes waits on that queue until a consumer shows up; then, asleep, on its wake-up."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from celery import Celery

from celery_workflow import Workflows, sleep
from celery_workflow.testing import LocalWorker
from celery_workflow.waiting_on import QueueWait, Sleep


@pytest.fixture(params=["sqlite", "postgres"])
def wf(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Workflows]:
    def make(url: str) -> Workflows:
        workflows = Workflows(Celery("waiting-sql"), world=url, broker="app")

        @workflows.workflow(queue="reports")
        def napping() -> str:
            sleep(timedelta(hours=1))
            return "awake"

        return workflows

    if request.param == "sqlite":
        workflows = make(f"sqlite:///{tmp_path / 'world.sqlite3'}")
        yield workflows
        workflows.close()
        return
    from tests.integration import pg_fixtures

    with pg_fixtures.fresh_schema("cw_waiting") as schema:
        workflows = make(pg_fixtures.schema_url(schema))
        yield workflows
        workflows.close()


def test_a_queue_nobody_consumes_then_a_sleep(wf: Workflows) -> None:
    run = wf.start("napping")
    assert run.waiting_on == [QueueWait("reports", "run")]
    store = wf.world.store  # type: ignore[attr-defined]
    store.touch("worker-1", ["reports"])
    assert run.waiting_on == []  # consumed: its start is on its way
    LocalWorker(wf, queues=["reports"]).run_until(lambda: bool(run.waiting_on))
    (item,) = run.waiting_on
    assert isinstance(item, Sleep)
    store.drop_consumer("worker-1", ["reports"])
    assert run.waiting_on == [item]  # a sleep's wake-up is not due yet: the queue does not matter now
