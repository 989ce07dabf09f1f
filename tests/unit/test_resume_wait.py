"""``wf.resume_hook(token, payload, wait=seconds)``: a resume sent right after ``start`` waits for the run to reach
its hook instead of racing it (issue #26, item 21)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_workflow import Workflows, create_hook
from celery_workflow.errors import ConfigurationError, HookNotFound
from celery_workflow.testing import LocalWorker, MemoryWorld


@pytest.fixture
def wf() -> Iterator[Workflows]:
    w = Workflows(Celery("resume-wait"), world=MemoryWorld(), broker="app")
    yield w
    w.close()


def test_a_resume_right_after_start_waits_for_the_hook(wf: Workflows) -> None:
    @wf.workflow
    def approve(order: str) -> Any:
        return create_hook(token=f"approve:{order}").wait()

    run = approve.start("o-1")
    with pytest.raises(HookNotFound):  # without waiting: the run has not reached its hook yet
        wf.resume_hook("approve:o-1", {"ok": True})
    outcome: dict[str, Any] = {}

    def resume() -> None:
        try:
            outcome["hook"] = wf.resume_hook("approve:o-1", {"ok": True}, wait=30)
        except Exception as exc:  # pragma: no cover - reported by the assertion below
            outcome["error"] = exc

    thread = threading.Thread(target=resume)
    thread.start()
    worker = LocalWorker(wf)
    worker.run_until(lambda: "hook" in outcome or "error" in outcome, timeout=30)
    worker.run_until_complete(run, timeout=30)
    thread.join(timeout=30)
    assert "error" not in outcome, outcome
    assert run.result(timeout=0) == {"ok": True}


def test_a_resume_that_waits_in_vain_raises_hook_not_found(wf: Workflows) -> None:
    with pytest.raises(HookNotFound):
        wf.resume_hook("nobody", None, wait=0.05)
    with pytest.raises(ConfigurationError):
        wf.resume_hook("nobody", None, wait=-1)
