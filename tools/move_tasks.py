"""A stand-in for SQS's message move task API, which moto does not implement, in front of a moto server.

moto (5.x) has no ``StartMessageMoveTask``, ``ListMessageMoveTasks`` or ``CancelMessageMoveTask``. A
:class:`MessageMoveTaskProxy` is a small threaded HTTP server on 127.0.0.1 that SQS clients reach through
``AWS_ENDPOINT_URL_SQS`` (botocore honours service-specific endpoint variables). It serves those three operations of
SQS's JSON protocol (``X-Amz-Target: AmazonSQS.<Operation>``) itself and forwards every other request unchanged to
moto (streaming the response back, long polls included), so everything else (the queues, their redrive policies,
the World's and the Celery transport's SQS traffic) is moto's.

What it does as the real API does (botocore's service model and the SQS documentation):

* ``StartMessageMoveTask(SourceArn, DestinationArn?, MaxNumberOfMessagesPerSecond?)`` → ``{"TaskHandle": …}``
  (base64 JSON of a task id and the source ARN). Without ``DestinationArn`` the messages go back to the queue whose
  ``RedrivePolicy`` names the source (moto does not record a dead-lettered message's origin, so the stand-in asks
  moto's ``ListDeadLetterSourceQueues``; none or several such queues fail the task with ``FailureReason``
  ``CouldNotDetermineMessageSource``). One active task per source: starting another while one is ``RUNNING``
  (or ``CANCELLING``) is ``UnsupportedOperation`` (``AWS.SimpleQueueService.UnsupportedOperation``, "There is
  already a task running…"); an unknown source is ``ResourceNotFoundException``.
* The task runs in a background thread: ``RUNNING`` while it moves the messages that were visible on the source at
  the start (``ApproximateNumberOfMessagesToMove``) one by one — receive from the source, send body and message
  attributes to the destination, delete from the source — counting ``ApproximateNumberOfMessagesMoved``, then
  ``COMPLETED`` (or ``FAILED`` with the error code as ``FailureReason`` when moto refuses a call).
* ``ListMessageMoveTasks(SourceArn, MaxResults=1)`` → ``{"Results": [...]}``, newest first, at most ``MaxResults``
  (1 to 10) entries with ``Status``, ``SourceArn``, ``ApproximateNumberOfMessagesMoved``,
  ``ApproximateNumberOfMessagesToMove``, ``StartedTimestamp`` (epoch milliseconds), ``TaskHandle`` only while
  ``RUNNING``, ``DestinationArn`` / ``MaxNumberOfMessagesPerSecond`` only when the start request gave them and
  ``FailureReason`` only when ``FAILED``.
* ``CancelMessageMoveTask(TaskHandle)`` → ``{"ApproximateNumberOfMessagesMoved": n}``; the task goes
  ``CANCELLING`` then ``CANCELLED`` (messages already moved stay moved). Only a ``RUNNING`` task can be cancelled.

Run it beside an emulator (docker-compose.yml does, in front of its moto service)::

    python -m tools.move_tasks --upstream http://127.0.0.1:5000 --port 5001
    AWS_ENDPOINT_URL_SQS=http://127.0.0.1:5001 python -m examples.sqs_redrive start '{"queueArn": …}'

Test controls (not part of the API): :meth:`pause` holds every task ``RUNNING`` before its next message until
:meth:`resume`; :meth:`fail_next` makes the next task started on a queue end ``FAILED`` with a given reason, moving
nothing; :meth:`hide_tasks` makes ``ListMessageMoveTasks`` answer no tasks for a queue (once, a few times or always:
a queue whose tasks the API does not report); :meth:`calls` lists the move task requests served and what they
answered.
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

import boto3
from botocore.exceptions import ClientError

__all__ = ["MessageMoveTaskProxy", "MoveTask", "ServedCall"]

_CONTENT_TYPE = "application/x-amz-json-1.0"
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
}
_ACTIVE = ("RUNNING", "CANCELLING")
_OPERATIONS = ("StartMessageMoveTask", "ListMessageMoveTasks", "CancelMessageMoveTask")


class SQSError(Exception):
    """An error answered in SQS's JSON protocol (``__type`` and, for query-compatible codes, the
    ``x-amzn-query-error`` header botocore maps to the legacy code)."""

    def __init__(self, shape: str, message: str, query_code: str | None = None) -> None:
        super().__init__(message)
        self.shape = shape
        self.message = message
        self.query_code = query_code


@dataclass
class MoveTask:
    handle: str
    source_arn: str
    destination_arn: str | None  # as given in the start request
    rate: int | None
    started_ms: int
    to_move: int
    status: str = "RUNNING"
    moved: int = 0
    failure_reason: str | None = None
    fail_with: str | None = None  # set by fail_next
    cancel: threading.Event = field(default_factory=threading.Event)

    def entry(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "Status": self.status,
            "SourceArn": self.source_arn,
            "ApproximateNumberOfMessagesMoved": self.moved,
            "ApproximateNumberOfMessagesToMove": self.to_move,
            "StartedTimestamp": self.started_ms,
        }
        if self.status == "RUNNING":
            out["TaskHandle"] = self.handle
        if self.destination_arn is not None:
            out["DestinationArn"] = self.destination_arn
        if self.rate is not None:
            out["MaxNumberOfMessagesPerSecond"] = self.rate
        if self.status == "FAILED":
            out["FailureReason"] = self.failure_reason
        return out


@dataclass(frozen=True)
class ServedCall:
    """A move task request the proxy answered: the operation, its request and its response (or error shape)."""

    operation: str
    request: dict[str, Any]
    response: dict[str, Any] | None
    error: str | None = None


class MessageMoveTaskProxy:
    """The stand-in in front of the moto server at ``upstream`` (see the module docstring); a context manager
    yielding itself. ``endpoint`` is its URL, to put in ``AWS_ENDPOINT_URL_SQS``."""

    def __init__(
        self,
        upstream: str,
        *,
        region: str = "us-east-1",
        credentials: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        creds = credentials or {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
        self.sqs = boto3.client("sqs", endpoint_url=upstream, region_name=region, **creds)  # moto itself
        self._lock = threading.Lock()
        self._tasks: list[MoveTask] = []  # oldest first
        self._calls: list[ServedCall] = []
        self._fail_next: dict[str, str] = {}  # source ARN -> FailureReason
        self._hidden: dict[str, int | None] = {}  # source ARN -> how many more List answers hide its tasks (None: all)
        self._running = threading.Event()  # cleared by pause()
        self._running.set()
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._server = ThreadingHTTPServer((host, port), _handler_for(self))
        self._server.daemon_threads = True
        bound = self._server.server_address
        self.endpoint = f"http://{bound[0]!s}:{bound[1]}"
        self._serve = threading.Thread(target=self._server.serve_forever, name="move-task-proxy", daemon=True)
        self._serve.start()

    # -- test controls ---------------------------------------------------------------------------------------------

    def pause(self) -> None:
        """Hold every task ``RUNNING`` before its next message until :meth:`resume`."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def fail_next(self, source_arn: str, reason: str = "AWS.SimpleQueueService.NonExistentQueue") -> None:
        """The next task started on ``source_arn`` ends ``FAILED`` with ``reason`` as its ``FailureReason``, moving
        nothing."""
        with self._lock:
            self._fail_next[source_arn] = reason

    def hide_tasks(self, source_arn: str, times: int | None = None) -> None:
        """The next ``times`` ``ListMessageMoveTasks`` answers for ``source_arn`` (``None``: every one from now on)
        list no tasks; the tasks themselves go on."""
        with self._lock:
            self._hidden[source_arn] = times

    def calls(self, operation: str | None = None, source_arn: str | None = None) -> list[ServedCall]:
        """The move task requests served so far, oldest first, filtered by operation and ``SourceArn``."""
        with self._lock:
            return [
                c
                for c in self._calls
                if (operation is None or c.operation == operation)
                and (source_arn is None or c.request.get("SourceArn") == source_arn)
            ]

    def tasks(self, source_arn: str) -> list[dict[str, Any]]:
        """The source's tasks as ``ListMessageMoveTasks`` entries, newest first (all of them)."""
        with self._lock:
            return [t.entry() for t in reversed(self._tasks) if t.source_arn == source_arn]

    def close(self) -> None:
        self._closed = True
        self._running.set()
        self._server.shutdown()
        self._server.server_close()
        self._serve.join(10)
        for thread in self._threads:
            thread.join(10)

    def __enter__(self) -> MessageMoveTaskProxy:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    # -- the operations --------------------------------------------------------------------------------------------

    def serve(self, operation: str, request: dict[str, Any]) -> dict[str, Any]:
        """Answer one move task operation (raises :class:`SQSError`), recording the call."""
        handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "StartMessageMoveTask": self._start,
            "ListMessageMoveTasks": self._list,
            "CancelMessageMoveTask": self._cancel,
        }
        try:
            response = handlers[operation](request)
        except SQSError as exc:
            with self._lock:
                self._calls.append(ServedCall(operation, request, None, exc.shape))
            raise
        with self._lock:
            self._calls.append(ServedCall(operation, request, response))
        return response

    def _queue_url(self, arn: str, parameter: str) -> str:
        parts = arn.split(":")
        if len(parts) != 6 or parts[:3] != ["arn", "aws", "sqs"]:
            raise SQSError("InvalidParameterValueException", f"Value {arn} for parameter {parameter} is invalid.")
        try:
            url: str = self.sqs.get_queue_url(QueueName=parts[5], QueueOwnerAWSAccountId=parts[4])["QueueUrl"]
        except ClientError as exc:
            raise SQSError(
                "ResourceNotFoundException", f"The resource that you specified for the {parameter} doesn't exist."
            ) from exc
        return url

    def _start(self, request: dict[str, Any]) -> dict[str, Any]:
        source = str(request.get("SourceArn", ""))
        source_url = self._queue_url(source, "SourceArn")
        destination = request.get("DestinationArn")
        if destination is not None:
            self._queue_url(str(destination), "DestinationArn")
        attributes = self.sqs.get_queue_attributes(QueueUrl=source_url, AttributeNames=["ApproximateNumberOfMessages"])
        with self._lock:
            if any(t.source_arn == source and t.status in _ACTIVE for t in self._tasks):
                raise SQSError(
                    "UnsupportedOperation",
                    "There is already a task running. Only one active task is allowed for each source queue arn at"
                    " a given time.",
                    "AWS.SimpleQueueService.UnsupportedOperation",
                )
            handle_id = json.dumps({"taskId": str(uuid.uuid4()), "sourceArn": source}, separators=(",", ":"))
            task = MoveTask(
                handle=base64.b64encode(handle_id.encode()).decode(),
                source_arn=source,
                destination_arn=None if destination is None else str(destination),
                rate=request.get("MaxNumberOfMessagesPerSecond"),
                started_ms=int(time.time() * 1000),
                to_move=int(attributes["Attributes"]["ApproximateNumberOfMessages"]),
                fail_with=self._fail_next.pop(source, None),
            )
            self._tasks.append(task)
            thread = threading.Thread(target=self._move, args=(task, source_url), name="move-task", daemon=True)
            self._threads.append(thread)
        thread.start()
        return {"TaskHandle": task.handle}

    def _list(self, request: dict[str, Any]) -> dict[str, Any]:
        source = str(request.get("SourceArn", ""))
        self._queue_url(source, "SourceArn")
        limit = min(max(int(request.get("MaxResults") or 1), 1), 10)  # the real API rejects values outside 1..10
        with self._lock:
            if source in self._hidden:
                left = self._hidden[source]
                if left is None or left > 0:
                    self._hidden[source] = None if left is None else left - 1
                    return {"Results": []}
        return {"Results": self.tasks(source)[:limit]}

    def _cancel(self, request: dict[str, Any]) -> dict[str, Any]:
        handle = str(request.get("TaskHandle", ""))
        with self._lock:
            task = next((t for t in self._tasks if t.handle == handle), None)
            if task is None:
                raise SQSError(
                    "ResourceNotFoundException", "The resource that you specified for the TaskHandle doesn't exist."
                )
            if task.status != "RUNNING":
                raise SQSError(
                    "UnsupportedOperation",
                    f"Only a RUNNING task can be cancelled; this one is {task.status}.",
                    "AWS.SimpleQueueService.UnsupportedOperation",
                )
            task.status = "CANCELLING"
            task.cancel.set()
            return {"ApproximateNumberOfMessagesMoved": task.moved}

    def _finish(self, task: MoveTask, status: str, reason: str | None = None) -> None:
        with self._lock:
            task.status = status
            task.failure_reason = reason

    def _destination_url(self, task: MoveTask, source_url: str) -> str | None:
        if task.destination_arn is not None:
            return self._queue_url(task.destination_arn, "DestinationArn")
        origins: list[str] = self.sqs.list_dead_letter_source_queues(QueueUrl=source_url).get("queueUrls", [])
        return origins[0] if len(origins) == 1 else None

    def _move(self, task: MoveTask, source_url: str) -> None:
        """The task's thread: move ``to_move`` messages one by one, then finish it."""
        if task.fail_with is not None:
            self._finish(task, "FAILED", task.fail_with)
            return
        try:
            destination = self._destination_url(task, source_url)
            if destination is None:
                self._finish(task, "FAILED", "CouldNotDetermineMessageSource")
                return
            while task.moved < task.to_move:
                self._running.wait()
                if task.cancel.is_set() or self._closed:
                    break
                received = self.sqs.receive_message(
                    QueueUrl=source_url, MaxNumberOfMessages=1, MessageAttributeNames=["All"], VisibilityTimeout=30
                ).get("Messages", [])
                if not received:
                    break  # fewer visible than counted at the start (consumed or in flight elsewhere)
                message = received[0]
                send: dict[str, Any] = {"QueueUrl": destination, "MessageBody": message["Body"]}
                attributes = {
                    name: {k: v for k, v in value.items() if k in ("DataType", "StringValue", "BinaryValue")}
                    for name, value in message.get("MessageAttributes", {}).items()
                }
                if attributes:
                    send["MessageAttributes"] = attributes
                self.sqs.send_message(**send)
                self.sqs.delete_message(QueueUrl=source_url, ReceiptHandle=message["ReceiptHandle"])
                with self._lock:
                    task.moved += 1
                if task.rate:
                    time.sleep(1 / task.rate)
        except ClientError as exc:
            self._finish(task, "FAILED", str(exc.response.get("Error", {}).get("Code", "InternalError")))
            return
        self._finish(task, "CANCELLED" if task.cancel.is_set() else "COMPLETED")


