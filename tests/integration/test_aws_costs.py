"""The cost counter on real boto3 calls to a moto server: DynamoDB units by AWS's rules, SQS and Scheduler requests."""

from __future__ import annotations

from typing import Any

import boto3
import pytest
from celery import Celery

from celery_workflow import Workflows
from celery_workflow.aws_costs import (
    INDEX_WRITE_UNITS,
    LAMBDA_GB_SECONDS,
    LAMBDA_REQUESTS,
    PITR_GB_MONTHS,
    PRICES,
    READ_UNITS,
    SCHEDULER_INVOCATIONS,
    SQS_FIFO_REQUESTS,
    SQS_REQUESTS,
    STORAGE_GB_MONTHS,
    WRITE_UNITS,
    CostCounter,
    TableSpec,
    Usage,
    item_kind,
    item_size,
)
from celery_workflow.world_sqs import AWSWorld, table_definition
from tests.integration.aws_fixtures import CREDENTIALS, TABLE, Aws, aws_fixture, moto_fixture  # noqa: F401


def s(text: str) -> dict[str, str]:
    return {"S": text}


@pytest.fixture
def counted(aws: Aws) -> tuple[CostCounter, Any, Any]:
    """A counter and DynamoDB / SQS clients it counts (the fixture's own clients stay uncounted)."""
    counter = CostCounter([TableSpec.from_definition(table_definition(TABLE))])
    dynamodb = counter.attach(boto3.client("dynamodb", endpoint_url=aws.endpoint, **CREDENTIALS))
    sqs = counter.attach(boto3.client("sqs", endpoint_url=aws.endpoint, **CREDENTIALS))
    return counter, dynamodb, sqs


def units(counter: CostCounter, unit: str, operation: str | None = None) -> float:
    return sum(a for (u, op, _), a in counter.usage().counts.items() if u == unit and operation in (None, op))


def test_the_table_spec_comes_from_the_definition_or_the_table(aws: Aws) -> None:
    spec = TableSpec.from_definition(table_definition(TABLE))
    assert spec.keys == ("pk", "sk")
    assert [(i.name, i.keys, i.projection) for i in spec.indexes] == [
        ("list", ("list_pk", "list_sk"), ("status",)),
        ("list_group", ("list_group_pk", "list_group_sk"), ()),
    ]
    assert TableSpec.describe(aws.dynamodb, TABLE) == spec


def test_puts_updates_and_deletes_cost_the_larger_size_per_started_kb(counted: tuple[CostCounter, Any, Any]) -> None:
    counter, dynamodb, _ = counted
    key = {"pk": s("RUN#1"), "sk": s("STEP#a")}
    dynamodb.put_item(TableName=TABLE, Item={**key, "data": {"B": b"x" * 3000}})
    assert units(counter, WRITE_UNITS, "PutItem") == 3  # 3,020 bytes (moto would report 1 unit)
    dynamodb.update_item(
        TableName=TABLE,
        Key=key,
        UpdateExpression="SET more = :m",
        ExpressionAttributeValues={":m": {"B": b"y" * 1200}},
    )
    assert units(counter, WRITE_UNITS, "UpdateItem") == 5  # 4,224 bytes after
    dynamodb.update_item(
        TableName=TABLE, Key=key, UpdateExpression="REMOVE #d, more", ExpressionAttributeNames={"#d": "data"}
    )
    assert units(counter, WRITE_UNITS, "UpdateItem") == 5 + 5  # billed on the size before
    dynamodb.delete_item(TableName=TABLE, Key=key)
    assert units(counter, WRITE_UNITS, "DeleteItem") == 1
    with pytest.raises(dynamodb.exceptions.ConditionalCheckFailedException):
        dynamodb.put_item(TableName=TABLE, Item={**key, "v": s("x")}, ConditionExpression="attribute_exists(pk)")
    assert units(counter, WRITE_UNITS, "PutItem") == 3 + 1  # a failed condition still costs the minimum
    assert units(counter, INDEX_WRITE_UNITS) == 0  # none of these items is in an index
    assert counter.usage().estimated == 0


