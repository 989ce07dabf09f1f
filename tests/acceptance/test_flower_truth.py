"""Flower tells the truth about workflow work (issue #29, item 3): a real `celery -A flowerapp worker -E` (prefork)
and a real Flower, on the SQLite, Postgres and AWS Worlds; Flower's HTTP API (``/api/tasks``) is what a team watching
Flower sees.

* a run that failed with FatalError: its workflow delivery is FAILURE with the run's error, and was acked (one
  delivery, one ``run_failed``, no dead letter, nothing left queued);
* a step attempt that failed and ran again: its delivery is RETRY, the retry's delivery SUCCESS;
* an inline step: a task of its own, ``step.<name>``, child of its workflow delivery, with its result.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from celery_workflow.dead_letters import dead_letter_store
from celery_workflow.events import EventType
from tests.integration.aws_fixtures import moto_fixture  # noqa: F401

from .workers import APPS, Worker, aws_environment, free_port, imported_app, postgres_schema, wait_for

pytestmark = pytest.mark.acceptance


@pytest.fixture(params=["sqlite", "postgres", "aws"])
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    if request.param == "sqlite":
        yield {"CELERY_WORKFLOW_URL": f"sqlite:///{tmp_path / 'world.sqlite3'}"}
    elif request.param == "aws":
        with aws_environment(request.getfixturevalue("moto")) as aws:
            yield aws
    else:
        with postgres_schema() as url:
            yield {"CELERY_WORKFLOW_URL": url}


@pytest.fixture
def app(env: dict[str, str]) -> Iterator[ModuleType]:
    with imported_app("flowerapp", env) as module:
        yield module


def api(port: int, path: str) -> Any:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


class Flower:
    """A `celery -A flowerapp flower` process on a free port, its API open."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.log = log
        self._log_file = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "flowerapp", "flower", "--address=127.0.0.1", f"--port={self.port}"],
            cwd=APPS,
            # the test's own PYTHONPATH too: Flower opens the World, and must run the code under test (a checkout
            # whose migrations are ahead would move the World past what the workers know)
            env={
                **os.environ,
                **env,
                "PYTHONPATH": f"{APPS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                "FLOWER_UNAUTHENTICATED_API": "1",
            },
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def tasks(self, **query: str) -> dict[str, dict[str, Any]]:
        path = "/api/tasks" + ("?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else "")
        return api(self.port, path) or {}

    def tail(self) -> str:
        self._log_file.flush()
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._log_file.close()


def of_run(tasks: dict[str, dict[str, Any]], run_id: str, name: str) -> list[dict[str, Any]]:
    return [t for t in tasks.values() if t.get("name") == name and run_id in str(t.get("args"))]


def test_flower_lists_failed_runs_retried_steps_and_inline_steps(
    app: ModuleType, env: dict[str, str], tmp_path: Path
) -> None:
    began = time.monotonic()
    worker = Worker("flowerapp", env, tmp_path / "worker.log", ["-E", "-c", "2", "-n", "truth@%h"])
    flower = Flower(env, tmp_path / "flower.log")
    try:
        worker.wait_ready()
        # Flower answers before its event consumer is bound: runs until one of them is seen whole
        canary = wait_for(lambda: _seen(flower, app.adding.start(1).id), 30, lambda: json.dumps(flower.tasks())[:2000])
        assert canary

        failed = app.fulfil.start("o-1")
        billing = app.billing.start("b-1")
        inline = app.adding.start(2)
        assert billing.result(timeout=30) == "b-1@2" and inline.result(timeout=30) == 3
        wait_for(lambda: failed.status == "failed", 30)

        # the failed run's delivery: FAILURE, with the run's error, received once
        (delivery,) = wait_for(lambda: of_run(flower.tasks(state="FAILURE"), failed.id, "workflow.fulfil"), 15)
        assert "RunFailedReport" in delivery["exception"], delivery
        assert "FatalError: card declined for o-1" in delivery["exception"], delivery
        assert len(of_run(flower.tasks(), failed.id, "workflow.fulfil")) == 1  # never redelivered
        # its inline step that failed for good: a task too
        (step,) = wait_for(lambda: of_run(flower.tasks(), failed.id, "step.declined"), 15)
        assert step["state"] == "FAILURE" and "card declined for o-1" in step["exception"], step

        # the step attempt that failed and ran again: RETRY, then the retry delivery's SUCCESS
        (retried,) = wait_for(lambda: of_run(flower.tasks(state="RETRY"), billing.id, "step.charge"), 15)
        assert "gateway timeout on attempt 1 of b-1" in retried["exception"], retried
        wait_for(lambda: of_run(flower.tasks(state="SUCCESS"), billing.id, "step.charge"), 15)

        # the inline step: a task of its own, child of its workflow delivery, with its result
        (added,) = wait_for(lambda: of_run(flower.tasks(state="SUCCESS"), inline.id, "step.add"), 15)
        parents = {t["uuid"] for t in of_run(flower.tasks(), inline.id, "workflow.adding")}
        assert added["parent_id"] in parents and added["result"] == "3", added

        # nothing redelivered, nothing dead-lettered: one run_failed, the World's queue drained
        assert [e.event_type for e in failed.events()].count(EventType.RUN_FAILED) == 1
        assert dead_letter_store(app.wf.world).list_dead_letters(run_id=failed.id) == []
    finally:
        flower.stop()
        worker.stop()
    print(f"flower truth on {env.get('CELERY_WORKFLOW_URL', '?').split(':')[0]}: {time.monotonic() - began:.1f} s")


def _seen(flower: Flower, run_id: str) -> bool:
    """Whether Flower lists run ``run_id``'s inline step as succeeded within a few seconds."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if of_run(flower.tasks(state="SUCCESS"), run_id, "step.add"):
            return True
        time.sleep(0.1)
    return False
