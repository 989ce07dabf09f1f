"""bench/moto_undo.py: a cancelled transaction leaves the table as it was, as moto's own backup does."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from bench import moto_undo
from celery_workflow.testing.moto_server import MotoServer

KEYS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


@pytest.fixture(name="dynamodb")
def dynamodb_fixture() -> Iterator[Any]:
    moto_undo.install()
    with MotoServer() as endpoint:
        client = boto3.client("dynamodb", endpoint_url=endpoint, **KEYS)
        client.create_table(
            TableName="t",
            KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}, {"AttributeName": "sk", "KeyType": "RANGE"}],
            AttributeDefinitions=[
                {"AttributeName": "pk", "AttributeType": "S"},
                {"AttributeName": "sk", "AttributeType": "S"},
            ],
            BillingMode="PAY_PER_REQUEST",
        )
        yield client


def items(client: Any) -> list[dict[str, Any]]:
    return sorted(client.scan(TableName="t")["Items"], key=lambda i: (i["pk"]["S"], i["sk"]["S"]))


def key(pk: str) -> dict[str, Any]:
    return {"pk": {"S": pk}, "sk": {"S": "m"}}


def test_a_cancelled_transaction_changes_nothing_and_a_committed_one_everything(dynamodb: Any) -> None:
    dynamodb.put_item(TableName="t", Item={**key("a"), "v": {"N": "1"}})
    dynamodb.put_item(TableName="t", Item={**key("b"), "v": {"N": "2"}})
    before = items(dynamodb)
    actions = [
        {"Put": {"TableName": "t", "Item": {**key("c"), "v": {"N": "3"}}}},  # a new item
        {"Put": {"TableName": "t", "Item": {**key("a"), "v": {"N": "9"}}}},  # an overwrite
        {"Delete": {"TableName": "t", "Key": key("b")}},
        {
            "Update": {
                "TableName": "t",
                "Key": key("d"),
                "UpdateExpression": "SET v = :v",
                "ConditionExpression": "attribute_exists(pk)",  # fails: d does not exist
                "ExpressionAttributeValues": {":v": {"N": "4"}},
            }
        },
    ]
    with pytest.raises(ClientError, match="TransactionCanceled"):
        dynamodb.transact_write_items(TransactItems=actions)
    assert items(dynamodb) == before
    dynamodb.transact_write_items(TransactItems=actions[:3])
    assert [(i["pk"]["S"], i["v"]["N"]) for i in items(dynamodb)] == [("a", "9"), ("c", "3")]