def test_transactions_double_and_index_entries_are_written_when_they_change(
    counted: tuple[CostCounter, Any, Any],
) -> None:
    counter, dynamodb, _ = counted
    meta = {"pk": s("RUN#1"), "sk": s("META"), "list_pk": s("RUNS"), "list_sk": s("1#1"), "status": s("running")}
    event = {"pk": s("RUN#1"), "sk": s("EVENT#1"), "data": {"B": b"e" * 1500}}
    dynamodb.transact_write_items(
        TransactItems=[{"Put": {"TableName": TABLE, "Item": meta}}, {"Put": {"TableName": TABLE, "Item": event}}]
    )
    assert units(counter, WRITE_UNITS, "TransactWriteItems") == 2 * 1 + 2 * 2
    assert units(counter, INDEX_WRITE_UNITS) == 1  # the run joins the list index (list_group: no keys)
    dynamodb.transact_write_items(
        TransactItems=[
            {
                "Update": {
                    "TableName": TABLE,
                    "Key": {"pk": s("RUN#1"), "sk": s("META")},
                    "UpdateExpression": "SET event_count = :n",
                    "ExpressionAttributeValues": {":n": {"N": "2"}},
                }
            }
        ]
    )
    assert units(counter, INDEX_WRITE_UNITS) == 1  # nothing projected changed
    dynamodb.update_item(
        TableName=TABLE,
        Key={"pk": s("RUN#1"), "sk": s("META")},
        UpdateExpression="SET #s = :s",
        ExpressionAttributeNames={"#s": "status"},
        ExpressionAttributeValues={":s": s("completed")},
    )
    assert units(counter, INDEX_WRITE_UNITS) == 2  # the status is projected
    kinds = {(u, kind) for (u, _, kind) in counter.usage().counts}
    assert (WRITE_UNITS, "RUN/EVENT") in kinds and (INDEX_WRITE_UNITS, "list index RUN/META") in kinds


def test_reads_by_consistency_batch_and_query_page(aws: Aws, counted: tuple[CostCounter, Any, Any]) -> None:
    counter, dynamodb, _ = counted
    for i in range(10):  # written uncounted: the counter learns their sizes by reading them
        aws.dynamodb.put_item(TableName=TABLE, Item={"pk": s("RUN#1"), "sk": s(f"EVENT#{i}"), "d": {"B": b"x" * 980}})
    key = {"pk": s("RUN#1"), "sk": s("EVENT#0")}
    dynamodb.get_item(TableName=TABLE, Key=key, ConsistentRead=True)
    dynamodb.get_item(TableName=TABLE, Key=key)
    dynamodb.get_item(TableName=TABLE, Key={"pk": s("RUN#1"), "sk": s("nothing")}, ConsistentRead=True)
    assert units(counter, READ_UNITS, "GetItem") == 1 + 0.5 + 1
    answer = dynamodb.query(
        TableName=TABLE,
        KeyConditionExpression="pk = :pk",
        ExpressionAttributeValues={":pk": s("RUN#1")},
        ConsistentRead=True,
    )
    assert len(answer["Items"]) == 10
    assert units(counter, READ_UNITS, "Query") == 3  # 10 items of ~1 KB summed, then rounded once
    keys = [{"pk": s("RUN#1"), "sk": s(f"EVENT#{i}")} for i in range(3)] + [{"pk": s("RUN#2"), "sk": s("META")}]
    dynamodb.batch_get_item(RequestItems={TABLE: {"Keys": keys, "ConsistentRead": True}})
    assert units(counter, READ_UNITS, "BatchGetItem") == 4  # each item rounded up alone, the missing one too
    dynamodb.transact_get_items(TransactItems=[{"Get": {"TableName": TABLE, "Key": key}}])
    assert units(counter, READ_UNITS, "TransactGetItems") == 2


