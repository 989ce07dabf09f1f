"""The Postgres World's run-end notification names the run and nothing else (issue #26, item 8): any role that can
connect may LISTEN on its channel, so a run's input and output are read by the waiter, never sent."""

from __future__ import annotations

import time
from typing import Any

import psycopg

from celery_workflow import ids
from celery_workflow._postgres.listener import CHANNEL_RUNS, SCHEMA_TAG
from celery_workflow.events import EventType
from celery_workflow.testing._conformance import ev
from celery_workflow.world import NewRun
from celery_workflow.world_pg import PostgresWorld
from tests.integration.pg_fixtures import (  # noqa: F401
    pg_schema_fixture,
    pg_url_fixture,
    pg_world_fixture,
)


def test_a_runs_end_is_announced_by_its_id_alone_and_its_waiter_reads_it(pg_world: PostgresWorld, pg_url: str) -> None:
    canary = "canary-7f3a"
    with psycopg.connect(pg_url, autocommit=True) as spy:
        (tag,) = spy.execute(f"SELECT {SCHEMA_TAG}").fetchone() or ("",)
        spy.execute(f'LISTEN "{CHANNEL_RUNS}_{tag}"')
        run_id = ids.new_run_id()
        pg_world.create_run(NewRun(run_id, "wf", {"args": [canary], "kwargs": {}}))
        pg_world.append(run_id, [ev(EventType.RUN_STARTED)])
        pg_world.append(run_id, [ev(EventType.RUN_COMPLETED, output=f"{canary} out")])
        heard: list[Any] = []
        deadline = time.monotonic() + 5
        while not heard and (left := deadline - time.monotonic()) > 0:
            heard += [n.payload for n in spy.notifies(timeout=left, stop_after=1)]
    assert heard == [run_id]
    ended = pg_world.wait_for_terminal(run_id, timeout=5)
    assert ended.status.terminal and ended.output == f"{canary} out" and ended.input["args"] == [canary]
