"""``create_hook(token_retention=...)`` and ``create_webhook(token_retention=...)``: a finished run keeps its hook's
token reserved until the retention ends (the rule is :mod:`celery_workflow.rules`; the World conformance suite holds
it on every World)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from celery_workflow import Workflows, create_hook, create_webhook, ids
from celery_workflow.errors import HookConflict, HookNotFound
from celery_workflow.events import EventType, RunStatus
from celery_workflow.testing import LocalWorker


def _created(wf: Workflows, run_id: str) -> dict[str, Any]:
    (event,) = [e for e in wf.world.list_events(run_id) if e.event_type is EventType.HOOK_CREATED]
    return dict(event.data)


def test_a_finished_run_keeps_its_token_reserved_until_the_retention_ends(wf: Workflows, worker: LocalWorker) -> None:
    @wf.workflow
    def approve(order: str) -> str:
        try:
            return str(create_hook(token=f"approve:{order}", token_retention=timedelta(hours=1)).wait())
        except HookConflict as exc:
            return f"conflict with {exc.conflicting_run_id}"

    first = approve.start("7")
    worker.run_until_idle()
    before = ids.utcnow()
    wf.resume_hook("approve:7", "yes")
    worker.run_until_complete(first)
    assert first.result() == "yes"
    until = ids.parse_iso(_created(wf, first.id)["token_retention_until"])
    assert before < until <= ids.utcnow() + timedelta(hours=1)
    with pytest.raises(HookNotFound, match=f"run {first.id}, which has ended"):
        wf.resume_hook("approve:7", "again")
    second = approve.start("7")  # the same order again: its token is still reserved by the first run
    worker.run_until_complete(second)
    assert second.result() == f"conflict with {first.id}"


def test_an_aware_datetime_is_the_retention_end_and_webhooks_take_it_too(wf: Workflows, worker: LocalWorker) -> None:
    end = datetime(2999, 1, 1, tzinfo=UTC)

    @wf.workflow
    def hooks() -> None:
        create_webhook(token="hook-w", token_retention=end).wait()

    run = hooks.start()
    worker.run_until_idle()
    assert ids.parse_iso(_created(wf, run.id)["token_retention_until"]) == end


@pytest.mark.parametrize("bad", [timedelta(seconds=-1), datetime(2999, 1, 1), 3600, "1h"])
def test_a_token_retention_that_is_not_a_timedelta_or_an_aware_datetime_fails_the_run(
    wf: Workflows, worker: LocalWorker, bad: Any
) -> None:
    @wf.workflow
    def wrong() -> None:
        create_hook(token="t", token_retention=bad)

    run = wrong.start()
    worker.run_until_complete(run)
    view = wf.world.get_run(run.id)
    assert view.status is RunStatus.FAILED and "token_retention" in str(view.error)
