"""Dead letters with real ``celery worker`` processes, on the SQLite, Postgres and AWS Worlds (on AWS: each queue's
SQS dead-letter queue, on a moto server).

The client registers a workflow the worker does not know (a deploy that has not reached the workers): Celery rejects
the unregistered task; a workflow delivery comes back with a backoff (another worker may know it) until its queue's
delivery limit, then moves to the dead letters and its run fails with the cause, instead of coming back every few
minutes forever with the run ``pending``. A workflow whose handling keeps failing (here the worker's handler is
broken on purpose: an outage, a bug) is put back with a backoff and its error, up to the same limit, then
dead-lettered the same way. A redrive delivers the message again. (A plain Celery task rejected without requeue
moves at once: ``tests/integration/transport_suite.py`` and the Flower test.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from celery_workflow import WorkflowFailed
from celery_workflow.dead_letters import dead_letter_store
from tests.integration.aws_fixtures import moto_fixture  # noqa: F401

from .workers import Worker, aws_environment, imported_app, postgres_schema, wait_for

pytestmark = pytest.mark.acceptance

APP = """
import os
from celery import Celery
from celery_workflow import Workflows

celery_app = Celery("dlapp")
wf = Workflows(celery_app, transport_options={"max_deliveries": 3, "lease_seconds": 5})


@wf.step
def add(a: int, b: int) -> int:
    return a + b


@wf.workflow
def works(n: int) -> int:
    return add(n, 1)


@wf.workflow
def broken(n: int) -> int:
    return add(n, 2)


if os.environ.get("DL_CLIENT"):  # only the client knows this one

    @wf.workflow
    def unknown_to_workers(n: int) -> int:
        return add(n, 3)


if os.environ.get("DL_BROKEN"):  # the worker's handling of `broken` fails every time
    handle = wf.runtime.handle_workflow

    def failing(run_id, **kwargs):
        if wf.world.get_run(run_id).workflow_name == "broken":
            raise RuntimeError("handler on fire")
        return handle(run_id, **kwargs)

    wf.runtime.handle_workflow = failing
"""


@pytest.fixture(scope="module", params=["sqlite", "postgres", "aws"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    base = tmp_path_factory.mktemp(f"dl-{request.param}")
    (base / "dlapp.py").write_text(APP)
    common = {"CW_APP_DIR": str(base)}
    if request.param == "sqlite":
        yield {"CELERY_WORKFLOW_URL": f"sqlite:///{base / 'world.sqlite3'}", **common}
        return
    if request.param == "aws":  # the queues' SQS dead-letter queues
        with aws_environment(request.getfixturevalue("moto")) as aws:
            yield {**aws, **common}
        return
    with postgres_schema() as url:
        yield {"CELERY_WORKFLOW_URL": url, **common}


@pytest.fixture(scope="module")
def app(env: dict[str, str]) -> Iterator[ModuleType]:
    with imported_app("dlapp", {**env, "DL_CLIENT": "1"}, path=Path(env["CW_APP_DIR"])) as module:
        yield module


@pytest.fixture(scope="module")
def worker(app: ModuleType, env: dict[str, str]) -> Iterator[Worker]:
    base = Path(env["CW_APP_DIR"])
    w = Worker("dlapp", {**env, "DL_BROKEN": "1", "DL_CLIENT": ""}, base / "worker.log", ("-c", "1"), cwd=base)
    w.wait_ready()
    yield w
    w.stop()


def test_an_unregistered_workflow_is_dead_lettered_and_its_run_failed(app: ModuleType, worker: Worker) -> None:
    """Celery rejects a task it does not know. A workflow delivery is retried with backoff first (in a rolling
    deploy another worker may know it), then dead-lettered at its queue's limit and its run failed."""
    run = app.unknown_to_workers.start(1)
    with pytest.raises(WorkflowFailed, match="dead-lettered"):
        run.result(timeout=60)
    error = run.view().error or {}
    assert error["type"] == "celery_workflow.errors.DeadLettered" and error["reason"] == "max-deliveries"
    (letter,) = dead_letter_store(app.wf.world).list_dead_letters(run_id=run.id)
    assert (letter.task_name, letter.reason, letter.deliveries) == ("workflow.unknown_to_workers", "max-deliveries", 3)
    log = worker.log.read_text()
    assert "Received unregistered task of type 'workflow.unknown_to_workers'" in log
    assert f"dead letter {letter.id}" in log  # the move is logged by the worker
    assert app.works.start(1).result(timeout=60) == 2  # the worker carries on


def test_a_delivery_that_keeps_failing_is_dead_lettered_after_its_limit(app: ModuleType, worker: Worker) -> None:
    run = app.broken.start(1)
    with pytest.raises(WorkflowFailed, match="delivered 3 times"):
        run.result(timeout=90)
    (letter,) = dead_letter_store(app.wf.world).list_dead_letters(run_id=run.id)
    assert (letter.reason, letter.deliveries) == ("max-deliveries", 3)
    assert json.loads(letter.payload)["headers"]["task"] == "workflow.broken"
    if isinstance(letter.id, str):  # SQS keeps neither the failure times nor the error of a message
        return
    assert letter.last_error == "RuntimeError: handler on fire"
    assert letter.first_failed_at is not None and letter.last_failed_at is not None
    # backed off between deliveries (1 s, then 2 s), not retried at once
    assert (letter.last_failed_at - letter.first_failed_at).total_seconds() >= 2.5


def test_a_redriven_dead_letter_is_delivered_again(app: ModuleType, worker: Worker) -> None:
    store = dead_letter_store(app.wf.world)
    run = app.unknown_to_workers.start(5)
    wait_for(lambda: store.list_dead_letters(run_id=run.id), timeout=60)
    moved = store.redrive_dead_letters([store.list_dead_letters(run_id=run.id)[0].id])
    assert moved == 1
    # the worker still does not know the task: it comes back as a new dead letter, once
    wait_for(lambda: store.list_dead_letters(run_id=run.id), timeout=60)
    assert len(store.list_dead_letters(run_id=run.id)) == 1
