"""World conformance: the transition rules of :mod:`celery_workflow.rules`, observed through a World, token retention
included (:class:`TokenRetentionConformance`, DESIGN §3: "Run end deletes its hooks (tokens kept until token
retention ends)")."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from celery_workflow import ids
from celery_workflow.errors import (
    EntityExists,
    EntityTerminal,
    EventInvalid,
    HookNotFound,
    RunTerminal,
    StepNotFound,
    TooEarly,
    WaitNotFound,
)
from celery_workflow.event_data import HookConflictData, HookReceivedData, StepStartedData
from celery_workflow.events import EventType, RunStatus, StepStatus, WaitStatus
from celery_workflow.testing._conformance import (
    Conformance,
    create,
    ev,
    eventually,
    hook_created,
    iso_in,
    step_created,
    unique,
)
from celery_workflow.world import World

_ERR = {"type": "ValueError", "message": "boom"}


class RunRulesConformance(Conformance):
    """Run lifecycle: started once, exactly one terminal event, nothing new on an ended run."""

    def test_run_started_sets_running_and_started_at_once(self, world: World) -> None:
        run = create(world)
        first = world.append(run.run_id, [ev(EventType.RUN_STARTED)]).run
        assert first.status is RunStatus.RUNNING and first.started_at is not None
        time.sleep(0.002)
        again = world.append(run.run_id, [ev(EventType.RUN_STARTED)])
        assert again.events == [] and again.run.event_count == 2
        assert world.get_run(run.run_id).started_at == first.started_at

    def test_run_completed_is_terminal(self, world: World) -> None:
        run = create(world, started=True)
        done = world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output={"ok": [1, 2]})]).run
        assert done.status is RunStatus.COMPLETED and done.output == {"ok": [1, 2]} and done.completed_at is not None
        assert world.get_run(run.run_id) == done
        for kind in (EventType.RUN_STARTED, EventType.RUN_COMPLETED, EventType.RUN_CANCELLED):
            with pytest.raises(RunTerminal):
                world.append(run.run_id, [ev(kind)])
        with pytest.raises(RunTerminal):
            world.append(run.run_id, [ev(EventType.RUN_FAILED, error=_ERR)])
        assert world.get_run(run.run_id).event_count == 3

    def test_run_failed_records_the_error(self, world: World) -> None:
        run = create(world, started=True)
        failed = world.append(run.run_id, [ev(EventType.RUN_FAILED, error=_ERR)]).run
        assert failed.status is RunStatus.FAILED and failed.error == _ERR and failed.output is None

    def test_run_cancelled_twice_is_a_no_op(self, world: World) -> None:
        run = create(world)
        cancelled = world.append(run.run_id, [ev(EventType.RUN_CANCELLED)]).run
        assert cancelled.status is RunStatus.CANCELLED and cancelled.event_count == 2
        again = world.append(run.run_id, [ev(EventType.RUN_CANCELLED)])
        assert again.events == [] and again.run.status is RunStatus.CANCELLED
        assert world.get_run(run.run_id).event_count == 2

    def test_ended_run_takes_no_new_entities(self, world: World) -> None:
        run = create(world, started=True)
        world.append(
            run.run_id, [step_created("pending"), step_created("running"), ev(EventType.STEP_STARTED, "running")]
        )
        world.append(run.run_id, [ev(EventType.RUN_CANCELLED)])
        for new in (
            step_created("s"),
            hook_created("h", unique("tok")),
            ev(EventType.WAIT_CREATED, "w", resume_at=iso_in(1)),
            ev(EventType.STEP_STARTED, "pending"),
            ev(EventType.STEP_RETRYING, "running", error=_ERR),
        ):
            with pytest.raises(RunTerminal):
                world.append(run.run_id, [new])
        # a step already running may still finish after the run ended
        done = world.append(run.run_id, [ev(EventType.STEP_COMPLETED, "running", result=5)])
        assert [e.event_type for e in done.events] == [EventType.STEP_COMPLETED]
        assert world.get_step(run.run_id, "running").status is StepStatus.COMPLETED
        world.append(run.run_id, [ev(EventType.STEP_FAILED, "pending", error=_ERR)])
        assert world.get_step(run.run_id, "pending").status is StepStatus.FAILED


class StepRulesConformance(Conformance):
    """Step lifecycle: unique creation, attempts, retry times, exactly one terminal event."""

    def test_step_lifecycle_counts_attempts_and_keeps_first_start(self, world: World) -> None:
        run = create(world, started=True)
        created = world.append(run.run_id, [step_created("s", name="charge", args=[7])]).events[0]
        step = world.get_step(run.run_id, "s")
        assert (step.step_name, step.status, step.attempt, step.input) == (
            "charge",
            StepStatus.PENDING,
            0,
            {"args": [7], "kwargs": {}},
        )
        assert step.started_at is None and step.created_at == created.created_at
        started = world.append(run.run_id, [ev(EventType.STEP_STARTED, "s")]).events[0]
        assert started.data_as(StepStartedData).attempt == 1
        first = world.get_step(run.run_id, "s")
        assert first.status is StepStatus.RUNNING and first.attempt == 1 and first.started_at is not None
        past = ids.isoformat(ids.utcnow() - timedelta(seconds=1))
        world.append(run.run_id, [ev(EventType.STEP_RETRYING, "s", error=_ERR, retry_after=past)])
        retrying = world.get_step(run.run_id, "s")
        assert retrying.status is StepStatus.PENDING and retrying.error == _ERR and retrying.retry_after is not None
        time.sleep(0.002)
        world.append(run.run_id, [ev(EventType.STEP_STARTED, "s")])
        second = world.get_step(run.run_id, "s")
        assert second.attempt == 2 and second.started_at == first.started_at and second.retry_after is None
        world.append(run.run_id, [ev(EventType.STEP_STARTED, "s")])  # a concurrent redelivery also counts (P8)
        assert world.get_step(run.run_id, "s").attempt == 3
        world.append(run.run_id, [ev(EventType.STEP_COMPLETED, "s", result={"r": 1})])
        done = world.get_step(run.run_id, "s")
        assert done.status is StepStatus.COMPLETED and done.output == {"r": 1} and done.completed_at is not None
        assert done.attempt == 3

    @pytest.mark.parametrize(
        "late",
        [
            (EventType.STEP_COMPLETED, {"result": 2}),
            (EventType.STEP_FAILED, {"error": _ERR}),
            (EventType.STEP_STARTED, {}),
            (EventType.STEP_RETRYING, {"error": _ERR}),
        ],
    )
    @pytest.mark.parametrize(
        "terminal", [(EventType.STEP_COMPLETED, {"result": 1}), (EventType.STEP_FAILED, {"error": _ERR})]
    )
    def test_step_has_exactly_one_terminal_event(
        self, world: World, terminal: tuple[EventType, dict[str, object]], late: tuple[EventType, dict[str, object]]
    ) -> None:
        run = create(world, started=True)
        world.append(
            run.run_id, [step_created("s"), ev(EventType.STEP_STARTED, "s"), ev(terminal[0], "s", **terminal[1])]
        )
        with pytest.raises(EntityTerminal):
            world.append(run.run_id, [ev(late[0], "s", **late[1])])
        assert world.get_run(run.run_id).event_count == 5

    def test_step_created_twice_is_entity_exists(self, world: World) -> None:
        run = create(world, started=True)
        world.append(run.run_id, [step_created("s")])
        with pytest.raises(EntityExists):
            world.append(run.run_id, [step_created("s")])
        with pytest.raises(EntityExists):
            world.append(run.run_id, [step_created("t"), step_created("t")])
        assert [s.step_id for s in world.list_steps(run.run_id)] == ["s"]

    def test_step_events_need_the_step(self, world: World) -> None:
        run = create(world, started=True)
        for new in (
            ev(EventType.STEP_STARTED, "nope"),
            ev(EventType.STEP_COMPLETED, "nope", result=1),
            ev(EventType.STEP_FAILED, "nope", error=_ERR),
            ev(EventType.STEP_RETRYING, "nope", error=_ERR),
        ):
            with pytest.raises(StepNotFound):
                world.append(run.run_id, [new])

    def test_step_started_before_retry_time_is_too_early(self, world: World) -> None:
        run = create(world, started=True)
        world.append(run.run_id, [step_created("s"), ev(EventType.STEP_STARTED, "s")])
        world.append(run.run_id, [ev(EventType.STEP_RETRYING, "s", error=_ERR, retry_after=iso_in(60))])
        with pytest.raises(TooEarly) as info:
            world.append(run.run_id, [ev(EventType.STEP_STARTED, "s")])
        assert info.value.retry_after > ids.utcnow() + timedelta(seconds=30)
        assert world.get_step(run.run_id, "s").attempt == 1
        # the retry time guards starting only: the step may still fail for good
        world.append(run.run_id, [ev(EventType.STEP_FAILED, "s", error=_ERR)])
        assert world.get_step(run.run_id, "s").status is StepStatus.FAILED


class HookRulesConformance(Conformance):
    """Hooks: unique live tokens across runs, hook_conflict instead of hook_created, release on dispose and run end."""

    def test_hook_created_is_live_and_found_by_token(self, world: World) -> None:
        run = create(world, started=True)
        token = unique("tok")
        world.append(run.run_id, [hook_created("h", token, metadata={"who": "me"}, is_webhook=True)])
        hook = world.get_hook_by_token(token)
        assert (hook.run_id, hook.hook_id, hook.token, hook.metadata, hook.is_webhook) == (
            run.run_id,
            "h",
            token,
            {"who": "me"},
            True,
        )
        assert world.list_hooks(run.run_id) == [hook]
        received = world.append(run.run_id, [ev(EventType.HOOK_RECEIVED, "h", payload={"ok": True})])
        assert received.events[0].data_as(HookReceivedData).payload == {"ok": True}
        with pytest.raises(HookNotFound):
            world.get_hook_by_token(unique("tok"))

    def test_live_token_of_another_run_gives_hook_conflict(self, world: World) -> None:
        owner = create(world, started=True)
        other = create(world, started=True)
        token = unique("tok")
        world.append(owner.run_id, [hook_created("h", token)])
        result = world.append(other.run_id, [hook_created("mine", token)])
        (conflict,) = result.events
        assert conflict.event_type is EventType.HOOK_CONFLICT and conflict.correlation_id == "mine"
        assert conflict.body == HookConflictData(token=token, conflicting_run_id=owner.run_id)
        assert world.list_hooks(other.run_id) == []
        assert world.get_hook_by_token(token).run_id == owner.run_id
        with pytest.raises(HookNotFound):
            world.append(other.run_id, [ev(EventType.HOOK_RECEIVED, "mine", payload=1)])

    def test_same_token_twice_in_one_batch_conflicts_with_itself(self, world: World) -> None:
        run = create(world, started=True)
        token = unique("tok")
        result = world.append(run.run_id, [hook_created("a", token), hook_created("b", token)])
        assert [e.event_type for e in result.events] == [EventType.HOOK_CREATED, EventType.HOOK_CONFLICT]
        assert result.events[1].data_as(HookConflictData).conflicting_run_id == run.run_id
        assert [h.hook_id for h in world.list_hooks(run.run_id)] == ["a"]

    def test_hook_disposed_releases_the_token(self, world: World) -> None:
        owner = create(world, started=True)
        other = create(world, started=True)
        token = unique("tok")
        world.append(owner.run_id, [hook_created("h", token)])
        world.append(owner.run_id, [ev(EventType.HOOK_DISPOSED, "h")])
        assert world.list_hooks(owner.run_id) == []
        with pytest.raises(HookNotFound):
            world.get_hook_by_token(token)
        for late in (ev(EventType.HOOK_RECEIVED, "h", payload=1), ev(EventType.HOOK_DISPOSED, "h")):
            with pytest.raises(HookNotFound):
                world.append(owner.run_id, [late])
        assert world.append(other.run_id, [hook_created("h2", token)]).events[0].event_type is EventType.HOOK_CREATED
        assert world.get_hook_by_token(token).run_id == other.run_id

    def test_dispose_and_recreate_in_one_batch_moves_the_token(self, world: World) -> None:
        run = create(world, started=True)
        token = unique("tok")
        world.append(run.run_id, [hook_created("old", token)])
        result = world.append(run.run_id, [ev(EventType.HOOK_DISPOSED, "old"), hook_created("new", token)])
        assert [e.event_type for e in result.events] == [EventType.HOOK_DISPOSED, EventType.HOOK_CREATED]
        assert world.get_hook_by_token(token).hook_id == "new"

    def test_run_end_deletes_hooks_and_releases_tokens(self, world: World) -> None:
        owner = create(world, started=True)
        other = create(world, started=True)
        tokens = [unique("tok"), unique("tok")]
        world.append(owner.run_id, [hook_created("a", tokens[0])])
        world.append(owner.run_id, [hook_created("b", tokens[1]), ev(EventType.RUN_COMPLETED, output=None)])
        assert world.list_hooks(owner.run_id) == []
        for token in tokens:
            with pytest.raises(HookNotFound):
                world.get_hook_by_token(token)
        with pytest.raises(HookNotFound):
            world.append(owner.run_id, [ev(EventType.HOOK_RECEIVED, "a", payload=1)])
        created = world.append(other.run_id, [hook_created("a", tokens[0]), hook_created("b", tokens[1])])
        assert [e.event_type for e in created.events] == [EventType.HOOK_CREATED, EventType.HOOK_CREATED]

    def test_hook_created_twice_is_entity_exists(self, world: World) -> None:
        run = create(world, started=True)
        world.append(run.run_id, [hook_created("h", unique("tok"))])
        with pytest.raises(EntityExists):
            world.append(run.run_id, [hook_created("h", unique("tok"))])

    def test_a_hook_id_is_created_once_per_run_even_after_dispose_or_conflict(self, world: World) -> None:
        run = create(world, started=True)
        holder = create(world, started=True)
        taken = unique("tok")
        world.append(holder.run_id, [hook_created("held", taken)])
        world.append(run.run_id, [hook_created("h", unique("tok")), hook_created("c", taken)])
        world.append(run.run_id, [ev(EventType.HOOK_DISPOSED, "h")])
        count = world.get_run(run.run_id).event_count
        for hook_id in ("h", "c"):  # disposed; conflicted
            with pytest.raises(EntityExists):
                world.append(run.run_id, [hook_created(hook_id, unique("tok"))])
        with pytest.raises(EntityExists):  # within one batch too
            world.append(run.run_id, [hook_created("n", unique("tok")), hook_created("n", unique("tok"))])
        assert world.get_run(run.run_id).event_count == count

    def test_hook_created_needs_a_token(self, world: World) -> None:
        run = create(world, started=True)
        with pytest.raises(EventInvalid):
            world.append(run.run_id, [hook_created("h", "")])
        assert world.list_hooks(run.run_id) == []


class WaitRulesConformance(Conformance):
    """Waits: created once, completed once, deleted when the run ends."""

    def test_wait_lifecycle(self, world: World) -> None:
        run = create(world, started=True)
        resume_at = ids.utcnow() + timedelta(minutes=5)
        world.append(run.run_id, [ev(EventType.WAIT_CREATED, "w", resume_at=ids.isoformat(resume_at))])
        (wait,) = world.list_waits(run.run_id)
        assert (wait.wait_id, wait.status, wait.resume_at, wait.completed_at) == (
            "w",
            WaitStatus.WAITING,
            resume_at,
            None,
        )
        world.append(run.run_id, [ev(EventType.WAIT_COMPLETED, "w")])
        (done,) = world.list_waits(run.run_id)
        assert done.status is WaitStatus.COMPLETED and done.completed_at is not None
        with pytest.raises(EntityTerminal):
            world.append(run.run_id, [ev(EventType.WAIT_COMPLETED, "w")])
        with pytest.raises(EntityExists):
            world.append(run.run_id, [ev(EventType.WAIT_CREATED, "w", resume_at=iso_in(1))])
        with pytest.raises(WaitNotFound):
            world.append(run.run_id, [ev(EventType.WAIT_COMPLETED, "nope")])
        assert world.get_run(run.run_id).event_count == 4

    def test_wait_created_needs_an_iso_resume_time(self, world: World) -> None:
        run = create(world, started=True)
        for bad in ("tomorrow", 12):
            with pytest.raises(EventInvalid):
                world.append(run.run_id, [ev(EventType.WAIT_CREATED, "w", resume_at=bad)])
        assert world.list_waits(run.run_id) == []

    def test_run_end_deletes_waits(self, world: World) -> None:
        run = create(world, started=True)
        world.append(
            run.run_id,
            [
                ev(EventType.WAIT_CREATED, "a", resume_at=iso_in(60)),
                ev(EventType.WAIT_CREATED, "b", resume_at=iso_in(60)),
            ],
        )
        world.append(run.run_id, [ev(EventType.WAIT_COMPLETED, "a"), ev(EventType.RUN_FAILED, error=_ERR)])
        assert world.list_waits(run.run_id) == []
        with pytest.raises(WaitNotFound):
            world.append(run.run_id, [ev(EventType.WAIT_COMPLETED, "b")])


class TokenRetentionConformance(Conformance):
    """Token retention: a ``hook_created`` with ``token_retention_until`` (an ISO 8601 time with its offset) keeps its
    token reserved after its run ends, until then. While the run is live the hook is an ordinary live hook. The run's
    end still deletes its hooks; a claim of the token gets ``hook_conflict`` naming the ended run until the retention
    ends, and ``hook_created`` after; resuming the token is HookNotFound. A retention already over, or a hook disposed
    (even in the batch that ends the run), releases the token at the end as any other."""

    #: How long the tests' retentions last (seconds): long enough to observe, short enough to wait out.
    RETAIN = 3.0

    def test_run_end_keeps_a_retained_token_until_its_retention_ends(self, world: World) -> None:
        owner = create(world, started=True)
        kept, free, past, dropped = (unique(name) for name in ("kept", "free", "past", "dropped"))
        world.append(
            owner.run_id,
            [
                hook_created("kept", kept, token_retention_until=iso_in(self.RETAIN)),
                hook_created("free", free),
                hook_created("past", past, token_retention_until=iso_in(-60)),
                hook_created("dropped", dropped, token_retention_until=iso_in(3600)),
            ],
        )
        assert world.get_hook_by_token(kept).run_id == owner.run_id  # live: an ordinary hook
        world.append(owner.run_id, [ev(EventType.HOOK_RECEIVED, "kept", payload={"ok": True})])
        world.append(owner.run_id, [ev(EventType.HOOK_DISPOSED, "dropped"), ev(EventType.RUN_COMPLETED, output=None)])
        assert world.list_hooks(owner.run_id) == []  # the run's end deletes its hooks all the same
        for token in (kept, free, past, dropped):
            with pytest.raises(HookNotFound):
                world.get_hook_by_token(token)
        with pytest.raises((HookNotFound, RunTerminal)):
            world.append(owner.run_id, [ev(EventType.HOOK_RECEIVED, "kept", payload=1)])
        claimant = create(world, started=True)
        claims = [hook_created(name, token) for name, token in (("k", kept), ("f", free), ("p", past), ("d", dropped))]
        conflict, *created = world.append(claimant.run_id, claims).events
        assert conflict.data_as(HookConflictData).conflicting_run_id == owner.run_id
        assert [e.event_type for e in created] == [EventType.HOOK_CREATED] * 3
        later = create(world, started=True)

        def claimed() -> bool | None:
            event = world.append(later.run_id, [hook_created(unique("h"), kept)]).events[0]
            return True if event.event_type is EventType.HOOK_CREATED else None

        eventually(claimed, timeout=self.RETAIN + 10, interval=0.1)
        assert world.get_hook_by_token(kept).run_id == later.run_id

    def test_a_hook_created_in_the_batch_that_ends_its_run_retains_its_token(self, world: World) -> None:
        owner = create(world, started=True)
        token = unique("tok")
        ended = [hook_created("h", token, token_retention_until=iso_in(3600)), ev(EventType.RUN_COMPLETED, output=1)]
        assert [e.event_type for e in world.append(owner.run_id, ended).events] == [
            EventType.HOOK_CREATED,
            EventType.RUN_COMPLETED,
        ]
        assert world.list_hooks(owner.run_id) == []
        claimant = create(world, started=True)
        (conflict,) = world.append(claimant.run_id, [hook_created("h", token)]).events
        assert conflict.data_as(HookConflictData).conflicting_run_id == owner.run_id

    def test_a_run_end_after_a_whole_read_of_the_run_retains_tokens_too(self, world: World) -> None:
        """A World may plan a run's next batch on the whole state it read (the Postgres World's kept snapshots): the
        retentions of its live hooks are part of that state, as are hooks disposed since."""
        owner = create(world, started=True)
        kept, released = unique("kept"), unique("released")
        world.append(
            owner.run_id,
            [
                hook_created("kept", kept, token_retention_until=iso_in(3600)),
                hook_created("released", released, token_retention_until=iso_in(3600)),
            ],
        )
        world.get_run_with_events(owner.run_id)
        world.append(owner.run_id, [ev(EventType.HOOK_DISPOSED, "released")])
        world.get_run_with_events(owner.run_id)
        world.append(owner.run_id, [ev(EventType.RUN_CANCELLED)])
        claimant = create(world, started=True)
        conflict, created = world.append(claimant.run_id, [hook_created("a", kept), hook_created("b", released)]).events
        assert conflict.data_as(HookConflictData).conflicting_run_id == owner.run_id
        assert created.event_type is EventType.HOOK_CREATED
        with pytest.raises(HookNotFound, match=f"run {owner.run_id}, which has ended"):
            world.get_hook_by_token(kept)

    def test_token_retention_until_must_be_an_iso_time_with_its_offset(self, world: World) -> None:
        run = create(world, started=True)
        for bad in ("tomorrow", 12, "2030-01-01T00:00:00", ["2030-01-01T00:00:00+00:00"]):
            with pytest.raises(EventInvalid):
                world.append(run.run_id, [hook_created("h", unique("tok"), token_retention_until=bad)])
        assert world.list_hooks(run.run_id) == [] and world.get_run(run.run_id).event_count == 2
