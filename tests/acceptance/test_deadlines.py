"""Issue #30 item 4, checked from outside on a real `celery worker` (prefork pool), SQLite and Postgres Worlds: a step
attempt past its timeout is interrupted by Celery's soft time limit and counts as a failed attempt; a run asleep past
its deadline is woken to fail with RunTimedOut."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_workflow import RunTimedOut
from celery_workflow.events import EventType

from .workers import Worker, imported_app, postgres_schema

pytestmark = pytest.mark.acceptance


@pytest.fixture(params=["sqlite", "postgres"])
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    if request.param == "sqlite":
        yield {"CELERY_WORKFLOW_URL": f"sqlite:///{tmp_path / 'world.sqlite3'}"}
        return
    with postgres_schema() as url:
        yield {"CELERY_WORKFLOW_URL": url}


def test_timeouts_on_a_real_worker(env: dict[str, str], tmp_path: Path) -> None:
    with imported_app("deadlinesapp", env) as app:
        worker = Worker("deadlinesapp", env, tmp_path / "worker.log", ["-c", "2", "-P", "prefork"])
        worker.wait_ready()
        try:
            hanging = app.call_hanging.start("h")
            sleeper = app.oversleeper.start()
            result = hanging.result(timeout=60)  # the body would run for two minutes
            with pytest.raises(RunTimedOut, match="passed its deadline"):
                sleeper.result(timeout=30)
        finally:
            worker.stop()
        assert result["type"] == "celery_workflow.errors.StepTimedOut", result
        assert "SoftTimeLimitExceeded" in result["message"]  # the worker's time limit interrupted the body
        kinds = [e.event_type for e in hanging.events()]
        assert kinds.count(EventType.STEP_STARTED) == 2  # max_retries=1: both attempts timed out
        assert kinds.count(EventType.STEP_RETRYING) == 1 and kinds.count(EventType.STEP_FAILED) == 1
        assert sleeper.events()[-1].data["code"] == "RUN_TIMED_OUT"
