"""The "SQS re-drive with Golang and Step Functions" use case, as one workflow.

A dead-letter queue (``sample-dlq``) collects what the Processor Lambda failed on ``sample``; the state machine moves
those messages back with SQS's message move task API. Its states and what they are here:

=================================  ====================================================================================
Step Functions                     Python
=================================  ====================================================================================
execution input / ``Payload``      ``redrive.start({"queueArn": "arn:aws:sqs:…:sample-dlq"})``; steps pass
                                   ``{"queueArn": …, "status": …}`` dicts, as the Lambdas do
Start Re-drive (Lambda)            step ``start_redrive``: ``StartMessageMoveTask(SourceArn=queueArn)``
Wait for Redrive (Wait)            ``sleep(POLL_SECONDS)``: durable (``REDRIVE_POLL_SECONDS``, default 10 s); no worker
                                   waits and no 5-minute EXPRESS limit applies
Redrive status check (Lambda)      step ``redrive_status``: ``ListMessageMoveTasks(SourceArn, MaxResults=1)`` → the
                                   newest task's ``Status``, or ``NOT_FOUND`` when the queue has none
Redrive Status (Choice)            the ``if`` chain in ``redrive``, looping back to the sleep while ``RUNNING``
Success / unknown success          ``return {…, "status": "COMPLETED"}`` / ``{…, "status": "UNKNOWN"}``
Fail                               ``raise FatalError(…)``: the run fails with the status (and ``FailureReason``)
Processor (Lambda, env ``FAIL``)   ``processor(event, context)``; ``python -m examples.sqs_redrive process`` runs it
                                   against the queue
=================================  ====================================================================================

NOT_FOUND versus UNKNOWN: the seed's check Lambda returns ``"NOT_FOUND"`` when the queue has no move task, but its
Choice only knows ``"UNKNOWN"``, so taken literally NOT_FOUND would fall into Fail. We follow the author's stated
intent ("if there are no MOVE tasks on the DLQ, I can just indicate that"): no task → the run succeeds with status
``UNKNOWN``.

Starting is idempotent: SQS allows one active move task per queue, so a task already ``RUNNING`` on the DLQ counts
as started (the step lists before it starts, and reads the "already a task running" error the same way), so a
retried step never starts a second task while the first runs. A step is retried (``max_retries=5``) on the errors that
pass (throttling, SQS's own failures: :data:`TRANSIENT`, and any error that is not SQS's answer); any other error SQS
answers (no such queue, a malformed ARN, access denied, a move task the queue does not support) is permanent and fails
the step at once, as it fails the state machine's execution at once. A run checks at most ``MAX_CHECKS`` times (its
bound, where EXPRESS has 5 minutes) and then fails, still ``RUNNING``.

    python -m examples.sqs_redrive setup                     # creates `sample` and `sample-dlq`; prints URLs and ARNs
    python -m examples.sqs_redrive send --queue-url URL      # aws sqs send-message … --message-body "Hello World"
    FAIL=true python -m examples.sqs_redrive process --queue-url URL   # fails until SQS has moved them to the DLQ
    celery -A examples.sqs_redrive worker                    # from the repository root
    python -m examples.sqs_redrive start '{"queueArn": "arn:aws:sqs:…:sample-dlq"}' --wait 300
    python -m examples.sqs_redrive process --queue-url URL   # FAIL unset: consumes the re-driven messages

boto3 takes the region, credentials and endpoint (``AWS_ENDPOINT_URL``, ``AWS_ENDPOINT_URL_SQS``) from the
environment; the World from ``$CELERY_WORKFLOW_URL`` (unset: embedded SQLite).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, NoReturn

import boto3
from botocore.exceptions import ClientError
from celery import Celery

from celery_workflow import FatalError, Workflows, sleep

celery_app = Celery("sqs_redrive")
wf = Workflows(celery_app)
POLL_SECONDS = float(os.environ.get("REDRIVE_POLL_SECONDS", "10"))
MAX_CHECKS = 360

Payload = dict[str, str]  # the seed's Payload: {"queueArn": …, "status": …}, plus "taskHandle" / "failureReason"


#: SQS error codes worth retrying (throttling, the service's own failures); every other answer of SQS is permanent.
TRANSIENT = frozenset(
    {
        "ThrottlingException",
        "RequestThrottled",
        "ServiceUnavailable",
        "InternalError",
        "InternalFailure",
        "KmsThrottled",
    }
)


def error_code(exc: ClientError) -> str:
    """The error's code without the ``AWS.SimpleQueueService.`` prefix of SQS's query-compatible codes."""
    return str(exc.response.get("Error", {}).get("Code", "")).rsplit(".", 1)[-1]


def give_up_unless_transient(exc: ClientError, what: str) -> NoReturn:
    """Raise ``exc`` again for the step to be retried when it is :data:`TRANSIENT`, else fail the step at once."""
    if error_code(exc) in TRANSIENT:
        raise exc
    message = exc.response.get("Error", {}).get("Message", "")
    raise FatalError(f"{what}: {error_code(exc)}: {message}") from exc


def newest_move_task(sqs: Any, queue_arn: str) -> dict[str, Any] | None:
    try:
        answer = sqs.list_message_move_tasks(SourceArn=queue_arn, MaxResults=1)
    except ClientError as exc:
        give_up_unless_transient(exc, f"ListMessageMoveTasks of {queue_arn}")
    results: list[dict[str, Any]] = answer.get("Results", [])
    return results[0] if results else None


def running_task_handle(sqs: Any, queue_arn: str) -> str | None:
    task = newest_move_task(sqs, queue_arn)
    return str(task["TaskHandle"]) if task is not None and task["Status"] == "RUNNING" else None


@wf.step(max_retries=5)
def start_redrive(event: Payload) -> Payload:
    """The "Start Re-drive" Lambda: move the DLQ's messages back to their source queue (a task already running
    counts as started)."""
    sqs = boto3.client("sqs")
    handle = running_task_handle(sqs, event["queueArn"])
    if handle is None:
        try:
            handle = sqs.start_message_move_task(SourceArn=event["queueArn"])["TaskHandle"]
        except ClientError as exc:
            if error_code(exc) == "UnsupportedOperation":  # "There is already a task running": one started since
                handle = running_task_handle(sqs, event["queueArn"])
            if handle is None:
                give_up_unless_transient(exc, f"StartMessageMoveTask of {event['queueArn']}")
    return {"queueArn": event["queueArn"], "status": "INITIATED", "taskHandle": handle}


@wf.step(max_retries=5)
def redrive_status(event: Payload) -> Payload:
    """The "Redrive status check" Lambda: the newest move task's status, or NOT_FOUND."""
    task = newest_move_task(boto3.client("sqs"), event["queueArn"])
    if task is None:
        return {"queueArn": event["queueArn"], "status": "NOT_FOUND"}
    checked = {"queueArn": event["queueArn"], "status": task["Status"]}
    return checked | ({"failureReason": task["FailureReason"]} if task.get("FailureReason") else {})


