"""AWS Lambda entry points of the AWS World (seed ``aws-world.txt``: ``Queue``, ``HTTP``, ``HTTPPrefix``, ``RPC``,
``Webhook``, ``CreateTable``).

.. code-block:: python

    # worker.py: the SQS event source mapping's function (with ReportBatchItemFailures)
    from celery_workflow.aws_lambda import queue_handler
    from myapp import wf                     # Workflows(Celery("app"), world=AWSWorld.from_env(), broker="app")

    handler = queue_handler(wf)

    # api.py: a Function URL or API Gateway route (RPC and webhooks under /v1/workflow)
    from celery_workflow.aws_lambda import http_handler
    handler = http_handler(wf)

    # or apart: the RPC behind IAM auth, the webhooks alone on a public Function URL
    from celery_workflow.aws_lambda import rpc_handler, webhook_handler
    rpc = rpc_handler(wf)                    # POST /v1/workflow/rpc only
    webhooks = webhook_handler(wf)           # /v1/workflow/webhooks/<token> only

    # tick.py: invoked every minute by EventBridge Scheduler (terraform/: tick_function_name), when no Celery worker
    # runs: fires the due schedules and sends the starts their writers left unsent
    from celery_workflow.aws_lambda import tick_handler
    handler = tick_handler(wf)

:func:`queue_handler` runs the deliveries of an SQS batch and answers ``{"batchItemFailures": [...]}``, so SQS
redelivers only the messages that failed (the mapping must enable ``ReportBatchItemFailures``, or Lambda deletes the
whole batch). The handler deletes no message itself: the mapping deletes every message the handler leaves out of
``batchItemFailures`` (one ``DeleteMessageBatch`` per batch), and a reported one stays for SQS to deliver again. For
each message: the World accepts it (a message whose body is not ours or whose record is gone is
acknowledged, one that arrives early is sent again with the remaining delay, an expiry runs the run's retention);
the delivery runs with its visibility extended every 30 s; a failure (of the delivery, or of the acknowledgement
after it: the message alone, never the batch) is reported and its message comes back after a backoff that doubles
from 1 s with each receive up to 15 minutes. Once the batch is halfway to the invocation's
deadline, no further message is started: the rest are reported with their visibility reset, so another invocation
takes them at once, and deliveries already running queue their next steps instead of running them inline. A
handed-off message counts as a receive toward the dead-letter queue's ``maxReceiveCount``. A message received for
the ``maxReceiveCount``-th time is not run: it is moved to the dead-letter queue here (SQS would move it silently on
its next receive) and its run failed with :class:`~celery_workflow.errors.DeadLettered` as the cause. After a batch
that ends before halfway, the handler runs the World's outbox sweep, at most once a minute per function instance
(:class:`celery_workflow._aws.starts.OutboxSweeper`: a start whose writer stopped before sending it is sent).

:func:`tick_handler` does on a Lambda-only deployment what a Celery worker's main process does in the background:
invoked every minute (an EventBridge Scheduler schedule ``rate(1 minute)`` or an EventBridge rule; the event is not
read), it makes one pass of the schedules' ticker (:meth:`celery_workflow.schedules.Ticker.tick`: every due
``wf.schedule(...)`` fires its ticks, one run per tick, claimed so that a tick fired by a worker or another invocation
is not fired again), then one outbox sweep (:meth:`~celery_workflow.world_sqs.AWSWorld.sweep_outbox`) of the pending
runs created from :data:`TICK_SWEEP_WINDOW` (15 minutes) ago up to the sweep's grace (a minute) ago: each start is
looked at by about fourteen invocations, which is harmless, since a start's payload leaves META as soon as it is sent.
The ticker fires no further schedule once half the invocation's time is gone (the rest stay due for the next
minute), and counts a tick late only past its schedule's ``catch_up`` plus the minute between invocations (a tick
due just after one invocation is seen by the next, up to a minute later: with the default ``catch_up`` of a minute
it would otherwise be skipped). It answers
``{"schedules_fired": n, "runs_started": n, "starts_sent": n, "errors": {part: message}}``. A part that fails is
logged and named in ``errors`` (``schedules``, ``outbox``) while the other part still runs; when every part that ran
failed, it raises :class:`~celery_workflow.errors.TickFailed`, so Lambda records a failed invocation (Lambda retries
an asynchronous invocation; a pass is idempotent).

:func:`http_handler` serves the Flask blueprints (:func:`celery_workflow.api.blueprint`) through ``apig-wsgi``
(API Gateway REST and HTTP APIs, Function URLs, ALB). It does not authenticate: prefer a Function URL with
``AWS_IAM`` auth or an API Gateway authorizer. :func:`rpc_handler` serves the RPC endpoint alone and
:func:`webhook_handler` the webhook endpoint alone (any other path is 404), for a public Function URL the internet
reaches: webhooks are authorised by their tokens, and such a function must not start or cancel runs. Each never
raises: an event it cannot read as a request (not an object, an unknown payload
``version``, a payload 2.0 event without ``headers`` or ``requestContext.http``, a body that is not a string or not
valid base64, a path or query string beyond Latin-1) is answered ``400`` with a JSON error
(``{"error": {"code": "malformed_event", "message": ...}}``) and logged.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from celery_workflow import dead_letters, ids
from celery_workflow._aws.starts import OutboxSweeper
from celery_workflow.app import Workflows
from celery_workflow.errors import ConfigurationError, TickFailed
from celery_workflow.worker_setup import ticker_of
from celery_workflow.world import Claim, ClaimedDelivery, World
from celery_workflow.world_sqs import AWSWorld, create_table

__all__ = [
    "create_table",
    "http_handler",
    "queue_handler",
    "retry_delay",
    "rpc_handler",
    "tick_handler",
    "webhook_handler",
]

log = logging.getLogger("celery_workflow.aws_lambda")

#: SQS's longest per-message visibility change worth waiting: 15 minutes.
MAX_BACKOFF = 900.0
#: A batch runs without a deadline this long when there is no Lambda context (tests, scripts).
NO_CONTEXT_BUDGET = 900.0
#: How far back the tick handler's outbox sweep looks: the windows of successive invocations overlap, so a start a
#: sweep failed to send is sent by a later one.
TICK_SWEEP_WINDOW = timedelta(minutes=15)


def retry_delay(receive_count: int) -> float:
    """Seconds before a failed delivery comes back: 1 s, doubling with each receive, at most 15 minutes."""
    return min(MAX_BACKOFF, 2.0 ** max(0, min(receive_count - 1, 30)))


def _aws_world(world: World) -> AWSWorld:
    if not isinstance(world, AWSWorld):
        raise ConfigurationError(f"the Lambda queue handler runs the AWS World's deliveries, not {world!r}'s")
    return world


@contextmanager
def _kept_visible(world: AWSWorld, receipt: str, every: float, lease: float) -> Iterator[None]:
    """Extend the message's visibility to ``lease`` seconds every ``every`` seconds while the block runs."""
    stop = threading.Event()

    def keep() -> None:
        while not stop.wait(every):
            try:
                world.extend([receipt], lease)
            except Exception:  # a failed extension is retried on the next tick
                log.warning("cannot extend the visibility of %s", receipt.rsplit("|", 1)[0], exc_info=True)

    thread = threading.Thread(target=keep, name="celery_workflow-visibility", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


def queue_handler(
    wf: Workflows, *, extend_every: float = 30.0, extend_to: float = 90.0
) -> Callable[[Mapping[str, Any], Any], dict[str, Any]]:
    """The SQS Lambda handler of ``wf`` (whose World is an :class:`~celery_workflow.world_sqs.AWSWorld`); see the
    module docstring. ``extend_every`` / ``extend_to``: the visibility keep-alive of a running delivery."""
    world = _aws_world(wf.world)
    sweeper = OutboxSweeper(world.queue.starts)

    def handler(event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
        started = time.monotonic()
        budget = context.get_remaining_time_in_millis() / 1000 if context is not None else NO_CONTEXT_BUDGET
        halfway = started + budget / 2
        records = list(event.get("Records") or [])
        failures: list[dict[str, str]] = []
        for i, message in enumerate(records):
            if time.monotonic() >= halfway:
                for rest in records[i:]:  # hand off: another invocation takes them at once
                    failures.append({"itemIdentifier": str(rest["messageId"])})
                    _quietly(world.return_message, rest, 0.0)
                log.info("handed %d message(s) back at half the invocation's time", len(records) - i)
                break
            if not _run_one(wf, world, message, halfway, keep_alive=(extend_every, extend_to)):
                failures.append({"itemIdentifier": str(message["messageId"])})
        else:
            if time.monotonic() < halfway:
                _quietly(sweeper.tick)
        return {"batchItemFailures": failures}

    return handler


def _run_one(
    wf: Workflows, world: AWSWorld, message: Mapping[str, Any], halfway: float, *, keep_alive: tuple[float, float]
) -> bool:
    """Run one message of the batch; False when it failed (reported, and backed off). ``keep_alive``: extend the
    visibility every so many seconds, to so many seconds."""
    every, lease = keep_alive
    count = int((message.get("attributes") or {}).get("ApproximateReceiveCount", "1"))
    try:
        claimed = world.accept_message(message)
    except Exception:
        log.exception("cannot accept message %s", message.get("messageId"))
        _quietly(world.return_message, message, retry_delay(count))
        return False
    if claimed is None:
        return True
    if _dead_lettered(world, claimed):
        return True
    try:
        with _kept_visible(world, claimed.receipt, every, lease):
            outcome = wf.handle_delivery(
                claimed.payload, Claim(claimed.receipt, claimed.attempts), inline_until=halfway
            )
    except Exception:
        log.exception("delivery %s failed (receive %d)", message.get("messageId"), claimed.attempts)
        _quietly(world.retry_later, claimed.receipt, retry_delay(claimed.attempts))
        return False
    log.debug("delivery %s: %s", message.get("messageId"), outcome)
    try:
        world.ack(claimed.receipt)
    except Exception:  # the delivery ran; its message comes back and its run finds the work done
        log.warning("cannot acknowledge delivery %s: reported as failed", message.get("messageId"), exc_info=True)
        _quietly(world.retry_later, claimed.receipt, retry_delay(claimed.attempts))
        return False
    return True


def _dead_lettered(world: AWSWorld, claimed: ClaimedDelivery) -> bool:
    """A message on its last receive before SQS would move it to the queue's dead-letter queue (``maxReceiveCount``)
    is moved here instead, undelivered, and its run failed with the cause (SQS would move it silently)."""
    try:
        receives = world.dead_letters.max_receives(claimed.queue)
        if receives is None or claimed.attempts < receives:
            return False
        letter = world.dead_letter(claimed.receipt, reason=dead_letters.MAX_DELIVERIES)
    except Exception:  # SQS moves it on its next receive anyway
        log.warning(
            "cannot move delivery %s to its dead-letter queue", claimed.receipt.rsplit("|", 1)[0], exc_info=True
        )
        return False
    if letter is None:
        return False
    log.error("%s (dead letter %s)", letter.describe(), letter.id)
    _quietly(dead_letters.fail_run, world, letter)
    return True


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # the message comes back after the queue's visibility timeout anyway
        log.warning("%s failed", getattr(fn, "__name__", fn), exc_info=True)


def tick_handler(
    wf: Workflows, *, every: float = 60.0, sweep_window: timedelta = TICK_SWEEP_WINDOW
) -> Callable[[Mapping[str, Any], Any], dict[str, Any]]:
    """The every-minute Lambda handler of ``wf`` (whose World is an :class:`~celery_workflow.world_sqs.AWSWorld`) on a
    deployment without Celery workers: one pass of the schedules' ticker, one outbox sweep over the last
    ``sweep_window``; see the module docstring. ``every``: the seconds between invocations (a tick up to that much
    later than its schedule's ``catch_up`` is still fired: it could not be seen sooner). Build it after the app's
    workflows are registered."""
    world = _aws_world(wf.world)
    ticker = ticker_of(wf, period=every)  # None: no workflow a schedule could start

    def handler(event: Mapping[str, Any] | None = None, context: Any = None) -> dict[str, Any]:
        budget = context.get_remaining_time_in_millis() / 1000 if context is not None else NO_CONTEXT_BUDGET
        halfway = time.monotonic() + budget / 2
        summary: dict[str, Any] = {"schedules_fired": 0, "runs_started": 0, "starts_sent": 0, "errors": {}}
        errors: dict[str, str] = summary["errors"]
        failure: Exception | None = None
        if ticker is not None:
            try:
                reports, _ = ticker.tick(stop=lambda: time.monotonic() >= halfway)
                summary["schedules_fired"] = len(reports)
                summary["runs_started"] = sum(len(report.started) for report in reports)
            except Exception as exc:
                log.exception("tick: the schedules' pass failed")
                errors["schedules"], failure = f"{type(exc).__name__}: {exc}", exc
        try:  # up to the sweep's grace ago
            summary["starts_sent"] = world.sweep_outbox(ids.utcnow() - sweep_window)
        except Exception as exc:
            log.exception("tick: the outbox sweep failed")
            errors["outbox"], failure = f"{type(exc).__name__}: {exc}", exc
        if failure is not None and len(errors) == (2 if ticker is not None else 1):  # nothing succeeded
            raise TickFailed("; ".join(f"{part}: {error}" for part, error in errors.items())) from failure
        log.info("tick: %s", summary)
        return summary

    return handler


def http_handler(
    wf: Workflows,
    *,
    prefix: str = "/v1/workflow",
    binary_support: bool = True,
    authorize: Callable[[Any, str], bool] | None = None,
) -> Callable[[Mapping[str, Any], Any], dict[str, Any]]:
    """A Lambda handler serving ``wf``'s RPC and webhook endpoints under ``prefix`` (Function URL, API Gateway REST
    or HTTP API, ALB), through ``apig-wsgi``; ``authorize(request, method)`` guards the RPC as in
    :func:`celery_workflow.api.rpc_blueprint`."""
    return _served(lambda api: api.blueprint(wf, authorize=authorize), prefix, binary_support)


def rpc_handler(
    wf: Workflows,
    *,
    prefix: str = "/v1/workflow",
    binary_support: bool = True,
    authorize: Callable[[Any, str], bool] | None = None,
) -> Callable[[Mapping[str, Any], Any], dict[str, Any]]:
    """A Lambda handler serving ``wf``'s RPC endpoint alone (``POST <prefix>/rpc``; webhooks are 404), as
    :func:`http_handler` does; ``authorize`` guards it (:func:`celery_workflow.api.rpc_blueprint`)."""
    return _served(lambda api: api.rpc_blueprint(wf, authorize=authorize), prefix, binary_support)


def webhook_handler(
    wf: Workflows, *, prefix: str = "/v1/workflow", binary_support: bool = True
) -> Callable[[Mapping[str, Any], Any], dict[str, Any]]:
    """A Lambda handler serving ``wf``'s webhook endpoint alone (``<prefix>/webhooks/<token>``; the RPC is 404), as
    :func:`http_handler` does: what a public Function URL may serve, since a webhook is authorised by its token."""
    return _served(lambda api: api.webhook_blueprint(wf), prefix, binary_support)


def _served(
    blueprint: Callable[[Any], Any], prefix: str, binary_support: bool
) -> Callable[[Mapping[str, Any], Any], dict[str, Any]]:
    """A Lambda handler serving the Flask blueprint ``blueprint(celery_workflow.api)`` under ``prefix``."""
    if not isinstance(prefix, str) or (prefix and not prefix.startswith("/")):
        raise ConfigurationError(f"prefix must be a path starting with '/' (or empty), got {prefix!r}")
    try:
        from apig_wsgi import make_lambda_handler
        from flask import Flask

        from celery_workflow import api
    except ImportError as exc:  # pragma: no cover - exercised only without the extras
        raise ConfigurationError(
            "the HTTP handlers need flask and apig-wsgi: pip install 'celery-workflow[aws,flask]'"
        ) from exc

    app = Flask("celery_workflow")
    app.register_blueprint(blueprint(api), url_prefix=prefix.rstrip("/") or None)
    handler: Any = make_lambda_handler(app, binary_support=binary_support)

    def serve(event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
        problem = malformed(event)
        if problem is not None:
            log.warning("malformed HTTP event: %s", problem)
            return _bad_event(problem)
        try:
            answer: dict[str, Any] = handler(dict(event), context)
        except Exception as exc:  # the app's own errors are answered by Flask: this is the event's conversion
            log.warning("cannot read the HTTP event as a request", exc_info=True)
            return _bad_event(f"the event cannot be read as a request ({type(exc).__name__})")
        return answer

    return serve


#: The Lambda HTTP payload versions :func:`http_handler` reads (``alb``: an ALB event, which has no version).
PAYLOAD_VERSIONS = ("1.0", "2.0", "alb")


def _bad_event(message: str) -> dict[str, Any]:
    """A 400 answer every payload version and the ALB accept."""
    body = {"error": {"code": "malformed_event", "message": message}}
    return {
        "statusCode": 400,
        "headers": {"content-type": "application/json"},
        "body": json.dumps(body),
        "isBase64Encoded": False,
    }


def _strings(value: Any, *, lists: bool = False) -> bool:
    """``value`` maps str to str (``lists``: to lists of str)."""
    if not isinstance(value, Mapping):
        return False
    for key, item in value.items():
        if not isinstance(key, str):
            return False
        if lists and not (isinstance(item, list) and all(isinstance(v, str) for v in item)):
            return False
        if not lists and not isinstance(item, str):
            return False
    return True


def _latin1(text: str) -> bool:
    try:
        text.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return True


def malformed(event: Any) -> str | None:
    """Why ``event`` cannot be served as an HTTP request (see the module docstring), or None when it can."""
    if not isinstance(event, Mapping):
        return f"the event is a {type(event).__name__}, not an object"
    context = event.get("requestContext")
    version = "alb" if isinstance(context, Mapping) and "elb" in context else event.get("version", "1.0")
    if version not in PAYLOAD_VERSIONS:
        return f"unknown payload version {str(version)[:20]!r}: one of 1.0, 2.0 (or an ALB event)"
    body = event.get("body")
    if body is not None and not isinstance(body, str):
        return f"body must be a string or null, not {type(body).__name__}"
    encoded = event.get("isBase64Encoded", False)
    if not isinstance(encoded, bool):
        return "isBase64Encoded must be true or false"
    if encoded and body:
        try:
            base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            return "body is not valid base64 (isBase64Encoded is true)"
    if version == "2.0":
        http = context.get("http") if isinstance(context, Mapping) else None
        if not isinstance(http, Mapping):
            return "requestContext.http is missing (payload 2.0)"
        if not all(isinstance(http.get(key), str) for key in ("method", "sourceIp", "protocol")):
            return "requestContext.http must have method, sourceIp and protocol strings"
        if not _strings(event.get("headers")):
            return "headers must be an object of strings (payload 2.0)"
        cookies = event.get("cookies", [])
        if not isinstance(cookies, list) or not all(isinstance(c, str) for c in cookies):
            return "cookies must be a list of strings"
        path, query = event.get("rawPath"), event.get("rawQueryString")
        if not isinstance(path, str) or not isinstance(query, str):
            return "rawPath and rawQueryString must be strings (payload 2.0)"
        if not _latin1(query):
            return "the query string has characters beyond Latin-1"
    else:
        path = event.get("path")
        if not isinstance(event.get("httpMethod"), str) or not isinstance(path, str):
            return "httpMethod and path must be strings (payload 1.0)"
        for key, lists in (
            ("headers", False),
            ("multiValueHeaders", True),
            ("queryStringParameters", False),
            ("multiValueQueryStringParameters", True),
        ):
            if event.get(key) is not None and not _strings(event[key], lists=lists):
                return f"{key} must be an object of {'lists of ' if lists else ''}strings or null"
    if not _latin1(path):
        return "the path has characters beyond Latin-1"
    return None
