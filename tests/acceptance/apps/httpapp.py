"""Workflows behind the HTTP edges, for tests with a real HTTP server and a real worker.

CELERY_WORKFLOW_URL: the World; CW_BASE_URL: where the blueprint is served (webhook URLs are built from it).
"""

from __future__ import annotations

import os
from pathlib import Path

from celery import Celery
from flask import Flask

from celery_workflow import WebhookRequest, Workflows, create_webhook, get_writable, step_metadata
from celery_workflow.api import CeleryWorkflow

celery_app = Celery("httpapp")
wf = Workflows(celery_app, base_url=os.environ.get("CW_BASE_URL"))
MARKERS = Path(os.environ.get("CW_MARKERS", "/tmp"))


@wf.step
def add(a: int, b: int) -> int:
    return a + b


@wf.workflow
def adder(a: int, b: int) -> int:
    return add(a, b)


@wf.step
def ticker(n: int) -> None:
    out = get_writable("ticks")
    for i in range(n):
        out.write({"tick": i})
        marker = MARKERS / f"http-tick-{step_metadata().run_id}-{i}"
        for _ in range(2000):  # the reader acknowledges each value before the next is written (≤ 20 s)
            if marker.exists():
                break
            import time

            time.sleep(0.01)
    out.write(b"\x00\x01")
    out.close()


@wf.workflow
def ticks(n: int) -> None:
    ticker(n)


@wf.step
def remember(url: str) -> str:
    (MARKERS / f"webhook-url-{step_metadata().run_id}").write_text(url)
    return url


@wf.workflow
def accepts_webhook() -> dict[str, object]:
    hook = create_webhook()
    remember(hook.url)
    req = hook.wait()
    return {"method": req.method, "json": req.json(), "query": req.query}


@wf.workflow
def fixed_webhook() -> str:
    hook = create_webhook(respond_with={"status": 201, "headers": {"x-fixed": "yes"}, "body": {"ok": True}})
    remember(hook.url)
    return hook.wait().text()


@wf.step
def answer(request: WebhookRequest) -> None:
    data = request.json()
    request.respond({"echo": data, "doubled": data["n"] * 2}, status=200, headers={"x-answered-by": "step"})


@wf.workflow
def manual_webhook() -> int:
    hook = create_webhook(respond_with="manual")
    remember(hook.url)
    request = hook.wait()
    answer(request)
    return int(request.json()["n"])


def create_app() -> Flask:
    app = Flask("httpapp")
    CeleryWorkflow(app, wf, url_prefix="/v1/workflow")
    return app
