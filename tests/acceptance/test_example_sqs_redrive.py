"""examples/sqs_redrive.py end to end: a real `celery -A examples.sqs_redrive worker` on the SQLite, Postgres and AWS
Worlds, its SQS calls going to a moto server.

moto has no message move task API (``StartMessageMoveTask``, ``ListMessageMoveTasks``), so the SQS clients of the
worker, the CLI and this process reach moto through ``MessageMoveTaskProxy`` (tools/move_tasks.py), a
stand-in that serves those operations itself (really moving the messages on moto) and forwards every other request
to moto unchanged. Everything else — the queues, the redrive policy that dead-letters the failed messages, the AWS
World's DynamoDB, SQS and Scheduler — is moto's.

The whole path runs on each World; the no-task, failed-task, idempotent-start and command-line cases run on SQLite.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import boto3
import pytest

from celery_workflow import WorkflowFailed
from tests.integration.aws_fixtures import CREDENTIALS, REGION, moto_fixture  # noqa: F401
from tools.move_tasks import MessageMoveTaskProxy

from .workers import Worker, aws_environment, imported_app, postgres_schema, wait_for

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples.sqs_redrive"


@pytest.fixture(scope="module")
def proxy(moto: str) -> Iterator[MessageMoveTaskProxy]:
    with MessageMoveTaskProxy(moto, region=REGION) as stand_in:
        yield stand_in


@pytest.fixture(scope="module")
def sqs(moto: str) -> Any:
    """A client of moto itself (not through the stand-in), for looking at the queues."""
    return boto3.client("sqs", endpoint_url=moto, **CREDENTIALS)


@pytest.fixture(scope="module", params=["sqlite", "postgres", "aws"])
def env(
    request: pytest.FixtureRequest, moto: str, proxy: MessageMoveTaskProxy, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """The environment of the worker, the CLI and the client: a World, and SQS through the stand-in."""
    aws = {
        "AWS_ENDPOINT_URL": moto,
        "AWS_ENDPOINT_URL_SQS": proxy.endpoint,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ACCESS_KEY_ID": CREDENTIALS["aws_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": CREDENTIALS["aws_secret_access_key"],
        "REDRIVE_POLL_SECONDS": "0.2",
    }
    if request.param == "sqlite":
        yield {**aws, "CELERY_WORKFLOW_URL": f"sqlite:///{tmp_path_factory.mktemp('redrive') / 'world.sqlite3'}"}
    elif request.param == "postgres":
        with postgres_schema() as url:
            yield {**aws, "CELERY_WORKFLOW_URL": url}
    else:
        with aws_environment(moto) as world:
            yield {**world, **aws}  # the World's SQS traffic goes through the stand-in too


@pytest.fixture(scope="module")
def worker(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    w = Worker(EXAMPLE, env, tmp_path_factory.mktemp("logs") / "redrive-worker.log", ["-c", "2"], cwd=ROOT)
    w.wait_ready()
    yield w
    w.kill()  # every run has ended by now: nothing is left for a warm shutdown to finish


@pytest.fixture(scope="module")
def example(env: dict[str, str], worker: Worker) -> Iterator[ModuleType]:
    """The example imported in this process (the client side), with ``env`` in ``os.environ`` while it is used."""
    with imported_app(EXAMPLE, env, path=ROOT) as module:
        yield module


def cli(env: dict[str, str], *args: str, **extra: str) -> str:
    """``python -m examples.sqs_redrive …`` from the repository root; its standard output."""
    done = subprocess.run(
        [sys.executable, "-m", EXAMPLE, *args],
        cwd=ROOT,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT), **extra},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def counts(sqs: Any, url: str) -> tuple[int, int]:
    """(visible, in flight) messages on the queue."""
    names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    attributes = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=names)["Attributes"]
    return int(attributes[names[0]]), int(attributes[names[1]])


def sample(example: ModuleType, sqs: Any, monkeypatch: pytest.MonkeyPatch, messages: int) -> dict[str, str]:
    """Fresh sample queues (visibility timeout 0, so a failed message is received again at once) with ``messages``
    messages sent, then the processor in failure mode until moto's redrive policy has moved them all to the DLQ."""
    queues: dict[str, str] = example.setup(f"sample-{secrets.token_hex(4)}", max_receive_count=2, visibility_timeout=0)
    for i in range(messages):
        sqs.send_message(QueueUrl=queues["queueUrl"], MessageBody=f"Hello World {i}")
    monkeypatch.setenv("FAIL", "true")

    def dead_lettered() -> bool:
        assert example.process(queues["queueUrl"], wait_seconds=0) == 0  # every batch fails
        return counts(sqs, queues["dlqUrl"]) == (messages, 0)

    wait_for(
        dead_lettered, 30, lambda: f"source {counts(sqs, queues['queueUrl'])}, DLQ {counts(sqs, queues['dlqUrl'])}"
    )
    monkeypatch.delenv("FAIL")
    assert counts(sqs, queues["queueUrl"]) == (0, 0)
    return queues


