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
        parsed: dict[str, Any] = {
            "Error": {"Code": code, "Message": f"injected {code}"},
            "ResponseMetadata": {"HTTPStatusCode": 400},
        }
        if reasons is not None:
            parsed["CancellationReasons"] = [{"Code": r} for r in reasons]
        return AWSResponse("https://dynamodb.invalid/", 400, {}, None), parsed


@pytest.fixture
def wf(aws: Aws) -> Iterator[Workflows]:
    workflows = Workflows(Celery("aws-faults"), world=aws.world(), configure_broker=False)
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
