"""``Run.waiting_on`` on an in-memory World, one case each (issue #30, item 5): a sleep until T, a hook (token hidden
unless revealed), a step's retry at T with its last error, a queued step, a queue nobody consumes, an ended run."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from celery import Celery

from celery_workflow import RetryableError, Workflows, create_hook, sleep
from celery_workflow.errors import PayloadError
from celery_workflow.ids import utcnow
from celery_workflow.testing import LocalWorker, MemoryWorld
from celery_workflow.waiting_on import (
    ChildWait,
    HookWait,
    QueueWait,
    Sleep,
    StepRetry,
    StepWait,
    Waiting,
    describe,
    waiting_json,
    waiting_of_json,
    waiting_on,
)

TOKEN = "approve:o-1"


@pytest.fixture
def wf() -> Iterator[Workflows]:
    workflows = Workflows(Celery("waiting-on"), MemoryWorld(), broker="app")

    @workflows.workflow
    def napping() -> str:
        sleep(timedelta(hours=1))
        return "awake"

    @workflows.workflow
    def approval() -> object:
        return create_hook(token=TOKEN, metadata={"order": "o-1"}).wait()

    @workflows.step(max_retries=3)
    def flaky() -> str:
        raise RetryableError("the bank is down", retry_after=600)

    @workflows.workflow
    def paying() -> str:
        return flaky()

    @workflows.step(queue="slow")
    def crunch() -> int:
        return 42

    @workflows.workflow
    def crunching() -> int:
        return crunch()

    @workflows.workflow
    def parent() -> str:
        return str(napping.start().result())

    yield workflows
    workflows.close()


def test_a_sleeping_run_waits_until_its_wake_up(wf: Workflows) -> None:
    run = wf.start("napping")
    before = utcnow()
    LocalWorker(wf).run_until(lambda: bool(run.waiting_on))
    (item,) = run.waiting_on
    assert isinstance(item, Sleep)
    assert before + timedelta(minutes=59) < item.until <= utcnow() + timedelta(hours=1)
    assert describe(item).startswith("sleep until ")


def test_a_parent_waits_on_its_child_run_until_the_child_ends(wf: Workflows) -> None:
    run = wf.start("parent")
    worker = LocalWorker(wf)
    worker.run_until(lambda: bool(run.waiting_on))
    (item,) = run.waiting_on
    assert item == ChildWait("child:1", f"{run.id}!1", "napping")
    assert describe(item) == f"child run {run.id}!1 (napping)"
    assert waiting_json([item])[0]["kind"] == "child"
    child = wf.get_run(f"{run.id}!1")
    worker.run_until(lambda: bool(child.waiting_on))
    (nap,) = child.waiting_on
    assert isinstance(nap, Sleep)  # what the child itself waits for
    child.cancel()
    worker.run_until_idle()
    assert run.waiting_on == []  # its child ended (cancelled): the parent woke and ended too


def test_a_run_on_a_hook_hides_its_token_unless_revealed(wf: Workflows) -> None:
    run = wf.start("approval")
    LocalWorker(wf).run_until(lambda: bool(run.waiting_on))
    (hidden,) = run.waiting_on
    assert isinstance(hidden, HookWait)
    assert hidden.token is None and hidden.metadata == {"order": "o-1"} and not hidden.is_webhook
    assert "(token hidden)" in describe(hidden) and TOKEN not in str(waiting_json([hidden]))
    (shown,) = run.waiting(reveal_tokens=True)
    assert isinstance(shown, HookWait) and shown.token == TOKEN


def test_a_step_retried_later_says_when_and_why(wf: Workflows) -> None:
    run = wf.start("paying")
    LocalWorker(wf).run_until(lambda: bool(run.waiting_on) and isinstance(run.waiting_on[0], StepRetry))
    (item,) = run.waiting_on
    assert isinstance(item, StepRetry)
    assert item.step_name == "flaky" and item.attempt == 1 and item.error["message"] == "the bank is down"
    assert item.retry_at is not None and item.retry_at > utcnow() + timedelta(minutes=9)
    assert "retry 2 at" in describe(item) and "the bank is down" in describe(item)
    assert waiting_json([item])[0]["kind"] == "retry"


def test_a_queued_step_and_a_queue_nobody_consumes(wf: Workflows) -> None:
    run = wf.start("crunching")
    LocalWorker(wf, queues=["celery"]).run_until(lambda: bool(run.waiting_on))
    (item,) = run.waiting_on  # the in-memory World records no consumers: the step is queued, no more is known
    assert isinstance(item, StepWait) and item.status == "queued" and item.step_name == "crunch"
    view, events = wf.world.get_run_with_events(run.id)
    (unserved,) = waiting_on(events, consumers={"celery": 1}, status=view.status)
    assert unserved == QueueWait("slow", item.step_id)
    assert "queue slow: no worker consumes it" in describe(unserved)
    assert waiting_on(events, consumers={"celery": 1, "slow": 2}, status=view.status) == [item]


def test_a_run_not_started_waits_on_its_queue_when_nobody_consumes_it(wf: Workflows) -> None:
    run = wf.start("napping")
    assert run.waiting_on == []  # nothing recorded yet, consumers unknown
    _, events = wf.world.get_run_with_events(run.id)
    assert waiting_on(events, consumers={}) == [QueueWait("celery", "run")]
    assert waiting_on(events, consumers={"celery": 1}) == []


def test_an_ended_run_waits_for_nothing(wf: Workflows) -> None:
    run = wf.start("approval")
    worker = LocalWorker(wf)
    worker.run_until(lambda: bool(run.waiting_on))
    wf.resume_hook(TOKEN, {"ok": True})
    worker.run_until_complete(run)
    assert run.waiting_on == []


def test_the_http_client_reads_it_from_get_run(wf: Workflows) -> None:
    import threading

    from flask import Flask
    from werkzeug.serving import make_server

    from celery_workflow.client import HTTPClient

    run = wf.start("approval")
    LocalWorker(wf).run_until(lambda: bool(run.waiting_on))
    app = Flask("waiting-http")
    app.register_blueprint(wf.blueprint(), url_prefix="/wf")
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        (item,) = HTTPClient(f"http://127.0.0.1:{server.server_port}/wf").get_run(run.id).waiting_on
    finally:
        server.shutdown()
        thread.join(5)
    assert item == run.waiting_on[0] and isinstance(item, HookWait) and item.token is None  # typed, as in-process
    assert describe(item) == "hook hook:1 (token hidden)"


def test_every_kind_reads_back_from_its_json() -> None:
    at = datetime(2026, 12, 6, 12, 0, 0, 123456, tzinfo=UTC)
    items: list[Waiting] = [
        Sleep("wait:1", at),
        HookWait("hook:1", None, True, {"a": [1]}, at, 2),
        StepRetry("step:s:1", "s", 2, at, {"type": "ValueError", "message": "no"}),
        StepRetry("step:s:2", "s", 1, None),
        StepWait("step:s:3", "s", "running", 1),
        QueueWait("reports", "run"),
        ChildWait("child:1", "wrun_x!1", "kid"),
    ]
    assert [waiting_of_json(data) for data in waiting_json(items)] == items
    assert waiting_of_json({"kind": "from-a-newer-server", "x": 1}) is None
    with pytest.raises(PayloadError):
        waiting_of_json({"kind": "sleep", "wait_id": "wait:1", "until": "not a time"})
    with pytest.raises(PayloadError):
        waiting_of_json({"kind": "queue", "queue": "q"})  # a field missing
    with pytest.raises(PayloadError):
        waiting_of_json("sleep")  # type: ignore[arg-type]  # what a broken server may send
