"""The runtime against the in-memory World: every workflow feature, replay and its failure modes."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
from pydantic import BaseModel

from celery_workflow import (
    FatalError,
    HookConflict,
    HookNotFound,
    PayloadError,
    ReplayDivergence,
    RetryableError,
    RunCancelled,
    StepFailed,
    WorkflowFailed,
    Workflows,
    create_hook,
    create_webhook,
    gather,
    get_writable,
    now,
    random,
    sleep,
    step_metadata,
    uuid4,
    workflow_metadata,
)
from celery_workflow.events import EventType, RunStatus, StepStatus
from celery_workflow.testing import LocalWorker
from celery_workflow.world import Claim


def types(run: Any) -> list[str]:
    return [ev.event_type.value for ev in run.events()]


def test_sequential_steps_run_inline_in_one_delivery(wf: Workflows, worker: LocalWorker) -> None:
    calls: list[str] = []

    @wf.step
    def add(a: int, b: int) -> int:
        calls.append(f"add{a},{b}")
        return a + b

    @wf.workflow
    def chain(n: int) -> int:
        total = 0
        for i in range(n):
            total = add(total, i)
        return total

    run = chain.start(4)
    worker.run_until_complete(run)
    assert run.status == "completed"
    assert run.result() == 6
    assert calls == ["add0,0", "add0,1", "add1,2", "add3,3"]
    assert len(worker.handled) == 1  # one delivery ran all four steps
    events = run.events()
    assert [e.slot for e in events] == list(range(1, len(events) + 1))
    assert Counter(types(run))["step_completed"] == 4
    assert types(run)[:2] == ["run_created", "run_started"]
    assert types(run)[-1] == "run_completed"


def test_retryable_errors_are_retried_then_succeed(wf: Workflows, worker: LocalWorker) -> None:
    attempts: list[int] = []

    @wf.step(max_retries=3, retry_backoff=0.01)
    def flaky() -> str:
        attempts.append(step_metadata().attempt)
        if len(attempts) < 3:
            raise RuntimeError("transient")
        return "ok"

    @wf.workflow
    def uses_flaky() -> str:
        return flaky()

    run = uses_flaky.start()
    worker.run_until_complete(run)
    assert run.result() == "ok"
    assert attempts == [1, 2, 3]
    assert Counter(types(run))["step_retrying"] == 2
    step = run.steps()[0]
    assert step.status is StepStatus.COMPLETED and step.attempt == 3


def test_retry_after_is_honoured_as_a_durable_delay(wf: Workflows, worker: LocalWorker) -> None:
    @wf.step(max_retries=1)
    def later() -> int:
        if step_metadata().attempt == 1:
            raise RetryableError("not yet", retry_after=0.2)
        return 7

    @wf.workflow
    def waits_for_retry() -> int:
        return later()

    run = waits_for_retry.start()
    worker.run_until_idle()
    assert run.status == "running"  # the retry is a delivery due later, nothing waits in memory
    retrying = [e for e in run.events() if e.event_type is EventType.STEP_RETRYING]
    assert len(retrying) == 1 and "retry_after" in retrying[0].data
    worker.run_until_complete(run)
    assert run.result() == 7


def test_exhausted_and_fatal_errors_raise_step_failed_in_the_workflow(wf: Workflows, worker: LocalWorker) -> None:
    @wf.step(max_retries=1, retry_backoff=0.01)
    def always_fails() -> None:
        raise ValueError("boom")

    @wf.step(max_retries=5)
    def fatal() -> None:
        raise FatalError("card declined")

    @wf.workflow
    def handles() -> dict[str, str]:
        out = {}
        try:
            always_fails()
        except StepFailed as exc:
            out["retried"] = f"{exc.error_type}:{exc.error['message']}"
        try:
            fatal()
        except StepFailed as exc:
            out["fatal"] = exc.error["message"]
        return out

    run = handles.start()
    worker.run_until_complete(run)
    assert run.result() == {"retried": "ValueError:boom", "fatal": "card declined"}
    steps = {s.step_name: s for s in run.steps()}
    assert steps["always_fails"].attempt == 2 and steps["always_fails"].status is StepStatus.FAILED
    assert steps["fatal"].attempt == 1  # no retry for FatalError


def test_an_uncaught_failure_fails_the_run(wf: Workflows, worker: LocalWorker) -> None:
    @wf.step(max_retries=0)
    def broken() -> None:
        raise KeyError("missing")

    @wf.workflow
    def fails() -> None:
        broken()

    run = fails.start()
    worker.run_until_complete(run)
    assert run.status == "failed"
    with pytest.raises(WorkflowFailed) as info:
        run.result()
    assert info.value.error["type"] == "celery_workflow.errors.StepFailed"
    assert "missing" in info.value.error["message"]


def test_sleep_suspends_and_resumes_from_a_timer_delivery(wf: Workflows, worker: LocalWorker) -> None:
    @wf.step
    def stamp() -> str:
        return "after"

    @wf.workflow
    def sleeper() -> str:
        sleep(0.2)
        return stamp()

    run = sleeper.start()
    worker.run_until_idle()
    assert run.status == "running"
    waits = run._world.list_waits(run.id)
    assert len(waits) == 1 and waits[0].status == "waiting"
    worker.run_until_complete(run)
    assert run.result() == "after"
    assert Counter(types(run))["wait_completed"] == 1
    assert run._world.list_waits(run.id) == []  # deleted at run end


def test_sleep_zero_does_not_suspend(wf: Workflows, worker: LocalWorker) -> None:
    @wf.workflow
    def instant() -> int:
        sleep(0)
        return 1

    run = instant.start()
    worker.run_until_complete(run)
    assert run.result() == 1
    assert len(worker.handled) == 1


def test_hook_receives_several_payloads_and_releases_its_token(wf: Workflows, worker: LocalWorker) -> None:
    @wf.workflow
    def collect(n: int) -> list[Any]:
        hook = create_hook(token="collect-token", metadata={"purpose": "test"})
        got = []
        for payload in hook:
            got.append(payload)
            if len(got) == n:
                break
        return got

    run = collect.start(3)
    worker.run_until_idle()
    assert run.status == "running"
    hook = wf.world.get_hook_by_token("collect-token")
    assert hook.run_id == run.id and hook.metadata == {"purpose": "test"}
    for i in range(3):
        wf.resume_hook("collect-token", {"i": i})
    worker.run_until_complete(run)
    assert run.result() == [{"i": 0}, {"i": 1}, {"i": 2}]
    with pytest.raises(HookNotFound):
        wf.world.get_hook_by_token("collect-token")  # released when the run ended
    with pytest.raises(HookNotFound):
        wf.resume_hook("collect-token", {})


def test_hook_token_conflict_raises_in_the_second_run(wf: Workflows, worker: LocalWorker) -> None:
    @wf.workflow
    def owner() -> str:
        try:
            return str(create_hook(token="shared").wait())
        except HookConflict as exc:
            return f"conflict with {exc.conflicting_run_id}"

    first = owner.start()
    worker.run_until_idle()
    second = owner.start()
    worker.run_until_complete(second)
    assert second.result() == f"conflict with {first.id}"
    assert EventType.HOOK_CONFLICT.value in types(second)
    wf.resume_hook("shared", "payload")
    worker.run_until_complete(first)
    assert first.result() == "payload"


def test_webhook_has_a_url_and_returns_the_request(wf: Workflows, worker: LocalWorker) -> None:
    from celery_workflow import WebhookRequest

    @wf.step
    def remember(url: str) -> str:
        return url

    @wf.workflow
    def webhook_flow() -> dict[str, Any]:
        hook = create_webhook()
        url = remember(hook.url)
        request = hook.wait()
        return {"url": url, "method": request.method, "json": request.json()}

    run = webhook_flow.start()
    worker.run_until_idle()
    (hook,) = wf.world.list_hooks(run.id)
    assert hook.is_webhook
    wf.runtime.resume_webhook(
        hook.token, WebhookRequest.build("POST", {"content-type": "application/json"}, b'{"a": 1}')
    )
    worker.run_until_complete(run)
    result = run.result()
    assert result["url"] == f"https://example.test/wf/webhooks/{hook.token}"
    assert result["method"] == "POST" and result["json"] == {"a": 1}


def test_parallel_steps_run_as_separate_deliveries(wf: Workflows, worker: LocalWorker) -> None:
    @wf.step
    def square(x: int) -> int:
        return x * x

    @wf.workflow
    def fan_out(n: int) -> list[int]:
        return gather(*[square.start(i) for i in range(n)])

    run = fan_out.start(4)
    worker.run_until_complete(run)
    assert run.result() == [0, 1, 4, 9]
    step_tasks = [t for t, _ in worker.handled if t.name == "step.square"]
    assert len(step_tasks) == 4
    created = [e.slot for e in run.events() if e.event_type is EventType.STEP_CREATED]
    assert created == list(range(created[0], created[0] + 4))  # created in one batch


def test_streams_are_written_by_steps_and_read_in_order(wf: Workflows, worker: LocalWorker) -> None:
    @wf.step
    def produce(n: int) -> None:
        out = get_writable("numbers")
        for i in range(n):
            out.write({"i": i})
        out.write(b"\x00raw")
        out.close()

    @wf.workflow
    def streaming(n: int) -> None:
        produce(n)

    run = streaming.start(3)
    worker.run_until_complete(run)
    assert list(run.stream("numbers")) == [{"i": 0}, {"i": 1}, {"i": 2}, b"\x00raw"]
    assert list(run.stream("numbers", start=2)) == [{"i": 2}, b"\x00raw"]


def test_cancel_stops_a_waiting_run_and_releases_its_hooks(wf: Workflows, worker: LocalWorker) -> None:
    @wf.workflow
    def waits() -> None:
        create_hook(token="cancel-me").wait()

    run = waits.start()
    worker.run_until_idle()
    run.cancel()
    assert run.status == "cancelled"
    with pytest.raises(RunCancelled):
        run.result(timeout=1)
    with pytest.raises(HookNotFound):
        wf.resume_hook("cancel-me", 1)
    run.cancel()  # idempotent
    assert Counter(types(run))["run_cancelled"] == 1


def test_start_is_idempotent_by_run_id(wf: Workflows, worker: LocalWorker) -> None:
    @wf.workflow
    def once(x: int) -> int:
        return x

    a = once.start(1, run_id="order-1")
    b = once.start(1, run_id="order-1")
    assert a.id == b.id == "order-1"
    worker.run_until_complete(a)
    c = wf.start("once", 1, run_id="order-1")
    assert c.result() == 1
    assert Counter(types(a))["run_created"] == 1
    assert len(wf.list_runs(workflow="once")) == 1


def test_now_random_uuid_are_deterministic_across_replays(wf: Workflows, worker: LocalWorker) -> None:
    seen: list[Any] = []

    @wf.step
    def record(values: list[str]) -> None:
        seen.append(values)

    @wf.workflow
    def deterministic() -> list[str]:
        values = [now().isoformat(), str(random()), str(uuid4()), workflow_metadata().run_id]
        record(values)
        create_hook(token="det").wait()  # forces a second delivery that replays from the top
        return values

    run = deterministic.start()
    worker.run_until_idle()
    wf.resume_hook("det", None)
    worker.run_until_complete(run)
    assert run.result() == seen[0]
    assert seen[0][3] == run.id
    assert len(worker.handled) == 2


@dataclasses.dataclass
class Item:
    sku: str
    qty: int


class Receipt(BaseModel):
    total: int
    items: list[str]


def test_dataclass_and_pydantic_payloads_round_trip_by_type_hints(wf: Workflows, worker: LocalWorker) -> None:
    @wf.step
    def price(items: list[Item]) -> Receipt:
        assert all(isinstance(i, Item) for i in items)
        return Receipt(total=sum(i.qty for i in items), items=[i.sku for i in items])

    @wf.workflow
    def checkout(items: list[Item]) -> Receipt:
        receipt = price(items)
        assert isinstance(receipt, Receipt)
        create_hook(token="pay").wait()  # replay: the receipt comes back from the log as a Receipt again
        assert isinstance(receipt, Receipt)
        return receipt

    run = checkout.start([Item("a", 2), Item("b", 3)])
    worker.run_until_idle()
    wf.resume_hook("pay", True)
    worker.run_until_complete(run)
    result = run.result()
    assert result == Receipt(total=5, items=["a", "b"])


def test_values_that_cannot_be_encoded_raise_payload_error(wf: Workflows) -> None:
    @wf.workflow
    def takes(x: Any) -> None:
        return None

    with pytest.raises(PayloadError):
        takes.start(object())
    with pytest.raises(PayloadError):
        takes.start(float("nan"))
    assert wf.list_runs() == []


def test_a_changed_workflow_is_reported_as_divergence(wf: Workflows, worker: LocalWorker) -> None:
    @wf.step
    def first() -> int:
        return 1

    @wf.step
    def second() -> int:
        return 2

    @wf.workflow
    def evolving() -> int:
        first()
        return int(create_hook(token="evolve").wait())

    run = evolving.start()
    worker.run_until_idle()

    def changed() -> int:
        second()  # the code now calls another step where the log has `first`
        return int(create_hook(token="evolve").wait())

    wf.registry.workflows["evolving"].func = changed
    with pytest.raises(ReplayDivergence, match="step:first:1"):
        wf.runtime.handle_workflow(run.id, delivery_id="dlv_test", claim=Claim("r", 1))
    assert run.status == "running"  # retried first, in case an old worker is still deploying
    assert wf.runtime.handle_workflow(run.id, delivery_id="dlv_test", claim=Claim("r", 4)) == "failed"
    view = run.view()
    assert view.status is RunStatus.FAILED and view.error is not None
    assert view.error["type"] == "ReplayDivergence"


def test_changed_step_arguments_are_a_divergence(wf: Workflows, worker: LocalWorker) -> None:
    @wf.step
    def echo(x: int) -> int:
        return x

    @wf.workflow
    def uses_arg(x: int) -> int:
        echo(x)
        return int(create_hook(token="args").wait())

    run = uses_arg.start(5)
    worker.run_until_idle()

    def changed(x: int) -> int:
        echo(x + 1)
        return 0

    wf.registry.workflows["uses_arg"].func = changed
    assert wf.runtime.handle_workflow(run.id, delivery_id="d", claim=Claim("r", 9)) == "failed"
    assert "other arguments" in str(run.view().error)


def test_unreached_log_entries_are_a_divergence(wf: Workflows, worker: LocalWorker) -> None:
    @wf.step
    def one() -> int:
        return 1

    @wf.workflow
    def shrinking() -> int:
        one()
        return int(create_hook(token="shrink").wait())

    run = shrinking.start()
    worker.run_until_idle()
    wf.registry.workflows["shrinking"].func = lambda: 0
    assert wf.runtime.handle_workflow(run.id, delivery_id="d", claim=Claim("r", 9)) == "failed"
    assert "no longer reaches" in str(run.view().error)


def test_calling_workflow_api_outside_a_workflow_is_an_error() -> None:
    from celery_workflow.runtime.context import NotInStep, NotInWorkflow

    with pytest.raises(NotInWorkflow):
        sleep(1)
    with pytest.raises(NotInStep):
        get_writable()


def test_steps_on_another_queue_are_queued_there(wf: Workflows) -> None:
    @wf.step(queue="gpu")
    def render() -> str:
        return "done"

    @wf.workflow(queue="orders")
    def routed() -> str:
        return render()

    run = routed.start()
    orders = LocalWorker(wf, ["orders"])
    orders.run_until_idle()
    assert run.status == "running"
    assert [t.name for t, _ in orders.handled] == ["workflow.routed"]
    LocalWorker(wf, ["gpu"]).run_until_idle()
    orders.run_until_complete(run)
    assert run.result() == "done"


def test_routes_added_after_construction_apply_to_new_runs(wf: Workflows) -> None:
    @wf.workflow
    def later_routed() -> None:
        return None

    before = later_routed.start()
    wf.route("later_routed", "backfill")
    after = later_routed.start()
    assert before.view().queue == "celery"
    assert after.view().queue == "backfill"


def test_a_route_to_an_unknown_queue_is_refused(wf: Workflows) -> None:
    from celery import Celery

    from celery_workflow import ConfigurationError
    from celery_workflow.testing import MemoryWorld

    strict = Workflows(Celery("strict"), world=MemoryWorld(), broker="app", queues=["celery", "orders"])
    with pytest.raises(ConfigurationError, match="unknown queue 'nowhere'"):
        strict.route("x", "nowhere")
    with pytest.raises(ConfigurationError, match="unknown queue"):

        @strict.workflow(queue="nowhere")
        def misrouted() -> None:
            return None

    strict.route("x", "orders")
    assert strict.routes == {"x": "orders"}


def test_the_worlds_own_routes_and_queues_apply() -> None:
    """A World's configuration routes workflows (PostgresConfig.routes, AWSConfig.routes) and may name the only queues
    it has (an AWS World's SQS queues): Workflows applies the first and refuses routes outside the second."""
    from types import MappingProxyType

    from celery import Celery

    from celery_workflow import ConfigurationError
    from celery_workflow.testing import MemoryWorld

    class ConfiguredWorld(MemoryWorld):
        routes = MappingProxyType({"nightly": "backfill"})
        queue_names = frozenset({"celery", "backfill"})

    wf = Workflows(Celery("configured"), world=ConfiguredWorld(), broker="app")
    assert wf.routes == {"nightly": "backfill"}
    assert wf.runtime.queue_for("nightly") == "backfill"
    with pytest.raises(ConfigurationError, match="which the World does not have"):
        wf.route("other", "orders")
    with pytest.raises(ConfigurationError, match="which the World does not have"):
        Workflows(Celery("overridden"), world=ConfiguredWorld(), broker="app", routes={"x": "nowhere"})


def test_now_after_an_inline_step_is_the_same_on_replay(wf: Workflows, worker: LocalWorker) -> None:
    seen: list[str] = []

    @wf.step
    def work() -> int:
        return 1

    @wf.step
    def note(stamp: str) -> None:
        seen.append(stamp)

    @wf.workflow
    def stamps() -> list[str]:
        work()
        after_first = now().isoformat()  # the step's result is not written yet: reading the clock writes it
        work()
        work()
        after_third = now().isoformat()
        note(after_third)  # a step argument: a different value on replay would be a divergence
        create_hook(token="stamps").wait()
        return [after_first, after_third]

    run = stamps.start()
    worker.run_until_idle()
    wf.resume_hook("stamps", None)
    worker.run_until_complete(run)
    first, third = run.result()
    completed = [e.created_at.isoformat() for e in run.events() if e.event_type is EventType.STEP_COMPLETED]
    assert first == completed[0] and third == completed[2] and seen == [third]


def test_sequential_inline_steps_take_one_write_each(wf: Workflows, worker: LocalWorker) -> None:
    appends: list[int] = []
    original = wf.world.append

    def counting(*args: Any, **kwargs: Any) -> Any:
        appends.append(len(args[1]))
        return original(*args, **kwargs)

    wf.world.append = counting  # type: ignore[method-assign]

    @wf.step
    def unit(i: int) -> int:
        return i

    @wf.workflow
    def five() -> int:
        return sum(unit(i) for i in range(5))

    run = five.start()
    worker.run_until_complete(run)
    assert run.result() == 10
    # [run_started, created, started], 4 x [completed, created, started], [completed, run_completed]
    assert appends == [3, 3, 3, 3, 3, 2]


def test_a_malformed_webhook_response_fails_its_step_without_retries(wf: Workflows, worker: LocalWorker) -> None:
    """``InvalidWebhookResponse`` in a step (``request.respond`` given a bad response): the webhook's caller has had
    its 500, and the same code builds the same response, so the step fails at once (a ConfigurationError, not a
    FatalError, was retried)."""
    from celery_workflow.errors import InvalidWebhookResponse

    @wf.step
    def answer() -> None:
        raise InvalidWebhookResponse("status 1000 is not an HTTP status")

    @wf.workflow
    def answering() -> str:
        try:
            answer()
        except StepFailed as exc:
            return exc.error_type
        return "answered"

    run = answering.start()
    worker.run_until_complete(run)
    assert run.result() == "celery_workflow.errors.InvalidWebhookResponse"
    assert [s.attempt for s in run.steps()] == [1]


def test_a_step_routed_to_its_own_queue_records_it(wf: Workflows, worker: LocalWorker) -> None:
    """Its ``step_created`` names the queue its deliveries go to, so the step view (and an inspector serving the
    World alone, without the registry) shows it (issue #26 item 20)."""

    @wf.step(queue="packing")
    def pack(n: int) -> int:
        return n

    @wf.workflow
    def packing(n: int) -> int:
        return pack(n)

    run = packing.start(3)
    LocalWorker(wf, queues=[wf.runtime.default_queue, "packing"]).run_until_complete(run)
    assert run.result() == 3
    (step,) = wf.world.list_steps(run.id)
    assert step.queue == "packing"