@wf.workflow
def redrive(event: Payload) -> Payload:
    started = start_redrive(event)
    for _ in range(MAX_CHECKS):
        sleep(POLL_SECONDS)  # Wait for Redrive
        checked = redrive_status(event)
        if checked["status"] == "COMPLETED":
            return {**started, "status": "COMPLETED"}
        if checked["status"] == "NOT_FOUND":  # the Choice's "UNKNOWN" (see the module docstring)
            return {**started, "status": "UNKNOWN"}
        if checked["status"] != "RUNNING":  # FAILED, CANCELLING, CANCELLED
            reason = f" ({checked['failureReason']})" if "failureReason" in checked else ""
            raise FatalError(f"redrive of {event['queueArn']} ended {checked['status']}{reason}")
    raise FatalError(f"redrive of {event['queueArn']} still RUNNING after {MAX_CHECKS} checks")


# -- the Processor Lambda and the sample's queues -------------------------------------------------------------------


def parse_bool(value: str) -> bool:
    """Go's ``strconv.ParseBool`` as the seed uses it (an unparsable value is false)."""
    return value in ("1", "t", "T", "TRUE", "true", "True")


def processor(event: dict[str, Any], context: object = None) -> None:
    """The Processor Lambda for an SQS event: raising fails the batch, so its messages return to the queue and,
    after ``maxReceiveCount`` receives, SQS's redrive policy moves them to the DLQ."""
    print(f"handling {len(event.get('Records', []))} messages")
    if parse_bool(os.environ.get("FAIL", "")):
        raise RuntimeError("in failure mode")


