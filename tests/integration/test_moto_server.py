"""The project's moto server: ``python -m celery_workflow.testing.moto_server`` in the foreground (its exports, its
stop on SIGTERM), and concurrent ``TransactWriteItems`` through it (issue #33, item 4): moto copies the table for a
transaction and puts the copy back when it is cancelled, so without one-at-a-time DynamoDB requests concurrent
writers get 500s ("dictionary changed size during iteration") and cancelled transactions undo others' writes."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from celery_workflow.testing.moto_server import MotoServer
from celery_workflow.world_sqs import create_table

CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
WRITERS = 8
WRITES = 25


def test_the_command_prints_its_exports_serves_and_stops_on_sigterm() -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "celery_workflow.testing.moto_server", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as server:
        serve_and_stop(server)


def serve_and_stop(server: subprocess.Popen[str]) -> None:
    try:
        assert server.stdout is not None
        exports = dict(server.stdout.readline().split()[1].split("=", 1) for _ in range(4))
        assert set(exports) == {"AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
        assert exports["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
        client = boto3.client(
            "sqs",
            endpoint_url=exports["AWS_ENDPOINT_URL"],
            region_name=exports["AWS_DEFAULT_REGION"],
            aws_access_key_id=exports["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=exports["AWS_SECRET_ACCESS_KEY"],
        )
        assert client.create_queue(QueueName="q")["QueueUrl"].endswith("/q")
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=10) == 0
        assert server.stderr is not None and "moto server stopped" in server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def put(table: str, pk: str, sk: str, condition: str | None = None) -> dict[str, Any]:
    action: dict[str, Any] = {"TableName": table, "Item": {"pk": {"S": pk}, "sk": {"S": sk}}}
    if condition:
        action["ConditionExpression"] = condition
    return {"Put": action}


@pytest.fixture(name="dynamodb")
def dynamodb_fixture() -> Any:
    with MotoServer() as endpoint:
        # one attempt: a 500 surfaces instead of being retried away by botocore
        client = boto3.client(
            "dynamodb", endpoint_url=endpoint, config=Config(retries={"max_attempts": 1}), **CREDENTIALS
        )
        create_table(client, "t", poll=0.05)
        yield client


def test_concurrent_transactions_neither_fail_nor_undo_each_other(dynamodb: Any) -> None:
    """Eight threads each commit 25 two-item transactions and have 25 more cancelled (a condition on an item that
    exists): every committed item is there, no cancelled one is, and no request failed otherwise."""
    errors: list[str] = []
    cancelled = [0]
    lock = threading.Lock()
    dynamodb.put_item(TableName="t", Item={"pk": {"S": "GUARD"}, "sk": {"S": "META"}})

    def writer(w: int) -> None:
        for k in range(WRITES):
            try:
                dynamodb.transact_write_items(TransactItems=[put("t", f"W{w}", f"A{k}"), put("t", f"W{w}", f"B{k}")])
            except ClientError as exc:
                with lock:
                    errors.append(f"commit {w}/{k}: {exc.response['Error']}")
            try:
                dynamodb.transact_write_items(
                    TransactItems=[
                        put("t", f"W{w}", f"X{k}"),
                        put("t", "GUARD", "META", "attribute_not_exists(pk)"),  # fails: cancels the transaction
                    ]
                )
            except ClientError as exc:
                if exc.response["Error"]["Code"] == "TransactionCanceledException":
                    with lock:
                        cancelled[0] += 1
                else:
                    with lock:
                        errors.append(f"cancel {w}/{k}: {exc.response['Error']}")

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert cancelled[0] == WRITERS * WRITES
    for w in range(WRITERS):
        items = dynamodb.query(
            TableName="t", KeyConditionExpression="pk = :pk", ExpressionAttributeValues={":pk": {"S": f"W{w}"}}
        )["Items"]
        keys = sorted(i["sk"]["S"] for i in items)
        assert keys == sorted([f"A{k}" for k in range(WRITES)] + [f"B{k}" for k in range(WRITES)]), w
