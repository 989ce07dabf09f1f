"""The Postgres World's kept snapshots: one-round-trip appends planned on a run's state read earlier.

The whole conformance suite runs again through a World that reads each run's whole state before every append, so
every rule is checked on the kept-snapshot path too; the other tests make the kept snapshot stale on purpose (another
World on the same schema writes in between) and check that the stale plan is refused and the batch planned again on
fresh reads, with the same outcome as without a kept snapshot.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from celery_workflow import ids
from celery_workflow._postgres import script as _pg
from celery_workflow.errors import EntityTerminal, RunNotFound, RunTerminal, StaleLog, StepNotFound
from celery_workflow.events import EventType, NewEvent, RunStatus
from celery_workflow.testing.conformance import WorldConformance
from celery_workflow.world import AppendResult, Delivery, NewRun, World
from celery_workflow.world_pg import PostgresWorld
from tests.integration.pg_fixtures import (  # noqa: F401
    pg_admin_fixture,
    pg_schema_fixture,
    pg_url_fixture,
    pg_world_fixture,
)


class Preloading:
    """A PostgresWorld that reads the run's whole state before every append (as a workflow delivery does)."""

    def __init__(self, inner: PostgresWorld) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def append(self, run_id: str, events: Sequence[NewEvent], **kwargs: Any) -> AppendResult:
        try:
            self.inner.get_run_with_events(run_id)
        except RunNotFound:
            pass
        return self.inner.append(run_id, events, **kwargs)


class TestPostgresWorldOnKeptSnapshots(WorldConformance):
    @pytest.fixture
    def world(self, pg_url: str) -> Iterator[World]:
        w = PostgresWorld.open(pg_url)
        yield Preloading(w)  # type: ignore[misc]
        w.close()


@pytest.fixture(name="pair")
def pair_fixture(pg_url: str) -> Iterator[tuple[PostgresWorld, PostgresWorld]]:
    """Two Worlds on one schema: two processes' worth of kept snapshots."""
    a, b = PostgresWorld.open(pg_url), PostgresWorld.open(pg_url)
    yield a, b
    a.close()
    b.close()


