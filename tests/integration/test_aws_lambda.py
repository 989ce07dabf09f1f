"""The Lambda entry points on a real moto server: the SQS queue handler driving runs to completion from messages
received off the moto queues (in the event shape an event source mapping delivers), failures reported per message,
the half-deadline handoff; the HTTP handlers (both endpoints, the RPC alone, the webhooks alone) behind a Function URL
event."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_workflow import Workflows, create_hook, create_webhook, gather, sleep
from celery_workflow.aws_lambda import http_handler, queue_handler, retry_delay
from celery_workflow.events import EventType, RunStatus
from celery_workflow.testing._conformance import eventually
from tests.integration.aws_fixtures import REGION, Aws, aws_fixture, moto_fixture  # noqa: F401


class Context:
    """The part of a Lambda context the handler reads: the time left before the invocation's deadline."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self.deadline - time.monotonic()) * 1000))


def sqs_event(aws: Aws, *, visibility: int = 30, wanted: int = 10) -> dict[str, Any]:
    """What an SQS event source mapping hands a function: messages received off the World's default queue."""
    answer = aws.sqs.receive_message(
        QueueUrl=aws.queue_url,
        MaxNumberOfMessages=wanted,
        VisibilityTimeout=visibility,
        AttributeNames=["All"],
        MessageAttributeNames=["All"],
    )
    return {
        "Records": [
            {
                "messageId": m["MessageId"],
                "receiptHandle": m["ReceiptHandle"],
                "body": m["Body"],
                "attributes": m["Attributes"],
                "messageAttributes": m.get("MessageAttributes", {}),
                "md5OfBody": m["MD5OfBody"],
                "eventSource": "aws:sqs",
                "eventSourceARN": aws.queue_arn,
                "awsRegion": REGION,
            }
            for m in answer.get("Messages", [])
        ]
    }


def invoke(aws: Aws, handler: Any, event: dict[str, Any], context: Any) -> dict[str, Any]:
    """What an event source mapping does with ReportBatchItemFailures: invoke the handler with the batch, then delete
    the messages it did not report (one DeleteMessageBatch); the reported ones stay for SQS to deliver again."""
    answer: dict[str, Any] = handler(event, context)
    failed = {f["itemIdentifier"] for f in answer["batchItemFailures"]}
    done = [r for r in event["Records"] if r["messageId"] not in failed]
    if done:
        entries = [{"Id": str(i), "ReceiptHandle": r["receiptHandle"]} for i, r in enumerate(done)]
        aws.sqs.delete_message_batch(QueueUrl=aws.queue_url, Entries=entries)
    return answer


