"""``python -m bench.aws_costs``: what a durable step costs on AWS, all-in, beside Step Functions (Standard and
Express) and Lambda durable functions.

Runs workflows of 1 and 10 no-op steps on the AWS World against a moto server in this process, the way the Lambda
deployment runs them: an SQS event source mapping (simulated: ``ReceiveMessage`` batches of up to 10, then
``DeleteMessageBatch`` of what succeeded, as Lambda does with ``ReportBatchItemFailures``) invokes
:func:`celery_workflow.aws_lambda.queue_handler`, whose duration is counted in GB-seconds at ``--memory``. Every
DynamoDB, SQS and Scheduler call goes through a :class:`celery_workflow.aws_costs.CostCounter`, which computes units by
AWS's sizing rules (moto's own ``ReturnConsumedCapacity`` is not faithful). The runs are kept ``--retention-days``
(``AWSConfig.retention``): their items' storage and point-in-time recovery are counted for that long (those with a
time to live two days longer, DynamoDB's deletion delay), and each run's expiry delivery, when its end queued one,
is run as it would be once due and counted. Then an idle Celery worker's receiving (the SQS transport, consuming the default queue) is counted
for ``--idle-seconds`` at two long-poll lengths and scaled to an hour.

It prints dollars per million steps by service, against the targets (10-step <= $3.50, 1-step <= $10), beside Step
Functions Standard, Express and Lambda durable functions (their assumptions under the table), and where the money of
each workflow goes. The Lambda duration is measured against moto in this process (its request handling included), so
it is an estimate. Needs ``pip install -e '.[test]'`` (boto3, moto).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

REGION = "us-east-1"
TABLE = "workflow"
ROLE_ARN = "arn:aws:iam::123456789012:role/celery-workflow-scheduler"


@dataclass
class Pricing:
    """What the bench assumes beyond the calls it counts."""

    memory_mb: int = 128  # the worker Lambda's memory
    retention_days: float = 30.0  # how long ended runs are kept (AWSConfig.retention)
    ttl_delay_days: float = 2.0  # how long DynamoDB keeps an item past its time to live before deleting it
    pitr: bool = True  # the Terraform module's default


@dataclass
class Shape:
    name: str
    steps: int
    runs: int


@dataclass
class Measured:
    shape: Shape
    usage: Any  # celery_workflow.aws_costs.Usage
    seconds: float

    @property
    def steps(self) -> int:
        return self.shape.steps * self.shape.runs


def _clients(endpoint: str, counter: Any) -> dict[str, Any]:
    import boto3

    options = {"endpoint_url": endpoint, "region_name": REGION}
    return {name: counter.attach(boto3.client(name, **options)) for name in ("dynamodb", "sqs", "scheduler")}


def _provision(endpoint: str) -> tuple[str, str]:
    """The table and the default queue on a fresh moto; the queue's URL and ARN."""
    import boto3

    from celery_workflow.world_sqs import create_table

    plain = {name: boto3.client(name, endpoint_url=endpoint, region_name=REGION) for name in ("dynamodb", "sqs")}
    create_table(plain["dynamodb"], TABLE, poll=0.05)
    url = plain["sqs"].create_queue(QueueName="workflow-tasks")["QueueUrl"]
    arn = plain["sqs"].get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    return url, arn


