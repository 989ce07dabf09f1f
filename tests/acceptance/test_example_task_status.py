"""examples/task_status.py on a real `celery -A examples.task_status worker`, on the SQLite, Postgres and AWS Worlds
(the same code on each), with its Tasks table in DynamoDB on a moto server: started by the invoke Lambda's handler,
over the Flask RPC and from the command line; the item is "Started" while the run sleeps, then "Done"."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import boto3
import pytest

from celery_workflow import RunNotFound
from tests.integration.aws_fixtures import CREDENTIALS, REGION, moto_fixture  # noqa: F401

from .workers import Worker, aws_environment, imported_app, postgres_schema, wait_for

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]
MODULE = "examples.task_status"


@pytest.fixture(scope="module", params=["sqlite", "postgres", "aws"])
def env(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, moto: str
) -> Iterator[dict[str, str]]:
    """The World (an SQLite file, a Postgres schema, or DynamoDB + SQS on moto), and the name of a Tasks table of its
    own on moto."""
    tasks = {
        "AWS_ENDPOINT_URL": moto,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ACCESS_KEY_ID": CREDENTIALS["aws_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": CREDENTIALS["aws_secret_access_key"],
        "TASKS_TABLE": f"Tasks-{secrets.token_hex(4)}",
        "TASK_WAIT_SECONDS": "2",
    }
    if request.param == "sqlite":
        yield {"CELERY_WORKFLOW_URL": f"sqlite:///{tmp_path_factory.mktemp('task-status') / 'world.sqlite3'}", **tasks}
    elif request.param == "postgres":
        with postgres_schema() as url:
            yield {"CELERY_WORKFLOW_URL": url, **tasks}
    else:
        with aws_environment(moto) as aws:
            yield {**aws, **tasks}


def dynamodb(env: dict[str, str]) -> Any:
    return boto3.client("dynamodb", endpoint_url=env["AWS_ENDPOINT_URL"], **CREDENTIALS)


@pytest.fixture(scope="module")
def example(env: dict[str, str]) -> Iterator[ModuleType]:
    """The example imported in the test process (the client side: handler, Flask app, table), bound to ``env``; the
    Tasks table created (and deleted afterwards)."""
    with imported_app(MODULE, env, path=ROOT) as module:
        module.tasks_table().create()
        yield module
    dynamodb(env).delete_table(TableName=env["TASKS_TABLE"])


@pytest.fixture(scope="module")
def worker(example: ModuleType, env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    w = Worker(MODULE, env, tmp_path_factory.mktemp("logs") / "task-status-worker.log", ["-c", "2"], cwd=ROOT)
    w.wait_ready(60)
    yield w
    w.kill()  # every run has ended: nothing is left for a warm shutdown to finish


def cli(env: dict[str, str], *args: str) -> str:
    """``python -m examples.task_status ARGS`` from the repository's root; its output."""
    done = subprocess.run(
        [sys.executable, "-m", MODULE, *args],
        cwd=ROOT,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def event_types(run: Any) -> list[str]:
    return [e.event_type.value for e in run.events()]


def asleep(run: Any, worker: Worker) -> None:
    """Wait until the run sleeps (its ``wait_created`` event is written after the item is put)."""
    wait_for(lambda: "wait_created" in event_types(run), 30, lambda: f"{event_types(run)}\n{worker.log.read_text()}")


def test_the_invoke_lambda_starts_a_run_that_tracks_the_task(example: ModuleType, worker: Worker) -> None:
    context = SimpleNamespace(aws_request_id=f"req-{secrets.token_hex(4)}")
    started = example.handler({"taskId": "Breakfast"}, context)
    assert started["taskId"] == "Breakfast" and started["runId"] == f"invoke-{context.aws_request_id}"
    assert abs(started["timestamp"] - time.time()) < 30
    assert example.handler({"taskId": "Breakfast"}, context) == started  # a retried invocation: the same run
    run = example.wf.get_run(started["runId"])
    asleep(run, worker)
    assert run.status == "running"
    item = {"taskId": "Breakfast", "timestamp": started["timestamp"], "Status": "Started"}
    assert example.tasks_table().query("Breakfast") == [item]  # not updated while the run sleeps
    assert run.result(timeout=30) == {**item, "Status": "Done"}
    assert example.tasks_table().query("Breakfast") == [{**item, "Status": "Done"}]
    types = event_types(run)
    assert types.index("wait_created") < types.index("wait_completed") < types.index("run_completed")
    assert [s.step_name for s in run.steps()] == ["create_task_item", "update_task_item"]


def test_the_rpc_starts_a_run_and_the_api_lambda_reads_it(example: ModuleType, worker: Worker) -> None:
    client = example.create_app().test_client()
    answer = client.post(
        "/v1/workflow/rpc",
        json={"method": "start", "params": {"workflow": "track_task", "args": [{"taskId": "Lunch"}]}},
    )
    assert answer.status_code == 200, answer.get_data(as_text=True)
    run = example.wf.get_run(answer.get_json()["result"]["run"]["run_id"])
    asleep(run, worker)
    (item,) = example.tasks_table().query("Lunch")  # the timestamp is the run's deterministic now()
    assert item["Status"] == "Started" and abs(item["timestamp"] - time.time()) < 30
    got = example.api_handler(function_url_event({"method": "get_run", "params": {"run_id": run.id, "wait": 30}}))
    assert got["statusCode"] == 200, got
    view = json.loads(got["body"])["result"]["run"]
    assert view["status"] == "completed" and view["output"] == {**item, "Status": "Done"}
    assert example.tasks_table().query("Lunch") == [{**item, "Status": "Done"}]


def function_url_event(body: dict[str, Any]) -> dict[str, Any]:
    """A Lambda Function URL request: POST /v1/workflow/rpc with a JSON body."""
    return {
        "version": "2.0",
        "rawPath": "/v1/workflow/rpc",
        "rawQueryString": "",
        "headers": {"content-type": "application/json", "host": "tasks.lambda-url.us-east-1.on.aws"},
        "requestContext": {
            "http": {"method": "POST", "path": "/v1/workflow/rpc", "protocol": "HTTP/1.1", "sourceIp": "127.0.0.1"}
        },
        "body": json.dumps(body),
        "isBase64Encoded": False,
    }


@pytest.mark.parametrize("event", [{}, {"taskId": ""}, {"taskId": 7}, {"task": "Breakfast"}, "Breakfast", None])
def test_the_invoke_lambda_refuses_a_bad_event(example: ModuleType, event: Any) -> None:
    context = SimpleNamespace(aws_request_id=f"req-{secrets.token_hex(4)}")
    with pytest.raises(example.InvalidTaskEvent, match=r'expected \{"taskId": "<non-empty string>"\}'):
        example.handler(event, context)
    with pytest.raises(RunNotFound):  # nothing was started
        example.wf.get_run(f"invoke-{context.aws_request_id}")


def test_the_command_line(example: ModuleType, worker: Worker, env: dict[str, str]) -> None:
    if not env["CELERY_WORKFLOW_URL"].startswith("sqlite:"):
        pytest.skip("the command line does the same on every World: run it once")
    table = f"Tasks-{secrets.token_hex(4)}"
    assert cli({**env, "TASKS_TABLE": table}, "setup") == f"{table} is ready\n"
    cli({**env, "TASKS_TABLE": table}, "setup")  # again: it exists already
    described = dynamodb(env).describe_table(TableName=table)["Table"]
    dynamodb(env).delete_table(TableName=table)
    assert described["TableStatus"] == "ACTIVE"
    assert described["BillingModeSummary"]["BillingMode"] == "PAY_PER_REQUEST"
    assert described["KeySchema"] == [
        {"AttributeName": "taskId", "KeyType": "HASH"},
        {"AttributeName": "timestamp", "KeyType": "RANGE"},
    ]
    assert sorted((a["AttributeName"], a["AttributeType"]) for a in described["AttributeDefinitions"]) == [
        ("taskId", "S"),
        ("timestamp", "N"),
    ]
    started = json.loads(cli(env, "start", "Dinner"))
    example.wf.get_run(started["runId"]).result(timeout=30)
    shown = [json.loads(line) for line in cli(env, "show", "Dinner").splitlines()]
    assert shown == [{"taskId": "Dinner", "timestamp": started["timestamp"], "Status": "Done"}]
