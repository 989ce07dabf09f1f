"""The AWS World on moto: fan-outs and run ends wider than one DynamoDB transaction (issue #26, item 4).

A transaction takes 100 actions: a gather of 40 steps needed 123 in one append (EventInvalid, the run failed), and a
run with more waits and hooks than fit beside its end could never end (its cleanup was in the same transaction).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import pytest
from celery import Celery

from celery_workflow import Workflows
from celery_workflow._aws.append import APPEND_LIMITS, MAX_TRANSACTION_BYTES
from celery_workflow._aws.append_actions import transaction_size
from celery_workflow._aws.items import from_item
from celery_workflow._aws.table import META, run_pk
from celery_workflow.errors import EventInvalid, EventTooLarge, HookNotFound
from celery_workflow.events import EventType, NewEvent, RunStatus
from celery_workflow.runtime.context import gather
from celery_workflow.testing._conformance import create, ev, hook_created, step_created, unique
from celery_workflow.testing.driver import LocalWorker, decode_task
from celery_workflow.world import AppendResult, Claim, ClaimedDelivery, Delivery
from celery_workflow.world_sqs import AWSWorld
from tests.integration.aws_fixtures import Aws, aws_fixture, moto_fixture  # noqa: F401


@pytest.fixture(name="world")
def world_fixture(aws: Aws) -> Iterator[AWSWorld]:
    w = aws.world()
    yield w
    w.close()


def test_a_gather_of_40_steps_completes(world: AWSWorld) -> None:
    wf = Workflows(Celery("awsfan"), world=world, broker="app")

    @wf.step
    def one(i: int) -> int:
        return i

    @wf.workflow
    def fan(n: int) -> int:
        return sum(gather(*[one.start(i) for i in range(n)]))

    run = fan.start(40)
    view = LocalWorker(wf, backoff=lambda attempts: 0.05).run_until_complete(run, timeout=60)
    assert view.status is RunStatus.COMPLETED, view.error
    assert run.result(timeout=0) == sum(range(40))
    wf.close()


def test_a_run_ends_whatever_waits_and_hooks_it_has(world: AWSWorld) -> None:
    run = create(world, started=True)
    waits = [ev(EventType.WAIT_CREATED, f"wait:{k}", resume_at="2000-01-01T00:00:00+00:00") for k in range(1, 41)]
    done = [ev(EventType.WAIT_COMPLETED, f"wait:{k}") for k in range(1, 41)]
    hooks = [hook_created(f"hook:{k}", unique("tok")) for k in range(1, 13)]
    setup = [*waits, *done, *hooks]
    for i in range(0, len(setup), 30):  # 30 events a transaction (a hook's creation is 3 actions)
        world.append(run.run_id, setup[i : i + 30])
    assert len(world.list_waits(run.run_id)) == 40 and len(world.list_hooks(run.run_id)) == 12
    # 40 waits, 12 hooks and their 12 tokens to delete: more than the room (RUN_END_ROOM) the end's transaction has
    ended = world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=1)]).run
    assert ended.status is RunStatus.COMPLETED
    assert world.list_waits(run.run_id) == [] and world.list_hooks(run.run_id) == []
    for hook in hooks:
        with pytest.raises(HookNotFound):
            world.get_hook_by_token(str(hook.data["token"]))


def test_transaction_size_counts_items_keys_and_values() -> None:
    put = {"Put": {"TableName": "t", "Item": {"pk": {"S": "a" * 10}, "v": {"B": b"x" * 100}}}}
    update = {
        "Update": {"TableName": "t", "Key": {"pk": {"S": "k"}}, "ExpressionAttributeValues": {":v": {"S": "y" * 50}}}
    }
    delete = {"Delete": {"TableName": "t", "Key": {"pk": {"S": "kk"}}}}
    assert transaction_size([put, update, delete]) == (2 + 10 + 1 + 100) + (2 + 1 + 50) + (2 + 2)
    assert MAX_TRANSACTION_BYTES == 4_000_000


def test_an_append_over_4_mb_is_event_invalid_and_writes_nothing(world: AWSWorld) -> None:
    """28 steps created with 150 KB inputs each: their events in 14 items of two (steps have no view items since
    issue #31, item 2), 15 actions, well within 100, but 4.2 MB, over DynamoDB's 4 MB per transaction: EventInvalid
    before anything is sent, like the 100-action limit, never a raw WorldError from DynamoDB (issue #27, item 7)."""
    run = create(world, started=True)
    before = world.get_run(run.run_id).event_count
    big = "x" * 150_000
    batch = [step_created(f"step:big:{k}", "big", [big]) for k in range(1, 29)]
    with pytest.raises(EventInvalid, match="4000000") as raised:
        world.append(run.run_id, batch)
    assert not isinstance(raised.value, EventTooLarge)  # no item is over 400 KB: the transaction is
    assert world.get_run(run.run_id).event_count == before and world.list_steps(run.run_id) == []
    world.append(run.run_id, batch[:12])  # what fits goes through
    assert len(world.list_steps(run.run_id)) == 12


def test_a_gather_over_4_mb_is_split_by_the_runtime(world: AWSWorld) -> None:
    """What the runtime writes for one delivery is split within the World's 4 MB as well as its 100 actions: a gather
    of 14 steps with 150 KB arguments each completes (issue #27, item 7)."""
    wf = Workflows(Celery("awsfan4mb"), world=world, broker="app")

    @wf.step
    def size(text: str) -> int:
        return len(text)

    @wf.workflow
    def fan(n: int) -> int:
        return sum(gather(*[size.start(chr(97 + i) * 150_000) for i in range(n)]))

    run = fan.start(14)
    view = LocalWorker(wf, backoff=lambda attempts: 0.05).run_until_complete(run, timeout=120)
    assert view.status is RunStatus.COMPLETED, view.error
    assert run.result(timeout=0) == 14 * 150_000
    wf.close()


def _wakes(world: AWSWorld, aws: Aws) -> list[bytes]:
    """The payloads of the wake-ups queued (claimed or not) on the default queue, received as a worker would."""
    got: list[bytes] = []
    while claimed := world.claim(["celery"], limit=10, lease=60):
        got += [c.payload for c in claimed]
    return got


def test_a_run_has_one_wake_up_queued_at_a_time(world: AWSWorld, aws: Aws) -> None:
    """Standard SQS does not deduplicate: each step result of a fan-out queued a wake-up, and each replayed the run
    from its whole log (N replays of an O(N) log). A wake-up queued and not yet taken stands for the next ones."""
    run = create(world, started=True)
    steps = [step_created(f"step:s:{i}") for i in range(1, 6)]
    world.append(run.run_id, steps)

    def result(i: int) -> None:
        world.append(
            run.run_id,
            [ev(EventType.STEP_STARTED, f"step:s:{i}"), ev(EventType.STEP_COMPLETED, f"step:s:{i}", result=i)],
            deliveries=[Delivery("celery", f"wake {i}".encode(), run.run_id, idempotency_key="wake")],
        )

    result(1)
    result(2)
    result(3)
    assert _wakes(world, aws) == [b"wake 1"]  # taken: the next result queues one again
    result(4)
    result(5)
    assert _wakes(world, aws) == [b"wake 4"]
    # other keys are not folded: a timer, a step's delivery
    world.append(run.run_id, [], deliveries=[Delivery("celery", b"timer", run.run_id, idempotency_key="timer:1")])
    world.append(run.run_id, [], deliveries=[Delivery("celery", b"timer", run.run_id, idempotency_key="timer:1")])
    assert _wakes(world, aws) == [b"timer", b"timer"]


def test_a_wake_up_of_another_run_is_never_folded(world: AWSWorld, aws: Aws) -> None:
    """A hand-over writes its successor's wake-up with the predecessor's end: a wake-up pending on the predecessor
    left the successor's out (it then waited for its check delivery, a minute later), and without one it was marked
    as the predecessor's pending wake-up."""
    run = create(world, started=True)
    successor = create(world, started=True)
    world.append(run.run_id, [], deliveries=[Delivery("celery", b"wake run", run.run_id, idempotency_key="wake")])
    successor_wake = Delivery("celery", b"wake successor", successor.run_id, idempotency_key="wake")
    world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=1)], deliveries=[successor_wake])
    assert sorted(_wakes(world, aws)) == [b"wake run", b"wake successor"]
    other = create(world, started=True)
    world.append(other.run_id, [], deliveries=[successor_wake])
    assert "pending_wake" not in from_item(world.table.get({"pk": run_pk(other.run_id), "sk": META}) or {})
    assert _wakes(world, aws) == [b"wake successor"]


