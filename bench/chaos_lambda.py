"""``python -m bench.chaos_lambda``: an SQS event source mapping and its Lambda function in one process, for the AWS
chaos run (``python -m bench.chaos --world aws --lambdas N``).

It receives batches of up to 10 messages from the World's task queue (``WORKFLOW_QUEUE_URL``) as the mapping does,
and invokes :func:`celery_workflow.aws_lambda.queue_handler` of ``bench.chaos_app``'s ``wf`` on each in a forked
child with a context whose deadline is ``CW_LAMBDA_DEADLINE`` seconds (short, so the handler's halfway hand-off and
its inline budget are exercised). A child still running at the deadline is SIGKILLed, as Lambda ends a timed-out
invocation (logged ``timeout`` in ``$CW_CHAOS_DIR/faults.log``); its batch comes back after the visibility timeout.
Messages the handler did not report as failed are deleted, as the mapping deletes them. Faults of
:mod:`bench.aws_faults` apply (``CW_AWS_FAULTS``: the chaos app installs them; the poller's own receives get the
``dup`` fault, as SQS duplicates reach a mapping too).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

#: Messages per invocation (the mapping's batch size).
BATCH = 10


class Context:
    """The part of Lambda's context object the handler reads: the time left before the deadline."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self.deadline - time.monotonic()) * 1000))


def record(message: dict[str, Any], arn: str, region: str) -> dict[str, Any]:
    """An SQS event record of a received message, as Lambda builds it."""
    return {
        "messageId": message["MessageId"],
        "receiptHandle": message["ReceiptHandle"],
        "body": message["Body"],
        "attributes": dict(message.get("Attributes") or {}),
        "messageAttributes": {},
        "eventSource": "aws:sqs",
        "eventSourceARN": arn,
        "awsRegion": region,
    }


def invoke(handler: Any, event: dict[str, Any], deadline: float) -> tuple[str, set[str]]:
    """Run ``handler(event, context)`` in a forked child within ``deadline`` seconds: ``("ok", ids of the failed
    messages)``, ``("timeout", …)`` when the child was still running at the deadline (it is SIGKILLed), or
    ``("crash", …)`` when it died or raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the invocation
        os.close(read)
        code = 0
        try:
            result = handler(event, Context(deadline))
            os.write(write, json.dumps([f["itemIdentifier"] for f in result["batchItemFailures"]]).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    ends = time.monotonic() + deadline
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() >= ends:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read)
            return "timeout", set()
        time.sleep(0.01)
    with os.fdopen(read, "rb") as pipe:
        out = pipe.read()
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0 or not out:
        return "crash", set()
    return "ok", set(json.loads(out))


def main() -> int:
    import boto3

    from bench import chaos_app
    from bench.aws_faults import ENV, install_dups, record_fault
    from celery_workflow.aws_lambda import queue_handler

    deadline = float(os.environ.get("CW_LAMBDA_DEADLINE", "3"))
    visibility = max(1, round(float(os.environ.get("CW_LEASE", "2"))))
    url = os.environ["WORKFLOW_QUEUE_URL"]
    region = os.environ.get("AWS_DEFAULT_REGION", "us-east-1")
    handler = queue_handler(chaos_app.wf, extend_every=max(0.5, deadline / 4), extend_to=visibility)
    sqs = boto3.session.Session().client("sqs")  # the mapping's own client: of the faults, only SQS's duplicates
    if os.environ.get(ENV):
        install_dups(sqs, os.environ[ENV], Path(os.environ.get("CW_CHAOS_DIR", "/tmp")) / "faults.log")
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    print("lambda poller ready.", flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    while not stop:
        got = sqs.receive_message(
            QueueUrl=url,
            MaxNumberOfMessages=BATCH,
            WaitTimeSeconds=1,
            VisibilityTimeout=visibility,
            AttributeNames=["All"],
        )
        messages = got.get("Messages", [])
        if not messages:
            continue
        outcome, failed = invoke(handler, {"Records": [record(m, arn, region) for m in messages]}, deadline)
        if outcome != "ok":
            record_fault(outcome, "Invoke")  # the batch comes back after its visibility timeout
            continue
        for m in messages:
            if m["MessageId"] not in failed:
                with contextlib.suppress(Exception):
                    sqs.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
    print("lambda poller stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