@pytest.fixture
def wf(aws: Aws) -> Iterator[Workflows]:
    app = Workflows(Celery("lambda-app"), world=aws.world(), broker="app")

    @app.step
    def double(n: int) -> int:
        return 2 * n

    @app.step
    def slow(seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @app.workflow
    def pipeline(n: int) -> dict[str, Any]:
        a = double(n)
        b, c = gather(double.start(a), double.start(a + 1))
        sleep(1)
        decision = create_hook(token=f"approve:{n}").wait()
        return {"a": a, "b": b, "c": c, "ok": decision["ok"]}

    @app.workflow
    def fan_out() -> int:
        return sum(gather(double.start(1), double.start(2)))

    @app.workflow
    def two_slow_steps(seconds: float) -> list[float]:
        return [slow(seconds), slow(seconds)]

    @app.workflow
    def callback() -> Any:
        hook = create_webhook(respond_with={"status": 201, "body": {"thanks": True}})
        double(1)  # the hook exists once this step has run
        return hook.wait().json()

    yield app
    app.close()


def drive(aws: Aws, handler: Any, until: Any, *, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Deliver the queue's messages to the handler, batch after batch, until ``until()``; the handler's answers."""
    answers = []
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "the runs did not finish"
        event = sqs_event(aws)
        if event["Records"]:
            answers.append(invoke(aws, handler, event, Context(60)))
        else:
            time.sleep(0.05)
    return answers


def test_the_queue_handler_runs_workflows_to_completion(aws: Aws, wf: Workflows) -> None:
    handler = queue_handler(wf)
    run = wf.start("pipeline", 3)
    answers = drive(aws, handler, lambda: wf.world.list_hooks(run.id) != [])
    wf.resume_hook("approve:3", {"ok": True})
    answers += drive(aws, handler, lambda: run.status.terminal)
    assert run.result() == {"a": 6, "b": 12, "c": 14, "ok": True}
    assert all(a == {"batchItemFailures": []} for a in answers)
    steps = {s.step_id: s for s in run.steps()}
    assert steps["step:double:2"].attempt == 1 and steps["step:double:3"].attempt == 1  # queued, each run once
    assert sqs_event(aws)["Records"] == []  # every message deleted
    assert not aws.dynamodb.scan(TableName="workflow", FilterExpression="begins_with(pk, :q)",
                                 ExpressionAttributeValues={":q": {"S": "QUEUE#"}})["Items"]  # fmt: skip


def test_the_event_source_mapping_deletes_the_messages_the_handler_ran(aws: Aws, wf: Workflows) -> None:
    """Under Lambda the handler deletes no message itself: the event source mapping deletes what the handler did not
    report, one DeleteMessageBatch per batch, so a DeleteMessage per delivery would be a second, paid delete of the
    same message (issue #31, item 1). Messages that are not ours, or whose record is gone, are left to it too."""
    deletes: list[str] = []
    aws.sqs.meta.events.register("before-call.sqs.DeleteMessage", lambda **_: deletes.append("DeleteMessage"))
    handler = queue_handler(wf)
    runs = [wf.start("two_slow_steps", 0.0), wf.start("fan_out")]
    aws.sqs.send_message(QueueUrl=aws.queue_url, MessageBody="{not json")
    aws.sqs.send_message(
        QueueUrl=aws.queue_url, MessageBody=json.dumps({"celery_workflow": 1, "id": "gone", "run": None})
    )
    answers = drive(aws, handler, lambda: all(r.status.terminal for r in runs))
    assert [r.result() for r in runs] == [[0.0, 0.0], 6]
    assert all(a == {"batchItemFailures": []} for a in answers)
    assert deletes == []
    assert sqs_event(aws, visibility=0)["Records"] == []  # the mapping deleted every one


def test_a_message_whose_delivery_failed_is_reported_and_not_deleted(
    aws: Aws, wf: Workflows, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delivery that fails after its append committed (here: SQS refuses the messages of the steps it queued) is
    reported in batchItemFailures and its message is not deleted, by the handler or the mapping: SQS delivers it
    again, and that delivery publishes what the run's outbox still lists, so the run completes (issue #31, item 1)."""
    from celery_workflow.errors import WorldUnavailable

    handler = queue_handler(wf)
    run = wf.start("fan_out")
    send = wf.world.queue.send  # type: ignore[attr-defined]

    def refused(*args: Any, **kwargs: Any) -> None:
        raise WorldUnavailable("SQS is away")

    monkeypatch.setattr(wf.world.queue, "send", refused)  # type: ignore[attr-defined]
    event = sqs_event(aws, visibility=1)
    (message,) = event["Records"]
    assert invoke(aws, handler, event, Context(60)) == {"batchItemFailures": [{"itemIdentifier": message["messageId"]}]}
    monkeypatch.setattr(wf.world.queue, "send", send)  # type: ignore[attr-defined]
    again = eventually(lambda: sqs_event(aws)["Records"] or None, timeout=10)
    assert [r["messageId"] for r in again] == [message["messageId"]]  # kept: delivered again
    assert invoke(aws, handler, {"Records": again}, Context(60)) == {"batchItemFailures": []}
    drive(aws, handler, lambda: run.status.terminal)
    assert run.result() == 6


def test_failures_are_reported_per_message_and_backed_off(aws: Aws, wf: Workflows) -> None:
    other = Workflows(Celery("other-app"), world=wf.world, broker="app")

    @other.workflow
    def unknown_here() -> int:
        return 1

    handler = queue_handler(wf)  # this app does not have unknown_here
    bad = other.start("unknown_here")
    good = wf.start("two_slow_steps", 0.0)
    event = sqs_event(aws)
    assert len(event["Records"]) == 2
    bad_message = next(r["messageId"] for r in event["Records"] if json.loads(r["body"])["run"] == bad.id)
    assert invoke(aws, handler, event, Context(60)) == {"batchItemFailures": [{"itemIdentifier": bad_message}]}
    drive(aws, handler, lambda: good.status.terminal)
    assert good.result() == [0.0, 0.0]
    assert retry_delay(1) == 1 and retry_delay(5) == 16 and retry_delay(50) == 900
    again = eventually(lambda: sqs_event(aws)["Records"] or None, timeout=10)  # backed off 1 s, then back
    assert again[0]["attributes"]["ApproximateReceiveCount"] == "2"


def test_a_failed_ack_is_reported_for_its_message_alone(
    aws: Aws, wf: Workflows, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception from the acknowledgement after a delivery ran fails that message alone (batchItemFailures), not
    the whole batch; the message comes back and its run completes (issue #27, item 5)."""
    from celery_workflow.errors import WorldUnavailable

    handler = queue_handler(wf)
    unlucky = wf.start("two_slow_steps", 0.0)
    lucky = wf.start("two_slow_steps", 0.0)
    event = sqs_event(aws)
    assert len(event["Records"]) == 2
    by_run = {json.loads(r["body"])["run"]: r["messageId"] for r in event["Records"]}
    original = wf.world.ack

    def ack(receipt: str) -> None:
        if unlucky.id in {c.run_id for c in acked if c.receipt == receipt}:
            raise WorldUnavailable("DynamoDB went away before the ack")
        original(receipt)

    acked: list[Any] = []
    accept = wf.world.accept_message  # type: ignore[attr-defined]

    def spy(message: Any) -> Any:
        claimed = accept(message)
        if claimed is not None:
            acked.append(claimed)
        return claimed

    monkeypatch.setattr(wf.world, "accept_message", spy)
    monkeypatch.setattr(wf.world, "ack", ack)
    assert invoke(aws, handler, event, Context(60)) == {"batchItemFailures": [{"itemIdentifier": by_run[unlucky.id]}]}
    monkeypatch.setattr(wf.world, "ack", original)
    drive(aws, handler, lambda: unlucky.status.terminal and lucky.status.terminal)
    assert unlucky.result() == lucky.result() == [0.0, 0.0]


def test_past_half_the_deadline_the_rest_is_handed_back(aws: Aws, wf: Workflows) -> None:
    handler = queue_handler(wf)
    first = wf.start("two_slow_steps", 1.2)
    second = wf.start("two_slow_steps", 1.2)
    event = sqs_event(aws)
    assert len(event["Records"]) == 2
    answer = invoke(aws, handler, event, Context(2.0))  # halfway after 1 s: the first slow step runs past it
    by_run = {json.loads(r["body"])["run"]: r["messageId"] for r in event["Records"]}
    started_first = first.status is not RunStatus.PENDING
    handed_back = by_run[second.id] if started_first else by_run[first.id]
    ran = first if started_first else second
    assert answer == {"batchItemFailures": [{"itemIdentifier": handed_back}]}
    created = [e for e in ran.events() if e.event_type is EventType.STEP_CREATED]
    assert [e.data["mode"] for e in created] == ["inline", "queued"]  # past halfway: the next step is queued
    back = sqs_event(aws)["Records"]  # visible again at once, with the queued step's delivery
    assert handed_back in {r["messageId"] for r in back} and len(back) == 2
    for r in back:
        aws.sqs.change_message_visibility(QueueUrl=aws.queue_url, ReceiptHandle=r["receiptHandle"], VisibilityTimeout=0)
    drive(aws, handler, lambda: first.status.terminal and second.status.terminal)
    assert first.result() == second.result() == [1.2, 1.2]


def test_a_running_delivery_keeps_its_message_hidden(aws: Aws, wf: Workflows, monkeypatch: pytest.MonkeyPatch) -> None:
    extended: list[tuple[list[str], float]] = []
    original = wf.world.extend

    def spy(receipts: Any, lease: float) -> None:
        extended.append((list(receipts), lease))
        original(receipts, lease)

    monkeypatch.setattr(wf.world, "extend", spy)
    handler = queue_handler(wf, extend_every=0.1, extend_to=7)
    run = wf.start("two_slow_steps", 0.4)
    answer = invoke(
        aws, handler, sqs_event(aws, visibility=1), Context(60)
    )  # the steps outlast the message's 1 s visibility
    assert answer == {"batchItemFailures": []} and run.result() == [0.4, 0.4]
    assert len(extended) >= 4 and {lease for _, lease in extended} == {7}
    assert sqs_event(aws, visibility=0)["Records"] == []  # never delivered twice meanwhile, and deleted at the end


def test_messages_that_are_not_ours_are_acknowledged(aws: Aws, wf: Workflows) -> None:
    handler = queue_handler(wf)
    aws.sqs.send_message(QueueUrl=aws.queue_url, MessageBody="{not json")
    aws.sqs.send_message(
        QueueUrl=aws.queue_url, MessageBody=json.dumps({"celery_workflow": 1, "id": "gone", "run": None})
    )
    assert invoke(aws, handler, sqs_event(aws), Context(60)) == {"batchItemFailures": []}
    assert sqs_event(aws, visibility=0)["Records"] == []


def function_url_event(
    method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """A Lambda Function URL request (payload format 2.0)."""
    text = "" if body is None else json.dumps(body)
    return {
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": path,
        "rawQueryString": "",
        "headers": {"content-type": "application/json", "host": "abc.lambda-url.us-east-1.on.aws", **(headers or {})},
        "requestContext": {
            "accountId": "123456789012",
            "apiId": "abc",
            "domainName": "abc.lambda-url.us-east-1.on.aws",
            "http": {"method": method, "path": path, "protocol": "HTTP/1.1", "sourceIp": "127.0.0.1", "userAgent": "t"},
            "requestId": "r1",
            "routeKey": "$default",
            "stage": "$default",
            "time": "01/Dec/2026:00:00:00 +0000",
            "timeEpoch": 0,
        },
        "body": text,
        "isBase64Encoded": False,
    }


def test_the_http_handler_serves_rpc_and_webhooks(aws: Aws, wf: Workflows) -> None:
    handler = http_handler(wf)
    started = handler(function_url_event("POST", "/v1/workflow/rpc", {"method": "start", "params": {
        "workflow": "two_slow_steps", "args": [0.0], "run_id": "via-http"}}), None)  # fmt: skip
    assert started["statusCode"] == 200, started
    assert json.loads(started["body"])["result"]["run"]["run_id"] == "via-http"
    assert wf.world.get_run("via-http").workflow_name == "two_slow_steps"
    missing = handler(
        function_url_event("POST", "/v1/workflow/rpc", {"method": "get_run", "params": {"run_id": "x"}}), None
    )
    assert missing["statusCode"] == 404 and json.loads(missing["body"])["error"]["code"] == "run_not_found"
    bad = handler(function_url_event("POST", "/v1/workflow/rpc", "not an object"), None)
    assert bad["statusCode"] == 400
    unknown = handler(function_url_event("POST", "/v1/workflow/webhooks/no-such-token", {"a": 1}), None)
    assert unknown["statusCode"] == 404
    worker = queue_handler(wf)
    run = wf.start("callback")
    drive(aws, worker, lambda: wf.world.list_hooks(run.id) != [])
    (hook,) = wf.world.list_hooks(run.id)
    answered = handler(function_url_event("POST", f"/v1/workflow/webhooks/{hook.token}", {"paid": 42}), None)
    assert answered["statusCode"] == 201 and json.loads(answered["body"]) == {"thanks": True}
    drive(aws, worker, lambda: run.status.terminal)
    assert run.result() == {"paid": 42}


def test_the_rpc_and_webhook_handlers_serve_their_endpoint_alone(aws: Aws, wf: Workflows) -> None:
    """The seed's RPC(world) and Webhook(world): a public Function URL serving webhooks must not serve the RPC (which
    starts and cancels runs), and the RPC's function need not serve webhooks (issue #27, item 6)."""
    from celery_workflow.aws_lambda import rpc_handler, webhook_handler
    from celery_workflow.errors import ConfigurationError

    rpc, webhooks = rpc_handler(wf), webhook_handler(wf)
    start = {"method": "start", "params": {"workflow": "callback", "run_id": "via-rpc"}}
    refused = webhooks(function_url_event("POST", "/v1/workflow/rpc", start), None)
    assert refused["statusCode"] == 404
    with pytest.raises(Exception, match="via-rpc"):
        wf.world.get_run("via-rpc")  # nothing started through the webhook function
    started = rpc(function_url_event("POST", "/v1/workflow/rpc", start), None)
    assert started["statusCode"] == 200, started
    worker = queue_handler(wf)
    drive(aws, worker, lambda: wf.world.list_hooks("via-rpc") != [])
    (hook,) = wf.world.list_hooks("via-rpc")
    path = f"/v1/workflow/webhooks/{hook.token}"
    assert rpc(function_url_event("POST", path, {"paid": 1}), None)["statusCode"] == 404  # not the RPC's
    answered = webhooks(function_url_event("POST", path, {"paid": 42}), None)
    assert answered["statusCode"] == 201 and json.loads(answered["body"]) == {"thanks": True}
    drive(aws, worker, lambda: wf.get_run("via-rpc").status.terminal)
    assert wf.get_run("via-rpc").result() == {"paid": 42}
    elsewhere = webhook_handler(wf, prefix="/hooks")
    unknown = elsewhere(function_url_event("POST", "/hooks/webhooks/unknown", {}), None)
    assert json.loads(unknown["body"])["error"]["code"] == "hook_not_found"  # served there, the token unknown
    with pytest.raises(ConfigurationError, match="prefix"):
        webhook_handler(wf, prefix="v1")


def test_a_message_on_its_last_receive_is_dead_lettered_and_its_run_failed(
    aws: Aws, wf: Workflows, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delivery that keeps failing comes back until its receive count reaches the redrive policy's
    maxReceiveCount; that receive is not run: the handler moves the message to the dead-letter queue itself (SQS
    would move it silently on the next receive) and fails the run with DeadLettered as its cause."""
    from celery_workflow.dead_letters import dead_letter_store

    dlq = aws.sqs.create_queue(QueueName="workflow-tasks-dlq")["QueueUrl"]
    arn = aws.sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    policy = json.dumps({"deadLetterTargetArn": arn, "maxReceiveCount": 3})
    aws.sqs.set_queue_attributes(QueueUrl=aws.queue_url, Attributes={"RedrivePolicy": policy})

    def on_fire(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("handler on fire")

    monkeypatch.setattr(wf.runtime, "handle_workflow", on_fire)
    handler = queue_handler(wf)
    run = wf.start("two_slow_steps", 0.0)
    answers = []
    deadline = time.monotonic() + 30
    while not run.status.terminal:
        assert time.monotonic() < deadline, "the run was not failed"
        event = sqs_event(aws, visibility=0)
        if event["Records"]:
            answers.append(invoke(aws, handler, event, Context(60)))
    assert [len(a["batchItemFailures"]) for a in answers] == [1, 1, 0]  # two failed deliveries, then the move
    error = run.view().error or {}
    assert error["type"] == "celery_workflow.errors.DeadLettered" and error["reason"] == "max-deliveries"
    (letter,) = dead_letter_store(wf.world).list_dead_letters()
    assert (letter.run_id, letter.queue, letter.task_name) == (run.id, "celery", "workflow.two_slow_steps")
    assert error["dead_letter"] == letter.id
