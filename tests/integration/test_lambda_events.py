"""The Lambda HTTP handler answers 400 for events it cannot read as a request, and never raises (issue #26, item 14).

``http_handler`` does not care which World serves the requests, so these run on a SQLite World in a temporary
directory; a well-formed event of each payload version (1.0, 2.0, ALB) is still served.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_workflow import Workflows
from celery_workflow.aws_lambda import http_handler
from celery_workflow.world_sqlite import SQLiteWorld

RPC = "/v1/workflow/rpc"
GET_RUN = json.dumps({"method": "get_run", "params": {"run_id": "nope"}})


def v2(path: str = RPC, body: str = GET_RUN) -> dict[str, Any]:
    """A Function URL / HTTP API request (payload format 2.0)."""
    return {
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": path,
        "rawQueryString": "",
        "headers": {"content-type": "application/json", "host": "abc.lambda-url.us-east-1.on.aws"},
        "requestContext": {
            "http": {"method": "POST", "path": path, "protocol": "HTTP/1.1", "sourceIp": "127.0.0.1"},
            "requestId": "r1",
        },
        "body": body,
        "isBase64Encoded": False,
    }


def v1(path: str = RPC, body: str = GET_RUN) -> dict[str, Any]:
    """An API Gateway REST request (payload format 1.0)."""
    return {
        "httpMethod": "POST",
        "path": path,
        "headers": {"content-type": "application/json"},
        "queryStringParameters": None,
        "requestContext": {"requestId": "r1"},
        "body": body,
        "isBase64Encoded": False,
    }


def alb() -> dict[str, Any]:
    event = v1()
    event["requestContext"] = {"elb": {"targetGroupArn": "arn:aws:elasticloadbalancing:…"}}
    return event


def changed(base: dict[str, Any], change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    event = copy.deepcopy(base)
    change(event)
    return event


MALFORMED: dict[str, Any] = {
    "not an object": ["a", "list"],
    "v2 without headers": changed(v2(), lambda e: e.pop("headers")),
    "v2 headers null": changed(v2(), lambda e: e.update(headers=None)),
    "v2 header value a number": changed(v2(), lambda e: e["headers"].update({"x-n": 5})),
    "v2 without requestContext": changed(v2(), lambda e: e.pop("requestContext")),
    "v2 without requestContext.http": changed(v2(), lambda e: e["requestContext"].pop("http")),
    "v2 rawQueryString null": changed(v2(), lambda e: e.update(rawQueryString=None)),
    "v2 query beyond Latin-1": changed(v2(), lambda e: e.update(rawQueryString="a=\u20ac")),
    "v2 path beyond Latin-1": changed(v2(), lambda e: e.update(rawPath="/v1/workflow/webhooks/\u20ac")),
    "v2 dict body": changed(v2(), lambda e: e.update(body={"method": "get_run"})),
    "v2 bad base64": changed(v2(), lambda e: e.update(body="!!not base64!!", isBase64Encoded=True)),
    "v2 isBase64Encoded a string": changed(v2(), lambda e: e.update(isBase64Encoded="yes")),
    "unknown version": changed(v2(), lambda e: e.update(version="3.0")),
    "v1 without path": changed(v1(), lambda e: e.pop("path")),
    "v1 path beyond Latin-1": changed(v1(), lambda e: e.update(path="/v1/\u20ac")),
    "v1 dict body": changed(v1(), lambda e: e.update(body={"a": 1})),
    "v1 bad base64": changed(v1(), lambda e: e.update(body="%%%", isBase64Encoded=True)),
    "v1 headers a list": changed(v1(), lambda e: e.update(headers=["content-type"])),
    "alb multiValueHeaders not lists": changed(alb(), lambda e: e.update(multiValueHeaders={"a": "b"})),
}


@pytest.fixture
def handler(tmp_path: Path) -> Iterator[Callable[[Any, Any], dict[str, Any]]]:
    wf = Workflows(Celery("lambda-http"), world=SQLiteWorld(tmp_path / "world.db"), broker="app")
    yield http_handler(wf)
    wf.close()


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_event_is_answered_400(handler: Callable[[Any, Any], dict[str, Any]], case: str) -> None:
    answer = handler(MALFORMED[case], None)
    assert answer["statusCode"] == 400, answer
    assert answer["headers"]["content-type"] == "application/json"
    assert json.loads(answer["body"])["error"]["code"] == "malformed_event"


@pytest.mark.parametrize("event", [v1(), v2(), alb()], ids=["1.0", "2.0", "alb"])
def test_a_wellformed_event_is_served(handler: Callable[[Any, Any], dict[str, Any]], event: dict[str, Any]) -> None:
    answer = handler(event, None)
    assert answer["statusCode"] == 404 and json.loads(answer["body"])["error"]["code"] == "run_not_found"


def test_headers_null_in_payload_1_is_no_headers(handler: Callable[[Any, Any], dict[str, Any]]) -> None:
    """The API Gateway console sends ``headers: null``: served as a request without headers (no JSON type: 415)."""
    answer = handler(changed(v1(), lambda e: e.update(headers=None)), None)
    assert answer["statusCode"] == 415
