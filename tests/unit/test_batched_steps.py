"""On a World that wants batched appends (``AppendLimits.batch_steps``: ``MemoryWorld(batch_steps=True)`` here, the
AWS World in production), the quick inline steps of one delivery start unwritten and share the delivery's next
append; a crash re-runs exactly the held steps, a duplicate delivery records each step once, and a slow, failing or
late step is written as before."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery

from celery_workflow import Workflows
from celery_workflow.errors import WorldUnavailable
from celery_workflow.events import EventType, RunStatus
from celery_workflow.runtime import effects, holding
from celery_workflow.testing import LocalWorker, MemoryWorld
from celery_workflow.world import Claim

C, S, D = EventType.STEP_CREATED, EventType.STEP_STARTED, EventType.STEP_COMPLETED


def _app(*, batch: bool) -> Workflows:
    return Workflows(Celery("unit"), world=MemoryWorld(batch_steps=batch), broker="app")


@pytest.fixture(autouse=True)
def _quick_below(monkeypatch: pytest.MonkeyPatch) -> None:
    """A quick step is one that took less than 0.5 s (not 10 ms): a body descheduled on a loaded machine still is."""
    monkeypatch.setattr(effects, "HOLD_START_BELOW", 0.5)


@pytest.fixture
def bwf() -> Iterator[Workflows]:
    workflows = _app(batch=True)
    yield workflows
    workflows.close()


def _worker(wf: Workflows) -> LocalWorker:
    return LocalWorker(wf, backoff=lambda attempts: 0.0)


def _appends(wf: Workflows, fail: Callable[[list[EventType]], BaseException | None] | None = None) -> list[Any]:
    """The event types of each append the World takes from now on; ``fail`` may raise instead of one of them."""
    appends: list[list[EventType]] = []
    original = wf.world.append

    def counting(*args: Any, **kwargs: Any) -> Any:
        kinds = [ev.event_type for ev in args[1]]
        error = fail(kinds) if fail is not None else None
        if error is not None:
            raise error
        result = original(*args, **kwargs)
        appends.append(kinds)
        return result

    wf.world.append = counting  # type: ignore[method-assign]
    return appends


class Flows:
    """Workflows over a quick step (which records its calls and then calls ``during``) and a slow one."""

    def __init__(self, wf: Workflows) -> None:
        self.calls: list[tuple[str, int]] = []
        self.during: Callable[[int], object] | None = None
        self.wf = wf

        @wf.step
        def quick(i: int) -> int:
            self.calls.append(("quick", i))
            if self.during is not None:
                self.during(i)
            if i < 0:
                raise ValueError("negative")
            return i + 1

        @wf.step
        def slow(i: int) -> int:
            self.calls.append(("slow", i))
            if self.during is not None:
                self.during(i)
            return i * 10

        @wf.step
        def fetch(i: int) -> int:
            return i

        @wf.workflow
        def ten(i: int) -> int:
            for _ in range(10):
                i = quick(i)
            return i

        @wf.workflow
        def mixed(i: int) -> int:
            for _ in range(3):
                i = quick(i)
            i = slow(i)
            for _ in range(3):
                i = quick(i)
            return i

        @wf.workflow
        def after_fetch(i: int) -> int:
            i = fetch.start(i).result()  # queued: the run is running when the quick steps come
            for _ in range(5):
                i = quick(i)
            return i

        @wf.workflow
        def failing(i: int) -> int:
            return quick(quick(quick(i)) - 10)

        self.quick, self.ten, self.mixed, self.after_fetch, self.failing = quick, ten, mixed, after_fetch, failing

    def warm(self) -> None:
        """Run each step once (the runtime learns they are quick), then mark ``slow`` as slow."""
        _worker(self.wf).run_until_complete(self.mixed.start(0))
        self.calls.clear()
        self.wf.runtime.inline_seconds["slow"] = 1.0


def _log(run: Any) -> list[tuple[EventType, str | None]]:
    return [(e.event_type, e.correlation_id) for e in run.events()]


def _recorded_once(run: Any) -> None:
    """Every step of the run is created, and ends, exactly once."""
    for kind in (C, D):
        cids = [e.correlation_id for e in run.events() if e.event_type is kind]
        assert len(cids) == len(set(cids)), (kind, cids)


def test_ten_quick_steps_write_their_delivery_in_one_append(bwf: Workflows) -> None:
    flows = Flows(bwf)
    flows.warm()
    appends = _appends(bwf)
    run = flows.ten.start(1)
    _worker(bwf).run_until_complete(run)
    assert run.result() == 11
    assert appends == [[EventType.RUN_STARTED, *[C, S, D] * 10, EventType.RUN_COMPLETED]]

    # the same workflow on a World that does not ask for it: a write per step, and the same log
    plain = _app(batch=False)
    try:
        other = Flows(plain)
        other.warm()
        plain_appends = _appends(plain)
        plain_run = other.ten.start(1)
        _worker(plain).run_until_complete(plain_run)
        assert plain_run.result() == 11
        assert len(plain_appends) == 10
        assert _log(plain_run) == _log(run)
        for a, b in zip(plain_run.events(), run.events(), strict=True):
            if a.event_type in (D, S):
                assert {k: v for k, v in a.data.items() if k != "owner"} == {
                    k: v for k, v in b.data.items() if k != "owner"
                }
    finally:
        plain.close()
    assert [(s.status.value, s.attempt) for s in bwf.world.list_steps(run.id)] == [("completed", 1)] * 10


def test_a_slow_step_is_written_before_its_body_runs(bwf: Workflows) -> None:
    flows = Flows(bwf)
    flows.warm()
    seen: list[list[tuple[EventType, str | None]]] = []
    target: dict[str, Any] = {}

    def look(i: int) -> None:
        if flows.calls[-1][0] == "slow":
            seen.append(_log(target["run"]))

    flows.during = look
    appends = _appends(bwf)
    run = target["run"] = flows.mixed.start(0)
    _worker(bwf).run_until_complete(run)
    assert run.result() == 33
    # the three quick steps held, then written with the slow step's start, before its body
    assert seen == [_log(run)[:13]]
    assert seen[0][-1] == (S, "step:slow:1")
    assert appends == [[EventType.RUN_STARTED, *[C, S, D] * 3, C, S], [D, *[C, S, D] * 3, EventType.RUN_COMPLETED]]


def test_a_step_raising_for_retry_is_written_at_once(bwf: Workflows) -> None:
    flows = Flows(bwf)
    flows.warm()
    appends = _appends(bwf)
    run = flows.failing.start(0)
    payload, claim = _claim(bwf, run.id)
    assert bwf.handle_delivery(payload, claim) == "suspended"
    assert appends == [[EventType.RUN_STARTED, *[C, S, D] * 2, C, S], [EventType.STEP_RETRYING]]
    assert _log(run)[-1] == (EventType.STEP_RETRYING, "step:quick:3")
    assert bwf.world.get_run(run.id).status is RunStatus.RUNNING


def _claim(wf: Workflows, run_id: str) -> tuple[bytes, Claim]:
    (claimed,) = wf.world.claim([wf.runtime.default_queue], limit=1, lease=30)
    assert claimed.run_id == run_id
    return claimed.payload, Claim(claimed.receipt, claimed.attempts)


@pytest.mark.parametrize(
    ("error", "again"),
    [
        # a crash in the write: nothing of it is written; the held steps run again, and so does the slow step,
        # whose start was written and whose result waited for the delivery's last write (durability per delivery)
        (RuntimeError("killed mid-write"), [("slow", 3), ("quick", 30), ("quick", 31), ("quick", 32)]),
        # a World fault: the slow step's result is still written on its own (its start is in the log); the held
        # steps' results cannot be (their starts are not): only they run again
        (WorldUnavailable("down"), [("quick", 30), ("quick", 31), ("quick", 32)]),
    ],
)
def test_a_crash_in_the_write_reruns_exactly_the_held_steps(
    bwf: Workflows, error: BaseException, again: list[tuple[str, int]]
) -> None:
    flows = Flows(bwf)
    flows.warm()
    failed: list[bool] = []

    def fail(kinds: list[EventType]) -> BaseException | None:
        if EventType.RUN_COMPLETED in kinds and not failed:
            failed.append(True)
            return error
        return None

    _appends(bwf, fail)
    run = flows.mixed.start(0)
    payload, claim = _claim(bwf, run.id)
    with pytest.raises(type(error)):
        bwf.handle_delivery(payload, claim)
    first = [("quick", 0), ("quick", 1), ("quick", 2), ("slow", 3), ("quick", 30), ("quick", 31), ("quick", 32)]
    assert flows.calls == first
    bwf.world.retry_later(claim.receipt, 0.0, error="crashed")
    _worker(bwf).run_until_complete(run)
    assert run.result() == 33
    assert flows.calls == first + again
    _recorded_once(run)
    starts = [str(e.correlation_id) for e in run.events() if e.event_type is S]
    rerun = ["step:slow:1"] if ("slow", 3) in again else []
    assert sorted(starts) == sorted([*(f"step:quick:{n}" for n in range(1, 7)), "step:slow:1", *rerun])


def test_a_duplicate_delivery_records_each_held_step_once(bwf: Workflows) -> None:
    """Two deliveries of a running run replay it at the same time (SQS delivered its message twice): both run the
    quick steps, held; the second to write is refused, drops its held results and finds the run ended."""
    flows = Flows(bwf)
    flows.warm()
    worker = _worker(bwf)
    run = flows.after_fetch.start(0)
    assert worker.run_once() and worker.run_once()  # the first delivery queues fetch; fetch's delivery wakes the run
    assert bwf.world.get_run(run.id).status is RunStatus.RUNNING
    nested: list[str] = []

    def duplicate(i: int) -> None:
        if i == 2 and not nested:
            nested.append("running")
            # the other delivery runs in its own thread (a context of its own), to its end, while this step runs
            other = threading.Thread(
                target=lambda: nested.append(bwf.runtime.handle_workflow(run.id, delivery_id="duplicate"))
            )
            other.start()
            other.join(timeout=10)

    flows.during = duplicate
    appends = _appends(bwf)
    payload, claim = _claim(bwf, run.id)
    assert bwf.handle_delivery(payload, claim) == "ended"
    assert nested == ["running", "completed"]
    assert run.result() == 5
    # the first delivery ran steps 1-3 before the duplicate ran all five; it then ran 4 and 5, and wrote nothing
    assert flows.calls == [("quick", i) for i in (0, 1, 2, 0, 1, 2, 3, 4, 3, 4)]
    assert appends == [[*[C, S, D] * 5, EventType.RUN_COMPLETED]]
    _recorded_once(run)
    assert [e.data["owner"] for e in run.events() if e.event_type is S][1:] == ["duplicate"] * 5
    worker.run_until_idle()


def test_the_batch_is_written_once_its_oldest_start_is_past_the_window(bwf: Workflows) -> None:
    flows = Flows(bwf)
    flows.warm()
    real = bwf.runtime.clock
    shift = [timedelta(0)]
    bwf.runtime.clock = lambda: real() + shift[0]

    def late(i: int) -> None:
        if i == 4:
            shift[0] += holding.BATCH_WINDOW

    flows.during = late
    appends = _appends(bwf)
    run = flows.ten.start(1)
    _worker(bwf).run_until_complete(run)
    assert run.result() == 11
    # steps 1-4 held; past the window they are written before the fifth, which starts the next batch
    assert appends == [[EventType.RUN_STARTED, *[C, S, D] * 4], [*[C, S, D] * 6, EventType.RUN_COMPLETED]]


def test_the_batch_stays_within_one_append() -> None:
    limits = MemoryWorld().append_limits
    wf = Workflows(Celery("unit"), world=MemoryWorld(batch_steps=True, append_limits=limits), broker="app")
    try:
        flows = Flows(wf)
        flows.warm()
        appends = _appends(wf)

        @wf.workflow
        def many(i: int) -> int:
            for _ in range(20):
                i = flows.quick(i)
            return i

        run = many.start(0)
        _worker(wf).run_until_complete(run)
        assert run.result() == 20
        assert [len(kinds) for kinds in appends] == [46, 16]
        assert max(len(kinds) for kinds in appends) + limits.reserved_actions <= (limits.max_actions or 0)
    finally:
        wf.close()


def test_a_step_not_known_quick_is_not_held(bwf: Workflows) -> None:
    flows = Flows(bwf)
    appends = _appends(bwf)
    run = flows.ten.start(1)
    _worker(bwf).run_until_complete(run)  # no step ran in this process yet: the first one starts in the World
    assert appends == [[EventType.RUN_STARTED, C, S], [D, *[C, S, D] * 9, EventType.RUN_COMPLETED]]
    assert bwf.runtime.inline_seconds["quick"] < effects.HOLD_START_BELOW


def test_a_deadline_passed_during_held_steps_fails_the_run_with_them_recorded(bwf: Workflows) -> None:
    flows = Flows(bwf)
    flows.warm()
    real = bwf.runtime.clock
    shift = [timedelta(0)]
    bwf.runtime.clock = lambda: real() + shift[0]

    @bwf.workflow(timeout=timedelta(minutes=5))
    def bounded(i: int) -> int:
        for _ in range(10):
            i = flows.quick(i)
        return i

    def late(i: int) -> None:
        if i == 3:
            shift[0] += timedelta(hours=1)  # the third step takes the run past its deadline

    flows.during = late
    appends = _appends(bwf)
    run = bounded.start(1)
    view = _worker(bwf).run_until_complete(run)
    assert view.status is RunStatus.FAILED and view.error is not None
    assert view.error["type"] == "celery_workflow.errors.RunTimedOut"
    assert flows.calls == [("quick", 1), ("quick", 2), ("quick", 3)]  # the fourth step was never started
    # the held steps that ran are written with the run's failure, in one append
    assert appends[0] == [EventType.RUN_STARTED, *[C, S, D] * 3, EventType.RUN_FAILED]
    _recorded_once(run)
