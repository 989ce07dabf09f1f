"""The examples run end to end (in-process worker, embedded SQLite World)."""

from __future__ import annotations

import importlib
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import boto3
import pytest

from celery_workflow.testing import LocalWorker
from celery_workflow.testing.move_tasks import MessageMoveTaskProxy
from tests.integration.aws_fixtures import CREDENTIALS, REGION, moto_fixture  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("CELERY_WORKFLOW_URL", f"sqlite:///{tmp_path / 'world.sqlite3'}")
    monkeypatch.setenv("TASKS_DB", str(tmp_path / "tasks.sqlite3"))
    monkeypatch.setenv("TASK_WAIT_SECONDS", "0.1")
    monkeypatch.setenv("REDRIVE_POLL_SECONDS", "0.01")
    monkeypatch.syspath_prepend(str(ROOT))
    loaded: list[str] = []

    def _load(name: str) -> ModuleType:
        sys.modules.pop(f"examples.{name}", None)
        loaded.append(f"examples.{name}")
        return importlib.import_module(f"examples.{name}")

    yield _load
    for name in loaded:
        module = sys.modules.pop(name, None)
        if module is not None:
            module.wf.close()


def test_shop(load: Any) -> None:
    shop = load("shop")
    run = shop.fulfil.start("o-1", 1200)
    worker = LocalWorker(shop.wf)
    worker.run_until_idle()
    shop.wf.resume_hook("approve:o-1", {"ok": False})
    worker.run_until_complete(run)
    assert run.result() == {"status": "rejected"}


def test_task_status(load: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The invoke Lambda's handler starts the run; the item is "Started" while the run sleeps, then "Done" (the
    Tasks table in a local SQLite file, TASKS_DB)."""
    monkeypatch.setenv("TASK_WAIT_SECONDS", "1")  # long enough that run_until_idle never reaches the wake-up
    example = load("task_status")
    started = example.handler({"taskId": "Breakfast"}, None)
    run = example.wf.get_run(started["runId"])
    worker = LocalWorker(example.wf)
    worker.run_until_idle()
    assert run.status == "running"  # asleep: waiting out the "long running task"
    assert [e.event_type.value for e in run.events()][-1] == "wait_created"
    item = {"taskId": "Breakfast", "timestamp": started["timestamp"], "Status": "Started"}
    assert example.tasks_table().query("Breakfast") == [item]
    worker.run_until_complete(run)
    assert run.result() == {**item, "Status": "Done"}
    assert example.tasks_table().query("Breakfast") == [{**item, "Status": "Done"}]
    with pytest.raises(example.InvalidTaskEvent, match="taskId"):
        example.handler({"taskId": ""}, None)


def test_sqs_redrive(load: Any, moto: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The re-drive on moto; moto lacks the message move task API, so SQS goes through the stand-in
    (``celery_workflow/testing/move_tasks.py``). tests/acceptance/test_example_sqs_redrive.py runs it on real workers."""
    with MessageMoveTaskProxy(moto, region=REGION) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_SQS", proxy.endpoint)
        monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", CREDENTIALS["aws_access_key_id"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CREDENTIALS["aws_secret_access_key"])
        monkeypatch.setenv("REDRIVE_POLL_SECONDS", "0.05")
        example = load("sqs_redrive")
        queues = example.setup(f"sample-{secrets.token_hex(4)}")
        sqs = boto3.client("sqs")
        for body in ("one", "two"):  # as if dead-lettered
            sqs.send_message(QueueUrl=queues["dlqUrl"], MessageBody=body)
        run = example.redrive.start({"queueArn": queues["dlqArn"]})
        LocalWorker(example.wf).run_until_complete(run)
        [started] = proxy.calls("StartMessageMoveTask", queues["dlqArn"])
        handle = started.response["TaskHandle"] if started.response else None
        assert run.result() == {"queueArn": queues["dlqArn"], "status": "COMPLETED", "taskHandle": handle}
        [task] = proxy.tasks(queues["dlqArn"])
        assert (task["Status"], task["ApproximateNumberOfMessagesMoved"]) == ("COMPLETED", 2)
        assert example.process(queues["queueUrl"], wait_seconds=0) == 2  # back on the source queue