@contextmanager
def _aws(endpoint: str, retention: timedelta | None = None) -> Iterator[tuple[Any, Any, dict[str, Any]]]:
    """The counter, the Workflows app on an AWS World whose clients it counts, and the uncounted set-up clients."""
    from celery import Celery

    from celery_workflow import Workflows
    from celery_workflow.aws_costs import CostCounter, TableSpec
    from celery_workflow.world_sqs import AWSConfig, AWSWorld, SchedulerConfig, table_definition

    url, arn = _provision(endpoint)
    counter = CostCounter([TableSpec.from_definition(table_definition(TABLE))])
    clients = _clients(endpoint, counter)
    config = AWSConfig(
        base_url="https://workflows.example.com/v1/workflow",
        table_name=TABLE,
        queue_url=url,
        scheduler=SchedulerConfig(clients["scheduler"], arn, ROLE_ARN),
        retention=retention,
    )
    wf = Workflows(Celery("bench-costs"), world=AWSWorld(config, clients["dynamodb"], clients["sqs"]))

    @wf.step
    def noop(i: int) -> int:
        return i

    @wf.workflow
    def one_step() -> int:
        return noop(0)

    @wf.workflow
    def ten_steps() -> int:
        return sum(noop(i) for i in range(10))

    try:
        yield counter, wf, {"queue_url": url, "queue_arn": arn, **clients}
    finally:
        wf.close()


def _event_source_mapping(
    sqs: Any, queue_url: str, queue_arn: str, counter: Any, memory_mb: int = 128
) -> Callable[[Any], int]:
    """One poll of a simulated SQS event source mapping: receive a batch, invoke the handler (its duration counted
    at ``memory_mb``), delete what succeeded."""
    from celery_workflow.aws_costs import LAMBDA_REQUESTS

    class Context:
        def get_remaining_time_in_millis(self) -> int:
            return 60_000

    def poll(handler: Any) -> int:
        answer = sqs.receive_message(
            QueueUrl=queue_url,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=1,
            AttributeNames=["All"],
            MessageAttributeNames=["All"],
        )
        messages = answer.get("Messages", [])
        if not messages:
            return 0
        records = [
            {
                "messageId": m["MessageId"],
                "receiptHandle": m["ReceiptHandle"],
                "body": m["Body"],
                "attributes": m["Attributes"],
                "messageAttributes": m.get("MessageAttributes", {}),
                "eventSource": "aws:sqs",
                "eventSourceARN": queue_arn,
                "awsRegion": REGION,
            }
            for m in messages
        ]
        counter.record(LAMBDA_REQUESTS, "Invoke", "queue handler")
        started = time.perf_counter()
        answer = handler({"Records": records}, Context())
        counter.duration(time.perf_counter() - started, memory_mb, kind="queue handler")
        failed = {f["itemIdentifier"] for f in answer["batchItemFailures"]}
        done = [r for r in records if r["messageId"] not in failed]
        if done:
            entries = [{"Id": str(i), "ReceiptHandle": r["receiptHandle"]} for i, r in enumerate(done)]
            sqs.delete_message_batch(QueueUrl=queue_url, Entries=entries)
        return len(messages)

    return poll