def running_answers(proxy: MessageMoveTaskProxy, source_arn: str) -> int:
    """How many ListMessageMoveTasks answers for the source said its newest task was RUNNING."""
    calls = proxy.calls("ListMessageMoveTasks", source_arn)
    return sum(
        1 for c in calls if c.response and c.response["Results"] and c.response["Results"][0]["Status"] == "RUNNING"
    )


def test_redrive_moves_the_dead_letters_back(
    example: ModuleType, proxy: MessageMoveTaskProxy, sqs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    queues = sample(example, sqs, monkeypatch, messages=3)
    proxy.pause()  # the move task stays RUNNING until the workflow has waited and checked twice
    try:
        run = example.redrive.start({"queueArn": queues["dlqArn"]})
        wait_for(lambda: running_answers(proxy, queues["dlqArn"]) >= 2, 30, lambda: str(proxy.calls()[-5:]))
    finally:
        proxy.resume()
    result = run.result(timeout=60)

    [started] = proxy.calls("StartMessageMoveTask", queues["dlqArn"])
    assert started.request == {"SourceArn": queues["dlqArn"]}
    assert started.response is not None
    assert result == {"queueArn": queues["dlqArn"], "status": "COMPLETED", "taskHandle": started.response["TaskHandle"]}
    [task] = proxy.tasks(queues["dlqArn"])
    assert (task["Status"], task["ApproximateNumberOfMessagesMoved"], task["ApproximateNumberOfMessagesToMove"]) == (
        "COMPLETED",
        3,
        3,
    )
    assert counts(sqs, queues["dlqUrl"]) == (0, 0)
    assert counts(sqs, queues["queueUrl"]) == (3, 0)  # back on the source queue
    assert example.process(queues["queueUrl"], wait_seconds=0) == 3  # FAIL unset: the processor consumes them
    assert counts(sqs, queues["queueUrl"]) == (0, 0)


@pytest.mark.parametrize("env", ["sqlite"], indirect=True)
def test_no_move_task_is_an_unknown_success(
    example: ModuleType, proxy: MessageMoveTaskProxy, sqs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    queues = sample(example, sqs, monkeypatch, messages=1)
    proxy.hide_tasks(queues["dlqArn"])  # ListMessageMoveTasks finds no task on the DLQ: the seed's NOT_FOUND
    result = example.redrive.start({"queueArn": queues["dlqArn"]}).result(timeout=60)
    assert result["status"] == "UNKNOWN"
    assert result["queueArn"] == queues["dlqArn"]
    assert len(proxy.calls("StartMessageMoveTask", queues["dlqArn"])) == 1


@pytest.mark.parametrize("env", ["sqlite"], indirect=True)
def test_a_failed_move_task_fails_the_run(
    example: ModuleType, proxy: MessageMoveTaskProxy, sqs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    queues = sample(example, sqs, monkeypatch, messages=1)
    proxy.fail_next(queues["dlqArn"], "AWS.SimpleQueueService.NonExistentQueue")
    run = example.redrive.start({"queueArn": queues["dlqArn"]})
    with pytest.raises(WorkflowFailed, match=r"ended FAILED \(AWS\.SimpleQueueService\.NonExistentQueue\)"):
        run.result(timeout=60)
    assert run.status == "failed"
    assert counts(sqs, queues["dlqUrl"]) == (1, 0)  # nothing moved


@pytest.mark.parametrize("env", ["sqlite"], indirect=True)
@pytest.mark.parametrize("seen", ["listed", "refused"])
def test_a_move_task_already_running_counts_as_started(
    example: ModuleType, proxy: MessageMoveTaskProxy, sqs: Any, monkeypatch: pytest.MonkeyPatch, seen: str
) -> None:
    """Started elsewhere (or by an earlier attempt of the step) and still RUNNING: the step lists it and starts
    nothing ("listed"), or, when the task started after its look, reads SQS's "already a task running" refusal as
    started ("refused")."""
    queues = sample(example, sqs, monkeypatch, messages=2)
    client = boto3.client("sqs", endpoint_url=proxy.endpoint, **CREDENTIALS)
    proxy.pause()
    try:
        handle = client.start_message_move_task(SourceArn=queues["dlqArn"])["TaskHandle"]
        if seen == "refused":
            proxy.hide_tasks(queues["dlqArn"], times=1)  # the step's first look misses the task
        run = example.redrive.start({"queueArn": queues["dlqArn"]})
        wait_for(lambda: running_answers(proxy, queues["dlqArn"]) >= 2, 30, lambda: str(proxy.calls()[-5:]))
    finally:
        proxy.resume()
    assert run.result(timeout=60) == {"queueArn": queues["dlqArn"], "status": "COMPLETED", "taskHandle": handle}
    starts = proxy.calls("StartMessageMoveTask", queues["dlqArn"])
    assert [c.error for c in starts] == ([None] if seen == "listed" else [None, "UnsupportedOperation"])
    assert len(proxy.tasks(queues["dlqArn"])) == 1
    assert counts(sqs, queues["queueUrl"]) == (2, 0)


@pytest.mark.parametrize("env", ["sqlite"], indirect=True)
def test_the_commands(env: dict[str, str], example: ModuleType, sqs: Any) -> None:
    """setup (idempotent), send, process with FAIL=true until the message is dead-lettered, start --wait,
    process again: the seed's walkthrough on the command line."""
    name = f"sample-{secrets.token_hex(4)}"
    args = ["setup", "--name", name, "--max-receive-count", "2", "--visibility-timeout", "0"]
    queues = json.loads(cli(env, *args))
    assert example.setup(name, max_receive_count=2, visibility_timeout=0) == queues  # again: the same queues
    assert queues["dlqArn"].endswith(f":{name}-dlq")
    policy = sqs.get_queue_attributes(QueueUrl=queues["queueUrl"], AttributeNames=["RedrivePolicy"])["Attributes"]
    assert json.loads(policy["RedrivePolicy"])["deadLetterTargetArn"] == queues["dlqArn"]
    assert "MessageId" in json.loads(cli(env, "send", "--queue-url", queues["queueUrl"]))

    def dead_lettered() -> bool:
        out = cli(env, "process", "--queue-url", queues["queueUrl"], "--wait-seconds", "0", FAIL="True")
        assert json.loads(out.splitlines()[-1]) == {"processed": 0}
        return counts(sqs, queues["dlqUrl"]) == (1, 0)

    wait_for(dead_lettered, 30, lambda: f"DLQ {counts(sqs, queues['dlqUrl'])}")
    out = cli(env, "start", json.dumps({"queueArn": queues["dlqArn"]}), "--wait", "60")
    assert json.loads(out)["status"] == "COMPLETED"
    out = cli(env, "process", "--queue-url", queues["queueUrl"], "--wait-seconds", "0", FAIL="false")
    assert json.loads(out.splitlines()[-1]) == {"processed": 1}
    assert counts(sqs, queues["queueUrl"]) == (0, 0)
    assert counts(sqs, queues["dlqUrl"]) == (0, 0)
