"""The AWS World's resources made with boto3, named as the Terraform module names them (for emulators and trials).

:func:`provision` creates what ``terraform/`` creates for an AWS World, minus IAM and Lambda: the table (as
:func:`~celery_workflow._aws.table.create_table` makes it), the task queue ``<name>-tasks`` and each routed queue
``<name>-<key>`` (``.fifo`` for a FIFO queue, with content-based deduplication), each with its dead-letter queue
(``-dlq``, ``maxReceiveCount``), and with a Scheduler role ARN the schedule group ``<name>``. It returns the module's
``environment`` output for them (:meth:`~celery_workflow._aws.config.AWSConfig.from_env` reads it). Everything is
idempotent: what exists already is taken as it is.

It is the newcomer's path to an AWS World on an emulator (``celery-workflow provision``): ``terraform apply`` against
moto takes over a minute, this a second. For a real account use the Terraform module, which also makes the IAM
policies and the Scheduler's role.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from typing import Any

from celery_workflow.errors import ConfigurationError, WorldUnavailable

from .table import create_table

__all__ = ["provision", "wait_for_endpoint"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
_KEY = re.compile(r"^[A-Za-z0-9_-]{1,30}$")


def _check(name: str, queues: Mapping[str, bool]) -> None:
    """The Terraform module's rules for ``name`` and the queue keys, with its messages."""
    if not _NAME.match(name):
        raise ConfigurationError(
            f"name {name!r}: 1 to 40 letters, digits, hyphens or underscores (it is part of SQS queue names)"
        )
    for key in queues:
        if not _KEY.match(key) or key in ("celery", "tasks") or key.endswith("-dlq"):
            raise ConfigurationError(
                f"queue {key!r}: 1 to 30 letters, digits, hyphens or underscores, not ending in -dlq, and not"
                ' "celery" (the default queue) or "tasks" (the task queue\'s name)'
            )


def wait_for_endpoint(dynamodb: Any, timeout: float) -> None:
    """Wait until DynamoDB at ``dynamodb``'s endpoint answers (an emulator started a moment ago); WorldUnavailable
    naming the endpoint after ``timeout`` seconds."""
    from botocore.exceptions import BotoCoreError, ClientError

    deadline = time.monotonic() + timeout
    while True:
        try:
            dynamodb.list_tables(Limit=1)
            return
        except ClientError:
            return  # it answered (refusing is an answer: the calls that follow say why)
        except BotoCoreError as exc:
            if time.monotonic() >= deadline:
                endpoint = dynamodb.meta.endpoint_url
                raise WorldUnavailable(f"DynamoDB at {endpoint} does not answer after {timeout:.0f} s: {exc}") from exc
            time.sleep(0.2)


def provision(
    name: str,
    queues: Mapping[str, bool],
    *,
    dynamodb: Any,
    sqs: Any,
    scheduler: Any = None,
    scheduler_role_arn: str | None = None,
    max_receive_count: int = 10,
    visibility_timeout: int = 360,
    table_timeout: float = 300.0,
) -> dict[str, str]:
    """Create the World's table and queues (``queues``: routing name -> FIFO) and return its environment
    (``WORKFLOW_TABLE``, ``WORKFLOW_QUEUE_URL``, ``WORKFLOW_QUEUES`` and, with ``scheduler_role_arn``,
    ``WORKFLOW_QUEUE_ARN``, ``WORKFLOW_SCHEDULER_GROUP`` and ``WORKFLOW_SCHEDULER_ROLE_ARN``), as the module's
    ``environment`` output has them.

    ``dynamodb``, ``sqs`` and ``scheduler``: boto3 clients. A FIFO queue needs the Scheduler, as in the module."""
    _check(name, queues)
    if any(queues.values()) and not scheduler_role_arn:
        raise ConfigurationError("a FIFO queue needs the Scheduler (FIFO queues take no per-message delay)")
    if scheduler_role_arn and scheduler is None:
        raise ConfigurationError("scheduler_role_arn given without a scheduler client")
    create_table(dynamodb, name, timeout=table_timeout, poll=0.1)

    def queue(queue_name: str, fifo: bool) -> tuple[str, str]:
        fifo_attributes = {"FifoQueue": "true", "ContentBasedDeduplication": "true"} if fifo else {}
        suffix = ".fifo" if fifo else ""
        dlq_url = sqs.create_queue(QueueName=f"{queue_name}-dlq{suffix}", Attributes=fifo_attributes)["QueueUrl"]
        dlq_arn = _arn(sqs, dlq_url)
        attributes = {
            **fifo_attributes,
            "VisibilityTimeout": str(visibility_timeout),
            "RedrivePolicy": json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": max_receive_count}),
        }
        url = sqs.create_queue(QueueName=f"{queue_name}{suffix}", Attributes=attributes)["QueueUrl"]
        return url, _arn(sqs, url)

    tasks_url, tasks_arn = queue(f"{name}-tasks", False)
    routed = {}
    for key, fifo in queues.items():
        url, arn = queue(f"{name}-{key}", fifo)
        routed[key] = {"url": url, "arn": arn, "fifo": fifo}
    environment = {
        "WORKFLOW_TABLE": name,
        "WORKFLOW_QUEUE_URL": tasks_url,
        "WORKFLOW_QUEUES": json.dumps(routed),
    }
    if scheduler_role_arn:
        try:
            scheduler.create_schedule_group(Name=name)
        except scheduler.exceptions.ConflictException:
            pass  # it exists
        environment["WORKFLOW_QUEUE_ARN"] = tasks_arn
        environment["WORKFLOW_SCHEDULER_GROUP"] = name
        environment["WORKFLOW_SCHEDULER_ROLE_ARN"] = scheduler_role_arn
    return environment


def _arn(sqs: Any, url: str) -> str:
    return str(sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"])