def expire(counter: Any, wf: Any, plain: Any, run_ids: list[str], pricing: Pricing) -> None:
    """What the runs' retention costs: their items' storage (and point-in-time recovery) for the retention, those with
    a time to live until DynamoDB deletes them, then their expiry deliveries, run as they would be once due (the
    clock moved past it): the claim, the run's reads and the deletes of what has no time to live, counted; the SQS
    receive, the event source mapping's delete and the Lambda request are a tenth each (batches of 10). A run whose
    end queued no expiry (its ``QUEUE#expire-`` record, read uncounted, is absent) costs only its storage."""
    from celery_workflow import ids
    from celery_workflow._aws.queue import BODY_KEY
    from celery_workflow._aws.table import TTL_ATTRIBUTE
    from celery_workflow.aws_costs import LAMBDA_REQUESTS, SQS_REQUESTS

    world = wf.world
    months = pricing.retention_days / 30
    real = ids.utcnow
    for run_id in run_ids:
        items = plain.query(
            TableName=TABLE,
            KeyConditionExpression="pk = :pk",
            ExpressionAttributeValues={":pk": {"S": f"RUN#{run_id}"}},
        )["Items"]
        timed = [i for i in items if TTL_ATTRIBUTE in i]
        counter.storage([i for i in items if TTL_ATTRIBUTE not in i], months, pitr=pricing.pitr, kind="run items")
        counter.storage(timed, months + pricing.ttl_delay_days / 30, pitr=pricing.pitr, kind="run items (TTL)")
        key = {"pk": {"S": f"QUEUE#expire-{run_id}"}, "sk": {"S": "META"}}
        if "Item" not in plain.get_item(TableName=TABLE, Key=key, ConsistentRead=True):
            continue  # its end gave every item its time to live and queued no expiry (issue #31, item 3)
        later = real() + timedelta(days=pricing.retention_days + 1)
        ids.utcnow = lambda later=later: later  # type: ignore[misc]
        try:
            body = json.dumps({BODY_KEY: 1, "id": f"expire-{run_id}", "run": run_id, "publish": "bench"})
            started = time.perf_counter()
            world.queue.accept(world.config.default_queue, "bench-expiry", body, 1, esm=True)
            counter.duration(time.perf_counter() - started, pricing.memory_mb, kind="expiry")
        finally:
            ids.utcnow = real  # type: ignore[misc]
        counter.record(SQS_REQUESTS, "ReceiveMessage (expiry, 1/10 batch)", "workflow-tasks", 0.1)
        counter.record(SQS_REQUESTS, "DeleteMessageBatch (expiry, 1/10 batch)", "workflow-tasks", 0.1)
        counter.record(LAMBDA_REQUESTS, "Invoke (expiry, 1/10 batch)", "queue handler", 0.1)


def measure_workflows(
    server: Any, shapes: list[Shape], *, batch: int = 10, pricing: Pricing | None = None
) -> list[Measured]:
    """Runs each shape's workflows one after another, ``batch`` runs per fresh table: moto copies the whole table
    for every transaction (and keeps the copies), so a long run on one table slows down and grows without bound.
    Before a table is dropped, its runs' retention is counted (:func:`expire`)."""
    import boto3

    from celery_workflow.aws_lambda import queue_handler

    pricing = pricing or Pricing()
    plain = boto3.client("dynamodb", endpoint_url=server.endpoint, region_name=REGION)
    results = []
    keep = timedelta(days=pricing.retention_days) if pricing.retention_days > 0 else None
    with _aws(server.endpoint, keep) as (counter, wf, aws):
        handler = queue_handler(wf)
        poll = _event_source_mapping(aws["sqs"], aws["queue_url"], aws["queue_arn"], counter, pricing.memory_mb)
        for shape in shapes:
            counter.reset()
            started = time.perf_counter()
            ended: list[str] = []
            for i in range(shape.runs):
                if i and i % batch == 0:
                    if keep is not None:
                        expire(counter, wf, plain, ended, pricing)
                    ended = []
                    server.reset()
                    _provision(server.endpoint)
                    counter.forget()
                run = wf.start(shape.name)
                deadline = time.monotonic() + 60
                while not run.status.terminal:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"a {shape.name} run did not finish in 60 s")
                    poll(handler)
                if run.status.value != "completed":
                    raise RuntimeError(f"a {shape.name} run ended {run.status.value}")
                ended.append(run.id)
            if keep is not None:
                expire(counter, wf, plain, ended, pricing)
            results.append(Measured(shape, counter.usage(), time.perf_counter() - started))
    return results


