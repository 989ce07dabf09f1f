"""``workflow scheduled``: the countdown/ETA tasks a SQLite or Postgres World's queue holds for later (issue #33,
item 3), here published by a plain Celery app on our SQLite transport with no worker running."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from click.testing import CliRunner, Result

from celery_workflow.cli import workflow


def invoke(*args: str) -> Result:
    result = CliRunner().invoke(workflow, list(args), catch_exceptions=False)
    assert "Traceback" not in result.output
    return result


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Celery]:
    celery = Celery("sched")
    celery.conf.update(
        broker_url=f"sqlite:///{tmp_path / 'broker.db'}", broker_transport="celery_workflow.transport.sqlite:Transport"
    )
    yield celery
    celery.close()


def test_scheduled_lists_what_the_store_holds_soonest_first(app: Celery) -> None:
    url = app.conf.broker_url
    later = app.send_task("sched.later", args=[1], countdown=600)
    sooner = app.send_task("sched.sooner", kwargs={"x": 2}, countdown=60, queue="backfill")
    app.send_task("sched.now", args=[3])  # due at once: waiting, not scheduled
    listed = json.loads(
        invoke("--world", url, "scheduled", "--queue", "celery", "--queue", "backfill", "--json").output
    )
    assert [e["request"]["id"] for e in listed] == [sooner.id, later.id]
    first = listed[0]
    assert first["request"]["name"] == "sched.sooner" and first["request"]["kwargs"] == "{'x': 2}"
    assert first["request"]["delivery_info"]["routing_key"] == "backfill" and first["eta"]
    assert [e["request"]["id"] for e in json.loads(invoke("--world", url, "scheduled", "--json").output)] == [
        sooner.id,
        later.id,
    ]  # every queue the store knows
    text = invoke("--world", url, "scheduled", "--queue", "celery").output
    assert "sched.later" in text and later.id in text and "sched.sooner" not in text
    assert invoke("--world", url, "scheduled", "--queue", "nothing-here").output.strip() == "no scheduled tasks"
