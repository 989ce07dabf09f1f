"""The "SQS re-drive with Step Functions" use case, as one workflow.

The state machine: start a message move task from a dead-letter queue back to its source (StartMessageMoveTask),
then loop — wait, check the move's status (ListMessageMoveTasks), and choose: COMPLETED → succeed; RUNNING → wait
again; no task found → "UNKNOWN" success; anything else → fail. Here that loop is a plain ``while`` with a durable
``sleep``; the two Lambdas are steps (retried on throttling by the step's retry policy); the Fail state is a
``FatalError``. No 5-minute EXPRESS limit applies: a sleep may last hours.

    celery -A examples.sqs_redrive worker
    python -c "from examples.sqs_redrive import redrive; print(redrive.start('arn:aws:sqs:…:sample-dlq').result())"
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from celery_workflow import FatalError, Workflows, sleep

celery_app = Celery("sqs_redrive")
wf = Workflows(celery_app)
POLL_SECONDS = float(os.environ.get("REDRIVE_POLL_SECONDS", "10"))
MAX_CHECKS = 360


def sqs_client() -> Any:
    import boto3

    return boto3.client("sqs")


@wf.step(max_retries=5)
def start_redrive(queue_arn: str) -> dict[str, str]:
    out = sqs_client().start_message_move_task(SourceArn=queue_arn)
    return {"queueArn": queue_arn, "status": "INITIATED", "taskHandle": out.get("TaskHandle", "")}


@wf.step(max_retries=5)
def redrive_status(queue_arn: str) -> str:
    results = sqs_client().list_message_move_tasks(SourceArn=queue_arn, MaxResults=1).get("Results", [])
    return str(results[0]["Status"]) if results else "NOT_FOUND"


@wf.workflow
def redrive(queue_arn: str) -> dict[str, str]:
    started = start_redrive(queue_arn)
    for _ in range(MAX_CHECKS):
        sleep(POLL_SECONDS)  # the Wait state
        status = redrive_status(queue_arn)
        if status == "COMPLETED":
            return {**started, "status": "COMPLETED"}
        if status == "NOT_FOUND":
            return {**started, "status": "UNKNOWN"}
        if status != "RUNNING":
            raise FatalError(f"redrive of {queue_arn} ended {status}")
    raise FatalError(f"redrive of {queue_arn} still running after {MAX_CHECKS} checks")
