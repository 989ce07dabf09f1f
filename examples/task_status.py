"""The "Lambda starts a Step Function that tracks a task in DynamoDB" application, as one durable workflow.

A Lambda invoked with ``{"taskId": "Breakfast"}`` adds the unix time and starts a state machine with
``{"taskId", "timestamp"}``, which puts the item ``{taskId, timestamp, Status: "Started"}`` into the DynamoDB table
``Tasks`` (partition key ``taskId``, sort key ``timestamp``), waits 30 seconds for a long running task, then sets
``Status`` to ``"Done"``. Here::

    Step Functions application                     here
    Lambda "invoke" ({"taskId"}, StartExecution)   handler(event, context): track_task.start({"taskId", "timestamp"})
    State machine                                  @wf.workflow track_task (an execution is a run, logged in the World)
    1. Create Dynamo Task Item (DynamoPutItem)     @wf.step create_task_item
    2. Execute long running task...wait 30 s       sleep(TASK_WAIT_SECONDS): durable, no worker waits meanwhile
    3. Update Dynamo Task Item (DynamoUpdateItem)  @wf.step update_task_item: SET #s = :val (#s: Status, :val: Done)
    DynamoDB table Tasks (the CDK stack)           python -m examples.task_status setup ($TASKS_TABLE, default Tasks)
    StartExecution over HTTP                       create_app(): POST /v1/workflow/rpc; api_handler: the same on Lambda
    Execution history in the console              celery-workflow runs show RUN_ID; RPC get_run, list_events

boto3 reads the region, credentials and ``AWS_ENDPOINT_URL`` from the environment, so the same code runs against AWS
and an emulator. With ``TASKS_DB=tasks.sqlite3`` the table is a local SQLite file instead: no AWS at all. The World
is ``$CELERY_WORKFLOW_URL`` (unset: an embedded SQLite file in the current directory)::

    python -m examples.task_status setup             # create the Tasks table (idempotent; waits until it is active)
    celery -A examples.task_status worker            # runs the workflow and its steps
    python -m examples.task_status start Breakfast   # what invoking the Lambda does: prints runId, taskId, timestamp
    python -m examples.task_status show Breakfast    # the Breakfast items: Status "Started", then "Done" 30 s later
    flask --app examples.task_status run             # POST /v1/workflow/rpc
    # {"method": "start", "params": {"workflow": "track_task", "args": [{"taskId": "Breakfast"}]}}

On Lambda, ``examples.task_status.handler`` is the invoke function and ``examples.task_status.api_handler`` the RPC
behind a Function URL (add your authentication); the deliveries run on ``celery worker`` processes, or on a function
of ``celery_workflow.aws_lambda.queue_handler(wf)`` with ``Workflows(..., broker="app")``.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import closing, contextmanager
from functools import cache
from typing import Any, NotRequired

import boto3
from boto3.dynamodb.conditions import Key
from celery import Celery
from flask import Flask
from typing_extensions import TypedDict  # pydantic, which rebuilds a run's input, needs this one before Python 3.12

from celery_workflow import Workflows, now, sleep

celery_app = Celery("task_status")
wf = Workflows(celery_app)  # the World: $CELERY_WORKFLOW_URL (sqlite:///…, postgresql://…, aws://)
WAIT_SECONDS = float(os.environ.get("TASK_WAIT_SECONDS", "30"))


class Task(TypedDict):
    """The state machine's input. The invoke Lambda sets ``timestamp``; without it the run takes its start time."""

    taskId: str
    timestamp: NotRequired[int]


class TaskItem(TypedDict):
    """An item of the Tasks table, with the seed's attribute names."""

    taskId: str
    timestamp: int
    Status: str


