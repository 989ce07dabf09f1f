"""The "Lambda + Step Functions + DynamoDB task status" use case, as one workflow.

The state machine: (1) put a task item {taskId, timestamp, status: "Started"}; (2) wait 30 seconds for a long
running job; (3) update the item's status to "Done". Here the Lambda that starts the execution becomes
``track_task.start(task_id)`` (or an RPC call to the Flask blueprint), the Wait state becomes a durable ``sleep``, and
the two DynamoDB tasks become steps. The Tasks table is DynamoDB when ``TASKS_TABLE`` is set (boto3, partition key
``taskId``, sort key ``timestamp``), else a local SQLite table with the same keys.

    celery -A examples.task_status worker
    python -c "from examples.task_status import track_task; print(track_task.start('Breakfast').result(60))"
"""

from __future__ import annotations

import os
import sqlite3
from typing import Any, Protocol

from celery import Celery

from celery_workflow import Workflows, now, sleep

celery_app = Celery("task_status")
wf = Workflows(celery_app)
WAIT_SECONDS = float(os.environ.get("TASK_WAIT_SECONDS", "30"))


class TaskTable(Protocol):
    def put(self, task_id: str, timestamp: int, status: str) -> None: ...
    def update_status(self, task_id: str, timestamp: int, status: str) -> None: ...
    def get(self, task_id: str, timestamp: int) -> dict[str, Any] | None: ...


class SQLiteTasks:
    def __init__(self, path: str = "tasks.sqlite3") -> None:
        self.path = path
        with sqlite3.connect(self.path) as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS tasks (task_id TEXT, timestamp INTEGER, status TEXT,"
                " PRIMARY KEY (task_id, timestamp))"
            )

    def put(self, task_id: str, timestamp: int, status: str) -> None:
        with sqlite3.connect(self.path) as db:  # an upsert: a retried step writes the same item again
            db.execute("INSERT OR REPLACE INTO tasks VALUES (?, ?, ?)", (task_id, timestamp, status))

    def update_status(self, task_id: str, timestamp: int, status: str) -> None:
        with sqlite3.connect(self.path) as db:
            db.execute("UPDATE tasks SET status = ? WHERE task_id = ? AND timestamp = ?", (status, task_id, timestamp))

    def get(self, task_id: str, timestamp: int) -> dict[str, Any] | None:
        with sqlite3.connect(self.path) as db:
            row = db.execute(
                "SELECT task_id, timestamp, status FROM tasks WHERE task_id = ? AND timestamp = ?", (task_id, timestamp)
            ).fetchone()
        return None if row is None else {"taskId": row[0], "timestamp": row[1], "status": row[2]}


class DynamoTasks:
    def __init__(self, table: str) -> None:
        import boto3

        self.table = boto3.resource("dynamodb").Table(table)

    def put(self, task_id: str, timestamp: int, status: str) -> None:
        self.table.put_item(Item={"taskId": task_id, "timestamp": timestamp, "status": status})

    def update_status(self, task_id: str, timestamp: int, status: str) -> None:
        self.table.update_item(
            Key={"taskId": task_id, "timestamp": timestamp},
            UpdateExpression="SET #s = :s",
            ExpressionAttributeNames={"#s": "status"},
            ExpressionAttributeValues={":s": status},
        )

    def get(self, task_id: str, timestamp: int) -> dict[str, Any] | None:
        item = self.table.get_item(Key={"taskId": task_id, "timestamp": timestamp}).get("Item")
        return None if item is None else {**item, "timestamp": int(item["timestamp"])}


def tasks() -> TaskTable:
    table = os.environ.get("TASKS_TABLE")
    return DynamoTasks(table) if table else SQLiteTasks(os.environ.get("TASKS_DB", "tasks.sqlite3"))


@wf.step
def create_task_item(task_id: str, timestamp: int) -> None:
    tasks().put(task_id, timestamp, "Started")


@wf.step
def update_task_item(task_id: str, timestamp: int) -> None:
    tasks().update_status(task_id, timestamp, "Done")


@wf.workflow
def track_task(task_id: str) -> dict[str, Any]:
    timestamp = int(now().timestamp())  # deterministic: the same on every replay of this run
    create_task_item(task_id, timestamp)
    sleep(WAIT_SECONDS)  # "Execute long running task... wait 30 seconds"
    update_task_item(task_id, timestamp)
    return {"taskId": task_id, "timestamp": timestamp, "status": "Done"}