class _Died(BaseException):
    """The writing worker's process ends here (nothing after it runs, nothing is released)."""


#: A split fan-out with fewer steps: each append takes 60 actions (19 step creations) instead of DynamoDB's 100, so a
#: gather of 40 steps is written in three appends, as one of 100 is in four, in less than half the time on moto.
NARROW = replace(APPEND_LIMITS, max_actions=60)
FAN = 40


def _fan_out(world: AWSWorld, name: str) -> tuple[Workflows, Any, LocalWorker]:
    world.append_limits = NARROW
    wf = Workflows(Celery(name), world=world, broker="app")

    @wf.step
    def one(i: int) -> int:
        return i

    @wf.workflow
    def fan(n: int) -> int:
        return sum(gather(*[one.start(i) for i in range(n)]))

    return wf, fan, LocalWorker(wf, backoff=lambda attempts: 0.05)


def _results_after_first_append(
    world: AWSWorld, worker: LocalWorker, run_id: str, monkeypatch: pytest.MonkeyPatch, *, then: BaseException | None
) -> list[str]:
    """Patch ``world.append`` so that right after the first append of the run's fan-out, three of the steps it created
    run on "other workers" (their results wake the run) while the writer goes on with its next appends (or dies,
    ``then``). The list returned gets the step ids that ran."""
    append = world.append
    ran: list[str] = []

    def append_then_results(run: str, events: Sequence[NewEvent], **kwargs: Any) -> AppendResult:
        result = append(run, events, **kwargs)
        if run == run_id and not ran and any(e.event_type is EventType.STEP_CREATED for e in events):
            for claimed in world.claim(["celery"], limit=3, lease=60):
                task = decode_task(claimed.payload)
                assert task.name.startswith("step."), task
                ran.append(str(task.args))
                worker.handle(claimed)
            assert ran
            if then is not None:
                raise then
        return result

    monkeypatch.setattr(world, "append", append_then_results)
    return ran


