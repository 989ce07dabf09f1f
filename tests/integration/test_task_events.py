"""What a Celery worker reports for workflow and step deliveries (issue #29, item 3): a real worker (Celery's embedded
test worker, solo pool, in this process) on the SQLite World's transport, with every event it sends recorded as it
is published and replayed into Celery's own ``events.State`` (what Flower keeps).

* a delivery that failed its run is FAILURE with the run's error, acked (nothing redelivered, nothing dead-lettered);
* a queued step attempt that failed and will run again is RETRY, and Celery publishes nothing for it;
* inline step attempts are tasks of their own (``step.<name>``) when the worker sends task events, and cost nothing
  when it does not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.events.dispatcher import EventDispatcher
from celery.events.state import State

from celery_workflow import FatalError, Workflows, step_metadata
from celery_workflow.events import EventType


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """Celery's embedded worker sets up logging for the whole process (the root logger's level to its loglevel,
    ERROR, and its handlers): put them back, or later tests in this process see no warnings (caplog)."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    root.setLevel(level)
    root.handlers[:] = handlers


class Recorded:
    """Every event any dispatcher of this process publishes (the worker's and the inline steps')."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def of(self, kind: str, name: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            events = list(self.events)
        names = {e["uuid"]: e.get("name") for e in events if e["type"] == "task-received"}
        return [e for e in events if e["type"] == kind and (name is None or names.get(e.get("uuid")) == name)]

    def state(self) -> State:
        state = State()
        with self.lock:
            for event in self.events:
                state.event({**event, "local_received": time.time()})
        return state


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Recorded:
    record = Recorded()
    publish = EventDispatcher._publish

    def recording(self: EventDispatcher, event: Any, producer: Any, routing_key: str, **kwargs: Any) -> Any:
        with record.lock:  # one event, or a batch of the worker's buffered task events
            record.events.extend(dict(e) for e in (event if isinstance(event, list) else [event]))
        return publish(self, event, producer, routing_key, **kwargs)

    monkeypatch.setattr(EventDispatcher, "_publish", recording)
    return record


@pytest.fixture
def wf(tmp_path: Path) -> Iterator[Workflows]:
    workflows = Workflows(Celery("task_events"), world=f"sqlite:///{tmp_path / 'world.sqlite3'}", broker="world")
    yield workflows
    workflows.close()


def define(wf: Workflows) -> Any:
    @wf.step(max_retries=0)
    def declined(order: str) -> None:
        raise FatalError(f"card declined for {order}")

    @wf.workflow
    def fulfil(order: str) -> None:
        declined(order)

    @wf.step(max_retries=2, retry_backoff=0.05)
    def flaky(tag: str) -> str:
        if step_metadata().attempt == 1:
            raise RuntimeError(f"attempt 1 of {tag} fails")
        return f"{tag}@{step_metadata().attempt}"

    @wf.workflow
    def queued_retry(tag: str) -> str:
        return flaky.start(tag).result()

    @wf.step
    def add(a: int, b: int) -> int:
        return a + b

    @wf.workflow
    def adding(n: int) -> int:
        return add(n, 1)

    return fulfil, queued_retry, adding


def wait_for(condition: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)
    return value


def idle(wf: Workflows) -> bool:
    """Nothing left in the World's queue: every delivery was acked, none put back or published again."""
    return wf.world.store.peek() == []  # type: ignore[attr-defined]


def test_a_run_that_failed_is_reported_failed_with_its_error_and_acked(wf: Workflows, recorded: Recorded) -> None:
    fulfil, _, _ = define(wf)
    with start_worker(wf.celery_app, perform_ping_check=False, task_events=True, shutdown_timeout=30):
        run = fulfil.start("o-1")
        wait_for(lambda: run.status == "failed")
        (failed,) = wait_for(lambda: recorded.of("task-failed", "workflow.fulfil"))
        wait_for(lambda: idle(wf))
    assert "RunFailedReport" in failed["exception"] and "FatalError: card declined for o-1" in failed["exception"]
    task = recorded.state().tasks[failed["uuid"]]
    assert (task.state, task.name) == ("FAILURE", "workflow.fulfil")
    assert run.id in task.args
    assert recorded.of("task-rejected") == []  # acked, not rejected: neither dead-lettered nor backed off
    assert [e.event_type for e in run.events()].count(EventType.RUN_FAILED) == 1
    assert len(recorded.of("task-received", "workflow.fulfil")) == 1  # one delivery, never redelivered
    assert wf.world.store.list_dead_letters(run_id=run.id) == []  # type: ignore[attr-defined]


def test_a_step_attempt_that_will_run_again_is_reported_retry_and_nothing_is_republished(
    wf: Workflows, recorded: Recorded
) -> None:
    _, queued_retry, _ = define(wf)
    with start_worker(wf.celery_app, perform_ping_check=False, task_events=True, shutdown_timeout=30):
        run = queued_retry.start("r-1")
        assert run.result(timeout=20) == "r-1@2"
        wait_for(lambda: idle(wf))
    (retried,) = recorded.of("task-retried", "step.flaky")
    assert "StepAttemptFailed" in retried["exception"] and "attempt 1 of r-1 fails" in retried["exception"]
    state = recorded.state()
    assert state.tasks[retried["uuid"]].state == "RETRY"
    received = recorded.of("task-received", "step.flaky")
    assert len(received) == 2  # the attempt that failed, and the retry delivery the World held: none from Celery
    assert [state.tasks[e["uuid"]].state for e in received] == ["RETRY", "SUCCESS"]
    assert recorded.of("task-rejected") == []


def test_inline_step_attempts_are_tasks_of_their_own_when_events_are_on(wf: Workflows, recorded: Recorded) -> None:
    _, _, adding = define(wf)
    with start_worker(wf.celery_app, perform_ping_check=False, task_events=True, shutdown_timeout=30):
        run = adding.start(2)
        assert run.result(timeout=20) == 3
        (done,) = wait_for(lambda: recorded.of("task-succeeded", "step.add"))
    (delivery,) = recorded.of("task-received", "workflow.adding")
    (received,) = recorded.of("task-received", "step.add")
    assert received["uuid"] != delivery["uuid"]
    assert received["parent_id"] == delivery["uuid"] and run.id in received["args"]
    assert received["retries"] == 0 and received["hostname"] == delivery["hostname"]
    assert done["result"] == "3" and done["runtime"] >= 0
    task = recorded.state().tasks[received["uuid"]]
    assert (task.name, task.state) == ("step.add", "SUCCESS")


def test_inline_steps_send_nothing_and_open_nothing_when_events_are_off(
    wf: Workflows, recorded: Recorded, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, adding = define(wf)
    opened: list[str] = []
    events = wf.celery_app.events
    default = events.default_dispatcher

    def counting(*args: Any, **kwargs: Any) -> Any:
        opened.append("dispatcher")
        return default(*args, **kwargs)

    monkeypatch.setattr(events, "default_dispatcher", counting)
    with start_worker(wf.celery_app, perform_ping_check=False, task_events=False, shutdown_timeout=30):
        assert adding.start(2).result(timeout=20) == 3
    assert opened == []
    assert recorded.of("task-received") == []