def _handler_for(proxy: MessageMoveTaskProxy) -> type[BaseHTTPRequestHandler]:
    upstream_host, upstream_port = proxy.upstream

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as botocore expects

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _body(self) -> bytes:
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def _reply(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", _CONTENT_TYPE)
            self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _handle(self) -> None:
            body = self._body()
            target = self.headers.get("X-Amz-Target", "")
            operation = target.removeprefix("AmazonSQS.") if target.startswith("AmazonSQS.") else ""
            if self.command == "POST" and operation in _OPERATIONS:
                self._serve_locally(operation, body)
            else:
                self._forward(body)

        def _serve_locally(self, operation: str, body: bytes) -> None:
            try:
                self._reply(200, proxy.serve(operation, json.loads(body or b"{}")))
            except SQSError as exc:
                headers = {"x-amzn-query-error": f"{exc.query_code};Sender"} if exc.query_code else {}
                self._reply(400, {"__type": f"com.amazonaws.sqs#{exc.shape}", "message": exc.message}, headers)

        def _forward(self, body: bytes) -> None:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            headers["Content-Length"] = str(len(body))
            conn = http.client.HTTPConnection(upstream_host, upstream_port, timeout=90)  # > a 20 s long poll
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                length = resp.getheader("Content-Length")
                content = resp.read() if length is None else b""  # chunked or close-delimited: buffer it
                self.send_response(resp.status, resp.reason)
                for name, value in resp.getheaders():
                    if name.lower() not in _HOP_BY_HOP:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(content)) if length is None else length)
                self.end_headers()
                self.wfile.write(content)
                while length is not None and (chunk := resp.read(65536)):  # a sized body: streamed through
                    self.wfile.write(chunk)
            finally:
                conn.close()

        do_POST = do_GET = do_PUT = do_DELETE = do_HEAD = _handle

    return Handler


def main(argv: list[str] | None = None) -> None:
    """``python -m tools.move_tasks --upstream URL [--host H] [--port P]``: serve until stopped."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(
        prog="python -m tools.move_tasks",
        description="SQS's message move task API in front of a moto server that lacks it (a stand-in for tests).",
    )
    parser.add_argument("--upstream", required=True, help="the moto server, e.g. http://127.0.0.1:5000")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5001)
    parser.add_argument("--region", default="us-east-1")
    args = parser.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with MessageMoveTaskProxy(args.upstream, region=args.region, host=args.host, port=args.port) as proxy:
        print(f"move task stand-in on {proxy.endpoint}, forwarding to {args.upstream}", flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