def _drain(world: AWSWorld) -> list[ClaimedDelivery]:
    got: list[ClaimedDelivery] = []
    while claimed := world.claim(["celery"], limit=10, lease=60):
        got += claimed
    return got


def _workflow_deliveries(claimed: Sequence[ClaimedDelivery]) -> list[str]:
    return [t.name for t in map(decode_task, (c.payload for c in claimed)) if not t.name.startswith("step.")]


def test_a_split_fan_out_holds_the_run_wake_ups_until_its_last_append(
    world: AWSWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the first delivery writes a fan-out of 40 steps in three appends, the steps of its first append run and
    their results wake the run: on standard SQS a second delivery then replayed beside the writer, met creations not
    yet written, wrote them itself, and both restarted from the whole log over and over (1,000 steps on moto: two
    deliveries replayed 14 times each over 33 s). The writer holds the run's wake-ups from its first append to its
    last and reads the results itself; nothing is lost (issue #26, item 4)."""
    wf, fan, worker = _fan_out(world, "awshold")
    run = fan.start(FAN)
    (opening,) = world.claim(["celery"], limit=1, lease=60)
    ran = _results_after_first_append(world, worker, run.id, monkeypatch, then=None)
    assert worker.handle(opening) == "suspended"
    assert 1 <= len(ran) <= 3
    monkeypatch.undo()
    queued = _drain(world)
    assert _workflow_deliveries(queued) == []  # no second delivery of the run to replay beside the writer
    assert "pending_wake" not in from_item(world.table.get({"pk": run_pk(run.id), "sk": META}) or {})
    for claimed in queued:
        world.release(claimed.receipt)
    view = worker.run_until_complete(run, timeout=120)
    assert view.status is RunStatus.COMPLETED, view.error
    assert run.result(timeout=0) == sum(range(FAN))
    wf.close()


def test_a_writer_that_dies_mid_split_strands_nothing(world: AWSWorld, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer of a split fan-out dies after its first append (results of its steps already in, their wake-ups
    held for it): its delivery comes back after its lease, whose claim ends the hold; it writes the rest, and the run
    completes with every step created once and run once."""
    wf, fan, worker = _fan_out(world, "awsholddies")
    run = fan.start(FAN)
    (opening,) = world.claim(["celery"], limit=1, lease=60)
    _results_after_first_append(world, worker, run.id, monkeypatch, then=_Died())
    monkeypatch.setattr(world, "release_wakes", lambda run_id, receipt: None)  # a dead process releases nothing
    with pytest.raises(_Died):
        wf.handle_delivery(opening.payload, Claim(opening.receipt, opening.attempts))
    monkeypatch.undo()
    queued = _drain(world)
    assert _workflow_deliveries(queued) == []  # held for the writer
    world.release(opening.receipt)  # its lease ends: SQS delivers it again
    for claimed in queued:
        world.release(claimed.receipt)
    view = worker.run_until_complete(run, timeout=120)
    assert view.status is RunStatus.COMPLETED, view.error
    assert run.result(timeout=0) == sum(range(FAN))
    created = [e.correlation_id for e in world.list_events(run.id) if e.event_type is EventType.STEP_CREATED]
    assert len(created) == len(set(created)) == FAN
    started = [e.correlation_id for e in world.list_events(run.id) if e.event_type is EventType.STEP_STARTED]
    assert sorted(started) == sorted(created)  # each step ran once


def test_a_split_fan_out_on_a_fifo_queue_completes(aws: Aws) -> None:
    """On a FIFO queue (one message of a run at a time) the split write holds and ends its hold the same way."""
    ordered = aws.queue("ordered.fifo", fifo=True)
    world = aws.world(queues={"ordered": ordered})
    world.append_limits = NARROW
    wf = Workflows(Celery("awsholdfifo"), world=world, broker="app")

    @wf.step(queue="ordered")
    def one(i: int) -> int:
        return i

    @wf.workflow(queue="ordered")
    def fan(n: int) -> int:
        return sum(gather(*[one.start(i) for i in range(n)]))

    run = fan.start(FAN)
    view = LocalWorker(wf, backoff=lambda attempts: 0.05).run_until_complete(run, timeout=120)
    assert view.status is RunStatus.COMPLETED, view.error
    assert run.result(timeout=0) == sum(range(FAN))
    assert "pending_wake" not in from_item(world.table.get({"pk": run_pk(run.id), "sk": META}) or {})
    world.close()
    wf.close()
