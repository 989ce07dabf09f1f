"""Forced hook claims (``create_hook(token, force=True)``) on the SQLite, Postgres, AWS (moto) and memory Worlds.

A token has one live owner. A forced claim takes it over: the owner's hook is disposed in the owner's own log
(``hook_disposed`` with ``taken_by``) and its run woken, so its ``wait()`` raises HookConflict naming the taker; the
taker records the conflict, then claims the token again as ``hook:<n>~1``. Two single-run appends, never one
transaction over two runs: nothing to lock in order, and no World needs code of its own for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_workflow import HookConflict, Workflows, create_hook
from celery_workflow.events import EventType
from celery_workflow.testing import History, LocalWorker, MemoryWorld, replay_history
from tests.integration.aws_fixtures import aws_fixture, moto_fixture  # noqa: F401


@pytest.fixture(params=["sqlite", "postgres", "aws", "memory"])
def wf(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Workflows]:
    if request.param == "aws":
        aws = request.getfixturevalue("aws")
        workflows = Workflows(Celery("forced"), world=aws.world(), broker="app")
        yield workflows
        workflows.close()
        return
    if request.param == "memory":
        workflows = Workflows(Celery("forced"), world=MemoryWorld(), broker="app")
        yield workflows
        workflows.close()
        return
    if request.param == "sqlite":
        workflows = Workflows(Celery("forced"), world=f"sqlite:///{tmp_path / 'f.sqlite3'}", broker="app")
        yield workflows
        workflows.close()
        return
    from tests.integration import pg_fixtures

    with pg_fixtures.fresh_schema("cw_forced") as schema:
        workflows = Workflows(Celery("forced"), world=pg_fixtures.schema_url(schema), broker="app")
        yield workflows
        workflows.close()


def _flows(wf: Workflows) -> Any:
    @wf.step
    def note(value: str) -> str:
        return value

    @wf.workflow
    def holder(token: str) -> list[Any]:
        hook = create_hook(token=token)
        try:
            return ["got", hook.wait()]
        except HookConflict as exc:
            return ["taken", exc.conflicting_run_id]

    @wf.workflow
    def taker(token: str, force: bool) -> list[Any]:
        hook = create_hook(token=token, force=force)
        noted = note("between")  # creations between the conflict and the re-claim keep their order
        try:
            return ["got", hook.wait(), noted]
        except HookConflict as exc:
            return ["conflict", exc.conflicting_run_id, noted]

    return holder, taker


def test_a_forced_claim_takes_the_token_and_the_owner_learns_who_took_it(wf: Workflows) -> None:
    holder, taker = _flows(wf)
    worker = LocalWorker(wf)
    a = holder.start("T")
    worker.run_until_idle()
    assert wf.world.get_hook_by_token("T").run_id == a.id

    b = taker.start("T", True)
    worker.run_until(lambda: a.status.terminal and wf.world.get_hook_by_token("T").run_id == b.id)
    assert a.result(timeout=0) == ["taken", b.id]
    disposed = [e for e in a.events() if e.event_type is EventType.HOOK_DISPOSED]
    assert [(e.correlation_id, e.data["taken_by"]) for e in disposed] == [("hook:1", b.id)]

    wf.resume_hook("T", 42)
    worker.run_until(lambda: b.status.terminal)
    assert b.result(timeout=0) == ["got", 42, "between"]
    kinds = [
        (e.event_type.value, e.correlation_id) for e in b.events() if e.correlation_id and "hook" in e.correlation_id
    ]
    assert kinds[:2] == [("hook_conflict", "hook:1"), ("hook_created", "hook:1~1")]
    assert b.events()[[e.correlation_id for e in b.events()].index("hook:1~1")].data["force"] is True

    # the logs replay without divergence
    for run in (a, b):
        assert replay_history(wf, History.from_world(wf.world, run.id)).status == "completed"


def test_without_force_the_second_claimant_gets_a_conflict(wf: Workflows) -> None:
    holder, taker = _flows(wf)
    worker = LocalWorker(wf)
    a = holder.start("U")
    worker.run_until_idle()
    b = taker.start("U", False)
    worker.run_until(lambda: b.status.terminal)
    assert b.result(timeout=0) == ["conflict", a.id, "between"]
    assert a.status == "running" and wf.world.get_hook_by_token("U").run_id == a.id


def test_a_token_taken_twice_ends_with_the_last_taker(wf: Workflows) -> None:
    _, taker = _flows(wf)
    worker = LocalWorker(wf)
    first = taker.start("V", True)  # free token: a plain claim
    worker.run_until_idle()
    second = taker.start("V", True)
    worker.run_until(lambda: first.status.terminal)
    assert first.result(timeout=0) == ["conflict", second.id, "between"]
    third = taker.start("V", True)
    worker.run_until(lambda: second.status.terminal)
    assert second.result(timeout=0) == ["conflict", third.id, "between"]
    wf.resume_hook("V", "done")
    worker.run_until(lambda: third.status.terminal)
    assert third.result(timeout=0) == ["got", "done", "between"]
