"""AWS test fixtures: a real moto server on loopback, boto3 clients pointed at it, and an AWS World on a fresh table.

Import the fixture functions into a test module (pytest finds them by their ``name``)::

    from tests.integration.aws_fixtures import aws_fixture, moto_fixture  # noqa: F401

* ``moto``: the session's moto server (:class:`celery_workflow.testing.moto_server.MotoServer`: moto's WSGI app on
  127.0.0.1 and a free port, DynamoDB requests served one at a time). Its state is reset before each test that uses
  ``aws``.
* ``aws``: an :class:`Aws` with boto3 clients (fixed test credentials, ``us-east-1``), the table and the default
  queue created, and helpers: ``world(**config)`` builds an AWS World on them, ``queue(name, fifo=…)`` creates a
  queue, and ``fire_due_schedules()`` does what moto's Scheduler never does (it stores schedules but never runs them):
  it sends each due schedule's input to its target queue and deletes the schedule, as ``ActionAfterCompletion=DELETE``
  would.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import boto3
import pytest

from celery_workflow.testing.moto_server import MotoServer
from celery_workflow.world_sqs import AWSConfig, AWSWorld, QueueConfig, SchedulerConfig, create_table

REGION = "us-east-1"
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": REGION}
ROLE_ARN = "arn:aws:iam::123456789012:role/celery-workflow-scheduler"
TABLE = "workflow"


@pytest.fixture(name="moto", scope="session")
def moto_fixture() -> Iterator[str]:
    with MotoServer() as endpoint:
        yield endpoint


@dataclass
class Aws:
    endpoint: str
    dynamodb: Any
    sqs: Any
    scheduler: Any
    queue_url: str
    queue_arn: str
    queues: dict[str, QueueConfig] = field(default_factory=dict)

    def client(self, service: str) -> Any:
        return boto3.client(service, endpoint_url=self.endpoint, **CREDENTIALS)

    def queue(self, name: str, *, fifo: bool = False) -> QueueConfig:
        attributes = {"FifoQueue": "true", "ContentBasedDeduplication": "true"} if fifo else {}
        url = self.sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
        arn = self.sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        return QueueConfig(url, arn, fifo)

    def config(self, **overrides: Any) -> AWSConfig:
        settings: dict[str, Any] = {
            "base_url": "https://workflows.example.com/v1/workflow",
            "table_name": TABLE,
            "queue_url": self.queue_url,
            "queues": self.queues,
            "scheduler": SchedulerConfig(self.scheduler, self.queue_arn, ROLE_ARN),
            "poll_interval": 0.05,
        }
        settings.update(overrides)
        return AWSConfig(**settings)

    def world(self, **overrides: Any) -> AWSWorld:
        return AWSWorld(self.config(**overrides), self.dynamodb, self.sqs)

    def schedules(self, group: str = "default") -> list[dict[str, Any]]:
        names = [s["Name"] for s in self.scheduler.list_schedules(GroupName=group).get("Schedules", [])]
        return [self.scheduler.get_schedule(Name=n, GroupName=group) for n in names]

    def fire_due_schedules(self, now: datetime | None = None, group: str = "default") -> int:
        """Run the due schedules as EventBridge Scheduler would (moto never does): send the input to the target
        queue (with the FIFO message group), then delete the schedule. Returns how many fired."""
        moment = now or datetime.now(UTC)
        fired = 0
        for schedule in self.schedules(group):
            expression = schedule["ScheduleExpression"]
            at = datetime.fromisoformat(expression[len("at(") : -1]).replace(tzinfo=UTC)
            if at > moment:
                continue
            target = schedule["Target"]
            name = target["Arn"].rsplit(":", 1)[-1]
            url = self.sqs.get_queue_url(QueueName=name)["QueueUrl"]
            kwargs: dict[str, Any] = {"QueueUrl": url, "MessageBody": target["Input"]}
            group_id = (target.get("SqsParameters") or {}).get("MessageGroupId")
            if group_id:
                kwargs["MessageGroupId"] = group_id
            self.sqs.send_message(**kwargs)
            self.scheduler.delete_schedule(Name=schedule["Name"], GroupName=group)
            fired += 1
        return fired


@pytest.fixture(name="aws")
def aws_fixture(moto: str) -> Aws:
    """Fresh moto state: the World's table and its default queue."""
    urllib.request.urlopen(urllib.request.Request(f"{moto}/moto-api/reset", method="POST"), timeout=10).close()
    dynamodb = boto3.client("dynamodb", endpoint_url=moto, **CREDENTIALS)
    sqs = boto3.client("sqs", endpoint_url=moto, **CREDENTIALS)
    scheduler = boto3.client("scheduler", endpoint_url=moto, **CREDENTIALS)
    create_table(dynamodb, TABLE, poll=0.05)
    url = sqs.create_queue(QueueName="workflow-tasks")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    return Aws(moto, dynamodb, sqs, scheduler, url, arn)


def summing_app(world: AWSWorld, name: str) -> Any:
    """A ``Workflows`` on ``world`` with the step ``add`` and the workflow ``sum_of(n)``, which adds 0..n-1 through n
    inline steps (the kept-snapshot and batched-step tests count the World calls of its deliveries)."""
    from celery import Celery

    from celery_workflow import Workflows

    app = Workflows(Celery(name), world=world, broker="app")

    @app.step
    def add(a: int, b: int) -> int:
        return a + b

    @app.workflow
    def sum_of(n: int) -> int:
        total = 0
        for i in range(n):
            total = add(total, i)
        return total

    return app