def lambda_record(message: dict[str, Any], queue_arn: str) -> dict[str, Any]:
    """A received message as a record of Lambda's SQS event."""
    return {
        "messageId": message["MessageId"],
        "receiptHandle": message["ReceiptHandle"],
        "body": message["Body"],
        "attributes": message.get("Attributes", {}),
        "messageAttributes": message.get("MessageAttributes", {}),
        "md5OfBody": message["MD5OfBody"],
        "eventSource": "aws:sqs",
        "eventSourceARN": queue_arn,
        "awsRegion": queue_arn.split(":")[3],
    }


def in_flight(sqs: Any, queue_url: str) -> int:
    name = "ApproximateNumberOfMessagesNotVisible"
    return int(sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=[name])["Attributes"][name])


def process(queue_url: str, *, wait_seconds: int = 2, max_polls: int = 1000) -> int:
    """Run :func:`processor` as Lambda's SQS event source would: receive a batch, delete it when the processor
    returns, leave it to come back after the visibility timeout when it raises. Stops when the queue is empty (none
    visible, none in flight: in failure mode, once the redrive policy has moved them all to the DLQ); returns how
    many messages were processed."""
    sqs = boto3.client("sqs")
    arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    done = 0
    for _ in range(max_polls):
        messages = sqs.receive_message(
            QueueUrl=queue_url,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=wait_seconds,
            AttributeNames=["All"],
            MessageAttributeNames=["All"],
        ).get("Messages", [])
        if not messages:
            if in_flight(sqs, queue_url) == 0:
                break
            continue
        records = [lambda_record(m, arn) for m in messages]
        try:
            processor({"Records": records})
        except Exception as exc:
            print(f"batch of {len(records)} failed: {exc}")
            continue
        entries = [{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)]
        sqs.delete_message_batch(QueueUrl=queue_url, Entries=entries)
        done += len(messages)
    return done


def setup(name: str = "sample", max_receive_count: int = 3, visibility_timeout: int = 30) -> dict[str, str]:
    """Create (or update) the queue ``name`` and its dead-letter queue ``name-dlq``; their URLs and ARNs."""
    sqs = boto3.client("sqs")

    def arn_of(url: str) -> str:
        return str(sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"])

    dlq_url = sqs.create_queue(QueueName=f"{name}-dlq")["QueueUrl"]
    queue_url = sqs.create_queue(QueueName=name)["QueueUrl"]
    policy = {"deadLetterTargetArn": arn_of(dlq_url), "maxReceiveCount": str(max_receive_count)}
    attributes = {"RedrivePolicy": json.dumps(policy), "VisibilityTimeout": str(visibility_timeout)}
    sqs.set_queue_attributes(QueueUrl=queue_url, Attributes=attributes)
    return {
        "queueUrl": queue_url,
        "queueArn": arn_of(queue_url),
        "dlqUrl": dlq_url,
        "dlqArn": policy["deadLetterTargetArn"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.sqs_redrive")
    commands = parser.add_subparsers(dest="command", required=True)
    cmd = commands.add_parser("setup", help="create the sample queue and its dead-letter queue")
    cmd.add_argument("--name", default="sample")
    cmd.add_argument("--max-receive-count", type=int, default=3)
    cmd.add_argument("--visibility-timeout", type=int, default=30)
    cmd = commands.add_parser("send", help="put a message on a queue")
    cmd.add_argument("--queue-url", required=True)
    cmd.add_argument("--message-body", default="Hello World")
    cmd = commands.add_parser("process", help="run the Processor Lambda against a queue until it is empty")
    cmd.add_argument("--queue-url", required=True)
    cmd.add_argument("--wait-seconds", type=int, default=2, help="long poll of each receive")
    cmd = commands.add_parser("start", help="start the state machine; prints the run id")
    cmd.add_argument("input", help='{"queueArn": "arn:aws:sqs:…:sample-dlq"}')
    cmd.add_argument("--wait", type=float, metavar="SECONDS", help="wait for the run and print its result instead")
    args = parser.parse_args(argv)
    if args.command == "setup":
        print(json.dumps(setup(args.name, args.max_receive_count, args.visibility_timeout)))
    elif args.command == "send":
        sent = boto3.client("sqs").send_message(QueueUrl=args.queue_url, MessageBody=args.message_body)
        print(json.dumps({"MessageId": sent["MessageId"]}))
    elif args.command == "process":
        print(json.dumps({"processed": process(args.queue_url, wait_seconds=args.wait_seconds)}))
    else:
        run = redrive.start(json.loads(args.input))
        print(json.dumps(run.result(timeout=args.wait)) if args.wait is not None else run.id)


if __name__ == "__main__":
    main()
