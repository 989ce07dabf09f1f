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

from celery_workflow.events import RunStatus
from celery_workflow.testing import LocalWorker
from tests.integration.aws_fixtures import CREDENTIALS, REGION, moto_fixture  # noqa: F401
from tools.move_tasks import MessageMoveTaskProxy

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
    (``tools/move_tasks.py``). tests/acceptance/test_example_sqs_redrive.py runs it on real workers."""
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


@pytest.fixture
def redrive(load: Any, moto: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, MessageMoveTaskProxy]]:
    """The re-drive example on moto behind the move task stand-in, with a short poll."""
    with MessageMoveTaskProxy(moto, region=REGION) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_SQS", proxy.endpoint)
        monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", CREDENTIALS["aws_access_key_id"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CREDENTIALS["aws_secret_access_key"])
        monkeypatch.setenv("REDRIVE_POLL_SECONDS", "0.05")
        yield load("sqs_redrive"), proxy


def _failure(run: Any) -> str:
    view = run.view()
    assert view.status is RunStatus.FAILED, view.status
    return str((view.error or {}).get("message", ""))


def _inject(example: Any, monkeypatch: pytest.MonkeyPatch, operation: str, codes: list[str]) -> list[str]:
    """The example's SQS clients answer ``operation`` with the errors ``codes``, one per call, then as SQS does."""
    from botocore.awsrequest import AWSResponse

    left = list(codes)
    client = example.boto3.client

    def answer(**_: Any) -> Any:
        if not left:
            return None
        code = left.pop(0)
        parsed = {"Error": {"Code": code, "Message": f"injected {code}"}, "ResponseMetadata": {"HTTPStatusCode": 400}}
        return AWSResponse("https://sqs.invalid/", 400, {}, None), parsed

    def made(*args: Any, **kwargs: Any) -> Any:
        built = client(*args, **kwargs)
        built.meta.events.register(f"before-call.sqs.{operation}", answer)
        return built

    monkeypatch.setattr(example.boto3, "client", made)
    return left


@pytest.mark.parametrize("code", ["AccessDeniedException", "AWS.SimpleQueueService.NonExistentQueue", "InvalidAddress"])
def test_sqs_redrive_a_permanent_start_error_fails_at_once(
    redrive: tuple[Any, MessageMoveTaskProxy], monkeypatch: pytest.MonkeyPatch, code: str
) -> None:
    """A permanent StartMessageMoveTask error fails the run at once, as it fails the state machine's execution,
    instead of being retried five times (issue #27, item 13)."""
    example, _proxy = redrive
    queues = example.setup(f"sample-{secrets.token_hex(4)}")
    _inject(example, monkeypatch, "StartMessageMoveTask", [code] * 10)
    run = example.redrive.start({"queueArn": queues["dlqArn"]})
    LocalWorker(example.wf, backoff=lambda attempts: 0.05).run_until_complete(run, timeout=30)
    assert code.rsplit(".", 1)[-1] in _failure(run)
    (step,) = [s for s in run.steps() if s.step_name.endswith("start_redrive")]
    assert step.attempt == 1  # not retried


def test_sqs_redrive_an_unknown_queue_fails_at_once(redrive: tuple[Any, MessageMoveTaskProxy]) -> None:
    example, proxy = redrive
    missing = f"arn:aws:sqs:{REGION}:123456789012:no-such-dlq-{secrets.token_hex(4)}"
    run = example.redrive.start({"queueArn": missing})
    LocalWorker(example.wf, backoff=lambda attempts: 0.05).run_until_complete(run, timeout=30)
    assert "ResourceNotFoundException" in _failure(run)
    assert len(proxy.calls("ListMessageMoveTasks", missing)) == 1 and proxy.calls("StartMessageMoveTask") == []


