"""Running workflows in the test process, without Celery workers: :class:`LocalWorker`.

It claims deliveries from the World's queue like a worker's transport does, decodes the Celery task message the
World stored, and calls the same handlers the Celery tasks call. Use it with the in-memory World for fast unit tests
of your workflows::

    wf = Workflows(Celery("test"), world=MemoryWorld(), broker="app")
    ...
    run = my_workflow.start(1, 2)
    LocalWorker(wf).run_until_complete(run)
    assert run.result() == 3
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from celery_workflow.app import TaskMessage, Workflows, decode_message
from celery_workflow.client import Run
from celery_workflow.errors import ResultTimeout
from celery_workflow.events import RunView
from celery_workflow.world import Claim, ClaimedDelivery

#: A decoded delivery (the same record ``Workflows.handle_delivery`` runs).
Task = TaskMessage


def decode_task(payload: bytes) -> Task:
    """The task of a stored delivery message (``celery_workflow.app.decode_message``)."""
    return decode_message(payload)


def failure_backoff(attempts: int) -> float:
    """The transport's delay before a failed delivery is due again: 1 s, 2 s, 4 s … capped at 300 s."""
    return float(min(300, 2 ** max(0, attempts - 1)))


class LocalWorker:
    """Claims and handles deliveries of a :class:`Workflows` in this process."""

    def __init__(
        self,
        workflows: Workflows,
        queues: Sequence[str] | None = None,
        *,
        lease: float = 30.0,
        backoff: Callable[[int], float] = failure_backoff,
    ) -> None:
        """``backoff``: how long a failed delivery waits before it is due again, by its attempts so far (the
        transport's doubling delay by default; tests of failures may pass a shorter one)."""
        self.workflows = workflows
        self.world = workflows.world
        self.lease = lease
        self.backoff = backoff
        self.queues = list(queues) if queues is not None else self._all_queues()
        self.handled: list[tuple[Task, str]] = []  # (task, what the handler returned)
        self.failures: list[tuple[Task, BaseException]] = []

    def _all_queues(self) -> list[str]:
        wf = self.workflows
        names = {wf.runtime.default_queue, *wf.routes.values()}
        names.update(w.queue for w in wf.registry.workflows.values() if w.queue)
        names.update(s.queue for s in wf.registry.steps.values() if s.queue)
        return sorted(names)

    def handle(self, claimed: ClaimedDelivery) -> str:
        """Run one claimed delivery's task; ack it on success, back it off on failure (like the transport)."""
        task = decode_task(claimed.payload)
        try:
            outcome = self.workflows.handle_delivery(claimed.payload, Claim(claimed.receipt, claimed.attempts))
        except Exception as exc:
            self.failures.append((task, exc))
            self.world.retry_later(
                claimed.receipt, self.backoff(claimed.attempts), error=f"{type(exc).__name__}: {exc}"
            )
            return "error"
        self.world.ack(claimed.receipt)
        self.handled.append((task, outcome))
        return outcome

    def run_once(self) -> bool:
        """Handle one due delivery; False when none is due."""
        claimed = self.world.claim(self.queues, limit=1, lease=self.lease)
        if not claimed:
            return False
        self.handle(claimed[0])
        return True

    def run_until(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Handle deliveries until ``predicate()`` holds; ResultTimeout after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise ResultTimeout(f"condition not reached within {timeout} s")
            if not self.run_once():
                time.sleep(min(0.01, self.world.poll_interval))

    def run_until_complete(self, run: Run[Any], timeout: float = 10.0) -> RunView:
        self.run_until(lambda: run.status.terminal, timeout)
        return run.view()

    def run_until_idle(self, timeout: float = 10.0) -> int:
        """Handle every delivery that is due now (and those they queue); return how many ran."""
        count = 0
        deadline = time.monotonic() + timeout
        while self.run_once():
            count += 1
            if time.monotonic() > deadline:
                raise ResultTimeout(f"still busy after {timeout} s")
        return count
