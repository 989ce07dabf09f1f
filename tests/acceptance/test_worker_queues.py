"""Which queues a real `celery -A queuesapp worker` serves, and a run waiting on a queue nobody serves (issue #27,
item 11), on the SQLite and Postgres Worlds; and the Postgres World's ``concurrency`` as the worker's (item 10).

Without ``-Q`` a worker serves every queue the app's Workflows knows: a route (``backfill``), a step's queue
(``bulk``), ``queues=`` (``extra``) and the default queue. ``-Q celery`` still restricts it: a run routed to
``backfill`` then waits, and ``runs list`` / ``runs show`` say that nobody consumes its queue.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from click.testing import CliRunner

from celery_workflow.cli import workflow
from celery_workflow.events import RunStatus
from celery_workflow.inspector.server import make_app

from .workers import Worker, imported_app, postgres_schema

pytestmark = pytest.mark.acceptance

DEADLINE = 60.0


@pytest.fixture(params=["sqlite", "postgres"])
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    if request.param == "sqlite":
        yield {"CELERY_WORKFLOW_URL": f"sqlite:///{tmp_path / 'world.sqlite3'}"}
        return
    with postgres_schema() as url:
        yield {"CELERY_WORKFLOW_URL": url}


@pytest.fixture
def app(env: dict[str, str]) -> Iterator[ModuleType]:
    with imported_app("queuesapp", env) as module:
        yield module


def _worker(env: dict[str, str], log: Path, *args: str) -> Iterator[Worker]:
    worker = Worker("queuesapp", env, log, args)
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()


def _served(log: Path) -> set[str]:
    """The queues the worker's banner lists (``.> name  exchange=…``)."""
    return set(re.findall(r"^\s+\.> (\S+)\s+exchange=", log.read_text(), re.M))


def _cli(url: str, *args: str) -> str:
    result = CliRunner().invoke(workflow, ["--world", url, *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_a_worker_without_Q_serves_every_queue_the_app_knows(
    app: ModuleType, env: dict[str, str], tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    for _ in _worker(env, log, "-c", "1"):
        assert {"celery", "backfill", "bulk", "extra"} <= _served(log), log.read_text()[-3000:]
        routed, plain = app.routed.start(20), app.plain.start(1)
        assert routed.result(timeout=DEADLINE) == 41  # on backfill, its step on bulk
        assert plain.result(timeout=DEADLINE) == 1


def test_Q_restricts_and_a_run_on_a_queue_nobody_serves_says_so(
    app: ModuleType, env: dict[str, str], tmp_path: Path
) -> None:
    url = env["CELERY_WORKFLOW_URL"]
    log = tmp_path / "worker.log"
    for _ in _worker(env, log, "-c", "1", "-Q", "celery"):
        assert _served(log) == {"celery"}, log.read_text()[-3000:]
        routed = app.routed.start(20)
        assert app.plain.start(1).result(timeout=DEADLINE) == 1  # the worker runs what it serves
        assert app.wf.world.get_run(routed.id).status is RunStatus.PENDING
        listed = _cli(url, "runs", "list")
        (line,) = [row for row in listed.splitlines() if row.startswith(routed.id)]
        assert line.endswith("backfill (no consumer)"), listed
        assert "no worker consumes backfill" in listed
        plain_line = next(row for row in listed.splitlines() if " completed " in row)
        assert plain_line.endswith(" celery"), listed
        shown = _cli(url, "runs", "show", routed.id)
        assert re.search(r"^queue\s+backfill \(no consumer\)$", shown, re.M), shown
        inspector = make_app(app.wf).test_client()
        page = inspector.get(f"/runs/{routed.id}").get_data(as_text=True)
        assert "no consumer: no worker serves this queue" in page
        page = inspector.get(f"/runs/{app.plain.start(2).id}").get_data(as_text=True)
        assert "no consumer" not in page  # celery is served


@pytest.mark.parametrize("args", [(), ("-c", "2")], ids=["its concurrency", "-c overrides"])
def test_the_postgres_worlds_concurrency_is_the_workers(tmp_path: Path, args: tuple[str, ...]) -> None:
    """``concurrency=3`` runs three deliveries at once (three prefork children) unless ``-c`` says otherwise; each
    child's pool holds what one delivery needs."""
    with postgres_schema() as url:
        env = {"CELERY_WORKFLOW_URL": url, "CW_CONCURRENCY": "3"}
        with imported_app("queuesapp", env) as app:
            log = tmp_path / "worker.log"
            for _ in _worker(env, log, *args):
                expected = args[1] if args else "3"
                assert re.search(rf"concurrency: {expected} \(prefork\)", log.read_text()), log.read_text()[-3000:]
                reported = app.pool_size.start().result(timeout=DEADLINE)
                assert reported["max_size"] == 2, reported  # one delivery at a time, one call beside it
