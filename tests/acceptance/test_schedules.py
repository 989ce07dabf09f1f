"""Issue #30 item 3, checked from outside: a schedule fired by two real `celery worker` processes (each runs a
ticker in its main process), SQLite and Postgres Worlds, on a sped-up clock (four minutes a second): ten ticks give
exactly ten runs, ``<schedule>@<tick>``, each completed, whether a tick was caught up at the workers' start or fired
live while both tickers competed for it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from celery_workflow.events import RunStatus
from celery_workflow.schedules import tick_run_id

from .workers import Worker, imported_app, postgres_schema, wait_for

pytestmark = pytest.mark.acceptance

START = datetime(2025, 12, 31, 23, 56, tzinfo=UTC)  # the first tick is four minutes (one second) away
TICKS = [datetime(2026, 1, 1, 0, minute, tzinfo=UTC) for minute in range(10)]  # "0-9 0 1 1 *"


@pytest.fixture(params=["sqlite", "postgres"])
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    if request.param == "sqlite":
        yield {"CELERY_WORKFLOW_URL": f"sqlite:///{tmp_path / 'world.sqlite3'}"}
        return
    with postgres_schema() as url:
        yield {"CELERY_WORKFLOW_URL": url}


def test_two_workers_start_exactly_one_run_per_tick(env: dict[str, str], tmp_path: Path) -> None:
    env = {
        **env,
        "CW_CLOCK_START": START.isoformat(),
        "CW_CLOCK_FACTOR": "240",
        "CW_CLOCK_REAL_START": repr(time.time()),
    }
    with imported_app("schedulesapp", env) as app:
        defined = app.wf.schedule(app.report, cron="0-9 0 1 1 *", id="reports", args=["eu"], overlap="allow",
                                  catch_up=timedelta(days=1))  # fmt: skip
        ticks = [tick for tick in TICKS if tick >= defined.next_tick]  # all ten, unless this machine is very slow
        assert len(ticks) >= 5, defined
        workers = [
            Worker("schedulesapp", env, tmp_path / f"w{n}.log", ["-c", "1", "-P", "prefork", "-n", f"w{n}@%h"])
            for n in (1, 2)
        ]
        try:
            for worker in workers:
                worker.wait_ready()
            expected = [tick_run_id("reports", tick) for tick in ticks]

            def done() -> list[str] | None:
                runs = app.wf.list_runs(workflow="acceptance.report", status=RunStatus.COMPLETED, limit=50)
                return [r.id for r in runs] if len(runs) >= len(expected) else None

            wait_for(done, 30, lambda: "".join(w.log.read_text()[-2000:] for w in workers))
            stored = app.wf.schedules.get("reports")
        finally:
            for worker in workers:
                worker.stop()
        runs = app.wf.list_runs(workflow="acceptance.report", limit=50)
        assert sorted(r.id for r in runs) == expected  # exactly one run per tick, none twice
        assert {r.result(timeout=1) for r in runs} == {"report eu"}
        assert stored.next_tick == datetime(2027, 1, 1, tzinfo=UTC)  # every tick of this year fired
        assert stored.last_run_id == expected[-1] and stored.lease_holder is None
        logs = "".join(w.log.read_text() for w in workers)
        assert logs.count("started run reports@") == len(expected)
        assert "already" not in logs  # each tick was claimed by one ticker: none fired a tick the other had