def measure_idle_worker(endpoint: str, seconds: float, wait: float) -> float:
    """SQS requests an hour of an idle worker's SQS transport consuming the default queue, ``wait`` s long polls:
    the counted requests between the first and the last completed poll, over the time between them."""
    from kombu import Connection, Consumer, Queue

    from celery_workflow.aws_costs import SQS_REQUESTS

    with _aws(endpoint) as (counter, wf, aws):
        polls: list[tuple[float, float]] = []  # (when a poll ended, requests counted by then)

        def ended(**_: Any) -> None:
            polls.append((time.monotonic(), counter.usage().total(SQS_REQUESTS)))

        aws["sqs"].meta.events.register_last("after-call.sqs.ReceiveMessage", ended)
        connection = Connection(
            "aws://",
            transport="celery_workflow.transport.sqs:Transport",
            transport_options={"world": wf.world, "wait_time_seconds": wait},
        )
        with connection:
            channel = connection.channel()
            consumer = Consumer(channel, [Queue("celery")], callbacks=[lambda body, message: message.ack()])
            consumer.qos(prefetch_count=4)
            consumer.consume()
            started = time.monotonic()
            while time.monotonic() - started < seconds or len(polls) < 3:
                try:
                    connection.drain_events(timeout=1.0)
                except TimeoutError:
                    pass
    (first, before), (last, after) = polls[0], polls[-1]
    return (after - before) * 3600 / (last - first)


def _fmt(value: float) -> str:
    return f"{value:.2f}" if value < 100 else f"{value:,.0f}"


