"""``python -m bench.aws_costs``: what a durable step costs on AWS, beside Step Functions Standard.

Runs workflows of 1 and 10 no-op steps on the AWS World against a moto server in this process, the way the Lambda
deployment runs them: an SQS event source mapping (simulated: ``ReceiveMessage`` batches of up to 10, then
``DeleteMessageBatch`` of what succeeded, as Lambda does with ``ReportBatchItemFailures``) invokes
:func:`celery_workflow.aws_lambda.queue_handler`. Every DynamoDB, SQS and Scheduler call goes through a
:class:`celery_workflow.aws_costs.CostCounter`, which computes units by AWS's sizing rules (moto's own
``ReturnConsumedCapacity`` is not faithful). Then an idle Celery worker's receiving (the SQS transport, consuming
the default queue) is counted for ``--idle-seconds`` at two long-poll lengths and scaled to an hour.

It prints, per step: write units (table, transactions doubled), index write units, read units, SQS requests,
Scheduler invocations and Lambda requests, their dollars per million steps at us-east-1 on-demand list prices, the
ratio to Step Functions Standard (one state transition per step, plus the Lambda request its Task state makes), and
where the units of the 10-step workflow go. Needs ``pip install -e '.[test]'`` (boto3, moto).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

REGION = "us-east-1"
TABLE = "workflow"
ROLE_ARN = "arn:aws:iam::123456789012:role/celery-workflow-scheduler"


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
    packed_event_units: float  # the write units of the same events, one item per transaction

    @property
    def steps(self) -> int:
        return self.shape.steps * self.shape.runs


class EventPacking:
    """Watches the World's transactions and prices their events as if each transaction wrote them as one item (an
    ``EVENTS#<first slot>`` item holding the append's events): the projection of a layout that would cost less."""

    def __init__(self) -> None:
        self.units = 0.0

    def attach(self, client: Any) -> None:
        client.meta.events.register("provide-client-params.dynamodb.TransactWriteItems", self._seen)

    def _seen(self, params: dict[str, Any], **_: Any) -> None:
        from celery_workflow._aws.billing import write_units
        from celery_workflow._aws.items import item_size

        sizes = [
            item_size(body["Item"])
            for entry in params.get("TransactItems", [])
            for action, body in entry.items()
            if action == "Put" and body["Item"].get("sk", {}).get("S", "").startswith("EVENT#")
        ]
        if sizes:
            key_overhead = 40  # the repeated pk/sk of all but one event, roughly
            self.units += write_units(sum(sizes) - key_overhead * (len(sizes) - 1), transactional=True)


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
def _aws(endpoint: str) -> Iterator[tuple[Any, Any, dict[str, Any]]]:
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


def _event_source_mapping(sqs: Any, queue_url: str, queue_arn: str, counter: Any) -> Callable[[Any], int]:
    """One poll of a simulated SQS event source mapping: receive a batch, invoke the handler, delete what succeeded."""
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
        failed = {f["itemIdentifier"] for f in handler({"Records": records}, Context())["batchItemFailures"]}
        done = [r for r in records if r["messageId"] not in failed]
        if done:
            entries = [{"Id": str(i), "ReceiptHandle": r["receiptHandle"]} for i, r in enumerate(done)]
            sqs.delete_message_batch(QueueUrl=queue_url, Entries=entries)
        return len(messages)

    return poll


def measure_workflows(server: Any, shapes: list[Shape], *, batch: int = 10) -> list[Measured]:
    """Runs each shape's workflows one after another, ``batch`` runs per fresh table: moto copies the whole table
    for every transaction (and keeps the copies), so a long run on one table slows down and grows without bound."""
    from celery_workflow.aws_lambda import queue_handler

    results = []
    with _aws(server.endpoint) as (counter, wf, aws):
        handler = queue_handler(wf)
        poll = _event_source_mapping(aws["sqs"], aws["queue_url"], aws["queue_arn"], counter)
        packing = EventPacking()
        packing.attach(aws["dynamodb"])
        for shape in shapes:
            counter.reset()
            packing.units = 0.0
            started = time.perf_counter()
            for i in range(shape.runs):
                if i and i % batch == 0:
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
            results.append(Measured(shape, counter.usage(), time.perf_counter() - started, packing.units))
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