def test_sqs_redrive_throttling_is_retried(
    redrive: tuple[Any, MessageMoveTaskProxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    example, proxy = redrive
    queues = example.setup(f"sample-{secrets.token_hex(4)}")
    left = _inject(example, monkeypatch, "StartMessageMoveTask", ["RequestThrottled", "ThrottlingException"])
    run = example.redrive.start({"queueArn": queues["dlqArn"]})
    LocalWorker(example.wf, backoff=lambda attempts: 0.05).run_until_complete(run, timeout=30)
    assert run.result(timeout=0)["status"] == "COMPLETED" and left == []
    assert len(proxy.calls("StartMessageMoveTask", queues["dlqArn"])) == 1  # the third try reached SQS


def test_sqs_redrive_a_cancelled_move_task_fails_the_run(redrive: tuple[Any, MessageMoveTaskProxy]) -> None:
    example, proxy = redrive
    queues = example.setup(f"sample-{secrets.token_hex(4)}")
    sqs = boto3.client("sqs")
    sqs.send_message(QueueUrl=queues["dlqUrl"], MessageBody="stuck")
    proxy.pause()  # the task stays RUNNING until it is cancelled
    run = example.redrive.start({"queueArn": queues["dlqArn"]})
    worker = LocalWorker(example.wf, backoff=lambda attempts: 0.05)
    worker.run_until(lambda: bool(proxy.tasks(queues["dlqArn"])), 30)
    (task,) = proxy.tasks(queues["dlqArn"])
    sqs.cancel_message_move_task(TaskHandle=task["TaskHandle"])
    proxy.resume()
    worker.run_until_complete(run, timeout=30)
    assert "ended CANCELLED" in _failure(run) or "ended CANCELLING" in _failure(run)


def test_sqs_redrive_gives_up_after_its_checks(
    redrive: tuple[Any, MessageMoveTaskProxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    example, proxy = redrive
    monkeypatch.setattr(example, "MAX_CHECKS", 3)
    queues = example.setup(f"sample-{secrets.token_hex(4)}")
    boto3.client("sqs").send_message(QueueUrl=queues["dlqUrl"], MessageBody="slow")
    proxy.pause()  # RUNNING for good
    try:
        run = example.redrive.start({"queueArn": queues["dlqArn"]})
        LocalWorker(example.wf, backoff=lambda attempts: 0.05).run_until_complete(run, timeout=30)
    finally:
        proxy.resume()
    assert "still RUNNING after 3 checks" in _failure(run)
    checks = [s for s in run.steps() if s.step_name.endswith("redrive_status")]
    assert len(checks) == 3


def test_batch_import_nightly_schedule_and_guarded_change(load: Any, tmp_path: Path) -> None:
    """The nightly schedule fires once at 02:00 Paris time (a sped-up clock) on the worker's ticker; its run imports
    the inbox as a child batch whose children are grandchildren of the tick's run; the empty file takes the guarded
    new path (no store step, its patch_applied recorded)."""
    from datetime import UTC, datetime, timedelta

    from celery_workflow.schedules import SpedUpClock, tick_run_id
    from celery_workflow.worker_setup import start_ticker

    example = load("batch_import")
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "a.csv").write_text("1,2")
    (inbox / "empty.csv").write_text("")
    night = datetime(2026, 3, 1, 0, 59, 58, tzinfo=UTC)  # 01:59:58 in Paris (UTC+1 in March before the change)
    example.wf.schedule_clock = SpedUpClock(night, factor=1.0)
    example.schedule_nightly(str(inbox))
    ticker = start_ticker(example.wf)
    assert ticker is not None
    tick = tick_run_id("nightly-import", night + timedelta(seconds=2))  # 02:00 in Paris: 01:00 UTC
    worker = LocalWorker(example.wf)
    try:
        worker.run_until(lambda: any(r.id == tick for r in example.wf.list_runs()), timeout=20)
    finally:
        ticker.stop()
    run = example.wf.get_run(tick)
    worker.run_until_complete(run)
    assert run.result() == {"stored": 2, "failed": {}}
    batch, (first, empty) = f"{tick}!1", (f"{tick}!1!2", f"{tick}!1!3")  # the batch's first child is its audit
    assert example.wf.get_run(batch).status is RunStatus.COMPLETED
    assert example.wf.get_run(empty).result() == {"file": "empty.csv", "stored": 0}
    kinds = [e.event_type.value for e in example.wf.world.list_events(empty)]
    assert "patch_applied" in kinds and kinds.count("step_created") == 1  # parse only: no store of an empty file
    assert [e.event_type.value for e in example.wf.world.list_events(first)].count("step_created") == 2
    assert example.wf.schedules.get("nightly-import").last_run_id == tick


def test_batch_import(load: Any) -> None:
    """Child runs: one per file, a failed file reported, the audit run abandoned to run on."""
    example = load("batch_import")
    run = example.import_batch.start({"a.csv": "1,2,3", "b.csv": "4,x", "c.csv": "5"}, run_id="import-1")
    LocalWorker(example.wf).run_until_complete(run)
    report = run.result()
    assert report["stored"] == 4
    assert list(report["failed"]) == ["import-1!3"]  # b.csv: the second import, the third child (after the audit)
    assert "invalid literal" in report["failed"]["import-1!3"]
    assert example.wf.get_run("import-1!1").status is RunStatus.COMPLETED  # the audit
