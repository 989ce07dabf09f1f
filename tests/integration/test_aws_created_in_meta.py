"""``run_created`` kept in the run's META item (issue #31, item 3): the log's slot 1 has no ``EVENT#`` item of its own;
every reader takes it from META. Runs an earlier version wrote (an ``EVENT#1`` item, META without ``run_created``)
read as before, and a ``run_created`` too large to sit beside the view keeps its own item, which META names."""

from __future__ import annotations

from typing import Any

from celery_workflow._aws.log import created_of
from celery_workflow.events import EventType, RunStatus
from celery_workflow.testing._conformance import create, ev, step_created
from celery_workflow.world import NewRun
from celery_workflow.world_sqs import AWSWorld
from tests.integration.aws_fixtures import TABLE, Aws, aws_fixture, moto_fixture  # noqa: F401
from tests.integration.aws_legacy import created_out_of_meta
from tests.integration.test_aws_kept_snapshots import calls
from tests.integration.test_aws_step_views import partition


def _sks(aws: Aws, run_id: str) -> list[str]:
    return list(partition(aws, run_id))


def _meta(aws: Aws, run_id: str) -> dict[str, Any]:
    key = {"pk": {"S": f"RUN#{run_id}"}, "sk": {"S": "META"}}
    item: dict[str, Any] = aws.dynamodb.get_item(TableName=TABLE, Key=key, ConsistentRead=True)["Item"]
    return item


def _reads_the_same(world: AWSWorld, run_id: str, workflow: str = "wf") -> None:
    log = world.list_events(run_id)
    assert [e.slot for e in log] == list(range(1, len(log) + 1))
    created = log[0]
    assert created.event_type is EventType.RUN_CREATED and created.slot == 1 and created.run_id == run_id
    assert created.data["workflow_name"] == workflow
    assert world.list_events(run_id, limit=1) == [created]
    assert world.list_events(run_id, after_slot=1) == log[1:]
    view, read = world.get_run_with_events(run_id)
    assert read == log and view.event_count == len(log)


def test_run_created_is_kept_in_meta_not_in_an_item(aws: Aws) -> None:
    world = aws.world()
    run = create(world, started=True)
    assert _sks(aws, run.run_id) == [f"EVENT#{2:026d}", "META"]  # run_started's item; no EVENT#1
    meta = _meta(aws, run.run_id)
    created = created_of(meta)
    assert created is not None and created.event_type is EventType.RUN_CREATED
    _reads_the_same(world, run.run_id)
    world.append(run.run_id, [step_created("s1")])
    _reads_the_same(world, run.run_id)
    assert [s.step_id for s in world.list_steps(run.run_id)] == ["s1"]
    (end,) = world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=1)]).events
    assert end.slot == 4 and world.get_run(run.run_id).status is RunStatus.COMPLETED


def test_a_new_runs_read_is_one_get_item(aws: Aws) -> None:
    """A delivery's read of a run nothing appended to yet (a 1-step run's start): META holds the whole log."""
    world = aws.world()
    run = create(world)
    made = calls(aws.dynamodb)
    view, log = world.get_run_with_events(run.run_id)
    assert made == ["GetItem"] and [e.event_type for e in log] == [EventType.RUN_CREATED] and view.event_count == 1


def test_a_run_an_earlier_version_wrote_reads_the_same(aws: Aws) -> None:
    """An ``EVENT#1`` item holding run_created, META without ``run_created`` (as versions before wrote them): every
    read path gives the same log, and the run goes on and ends (its end queues the seed's expiry)."""
    world = aws.world()
    run = create(world, started=True)
    world.append(run.run_id, [step_created("s1")])
    before = world.list_events(run.run_id)
    created_out_of_meta(aws.dynamodb, TABLE, run.run_id)
    assert f"EVENT#{1:026d}" in _sks(aws, run.run_id) and "run_created" not in _meta(aws, run.run_id)
    fresh = aws.world()  # nothing kept of what the other read
    assert fresh.list_events(run.run_id) == before
    _reads_the_same(fresh, run.run_id)
    fresh.append(run.run_id, [ev(EventType.STEP_STARTED, "s1", attempt=1)])  # planned on its kept read
    assert [s.status.value for s in fresh.list_steps(run.run_id)] == ["running"]
    fresh.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=1)])
    assert fresh.get_run(run.run_id).status is RunStatus.COMPLETED
    assert [e.slot for e in fresh.list_events(run.run_id)] == [1, 2, 3, 4, 5]


def test_a_run_created_too_large_for_meta_keeps_its_own_item(aws: Aws) -> None:
    """Its input twice (the view's and the event's) and the room for the output would not fit in META's 400 KB:
    run_created gets its EVENT#1 item, which META names; the run reads and ends as any other, output included."""
    world = aws.world()
    big = "x" * (world.max_payload // 2)
    view, created = world.create_run(NewRun("wrun_big", "wf", {"args": [big]}))
    assert created
    assert _sks(aws, view.run_id) == [f"EVENT#{1:026d}", "META"]
    assert _meta(aws, view.run_id)["run_created"] == {"S": f"EVENT#{1:026d}"}
    log = world.list_events(view.run_id)
    assert log[0].data["input"] == {"args": [big]}
    _reads_the_same(world, view.run_id)
    world.append(view.run_id, [ev(EventType.RUN_STARTED)])
    world.get_run_with_events(view.run_id)
    world.append(view.run_id, [ev(EventType.RUN_COMPLETED, output="y" * (world.max_payload - 100))])
    assert world.get_run(view.run_id).status is RunStatus.COMPLETED


def test_a_small_input_is_kept_in_meta(aws: Aws) -> None:
    world = aws.world()
    view, _ = world.create_run(NewRun("wrun_small", "wf", {"args": ["x" * 10_000]}))
    assert _sks(aws, view.run_id) == ["META"]
    assert world.list_events(view.run_id)[0].data["input"] == {"args": ["x" * 10_000]}