def report(results: list[Measured], idle: dict[float, float]) -> str:
    from celery_workflow.aws_costs import (
        INDEX_WRITE_UNITS,
        LAMBDA_REQUESTS,
        PRICES,
        READ_UNITS,
        SCHEDULER_INVOCATIONS,
        SQS_FIFO_REQUESTS,
        SQS_REQUESTS,
        STEP_FUNCTIONS_TRANSITION,
        WRITE_UNITS,
    )

    units = [
        (WRITE_UNITS, "WRU"),
        (INDEX_WRITE_UNITS, "index WRU"),
        (READ_UNITS, "RRU"),
        (SQS_REQUESTS, "SQS req"),
        (SQS_FIFO_REQUESTS, "SQS FIFO req"),
        (SCHEDULER_INVOCATIONS, "Scheduler"),
        (LAMBDA_REQUESTS, "Lambda req"),
    ]
    lines = ["Per durable step (counted, then divided by the steps run):", ""]
    lines.append(
        "| workflow | runs | " + " | ".join(label for _, label in units) + " | $ / M steps | SFN $ / M | ratio |"
    )
    lines.append("| --- | ---: | " + " | ".join("---:" for _ in units) + " | ---: | ---: | ---: |")
    step_functions = (STEP_FUNCTIONS_TRANSITION + PRICES[LAMBDA_REQUESTS]) * 1e6
    for m in results:
        per = m.usage.scaled(1 / m.steps)
        dollars = per.cost() * 1e6
        cells = " | ".join(_fmt(per.total(unit)) for unit, _ in units)
        lines.append(
            f"| {m.shape.steps}-step | {m.shape.runs} | {cells} | **{dollars:.2f}** | {step_functions:.2f} |"
            f" {step_functions / dollars:.1f}x |"
        )
    lines += ["", "Dollars per million steps by service:", ""]
    lines.append("| workflow | " + " | ".join(label for _, label in units) + " | all-in |")
    lines.append("| --- | " + " | ".join("---:" for _ in units) + " | ---: |")
    for m in results:
        per = m.usage.scaled(1e6 / m.steps).dollars()
        cells = " | ".join(f"{per.get(unit, 0.0):.2f}" for unit, _ in units)
        lines.append(f"| {m.shape.steps}-step | {cells} | {sum(per.values()):.2f} |")
    for m in results:
        lines += ["", f"Where the units of the {m.shape.steps}-step workflow go (per step, the costliest first):", ""]
        lines.append("| unit | call | item kind / queue | per step | $ / M steps |")
        lines.append("| --- | --- | --- | ---: | ---: |")
        for unit, op, kind, amount, dollars in m.usage.scaled(1 / m.steps).breakdown()[:12]:
            lines.append(f"| {unit} | {op} | {kind} | {amount:.2f} | {dollars * 1e6:.2f} |")
    lines += ["", "What other item layouts would cost (projected from the same calls; $ per million steps):", ""]
    lines.append("| workflow | seed layout (measured) | events of an append in one item | and no step items |")
    lines.append("| --- | ---: | ---: | ---: |")
    for m in results:
        counts = m.usage.counts
        event_units = sum(a for (u, op, k), a in counts.items() if u == WRITE_UNITS and k == "RUN/EVENT")
        packed = m.usage.cost() - (event_units - m.packed_event_units) * PRICES[WRITE_UNITS]
        step_cost = sum(a * PRICES[u] for (u, op, k), a in counts.items() if k == "RUN/STEP")
        per = 1e6 / m.steps
        lines.append(
            f"| {m.shape.steps}-step | {m.usage.cost() * per:.2f} | {packed * per:.2f} | {(packed - step_cost) * per:.2f} |"
        )
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
    args = parser.parse_args(argv)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    from celery_workflow.testing.moto_server import MotoServer

    server = MotoServer()
    try:
        shapes = [Shape("one_step", 1, args.runs), Shape("ten_steps", 10, max(1, args.runs // 5))]
        results = measure_workflows(server, shapes)
        idle = {}
        for wait in (5.0, 20.0):
            server.reset()
            idle[wait] = measure_idle_worker(server.endpoint, args.idle_seconds, wait)
    finally:
        server.stop()
    print(report(results, idle))
    return 0


if __name__ == "__main__":
    sys.exit(main())
