"""A real `celery -A qapp worker -Q celery,backfill[,bulk] -c 1` on the SQS transport (moto server, Redis as the control
channel): dozens of runs on the default queue while the other queues sit idle, then runs arriving on those
(issue #26 item 6 and issue #33 item 5: the idle queue's long poll held the worker's only prefetch slot, or the
first queue's receiver kept it, and the worker stopped taking work while runs sat visible on a queue it consumes).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from tests.integration.aws_fixtures import CREDENTIALS, moto_fixture  # noqa: F401

from .workers import Worker, aws_environment, imported_app

pytestmark = pytest.mark.acceptance

APP = """
import os
from celery import Celery
from celery_workflow import Workflows

celery_app = Celery("qapp")
wait = os.environ.get("Q_WAIT")
wf = Workflows(celery_app, transport_options={"wait_time_seconds": float(wait)} if wait else {})


@wf.step
def add(a: int, b: int) -> int:
    return a + b


@wf.workflow
def busy(n: int) -> int:
    return add(n, 1)


@wf.workflow(queue="backfill")
def backfill(n: int) -> int:
    return add(n, 2)


if "bulk" in os.environ.get("WORKFLOW_QUEUES", ""):

    @wf.workflow(queue="bulk")
    def bulk(n: int) -> int:
        return add(n, 3)
"""


@pytest.fixture
def env(moto: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    (tmp_path / "qapp.py").write_text(APP)
    with aws_environment(moto) as aws:
        sqs = boto3.client("sqs", endpoint_url=moto, **CREDENTIALS)
        url = sqs.create_queue(QueueName=f"{aws['WORKFLOW_TABLE']}-bulk")["QueueUrl"]
        arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        try:
            yield {
                **aws,
                "CW_APP_DIR": str(tmp_path),
                "BULK_QUEUE": json.dumps({"url": url, "arn": arn, "fifo": False}),
            }
        finally:
            sqs.delete_queue(QueueUrl=url)


@pytest.mark.parametrize(
    ("queues", "wait"),
    [(["celery", "backfill"], "1"), (["celery", "backfill", "bulk"], "")],
    ids=["two-1s", "three-5s"],
)
def test_a_worker_on_several_queues_serves_them_all(env: dict[str, str], queues: list[str], wait: str) -> None:
    base = Path(env["CW_APP_DIR"])
    configured = json.loads(env["WORKFLOW_QUEUES"])
    if "bulk" in queues:
        configured["bulk"] = json.loads(env["BULK_QUEUE"])
    env = {**env, "WORKFLOW_QUEUES": json.dumps(configured), "Q_WAIT": wait}
    with imported_app("qapp", env, path=base) as app:
        worker = Worker("qapp", env, base / "worker.log", ("-c", "1", "-Q", ",".join(queues)), cwd=base)
        try:
            worker.wait_ready()
            many = [app.busy.start(n) for n in range(40)]
            assert many[9].result(timeout=120) == 10  # the worker is into the backlog …
            idle = [getattr(app, q).start(100) for q in queues[1:]]  # … when runs arrive on the idle queues
            assert [run.result(timeout=120) for run in idle] == [102, 103][: len(idle)]
            assert [run.result(timeout=120) for run in many] == list(range(1, 41))
        finally:
            worker.stop()
