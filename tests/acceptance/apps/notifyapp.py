"""A workflow whose input reaches its output, a stream and its task messages: the notification test runs it on a
real `celery -A notifyapp worker` against the Postgres World of CELERY_WORKFLOW_URL."""

from __future__ import annotations

from celery import Celery

from celery_workflow import Workflows, get_writable

celery_app = Celery("notifyapp")
wf = Workflows(celery_app)


@wf.step
def shout(text: str) -> str:
    out = get_writable("notes")
    out.write({"heard": text})
    out.close()
    return f"{text} heard"


@wf.workflow
def echo(text: str) -> str:
    return shout(text)