@pytest.fixture(name="round_trips")
def round_trips_fixture(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The first statement of every Script sent (one entry per round trip of a script)."""
    sent: list[str] = []
    original = _pg.Script.send

    def send(self: _pg.Script) -> list[_pg.Result]:
        sent.append(" ".join(sql for sql, _ in self._queued[:3]))
        return original(self)

    monkeypatch.setattr(_pg.Script, "send", send)
    return sent


def started_run(world: PostgresWorld) -> str:
    run_id = ids.new_run_id()
    world.create_run(NewRun(run_id, "wf", {"args": [], "kwargs": {}}))
    world.append(run_id, [NewEvent(EventType.RUN_STARTED)])
    return run_id


def created(step_id: str) -> NewEvent:
    return NewEvent(EventType.STEP_CREATED, step_id, {"step_name": "s", "input": {"args": [], "kwargs": {}}})


def started(step_id: str) -> NewEvent:
    return NewEvent(EventType.STEP_STARTED, step_id, {})


def completed(step_id: str, result: Any = 1) -> NewEvent:
    return NewEvent(EventType.STEP_COMPLETED, step_id, {"result": result})


def test_appends_after_a_whole_read_take_one_round_trip_each(pg_world: PostgresWorld, round_trips: list[str]) -> None:
    run_id = started_run(pg_world)
    pg_world.get_run_with_events(run_id)
    round_trips.clear()
    pg_world.append(run_id, [created("s1"), started("s1")], durable=False)
    pg_world.append(run_id, [completed("s1"), created("s2"), started("s2")], durable=False)
    pg_world.append(run_id, [completed("s2"), NewEvent(EventType.RUN_COMPLETED, None, {"output": 2})])
    assert len(round_trips) == 3
    assert [e.slot for e in pg_world.list_events(run_id)] == list(range(1, 10))
    assert pg_world.get_run(run_id).status is RunStatus.COMPLETED
    assert len(pg_world.snapshots) == 0  # a terminal run is not kept


def test_without_a_whole_read_an_append_takes_two_round_trips(pg_world: PostgresWorld, round_trips: list[str]) -> None:
    run_id = started_run(pg_world)
    round_trips.clear()
    pg_world.append(run_id, [created("s1")])
    assert len(round_trips) == 2


def test_a_slot_taken_meanwhile_refuses_the_kept_plan_and_the_batch_is_planned_again(
    pair: tuple[PostgresWorld, PostgresWorld],
) -> None:
    a, b = pair
    run_id = started_run(a)
    a.get_run_with_events(run_id)
    b.append(run_id, [created("by-b")])  # a's snapshot is now one event behind
    result = a.append(run_id, [created("by-a")])
    assert [e.slot for e in result.events] == [4]
    log = a.list_events(run_id)
    assert [(e.slot, e.correlation_id) for e in log[2:]] == [(3, "by-b"), (4, "by-a")]
    assert {s.step_id for s in a.list_steps(run_id)} == {"by-a", "by-b"}


def test_a_rule_violation_on_a_stale_snapshot_is_decided_on_fresh_reads(
    pair: tuple[PostgresWorld, PostgresWorld],
) -> None:
    a, b = pair
    run_id = started_run(a)
    a.get_run_with_events(run_id)
    b.append(run_id, [created("s1"), started("s1")])
    # a's snapshot has no s1: on fresh reads the completion is valid
    assert [e.event_type for e in a.append(run_id, [completed("s1")]).events] == [EventType.STEP_COMPLETED]
    a.get_run_with_events(run_id)
    with pytest.raises(StepNotFound):
        a.append(run_id, [completed("never-created")])


def test_a_stale_snapshot_does_not_hide_a_terminal_step_or_a_moved_log(
    pair: tuple[PostgresWorld, PostgresWorld],
) -> None:
    a, b = pair
    run_id = started_run(a)
    a.append(run_id, [created("s1"), started("s1")])
    a.get_run_with_events(run_id)
    b.append(run_id, [completed("s1", "from b")])  # a still sees s1 running
    with pytest.raises(EntityTerminal):
        a.append(run_id, [completed("s1", "from a")])
    seen = a.get_run_with_events(run_id)[0].event_count
    b.append(run_id, [created("s2")])  # the log moves past what a replayed
    with pytest.raises(StaleLog):
        a.append(run_id, [created("s3")], expected_count=seen)
    results = [e.data.get("result") for e in a.list_events(run_id) if e.event_type is EventType.STEP_COMPLETED]
    assert results == ["from b"]


def test_a_run_ended_elsewhere_is_refused_on_fresh_reads(pair: tuple[PostgresWorld, PostgresWorld]) -> None:
    a, b = pair
    run_id = started_run(a)
    a.get_run_with_events(run_id)
    b.append(run_id, [NewEvent(EventType.RUN_CANCELLED, None, {})])
    with pytest.raises(RunTerminal):
        a.append(run_id, [created("late")])
    assert a.get_run(run_id).status is RunStatus.CANCELLED


def test_a_run_deleted_under_a_kept_snapshot_gets_no_rows(
    pg_world: PostgresWorld, pg_admin: Any, pg_schema: str
) -> None:
    """The tables an append writes have no foreign key to the run: the run's guarded UPDATE is what refuses a batch
    planned on a kept snapshot of a run deleted since (as the retention sweep does), before any of its rows lands."""
    run_id = started_run(pg_world)
    pg_world.get_run_with_events(run_id)  # the kept snapshot
    for table in ("events", "steps", "runs"):
        pg_admin.execute(f'DELETE FROM "{pg_schema}".celery_workflow_{table} WHERE run_id = %s', (run_id,))
    with pytest.raises(RunNotFound):
        pg_world.append(run_id, [created("s1"), started("s1")], deliveries=[Delivery("q", b"x", run_id=run_id)])
    for table in ("events", "steps", "queue"):
        row = pg_admin.execute(
            f'SELECT count(*) FROM "{pg_schema}".celery_workflow_{table} WHERE run_id = %s', (run_id,)
        )
        assert row.fetchone() == (0,), table


def test_a_kept_append_is_one_implicit_transaction_with_only_the_writes_the_run_needs(
    pg_world: PostgresWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripts: list[list[str]] = []
    original = _pg.Script.send

    def send(self: _pg.Script) -> list[_pg.Result]:
        scripts.append([sql.split(" (")[0] for sql, _ in self._queued])
        return original(self)

    monkeypatch.setattr(_pg.Script, "send", send)
    run_id = started_run(pg_world)
    pg_world.get_run_with_events(run_id)
    scripts.clear()
    pg_world.append(run_id, [created("s1"), started("s1")], durable=False)
    pg_world.append(run_id, [completed("s1"), NewEvent(EventType.RUN_COMPLETED, None, {"output": 1})])
    lazy, last = scripts
    # no BEGIN/COMMIT (the pipeline's end commits), the run's UPDATE locks it first, the events' key checks the plan
    assert lazy == [
        "SELECT set_config('synchronous_commit', %s, true)",
        "WITH updated AS",
        "INSERT INTO celery_workflow_events",
        "INSERT INTO celery_workflow_steps",
    ]
    # the run never had a hook or a wait: its end deletes none (nor locks tokens), and notifies its waiters
    assert not any("hook" in sql or "waits" in sql or sql.startswith(("BEGIN", "COMMIT")) for sql in last), last
    assert last[-1].startswith("SELECT pg_notify")
    assert pg_world.get_run(run_id).status is RunStatus.COMPLETED


def test_a_new_runs_quick_first_step_is_one_round_trip_with_its_end(pg_url: str, round_trips: list[str]) -> None:
    """The first delivery of a one-step run whose step is known to be quick reads the run once and writes once: the
    run's start, the step's creation, start and result, the run's end and the ack together."""
    from celery import Celery

    from celery_workflow import Workflows
    from celery_workflow.app import decode_message
    from celery_workflow.testing import LocalWorker
    from celery_workflow.world import Claim

    wf = Workflows(Celery("held"), world=PostgresWorld.open(pg_url), broker="app")
    try:

        @wf.step
        def bump(i: int) -> int:
            return i + 1

        @wf.workflow
        def once(i: int) -> int:
            return bump(i)

        LocalWorker(wf).run_until_complete(once.start(1))  # the step runs once in this process: now known quick
        run = once.start(2)
        world: Any = wf.world
        (claimed,) = world.claim([wf.runtime.default_queue], limit=1, lease=30)
        round_trips.clear()
        assert wf.handle_delivery(claimed.payload, Claim(claimed.receipt, claimed.attempts)) == "completed"
        assert len(round_trips) == 2, round_trips  # the read (nothing a message carries is trusted), the write
        assert [e.event_type for e in run.events()] == [
            EventType.RUN_CREATED,
            EventType.RUN_STARTED,
            EventType.STEP_CREATED,
            EventType.STEP_STARTED,
            EventType.STEP_COMPLETED,
            EventType.RUN_COMPLETED,
        ]
        delivery_id = decode_message(claimed.payload).id
        assert [(s.status.value, s.attempt, s.owner) for s in world.list_steps(run.id)] == [
            ("completed", 1, delivery_id)
        ]
        assert run.result() == 3 and world.store.peek() == []  # the delivery went with the write
    finally:
        wf.close()
