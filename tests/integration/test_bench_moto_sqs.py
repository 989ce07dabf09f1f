"""bench/moto_sqs.py: receipt handles found by index behave as moto's scans do (deletes, visibility, old handles)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from bench import moto_sqs
from celery_workflow.testing.moto_server import MotoServer

KEYS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


@pytest.fixture(name="sqs")
def sqs_fixture() -> Iterator[tuple[Any, str]]:
    moto_sqs.install()
    with MotoServer() as endpoint:
        client = boto3.client("sqs", endpoint_url=endpoint, **KEYS)
        yield client, client.create_queue(QueueName="q")["QueueUrl"]


def receive(client: Any, url: str, n: int = 10, visibility: int = 30) -> list[dict[str, Any]]:
    answer = client.receive_message(QueueUrl=url, MaxNumberOfMessages=n, VisibilityTimeout=visibility)
    return list(answer.get("Messages", []))


def test_deletes_and_visibility_by_receipt_handle(sqs: tuple[Any, str]) -> None:
    client, url = sqs
    for i in range(5):
        client.send_message(QueueUrl=url, MessageBody=f"m{i}")
    first = receive(client, url, 3)
    assert len(first) == 3
    assert len(receive(client, url)) == 2  # the other two; the first three are in flight
    assert receive(client, url) == []
    client.delete_message(QueueUrl=url, ReceiptHandle=first[0]["ReceiptHandle"])
    client.delete_message(QueueUrl=url, ReceiptHandle=first[0]["ReceiptHandle"])  # deleted already: fine
    client.change_message_visibility(QueueUrl=url, ReceiptHandle=first[1]["ReceiptHandle"], VisibilityTimeout=0)
    again = receive(client, url)
    assert [m["Body"] for m in again] == [first[1]["Body"]]  # visible again, received with a new handle
    assert again[0]["ReceiptHandle"] != first[1]["ReceiptHandle"]
    client.delete_message(QueueUrl=url, ReceiptHandle=first[1]["ReceiptHandle"])  # an old handle still deletes it
    with pytest.raises(ClientError, match="ReceiptHandleIsInvalid"):
        client.delete_message(QueueUrl=url, ReceiptHandle="not-a-handle")
    with pytest.raises(ClientError, match="ReceiptHandleIsInvalid"):
        client.change_message_visibility(QueueUrl=url, ReceiptHandle="not-a-handle", VisibilityTimeout=0)
    attrs = client.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    assert int(attrs["ApproximateNumberOfMessages"]) + int(attrs["ApproximateNumberOfMessagesNotVisible"]) == 3
