"""A message whose body is not what its content type says, taken by a real ``celery worker``, on the SQLite,
Postgres and AWS Worlds' transports (issue #26, item 7).

Celery's consumer logs "Can't decode message body" and acks such a message (``Consumer.on_decode_error``), which
deleted it: it must go to the dead letters like any undecodable message, listed by ``dead-letters list``, while the
worker goes on with the next message. (The Kombu side, for every way a body may not decode, is in
``tests/integration/test_transport_hostile.py``.)
"""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from celery_workflow.cli import main
from celery_workflow.dead_letters import UNDECODABLE, dead_letter_store
from tests.integration.aws_fixtures import moto_fixture  # noqa: F401

from .workers import Worker, aws_environment, imported_app, postgres_schema, wait_for

pytestmark = pytest.mark.acceptance

APP = """
from celery import Celery
from celery_workflow import Workflows

celery_app = Celery("undecapp")
wf = Workflows(celery_app)


@celery_app.task(name="undecapp.add")
def add(a: int, b: int) -> int:
    return a + b
"""


@pytest.fixture(scope="module", params=["sqlite", "postgres", "aws"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    base = tmp_path_factory.mktemp(f"undec-{request.param}")
    (base / "undecapp.py").write_text(APP)
    common = {"CW_APP_DIR": str(base)}
    if request.param == "sqlite":
        yield {"CELERY_WORKFLOW_URL": f"sqlite:///{base / 'world.sqlite3'}", **common}
        return
    if request.param == "aws":  # the task queue's SQS dead-letter queue
        with aws_environment(request.getfixturevalue("moto")) as aws:
            yield {**aws, **common}
        return
    with postgres_schema() as url:
        yield {"CELERY_WORKFLOW_URL": url, **common}


@pytest.fixture(scope="module")
def app(env: dict[str, str]) -> Iterator[ModuleType]:
    with imported_app("undecapp", env, path=Path(env["CW_APP_DIR"])) as module:
        yield module


@pytest.fixture(scope="module")
def worker(app: ModuleType, env: dict[str, str]) -> Iterator[Worker]:
    base = Path(env["CW_APP_DIR"])
    w = Worker("undecapp", env, base / "worker.log", ("-c", "1"), cwd=base)
    w.wait_ready()
    yield w
    w.stop()


def test_a_body_that_is_not_json_is_dead_lettered_not_acked_away(
    app: ModuleType, worker: Worker, env: dict[str, str]
) -> None:
    task_id = str(uuid.uuid4())
    with app.celery_app.connection_for_write() as conn:
        channel = conn.default_channel
        message = channel.prepare_message(
            b"this is not JSON",
            content_type="application/json",
            content_encoding="utf-8",
            headers={"task": "undecapp.add", "id": task_id, "lang": "py"},
        )
        channel.basic_publish(message, exchange="", routing_key="celery")
    good = app.add.delay(2, 3)

    store = dead_letter_store(app.wf.world)
    letter = wait_for(
        lambda: next((d for d in store.list_dead_letters() if d.task_id == task_id), None),
        60,
        lambda: worker.log.read_text()[-3000:],
    )
    assert (letter.queue, letter.reason, letter.task_name) == ("celery", UNDECODABLE, "undecapp.add")
    assert letter.last_error and "application/json" in letter.last_error
    log = worker.log.read_text()
    assert "Can't decode message body" in log  # Celery gave up on it (and acked it) ...
    wait_for(lambda: f"Task undecapp.add[{good.id}] succeeded" in worker.log.read_text(), 60, lambda: log[-3000:])

    out = io.StringIO()  # ... and it is there to see, redrive or purge
    assert main(["--world", env["CELERY_WORKFLOW_URL"], "dead-letters", "list", "--json"], out=out) == 0
    assert task_id in [d["task_id"] for d in json.loads(out.getvalue())]
    assert store.purge_dead_letters([letter.id]) == 1