def report(results: list[Measured], idle: dict[float, float], pricing: Pricing | None = None) -> str:
    from celery_workflow.aws_costs import (
        DURABLE_OPERATION,
        INDEX_WRITE_UNITS,
        LAMBDA_GB_SECONDS,
        LAMBDA_REQUESTS,
        PITR_GB_MONTHS,
        PRICES,
        READ_UNITS,
        SCHEDULER_INVOCATIONS,
        SQS_FIFO_REQUESTS,
        SQS_REQUESTS,
        STEP_FUNCTIONS_EXPRESS_GB_SECOND,
        STEP_FUNCTIONS_EXPRESS_REQUEST,
        STEP_FUNCTIONS_TRANSITION,
        STORAGE_GB_MONTHS,
        WRITE_UNITS,
    )

    pricing = pricing or Pricing()
    units = [
        (WRITE_UNITS, "WRU"),
        (INDEX_WRITE_UNITS, "index WRU"),
        (READ_UNITS, "RRU"),
        (SQS_REQUESTS, "SQS req"),
        (SQS_FIFO_REQUESTS, "SQS FIFO req"),
        (SCHEDULER_INVOCATIONS, "Scheduler"),
        (LAMBDA_REQUESTS, "Lambda req"),
        (LAMBDA_GB_SECONDS, "Lambda GB-s"),
        (STORAGE_GB_MONTHS, "storage"),
        (PITR_GB_MONTHS, "PITR"),
    ]
    memory_gb = pricing.memory_mb / 1024
    lines = [
        f"Assumed: worker Lambda {pricing.memory_mb} MB (x86), runs kept {pricing.retention_days:g} days"
        f" (AWSConfig.retention), items with a time to live stored {pricing.ttl_delay_days:g} days past it,"
        f" point-in-time recovery {'on' if pricing.pitr else 'off'}.",
        "",
        "Dollars per million steps, all-in (counted, then divided by the steps run):",
        "",
    ]
    lines.append("| workflow | runs | " + " | ".join(label for _, label in units) + " | **all-in** |")
    lines.append("| --- | ---: | " + " | ".join("---:" for _ in units) + " | ---: |")
    for m in results:
        per = m.usage.scaled(1e6 / m.steps).dollars()
        cells = " | ".join(f"{per.get(unit, 0.0):.2f}" for unit, _ in units)
        lines.append(f"| {m.shape.steps}-step | {m.shape.runs} | {cells} | **{sum(per.values()):.2f}** |")
    lines += ["", "Beside AWS's durable options ($ per million steps; see the notes below the table):", ""]
    lines.append("| workflow | ours | SFN Standard | SFN Express | Lambda durable functions | target | met? |")
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    targets = {1: 10.0, 10: 3.50}
    for m in results:
        n = m.shape.steps
        ours = m.usage.cost() * 1e6 / m.steps
        step_seconds = m.usage.total(LAMBDA_GB_SECONDS) / memory_gb / m.steps  # our worker's time per step
        noop = 0.001 * memory_gb * PRICES[LAMBDA_GB_SECONDS]  # a Task state's Lambda running the step: 1 ms billed
        lambda_task = PRICES[LAMBDA_REQUESTS] + noop
        standard = (STEP_FUNCTIONS_TRANSITION + lambda_task) * 1e6
        express = (STEP_FUNCTIONS_EXPRESS_REQUEST / n + 0.1 * 64 / 1024 * STEP_FUNCTIONS_EXPRESS_GB_SECOND) * 1e6
        express += lambda_task * 1e6
        durable = (DURABLE_OPERATION + PRICES[LAMBDA_REQUESTS] / n) * 1e6
        durable += step_seconds * memory_gb * PRICES[LAMBDA_GB_SECONDS] * 1e6
        target = targets.get(n)
        met = "" if target is None else ("yes" if ours <= target else "**no**")
        lines.append(
            f"| {n}-step | **{ours:.2f}** | {standard:.2f} | {express:.2f} | {durable:.2f} |"
            f" {'' if target is None else f'{target:.2f}'} | {met} |"
        )
    lines += [
        "",
        "- SFN Standard: one state transition per step and the Lambda its Task state invokes (request, 1 ms).",
        "- SFN Express: one request per workflow, 100 ms of execution per step at 64 MB (its billing minimum), and",
        "  the Task state's Lambda; Express runs at most 5 minutes and is at-least-once (not durable across that).",
        "- Lambda durable functions: one durable operation per step ($8.00 per million), one invocation per",
        "  workflow, and our worker's measured duration per step for the function's own; their data retention",
        "  charges are left out (a lower bound).",
    ]
    for m in results:
        lines += ["", f"Where the {m.shape.steps}-step workflow's money goes (per step, the costliest first):", ""]
        lines.append("| unit | call | item kind / queue | per step | $ / M steps |")
        lines.append("| --- | --- | --- | ---: | ---: |")
        for unit, op, kind, amount, dollars in m.usage.scaled(1 / m.steps).breakdown()[:18]:
            lines.append(f"| {unit} | {op} | {kind} | {amount:.3g} | {dollars * 1e6:.2f} |")
    estimated = sum(m.usage.estimated for m in results)
    lines += ["", f"Calls whose units were estimated: {estimated}.", ""]
    lines.append("An idle Celery worker on the SQS transport, consuming one queue (requests per hour, $ per month):")
    lines.append("")
    for wait, per_hour in sorted(idle.items()):
        month = per_hour * 24 * 30 * PRICES[SQS_REQUESTS]
        lines.append(
            f"- `wait_time_seconds={wait:g}`: {per_hour:,.0f} requests/hour"
            f" (3600 / {wait:g} = {3600 / wait:,.0f} expected), ${month:.2f} per queue per month"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.aws_costs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="runs of the 1-step workflow (10-step: a fifth)")
    parser.add_argument("--idle-seconds", type=float, default=60.0, help="how long to count an idle worker")
    parser.add_argument("--memory", type=int, default=128, help="the worker Lambda's memory (MB)")
    parser.add_argument(
        "--retention-days", type=float, default=30.0, help="how long ended runs are kept (0: for good, uncounted)"
    )
    parser.add_argument("--no-pitr", action="store_true", help="without point-in-time recovery")
    args = parser.parse_args(argv)
    pricing = Pricing(args.memory, args.retention_days, pitr=not args.no_pitr)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    from celery_workflow.testing.moto_server import MotoServer

    server = MotoServer()
    try:
        shapes = [Shape("one_step", 1, args.runs), Shape("ten_steps", 10, max(1, args.runs // 5))]
        results = measure_workflows(server, shapes, pricing=pricing)
        idle = {}
        for wait in (5.0, 20.0):
            server.reset()
            idle[wait] = measure_idle_worker(server.endpoint, args.idle_seconds, wait)
    finally:
        server.stop()
    print(report(results, idle, pricing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
