"""The task messages the World stores for Celery: what Flower and ``celery inspect`` show of them."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from celery import Celery
from celery.utils.saferepr import saferepr

from celery_workflow.app import build_message


def headers_of(payload: bytes) -> dict[str, Any]:
    headers: dict[str, Any] = json.loads(payload)["headers"]
    return headers


@pytest.mark.parametrize(
    "args",
    [
        ["wrun_01M8Y25G0X2FKSPJBM9Q799QDB"],
        ["wrun_01M8Y25G0X2FKSPJBM9Q799QDB", "step:charge card:1"],
        ["quotes ' and \" and é"],
        ["x" * 2000],  # longer than Celery cuts: saferepr's own output
        [1, {"a": [1, 2]}],
    ],
)
def test_argsrepr_is_what_celery_would_show(args: list[Any]) -> None:
    app = Celery("messages")
    headers = headers_of(build_message(app, "wf.task", args, {}, queue="celery", task_id="t-1"))
    conf = app.conf
    assert headers["argsrepr"] == saferepr(args, app.amqp.argsrepr_maxsize, maxlevels=conf.task_repr_maxlevels)
    assert headers["kwargsrepr"] == "{}"


def test_kwargs_are_shown_by_celerys_saferepr() -> None:
    app = Celery("messages")
    payload = build_message(app, "wf.task", [], {"run_id": "wrun_1"}, queue="celery", task_id="t-1")
    assert headers_of(payload)["kwargsrepr"] == saferepr({"run_id": "wrun_1"}, app.amqp.kwargsrepr_maxsize)
    body = json.loads(base64.b64decode(json.loads(payload)["body"]))
    assert body[:2] == [[], {"run_id": "wrun_1"}]