def test_sqs_requests_count_64kb_chunks_and_empty_receives(aws: Aws, counted: tuple[CostCounter, Any, Any]) -> None:
    counter, _, sqs = counted
    sqs.send_message(QueueUrl=aws.queue_url, MessageBody="x" * (100 * 1024))
    sqs.send_message_batch(QueueUrl=aws.queue_url, Entries=[{"Id": str(i), "MessageBody": "small"} for i in range(10)])
    assert units(counter, SQS_REQUESTS, "SendMessage") == 2
    assert units(counter, SQS_REQUESTS, "SendMessageBatch") == 1  # ten messages, one request
    got = sqs.receive_message(QueueUrl=aws.queue_url, MaxNumberOfMessages=10)["Messages"]
    sqs.delete_message_batch(
        QueueUrl=aws.queue_url, Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(got)]
    )
    assert units(counter, SQS_REQUESTS, "DeleteMessageBatch") == 1
    fifo = aws.queue("orders.fifo", fifo=True)
    sqs.send_message(QueueUrl=fifo.url, MessageBody="{}", MessageGroupId="g")
    assert units(counter, SQS_FIFO_REQUESTS) == 1
    sqs.purge_queue(QueueUrl=aws.queue_url)
    sqs.receive_message(QueueUrl=aws.queue_url, WaitTimeSeconds=1)
    assert units(counter, SQS_REQUESTS, "ReceiveMessage (empty)") == 1


def test_a_workflow_run_is_counted_end_to_end(aws: Aws) -> None:
    """Through the AWS World itself: every write a run makes is counted, nothing is estimated, and the figures are
    plausible against the seed's worked floor (a step is more than 1 and fewer than 40 write units)."""
    from celery_workflow.aws_lambda import queue_handler
    from tests.integration.test_aws_lambda import Context, sqs_event

    counter = CostCounter([TableSpec.from_definition(table_definition(TABLE))])
    dynamodb = counter.attach(boto3.client("dynamodb", endpoint_url=aws.endpoint, **CREDENTIALS))
    sqs = counter.attach(boto3.client("sqs", endpoint_url=aws.endpoint, **CREDENTIALS))
    counter.attach(aws.scheduler)
    wf = Workflows(Celery("costs"), world=AWSWorld(aws.config(), dynamodb, sqs), broker="app")

    @wf.step
    def add(a: int, b: int) -> int:
        return a + b

    @wf.workflow
    def sum_of(n: int) -> int:
        total = 0
        for i in range(n):
            total = add(total, i)
        return total

    handler = queue_handler(wf)
    try:
        run = wf.start("sum_of", 5)
        for _ in range(200):
            if run.status.terminal:
                break
            event = sqs_event(aws)
            if event["Records"]:
                counter.record(LAMBDA_REQUESTS, "Invoke", "queue")
                handler(event, Context(60))
        assert run.result(timeout=5) == 10
    finally:
        wf.close()
    usage = counter.usage()
    per_step = usage.scaled(1 / 5)
    assert usage.estimated == 0
    assert 1 < per_step.total(WRITE_UNITS) < 40
    assert per_step.total(READ_UNITS) > 0
    assert usage.total(SQS_REQUESTS) >= 1  # the first delivery at least (the fixture receives uncounted)
    assert usage.total(SCHEDULER_INVOCATIONS) == 0  # nothing sleeps
    assert usage.total(LAMBDA_REQUESTS) >= 1
    assert 0 < usage.cost() == pytest.approx(sum(usage.dollars(PRICES).values()))
    assert usage.counts[(SQS_REQUESTS, "SendMessage", "workflow-tasks")] >= 1
    assert (SQS_REQUESTS, "DeleteMessage", "workflow-tasks") not in usage.counts  # the event source mapping deletes
    assert (WRITE_UNITS, "DeleteItem", "QUEUE/META") not in usage.counts  # the append's transaction deleted them
    assert {kind for (_, op, kind) in usage.counts if op == "Query"} <= {"RUN/EVENT", "?", "list index"}
    top = usage.breakdown()[0]
    assert top[0] == WRITE_UNITS and top[4] > 0