class DynamoTasks:
    """The DynamoDB table (partition key ``taskId`` string, sort key ``timestamp`` number)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.db = boto3.resource("dynamodb")

    def create(self) -> None:
        client = self.db.meta.client
        try:
            client.create_table(
                TableName=self.name,
                KeySchema=[
                    {"AttributeName": "taskId", "KeyType": "HASH"},
                    {"AttributeName": "timestamp", "KeyType": "RANGE"},
                ],
                AttributeDefinitions=[
                    {"AttributeName": "taskId", "AttributeType": "S"},
                    {"AttributeName": "timestamp", "AttributeType": "N"},
                ],
                BillingMode="PAY_PER_REQUEST",
            )
        except client.exceptions.ResourceInUseException:
            pass  # it exists already
        client.get_waiter("table_exists").wait(TableName=self.name, WaiterConfig={"Delay": 1, "MaxAttempts": 120})

    def put(self, item: TaskItem) -> None:
        self.db.Table(self.name).put_item(Item=dict(item))

    def set_status(self, task_id: str, timestamp: int, status: str) -> None:
        self.db.Table(self.name).update_item(
            Key={"taskId": task_id, "timestamp": timestamp},
            UpdateExpression="SET #s = :val",
            ExpressionAttributeNames={"#s": "Status"},
            ExpressionAttributeValues={":val": status},
        )

    def query(self, task_id: str) -> list[TaskItem]:
        found = self.db.Table(self.name).query(KeyConditionExpression=Key("taskId").eq(task_id), ConsistentRead=True)
        return [TaskItem(taskId=i["taskId"], timestamp=int(i["timestamp"]), Status=i["Status"]) for i in found["Items"]]


class SQLiteTasks:
    """The same table in a local SQLite file, to run the example with no AWS."""

    def __init__(self, path: str) -> None:
        self.name = self.path = path
        self.create()

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        with closing(sqlite3.connect(self.path)) as db, db:  # one transaction, then close
            yield db

    def create(self) -> None:
        with self._db() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS tasks"
                " (taskId TEXT, timestamp INTEGER, Status TEXT, PRIMARY KEY (taskId, timestamp))"
            )

    def put(self, item: TaskItem) -> None:
        with self._db() as db:
            db.execute(
                "INSERT OR REPLACE INTO tasks VALUES (?, ?, ?)", (item["taskId"], item["timestamp"], item["Status"])
            )

    def set_status(self, task_id: str, timestamp: int, status: str) -> None:
        with self._db() as db:
            db.execute("UPDATE tasks SET Status = ? WHERE taskId = ? AND timestamp = ?", (status, task_id, timestamp))

    def query(self, task_id: str) -> list[TaskItem]:
        with self._db() as db:
            rows = db.execute("SELECT * FROM tasks WHERE taskId = ? ORDER BY timestamp", (task_id,)).fetchall()
        return [TaskItem(taskId=t, timestamp=ts, Status=s) for t, ts, s in rows]


def tasks_table() -> DynamoTasks | SQLiteTasks:
    """``$TASKS_DB`` (a SQLite file) if set, else the DynamoDB table ``$TASKS_TABLE`` (default ``Tasks``)."""
    path = os.environ.get("TASKS_DB")
    return SQLiteTasks(path) if path else DynamoTasks(os.environ.get("TASKS_TABLE", "Tasks"))


@wf.step
def create_task_item(task_id: str, timestamp: int) -> None:
    """Put the item with Status "Started". A retry puts the same item again, so it is idempotent."""
    tasks_table().put(TaskItem(taskId=task_id, timestamp=timestamp, Status="Started"))


@wf.step
def update_task_item(task_id: str, timestamp: int) -> None:
    """Set the item's Status to "Done" (idempotent too)."""
    tasks_table().set_status(task_id, timestamp, "Done")


@wf.workflow
def track_task(task: Task) -> TaskItem:
    # now() is deterministic: the same on every replay of this run
    timestamp = task["timestamp"] if "timestamp" in task else int(now().timestamp())
    create_task_item(task["taskId"], timestamp)
    sleep(WAIT_SECONDS)  # "Execute long running task...wait 30 seconds": the table is not updated meanwhile
    update_task_item(task["taskId"], timestamp)
    return TaskItem(taskId=task["taskId"], timestamp=timestamp, Status="Done")


class InvalidTaskEvent(ValueError):
    """The invoke Lambda's event is not ``{"taskId": "<non-empty string>"}``."""


def handler(event: Any, context: Any = None) -> dict[str, Any]:
    """The invoke Lambda: start ``track_task`` with ``{"taskId", "timestamp"}`` and return its run id and input.

    Idempotent per Lambda request: the run id is ``invoke-<aws_request_id>``, so when Lambda retries an invocation
    the retry answers with the first attempt's run and timestamp. Without a context (scripts), each call starts a run.
    """
    task_id = event.get("taskId") if isinstance(event, Mapping) else None
    if not isinstance(task_id, str) or not task_id:
        raise InvalidTaskEvent(f'expected {{"taskId": "<non-empty string>"}}, got {event!r:.200}')
    request_id = getattr(context, "aws_request_id", None)
    run = track_task.start(
        Task(taskId=task_id, timestamp=int(time.time())), run_id=f"invoke-{request_id}" if request_id else None
    )
    task = run.view().input["args"][0]  # what the run was started with (the first attempt's, on a retry)
    return {"runId": run.id, "taskId": task["taskId"], "timestamp": task["timestamp"]}


def create_app() -> Flask:
    """A Flask app serving the RPC (``start``, ``get_run``, …) and webhooks under ``/v1/workflow``."""
    app = Flask(__name__)
    app.register_blueprint(wf.blueprint(), url_prefix="/v1/workflow")
    return app


@cache
def _api() -> Callable[[Mapping[str, Any], Any], dict[str, Any]]:
    from celery_workflow.aws_lambda import http_handler

    return http_handler(wf, prefix="/v1/workflow")


def api_handler(event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
    """The RPC as a Lambda behind a Function URL or API Gateway (what ``create_app()`` serves)."""
    return _api()(event, context)


def main(argv: list[str]) -> None:
    match argv:
        case ["setup"]:
            table = tasks_table()
            table.create()
            print(f"{table.name} is ready")
        case ["start", task_id]:
            print(json.dumps(handler({"taskId": task_id})))
        case ["show", task_id]:
            for item in tasks_table().query(task_id):
                print(json.dumps(item))
        case _:
            raise SystemExit("usage: python -m examples.task_status setup | start TASK_ID | show TASK_ID")


if __name__ == "__main__":
    main(sys.argv[1:])
