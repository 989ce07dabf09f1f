"""Payload limits on the in-memory World: oversized values fail where they are produced, once, with their cause;
recorded errors are cut to a stated size; the HTTP body limit follows the World's ``max_payload``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from celery import Celery
from flask import Flask

from celery_workflow import StepFailed, WorkflowFailed, Workflows, create_hook
from celery_workflow.api import BODY_ROOM, default_max_body
from celery_workflow.codec import MAX_ERROR_MESSAGE, MAX_PAYLOAD_BYTES, MAX_TRACEBACK, cut, encoded_size
from celery_workflow.errors import PayloadTooLarge
from celery_workflow.events import EventType, StepStatus
from celery_workflow.testing import LocalWorker, MemoryWorld
from celery_workflow.world import DEFAULT_MAX_PAYLOAD

TOO_LARGE = "celery_workflow.errors.PayloadTooLarge"


def sized(n: int) -> str:
    """A string whose JSON encoding is ``n`` bytes (its two quotes included)."""
    return "x" * (n - 2)


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def failed_events(run: Any, kind: EventType) -> list[Any]:
    return [e for e in run.events() if e.event_type is kind]


def test_every_world_declares_its_limit() -> None:
    from celery_workflow._aws.table import MAX_ITEM_BYTES
    from celery_workflow.world_pg import PostgresWorld
    from celery_workflow.world_sqlite import SQLiteWorld
    from celery_workflow.world_sqs import AWSWorld

    assert MemoryWorld.max_payload == SQLiteWorld.max_payload == PostgresWorld.max_payload == DEFAULT_MAX_PAYLOAD
    # a DynamoDB item holds a value twice (input and output) and an error within 400 KB
    assert 100_000 < AWSWorld.max_payload < MAX_ITEM_BYTES // 2


@pytest.mark.parametrize("queued", [False, True], ids=["inline", "queued"])
def test_a_step_result_over_the_limit_fails_once_with_its_cause(
    wf: Workflows, worker: LocalWorker, queued: bool
) -> None:
    limit = wf.world.max_payload
    calls: list[int] = []

    @wf.step(max_retries=3)
    def produce(n: int) -> str:
        calls.append(n)
        return sized(n)

    @wf.workflow
    def flow() -> dict[str, Any]:
        fits = produce.start(limit).result() if queued else produce(limit)
        try:
            produce.start(limit + 1).result() if queued else produce(limit + 1)
        except StepFailed as exc:
            return {"fits": len(fits), "type": exc.error_type, "message": exc.error["message"]}
        return {"fits": len(fits)}

    run = flow.start()
    worker.run_until_complete(run, timeout=5)
    assert worker.failures == []  # no delivery failed: nothing was refused by an append
    out = run.result()
    assert out["fits"] == limit - 2  # a value of exactly max_payload bytes is stored
    assert out["type"] == TOO_LARGE and str(limit + 1) in out["message"] and str(limit) in out["message"]
    assert calls == [limit, limit + 1]  # the oversized step ran exactly once: no retry
    big = next(s for s in run.steps() if s.step_id == "step:produce:2")
    assert big.status is StepStatus.FAILED and big.attempt == 1
    (ev,) = failed_events(run, EventType.STEP_FAILED)
    assert ev.data["error"]["type"] == TOO_LARGE
    assert failed_events(run, EventType.STEP_RETRYING) == []


def test_an_uncaught_oversized_step_result_fails_the_run_with_that_cause(wf: Workflows, worker: LocalWorker) -> None:
    calls: list[int] = []

    @wf.step
    def produce() -> str:
        calls.append(1)
        return sized(wf.world.max_payload + 1)

    @wf.workflow
    def flow() -> str:
        return produce()

    run = flow.start()
    worker.run_until_complete(run, timeout=5)
    with pytest.raises(WorkflowFailed) as info:
        run.result()
    assert info.value.error["type"] == "celery_workflow.errors.StepFailed"
    assert "PayloadTooLarge" in info.value.error["message"]
    assert calls == [1]


def test_the_runtime_uses_the_limit_the_world_declares() -> None:
    world = MemoryWorld()
    world.max_payload = 1_000  # a World with a smaller store
    wf = Workflows(Celery("limits"), world=world, broker="app")
    try:
        assert wf.runtime.max_payload == 1_000
        calls: list[int] = []

        @wf.step
        def produce(n: int) -> str:
            calls.append(n)
            return sized(n)

        @wf.workflow
        def flow(text: str) -> int:
            return len(produce(1_000)) + len(produce(1_001))

        with pytest.raises(PayloadTooLarge):
            flow.start(sized(1_000))  # the input: {"args": [...], "kwargs": {}} is larger still
        assert wf.list_runs() == []
        run = flow.start("")
        LocalWorker(wf).run_until_complete(run, timeout=5)
        with pytest.raises(WorkflowFailed) as info:
            run.result()
        assert "1001 bytes" in info.value.error["message"] and calls == [1_000, 1_001]
        assert default_max_body(wf) == 1_000 + BODY_ROOM
        assert default_max_body(wf, webhook=True) == (1_000 - 250) // 4 * 3  # its base64 beside a quarter for headers
    finally:
        wf.close()


def test_an_oversized_workflow_output_fails_the_run(wf: Workflows, worker: LocalWorker) -> None:
    @wf.workflow
    def returns_too_much() -> str:
        return sized(wf.world.max_payload + 1)

    run = returns_too_much.start()
    worker.run_until_complete(run, timeout=5)
    assert run.status == "failed" and worker.failures == []
    with pytest.raises(WorkflowFailed) as info:
        run.result()
    assert info.value.error["type"] == TOO_LARGE


def test_an_oversized_step_input_raises_in_the_workflow(wf: Workflows, worker: LocalWorker) -> None:
    calls: list[int] = []

    @wf.step
    def take(text: str) -> int:
        calls.append(1)
        return len(text)

    @wf.workflow
    def flow() -> str:
        try:
            take(sized(wf.world.max_payload))
        except PayloadTooLarge as exc:
            return exc.message
        return "stored"

    run = flow.start()
    worker.run_until_complete(run, timeout=5)
    assert "the input of step take" in run.result() and calls == []


def test_an_oversized_hook_payload_is_refused_and_changes_nothing(wf: Workflows, worker: LocalWorker) -> None:
    @wf.workflow
    def waits() -> Any:
        return create_hook(token="big").wait()

    run = waits.start()
    worker.run_until_idle()
    count = len(run.events())
    with pytest.raises(PayloadTooLarge):
        wf.resume_hook("big", sized(wf.world.max_payload + 1))
    assert len(run.events()) == count
    wf.resume_hook("big", "ok")
    worker.run_until_complete(run, timeout=5)
    assert run.result() == "ok"


def test_a_huge_workflow_error_message_is_cut(wf: Workflows, worker: LocalWorker) -> None:
    @wf.workflow
    def raises() -> None:
        raise ValueError("m" * 1_000_000)

    run = raises.start()
    worker.run_until_complete(run, timeout=5)
    assert worker.failures == []
    with pytest.raises(WorkflowFailed) as info:
        run.result()
    error = info.value.error
    assert error["type"] == "ValueError"
    message, tb = error["message"], error["traceback"]
    assert len(message.encode()) <= MAX_ERROR_MESSAGE and message.startswith("mmm")
    kept = len(message) - len(message[message.index("…") :])
    assert message.endswith(f"… [truncated {1_000_000 - kept} bytes]")
    assert len(tb.encode()) <= MAX_TRACEBACK and tb.startswith("… [truncated ") and tb.endswith("mmm\n")


def test_a_huge_step_error_message_is_cut_in_retries_and_failure(wf: Workflows, worker: LocalWorker) -> None:
    calls: list[int] = []

    @wf.step(max_retries=1, retry_backoff=0.01)
    def noisy() -> None:
        calls.append(1)
        raise RuntimeError("n" * 500_000)

    @wf.workflow
    def flow() -> str:
        try:
            noisy()
        except StepFailed as exc:
            return exc.message
        return "no"

    run = flow.start()
    worker.run_until_complete(run, timeout=5)
    assert calls == [1, 1] and worker.failures == []
    assert "[truncated" in run.result()
    for kind in (EventType.STEP_RETRYING, EventType.STEP_FAILED):
        (ev,) = failed_events(run, kind)
        error = ev.data["error"]
        assert len(error["message"].encode()) <= MAX_ERROR_MESSAGE and "[truncated" in error["message"]
        assert len(error["traceback"].encode()) <= MAX_TRACEBACK
    assert encoded_size(run.view().output) < 2 * MAX_ERROR_MESSAGE


def test_an_exception_whose_str_fails_is_recorded_by_its_type(wf: Workflows, worker: LocalWorker) -> None:
    @wf.step(max_retries=0)
    def bad_step() -> None:
        raise BadStr()

    @wf.workflow
    def catches() -> str:
        try:
            bad_step()
        except StepFailed as exc:
            return str(exc.error["message"])
        return "no"

    @wf.workflow
    def raises() -> None:
        raise BadStr()

    caught, failed = catches.start(), raises.start()
    worker.run_until_complete(caught, timeout=5)
    worker.run_until_complete(failed, timeout=5)
    assert worker.failures == []
    assert caught.result() == "<BadStr: str() failed>"
    with pytest.raises(WorkflowFailed) as info:
        failed.result()
    assert info.value.error["message"] == "<BadStr: str() failed>"
    assert info.value.error["type"].endswith("BadStr")


def test_cut_keeps_within_the_limit_and_says_how_much_it_dropped() -> None:
    assert cut("short", 10) == "short"
    for text in ("a" * 5_000, "é" * 5_000, "🙂" * 5_000):
        for keep_end in (False, True):
            out = cut(text, 100, keep_end=keep_end)
            assert len(out.encode()) <= 100
            body = out.split("]", 1)[1] if keep_end else out.split("…", 1)[0]
            dropped = int(out.split("truncated ", 1)[1].split(" ", 1)[0])
            assert dropped + len(body.encode()) == len(text.encode())


def test_the_http_body_limit_follows_the_world(wf: Workflows) -> None:
    @wf.workflow
    def echo(text: str) -> str:
        return text

    app = Flask("limits")
    app.register_blueprint(wf.blueprint(), url_prefix="/wf")
    http = app.test_client()
    limit = wf.world.max_payload
    over = json.dumps({"method": "start", "params": {"workflow": "echo", "args": ["x" * (limit + BODY_ROOM)]}})
    resp = http.post("/wf/rpc", data=over, content_type="application/json")
    assert resp.status_code == 413 and "request body" in resp.get_json()["error"]["message"]
    # under the body limit but over what the World stores: refused by the payload check, nothing written
    under = json.dumps({"method": "start", "params": {"workflow": "echo", "args": [sized(limit + 1)]}})
    resp = http.post("/wf/rpc", data=under, content_type="application/json")
    assert resp.status_code == 413 and "max_payload" in resp.get_json()["error"]["message"]
    fits = json.dumps({"method": "start", "params": {"workflow": "echo", "args": [sized(limit - 100)]}})
    resp = http.post("/wf/rpc", data=fits, content_type="application/json")
    assert resp.status_code == 200, resp.get_json()
    assert default_max_body(wf) == limit + BODY_ROOM


def test_an_output_the_world_refuses_despite_its_limit_fails_the_run() -> None:
    """A World that declares more than an append takes (here: beyond the event-data limit every World checks): the
    refused run_completed becomes run_failed with PayloadTooLarge, instead of a delivery retried until it dies."""
    world = MemoryWorld()
    world.max_payload = MAX_PAYLOAD_BYTES * 2
    wf = Workflows(Celery("overstated"), world=world, broker="app")
    try:

        @wf.workflow
        def returns_too_much() -> str:
            return sized(MAX_PAYLOAD_BYTES + 100)

        run = returns_too_much.start()
        worker = LocalWorker(wf)
        worker.run_until_complete(run, timeout=5)
        assert worker.failures == []
        with pytest.raises(WorkflowFailed) as info:
            run.result()
        assert info.value.error["type"] == TOO_LARGE and "was refused" in info.value.error["message"]
    finally:
        wf.close()