def test_usage_subtracts_scales_and_prices() -> None:
    before = Usage({(WRITE_UNITS, "PutItem", "RUN/META"): 2.0})
    after = Usage({(WRITE_UNITS, "PutItem", "RUN/META"): 6.0, (SQS_REQUESTS, "SendMessage", "q"): 1.0}, estimated=1)
    delta = after - before
    assert delta.counts == {(WRITE_UNITS, "PutItem", "RUN/META"): 4.0, (SQS_REQUESTS, "SendMessage", "q"): 1.0}
    assert delta.estimated == 1
    assert delta.scaled(0.5).total(WRITE_UNITS) == 2.0
    assert delta.cost() == pytest.approx(4 * 0.625e-6 + 0.40e-6)
    assert item_kind({"pk": s("QUEUE#abc"), "sk": s("META")}) == "QUEUE/META"


def test_a_failed_conditional_write_is_billed_on_the_larger_of_the_item_and_the_write(
    counted: tuple[CostCounter, Any, Any],
) -> None:
    """AWS bills a write whose condition failed on the larger of the item as it is and the item it would have
    written, as a successful one (issue #31, item 4): a refused 3 KB put over no item costs 3 units, not 1."""
    counter, dynamodb, _ = counted
    key = {"pk": s("RUN#1"), "sk": s("STEP#a")}
    with pytest.raises(dynamodb.exceptions.ConditionalCheckFailedException):
        dynamodb.put_item(
            TableName=TABLE, Item={**key, "data": {"B": b"x" * 3000}}, ConditionExpression="attribute_exists(pk)"
        )
    assert units(counter, WRITE_UNITS, "PutItem") == 3
    dynamodb.put_item(TableName=TABLE, Item={**key, "v": s("x")})
    with pytest.raises(dynamodb.exceptions.TransactionCanceledException):
        dynamodb.transact_write_items(TransactItems=[{"Update": {
            "TableName": TABLE, "Key": key, "UpdateExpression": "SET more = :m", "ConditionExpression": "v = :no",
            "ExpressionAttributeValues": {":m": {"B": b"y" * 2500}, ":no": s("no")},
        }}])  # fmt: skip
    assert units(counter, WRITE_UNITS, "TransactWriteItems") == 2 * 3  # 2.5 KB after, doubled in a transaction
    assert units(counter, INDEX_WRITE_UNITS) == 0  # nothing was written


def test_lambda_duration_storage_and_point_in_time_recovery_are_counted() -> None:
    counter = CostCounter([TableSpec.from_definition(table_definition(TABLE))])
    counter.duration(0.0101, 128)  # billed per started ms: 11 ms at 1/8 GB
    assert counter.usage().total(LAMBDA_GB_SECONDS) == pytest.approx(0.011 / 8)
    plain = {"pk": s("RUN#1"), "sk": s("EVENT#1"), "data": s("x" * 900)}  # in no index
    listed = {"pk": s("RUN#1"), "sk": s("META"), "list_pk": s("RUNS"), "list_sk": s("1#r"), "status": s("done")}
    counter.storage([plain, listed], months=2)
    size = (item_size(plain) + 100) + (item_size(listed) + 100) * 2  # META's list index entry: all of it here
    usage = counter.usage()
    assert usage.total(STORAGE_GB_MONTHS) == pytest.approx(size / 1024**3 * 2)
    assert usage.total(PITR_GB_MONTHS) == usage.total(STORAGE_GB_MONTHS)
    assert usage.dollars()[STORAGE_GB_MONTHS] == pytest.approx(size / 1024**3 * 2 * 0.25)
