"""The AWS World under the contention and throttling real DynamoDB produces and moto never does (issue #33, item 1).

Errors are injected into the DynamoDB client before a request reaches the emulator (botocore's ``before-call``
event answers in its place), so nothing was written, as when DynamoDB cancels a transaction for a conflict with
another writer or throttles a request: a quarter of the transactions cancelled with ``TransactionConflict`` (and a few
with ``ThrottlingError``), every fifth query throttled. Every run completes with its result; none records a World
error as its failure.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse
from celery import Celery

from celery_workflow import Workflows, gather
from celery_workflow.errors import WorldError
from celery_workflow.events import EventType, RunStatus
from celery_workflow.testing import LocalWorker
from tests.integration.aws_fixtures import Aws, aws_fixture, moto_fixture  # noqa: F401


def injected_error(code: str, reasons: list[str] | None = None) -> tuple[AWSResponse, dict[str, Any]]:
    """A DynamoDB error answer in place of the request (``reasons``: a cancelled transaction's, per action)."""
    parsed: dict[str, Any] = {
        "Error": {"Code": code, "Message": f"injected {code}"},
        "ResponseMetadata": {"HTTPStatusCode": 400},
    }
    if reasons is not None:
        parsed["CancellationReasons"] = [{"Code": r} for r in reasons]
    return AWSResponse("https://dynamodb.invalid/", 400, {}, None), parsed


class Injector:
    """Answers chosen DynamoDB calls with an error instead of sending them."""

    def __init__(self) -> None:
        self.counts: dict[str, itertools.count[int]] = {}
        self.injected: dict[str, int] = {}
        self.lock = threading.Lock()

    def __call__(self, model: Any, params: Any, **_: Any) -> tuple[AWSResponse, dict[str, Any]] | None:
        name = model.name
        with self.lock:
            n = next(self.counts.setdefault(name, itertools.count(1)))
        if name in ("TransactWriteItems", "TransactGetItems") and n % 4 == 0:
            actions = len(params.get("TransactItems", [])) or 1
            reason = "ThrottlingError" if n % 12 == 0 else "TransactionConflict"
            return self._error(name, "TransactionCanceledException", [reason] + ["None"] * (actions - 1))
        if name == "Query" and n % 5 == 0:
            return self._error(name, "ThrottlingException")
        return None

    def _error(self, name: str, code: str, reasons: list[str] | None = None) -> tuple[AWSResponse, dict[str, Any]]:
        with self.lock:
            self.injected[name] = self.injected.get(name, 0) + 1
        return injected_error(code, reasons)


@pytest.fixture
def wf(aws: Aws) -> Iterator[Workflows]:
    workflows = Workflows(Celery("aws-faults"), world=aws.world(), broker="app")
    yield workflows
    workflows.close()


def test_every_run_completes_under_injected_conflicts_and_throttles(aws: Aws, wf: Workflows) -> None:
    @wf.step
    def add(a: int, b: int) -> int:
        return a + b

    @wf.workflow
    def chain(n: int) -> dict[str, Any]:
        total = 0
        for i in range(5):
            try:
                total = add(total, i + n)
            except Exception as exc:  # a World error must never reach the workflow's code
                return {"caught": f"{type(exc).__name__}: {exc}"}
        fan = gather(*(add.start(total, k) for k in range(5)))
        return {"total": total, "fan": fan}

    runs = [chain.start(n) for n in range(8)]  # (a start that meets a conflict raises to its caller: not this test)
    injector = Injector()
    aws.dynamodb.meta.events.register("before-call.dynamodb", injector)
    worker = LocalWorker(wf, backoff=lambda attempts: 0.05)
    deadline = time.monotonic() + 120
    while not all(run.status.terminal for run in runs):
        assert time.monotonic() < deadline, [run.status.value for run in runs]
        if not worker.run_once():
            time.sleep(0.02)
    aws.dynamodb.meta.events.unregister("before-call.dynamodb", injector)

    assert injector.injected.get("TransactWriteItems", 0) >= 5, injector.injected  # the faults really happened
    assert any(isinstance(exc, WorldError) for _, exc in worker.failures)
    for n, run in enumerate(runs):
        total = sum(i + n for i in range(5))
        assert run.status is RunStatus.COMPLETED, (run.id, run.view().error)
        assert run.result(timeout=0) == {"total": total, "fan": [total + k for k in range(5)]}
        assert EventType.RUN_FAILED not in [e.event_type for e in run.events()]


class Scripted:
    """Answers the calls of one DynamoDB operation with the scripted errors, one per call, then lets them through."""

    def __init__(self, operation: str, errors: list[tuple[str, list[str] | None]]) -> None:
        self.operation = operation
        self.errors = list(errors)
        self.calls = 0

    def __call__(self, model: Any, params: Any, **_: Any) -> tuple[AWSResponse, dict[str, Any]] | None:
        if model.name != self.operation:
            return None
        self.calls += 1
        if not self.errors:
            return None
        code, reasons = self.errors.pop(0)
        return injected_error(code, reasons)


def _scripted(aws: Aws, operation: str, errors: list[tuple[str, list[str] | None]]) -> Scripted:
    scripted = Scripted(operation, errors)
    aws.dynamodb.meta.events.register("before-call.dynamodb", scripted)
    return scripted


def test_a_transact_get_cancelled_for_contention_is_retried(aws: Aws) -> None:
    """TransactGetItems (an append's snapshot) cancelled with TransactionConflict or a throttling reason is read again;
    one that keeps being throttled is WorldUnavailable (issue #27, item 2)."""
    from celery_workflow._aws.dynamo import CONTENTION_TRIES
    from celery_workflow.errors import WorldUnavailable
    from celery_workflow.testing._conformance import create

    world = aws.world()
    run = create(world, run_id="wrun_contended_read", started=True)
    key = {"pk": f"RUN#{run.run_id}", "sk": "META"}
    cancelled = "TransactionCanceledException"
    reasons = [["TransactionConflict", "None"], ["None", "ThrottlingError"], ["ProvisionedThroughputExceeded", "None"]]
    scripted = _scripted(aws, "TransactGetItems", [(cancelled, r) for r in reasons])
    (item,) = world.table.get_snapshot(key, [{"pk": f"RUN#{run.run_id}", "sk": "STEP#none"}])
    assert item["pk"]["S"] == key["pk"] and scripted.calls == 4
    scripted.errors = [(cancelled, ["ThrottlingError", "None"])] * CONTENTION_TRIES
    with pytest.raises(WorldUnavailable, match="ThrottlingError"):
        world.table.get_snapshot(key, [{"pk": f"RUN#{run.run_id}", "sk": "STEP#none"}])
    assert scripted.calls == 4 + CONTENTION_TRIES


@pytest.mark.parametrize(
    "code", ["ThrottlingError", "ProvisionedThroughputExceeded", "ProvisionedThroughputExceededException"]
)
def test_throttling_codes_are_unavailability(aws: Aws, code: str) -> None:
    """Throttling is unavailability (503, retried later) in whichever spelling DynamoDB answers it, never a bare
    WorldError (issue #27, item 2)."""
    from celery_workflow.errors import WorldUnavailable

    world = aws.world()
    _scripted(aws, "GetItem", [(code, None)] * 10)
    with pytest.raises(WorldUnavailable, match=code):
        world.table.get({"pk": "RUN#x", "sk": "META"})


def test_a_single_write_refused_for_a_running_transaction_is_retried(aws: Aws) -> None:
    """A single-item request on an item a transaction holds is refused with TransactionConflictException (nothing
    written): it is sent again after a jittered pause, like a cancelled transaction, and a claim goes through
    (issue #27, item 2)."""
    from celery_workflow.world import Delivery

    world = aws.world()
    world.enqueue([Delivery("celery", b"contended", run_id="wrun_contended_write")])
    scripted = _scripted(
        aws, "UpdateItem", [("TransactionConflictException", None), ("ReplicatedWriteConflictException", None)]
    )
    deadline = time.monotonic() + 10
    claimed = world.claim(["celery"], lease=30)
    while not claimed:
        assert time.monotonic() < deadline, "the delivery was never claimed"
        claimed = world.claim(["celery"], lease=30)
    assert [c.payload for c in claimed] == [b"contended"] and scripted.calls == 3
    world.ack(claimed[0].receipt)
