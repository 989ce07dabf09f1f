"""Handling deliveries against a World: start a run, run a workflow delivery, run a step delivery, resume a hook.

The :class:`Runtime` knows nothing of Celery: it reads and writes through the World protocol and asks a
:class:`Dispatcher` (Celery's, in ``app.py``; a plain one in ``testing``) to build delivery messages.

Crash safety: every state change is one World append that carries the deliveries it implies (a step's delivery
with its creation, the workflow's wake-up with a step's result or a hook's payload), and the delivery being handled
is acknowledged only after the handler returns. A crash anywhere leaves either the old state with the triggering
delivery still queued, or the new state with its deliveries queued; redelivery replays from the log.
"""

from __future__ import annotations

import logging
import random as _random
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from datetime import datetime
from typing import Any, Protocol

from celery_workflow import codec
from celery_workflow._backend.children import close_children
from celery_workflow.errors import (
    CeleryWorkflowError,
    ConfigurationError,
    EntityExists,
    EntityTerminal,
    EventInvalid,
    EventTooLarge,
    HookNotFound,
    NotFound,
    PayloadError,
    PayloadTooLarge,
    ReplayDivergence,
    RunTerminal,
    StaleLog,
    TooEarly,
    WebhookUsed,
    WorldError,
)
from celery_workflow.event_data import (
    HookCreatedData,
    HookReceivedData,
    RunCancelledData,
    RunCompletedData,
    RunCreatedData,
    RunFailedData,
    StepFailedData,
    StepStartedData,
)
from celery_workflow.events import EventType, HookView, NewEvent, RunStatus, RunView
from celery_workflow.ids import USER_RUN_ID, new_run_id, to_micros, utcnow
from celery_workflow.runtime import continuation, steps
from celery_workflow.runtime.context import WebhookRequest
from celery_workflow.runtime.control import Outcome, Refused, Restart, WorldFault
from celery_workflow.runtime.effects import RunEnded, WorkflowEffects
from celery_workflow.runtime.handled import Handled
from celery_workflow.runtime.registry import Registry, StepDef
from celery_workflow.runtime.replay import RUN_TIMED_OUT, Replay
from celery_workflow.runtime.task_events import InlineStepEvents
from celery_workflow.telemetry.hooks import Probe, delivered, started
from celery_workflow.world import DEFAULT_QUEUE, Claim, Delivery, NewRun, World

log = logging.getLogger("celery_workflow")

MAX_RESTARTS = 100
_RUN_ID = USER_RUN_ID


class Dispatcher(Protocol):
    """Builds the delivery messages the World stores (opaque to it)."""

    def workflow_delivery(
        self,
        run_id: str,
        workflow_name: str,
        queue: str,
        *,
        not_before: datetime | None,
        idempotency_key: str,
    ) -> Delivery: ...

    def step_delivery(
        self, run_id: str, workflow_name: str, step_name: str, step_id: str, queue: str, *, not_before: datetime | None
    ) -> Delivery: ...


class Runtime:
    """Runs workflows and steps for one World and registry."""

    def __init__(
        self,
        world: World,
        registry: Registry,
        dispatcher: Dispatcher,
        *,
        base_url: str | None = None,
        routes: dict[str, str] | None = None,
        default_queue: str = DEFAULT_QUEUE,
        inline_budget: float = 30.0,
        divergence_retries: int = 3,
        durability: str = "delivery",
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        if durability not in ("delivery", "step"):
            raise ConfigurationError("durability must be 'delivery' or 'step'")
        self.world = world
        self.registry = registry
        self.dispatcher = dispatcher
        self.base_url = base_url
        self.routes = routes if routes is not None else {}  # shared with Workflows.route()
        self.default_queue = default_queue
        self.inline_budget = inline_budget
        self.divergence_retries = divergence_retries
        #: "step": every write is durable when it returns; "delivery": a delivery's writes become durable with its
        #: last one (one disk flush per delivery; a database crash mid-delivery re-runs that delivery's steps)
        self.every_write_durable = durability == "step"
        self.clock = clock
        #: how long each step's body took the last time it ran inline in this process (see may_hold_start)
        self.inline_seconds: dict[str, float] = {}
        #: the World's ``max_payload``: inputs, step results, run outputs and hook payloads are checked against it
        #: where they are produced, so none is refused by an append after its side effects
        self.max_payload = steps.payload_limit(world)
        #: exceptions a worker's time limit raises in a step body (Celery's SoftTimeLimitExceeded, set by app.py): an
        #: attempt of a step with a timeout that raises one is StepTimedOut
        self.timeout_errors: tuple[type[BaseException], ...] = ()
        #: the telemetry hooks (``Workflows(telemetry=...)`` replaces this one, which records nothing)
        self.telemetry: Probe = Probe()

    # -- queues ----------------------------------------------------------------------------------------------------

    def queue_for(self, workflow_name: str) -> str:
        if workflow_name in self.routes:
            return self.routes[workflow_name]
        wdef = self.registry.workflows.get(workflow_name)
        return (wdef.queue if wdef else None) or self.default_queue

    def _step_queue(self, run: RunView, sdef: StepDef) -> str:
        return sdef.queue or run.queue or self.default_queue

    def wake_delivery(self, run: RunView, *, not_before: datetime | None = None) -> Delivery:
        key = "wake" if not_before is None else f"timer:{to_micros(not_before)}"
        return self.dispatcher.workflow_delivery(
            run.run_id, run.workflow_name, run.queue or self.default_queue, not_before=not_before, idempotency_key=key
        )

    # -- outside calls ---------------------------------------------------------------------------------------------

    @started
    def start(
        self, workflow_name: str, args: Sequence[Any], kwargs: Mapping[str, Any], *, run_id: str | None = None
    ) -> tuple[RunView, bool]:
        """Create the run and its first delivery in one write. Idempotent by ``run_id``."""
        wdef = self.registry.workflow(workflow_name)
        if run_id is not None and not _RUN_ID.match(run_id):
            raise EventInvalid(f"invalid run id {run_id!r}: 1-200 characters of letters, digits and _ - . : @")
        rid = run_id or new_run_id()
        data_input = wdef.signature.encode_args(args, kwargs)
        codec.check_size(data_input, self.max_payload, f"the input of workflow {workflow_name}")
        queue = self.queue_for(workflow_name)
        deadline = self.clock() + wdef.timeout if wdef.timeout is not None else None
        new = NewRun(rid, workflow_name, data_input, queue, deadline=deadline, traceparent=self.telemetry.traceparent())
        first = self.dispatcher.workflow_delivery(rid, workflow_name, queue, not_before=None, idempotency_key="wake")
        return self.world.create_run(new, [first, *self._deadline_deliveries(new)])

    def _deadline_deliveries(self, new: NewRun) -> list[Delivery]:
        """The workflow delivery due at a new run's deadline, which fails it then if it is still going (asleep,
        waiting on a hook or on steps): none for a run without one."""
        if new.deadline is None:
            return []
        return [
            self.dispatcher.workflow_delivery(
                new.run_id,
                new.workflow_name,
                new.queue or self.default_queue,
                not_before=new.deadline,
                idempotency_key=f"deadline:{to_micros(new.deadline)}",
            )
        ]

    def resume_hook(self, token: str, payload: Any, *, wait: float = 0.0) -> HookView:
        """Deliver ``payload`` to the live hook owning ``token`` and wake its run. HookNotFound if none; WebhookUsed
        if the hook is a webhook that answers once and has already had its request.

        ``wait``: seconds to keep looking for the hook while no live hook has the token (a run just started has not
        reached its ``create_hook`` yet): it is looked up again after short, growing pauses (up to the World's
        ``poll_interval``), and HookNotFound is raised only once ``wait`` has passed."""
        if not wait >= 0:  # a negative number or NaN
            raise ConfigurationError("resume_hook(wait=...) takes a number of seconds >= 0")
        deadline = time.monotonic() + wait
        pause = 0.005
        while True:
            try:
                hook = self.world.get_hook_by_token(token)
                break
            except HookNotFound:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                time.sleep(min(pause, left))
                pause = min(pause * 2, max(0.005, self.world.poll_interval))
        if hook.is_webhook:
            return self._receive_webhook(hook, lambda keep_credentials: payload)
        run = self.world.get_run(hook.run_id)
        data = HookReceivedData(payload=codec.to_json(payload))
        codec.check_size(data.payload, self.max_payload, f"the payload of hook {hook.hook_id}")
        self.world.append(hook.run_id, [NewEvent.of(data, hook.hook_id)], deliveries=[self.wake_delivery(run)])
        return hook

    def resume_webhook(self, token: str, request: WebhookRequest, *, hook: HookView | None = None) -> HookView:
        """Record ``request`` as received by the webhook owning ``token`` and wake its run.

        ``hook``: the webhook as the caller already read it (so the request goes to the hook whose options the caller
        saw). The credential headers are dropped unless the webhook keeps them. HookNotFound if no live webhook owns
        the token (a plain hook's token included); WebhookUsed if the webhook answers once and has had its request.
        """
        hook = hook if hook is not None else self.world.get_hook_by_token(token)
        if not hook.is_webhook or hook.token != token:
            raise HookNotFound("no webhook has this token")

        def payload(keep_credentials: bool) -> Any:
            return (request if keep_credentials else request.without_credentials()).to_payload()

        return self._receive_webhook(hook, payload)

    def _receive_webhook(self, hook: HookView, payload_of: Callable[[bool], Any]) -> HookView:
        """Append ``hook_received`` to a webhook. One that answers once is appended on the condition that the event
        count is the one read with the log that shows no request yet: of two racing first requests the World takes
        one, and the other (StaleLog) re-reads the log, finds the request and raises WebhookUsed."""
        for attempt in range(MAX_RESTARTS):
            run, events = self.world.get_run_with_events(hook.run_id)
            created = next(
                (e.body for e in events if isinstance(e.body, HookCreatedData) and e.correlation_id == hook.hook_id),
                None,
            )
            if created is None or created.token != hook.token:
                raise HookNotFound("no webhook has this token")
            many, keep_credentials = created.webhook_options
            data = HookReceivedData(payload=codec.to_json(payload_of(keep_credentials)))
            codec.check_size(data.payload, self.max_payload, f"the request to webhook {hook.hook_id}")
            received = NewEvent.of(data, hook.hook_id)
            if many:
                self.world.append(hook.run_id, [received], deliveries=[self.wake_delivery(run)])
                return hook
            if any(e.event_type is EventType.HOOK_RECEIVED and e.correlation_id == hook.hook_id for e in events):
                raise WebhookUsed(f"webhook {hook.hook_id} of run {hook.run_id} answers once and has had its request")
            count = events[-1].slot if events else 0
            try:
                self.world.append(hook.run_id, [received], expected_count=count, deliveries=[self.wake_delivery(run)])
            except StaleLog:
                time.sleep(_random.uniform(0.0, min(0.05, 0.001 * (attempt + 1))))  # the run moved: read it again
                continue
            return hook
        raise WorldError(f"run {hook.run_id}: the event log kept moving under {MAX_RESTARTS} webhook requests")

    def cancel(self, run_id: str, reason: str | None = None) -> RunView:
        """Write ``run_cancelled``: later deliveries do nothing; its children still running are cancelled too (those
        started with ``parent_close="abandon"`` run on). RunTerminal if the run already finished."""
        view = self.world.append(run_id, [NewEvent.of(RunCancelledData(reason=reason or None))]).run
        close_children(self.world, run_id)
        return view

    # -- workflow deliveries ---------------------------------------------------------------------------------------

    @delivered("workflow")
    def handle_workflow(
        self,
        run_id: str,
        *,
        delivery_id: str,
        claim: Claim | None = None,
        inline_until: float | None = None,
        workflow_name: str | None = None,
        task_events: InlineStepEvents | None = None,
    ) -> Handled:
        """Replay the run and move it as far as it goes now. Returns what happened (for logs and tests).

        ``claim`` (the transport's claim of this delivery, None when it did not come from one of our transports)
        says how many times the delivery was received, and its receipt lets the last write delete the delivery in
        the same transaction; the writes before it are not made durable one by one (``World.append(durable=...)``).
        ``inline_until`` (a ``time.monotonic()`` deadline, e.g. half a Lambda invocation's time): past it, steps are
        queued as their own deliveries instead of run inline, as past ``inline_budget``. ``workflow_name``: the
        workflow the delivery's task names; a delivery naming another workflow than the run's is dropped.
        ``task_events``: where the attempts of steps run inline are reported as Celery task events (a worker whose
        task events are on, :mod:`.task_events`).

        The run is always read from the World first: nothing the message carries decides which code runs with which
        input, and a run cancelled before its delivery arrives runs no step. A World error (unavailable, throttled,
        a driver error) is raised to the caller, whatever the workflow's code does: the delivery is retried with
        backoff and the run is untouched. A write the World refuses as malformed fails the run at once.
        """
        attempt = claim.attempts if claim is not None else 1
        receipt = claim.receipt if claim is not None else None
        started = time.monotonic()
        for _ in range(MAX_RESTARTS):
            try:
                run, events = self.world.get_run_with_events(run_id)
            except NotFound:
                log.warning("delivery %s: run %s does not exist; dropping it", delivery_id, run_id)
                return Handled("missing")
            if workflow_name is not None and workflow_name != run.workflow_name:
                log.warning(
                    "delivery %s names workflow %r, but run %s is a run of %r; dropping it",
                    delivery_id,
                    workflow_name,
                    run_id,
                    run.workflow_name,
                )
                return Handled("mismatch")
            if run.status.terminal:
                return Handled("ended")
            predecessor = continuation.predecessor_of(events[0].body) if run.status is RunStatus.PENDING else None
            if predecessor is not None:
                verdict = continuation.gate(self.world, run, predecessor)
                if verdict == "wait":
                    self.world.enqueue([self.wake_delivery(run, not_before=self.clock() + continuation.CHECK_AFTER)])
                    return Handled("waiting")
                if verdict == "orphan":
                    with suppress(RunTerminal):
                        self.cancel(run_id, f"its predecessor {predecessor} ended without handing over to it")
                    return Handled("ended")
            wdef = self.registry.workflow(run.workflow_name)
            effects = WorkflowEffects(
                self, run, delivery_id, started, receipt, inline_until=inline_until, task_events=task_events
            )
            replay = Replay(
                run=run,
                wdef=wdef,
                registry=self.registry,
                effects=effects,
                events=events,
                base_url=self.base_url,
                max_payload=self.max_payload,
            )
            effects.replay = replay
            try:
                outcome = replay.execute()
                return self._finish(run, replay, outcome, attempt)
            except Restart:
                continue
            except RunEnded:
                return Handled("ended")
            except WorldFault as fault:
                raise fault.error  # noqa: B904 - its own cause is the driver's error
        raise WorldError(f"run {run_id}: the event log kept moving under {MAX_RESTARTS} replays")

    def _finish(self, run: RunView, replay: Replay, outcome: Outcome, attempt: int) -> Handled:
        """Write what ``outcome`` means; a write the World refuses as malformed fails the run with the cause instead
        (the same write would be refused again: retrying it would only end in the dead letters)."""
        try:
            kind = self._settle(run, replay, outcome, attempt)
            if kind != "suspended":
                self._close_children(run, replay)
            return kind
        except Refused as refused:
            exc = refused.error
            if outcome.kind == "completed" and isinstance(exc, EventTooLarge):
                # checked against max_payload already; a World whose views hold more than one value (the run's
                # input beside its output) may still refuse it
                exc = PayloadTooLarge(f"the output of run {run.run_id} was refused: {exc.message}")
            log.error("run %s: the World refused its write (%s); failing the run", run.run_id, exc)
            replay.discard()
            error = steps.error_info(exc)
            try:
                replay.write([NewEvent.of(RunFailedData(error=error))], final=True)
            except Refused as again:
                raise again.error from exc
            self._close_children(run, replay)
            return Handled("failed", failure=error)

    def _close_children(self, run: RunView, replay: Replay) -> None:
        """The run has ended: apply its children's ``parent_close`` policy. A failure here is logged, not raised:
        the run's end is written and its delivery acked (the children then run on, as abandoned ones do)."""
        if not any(ev.event_type is EventType.CHILD_STARTED for ev in replay.events):
            return
        try:
            close_children(self.world, run.run_id, replay.events)
        except CeleryWorkflowError as exc:
            log.warning("run %s ended, but its children could not all be cancelled: %s", run.run_id, exc)

    def _settle(self, run: RunView, replay: Replay, outcome: Outcome, attempt: int) -> Handled:
        if outcome.kind == "completed":
            replay.write([NewEvent.of(RunCompletedData(output=outcome.output))], final=True)
            return Handled("completed")
        if outcome.kind == "failed":
            error = outcome.error or {}
            replay.write([NewEvent.of(RunFailedData(error=error, code=outcome.code))], final=True)
            return Handled("timed_out" if outcome.code == RUN_TIMED_OUT else "failed", failure=error)
        if outcome.kind == "continued":
            return self._hand_over(run, replay, outcome.output)
        if outcome.kind == "diverged":
            message = str((outcome.error or {}).get("message", "replay divergence"))
            if attempt <= self.divergence_retries:
                raise ReplayDivergence(f"run {run.run_id}: {message} (attempt {attempt}, will retry)")
            log.error("run %s diverged from its event log: %s", run.run_id, message)
            error = outcome.error or {}
            replay.write([NewEvent.of(RunFailedData(error=error, code="REPLAY_DIVERGENCE"))], final=True)
            return Handled("failed", failure=error)
        deliveries: list[Delivery] = []
        if replay.open_waits:
            deliveries.append(self.wake_delivery(run, not_before=min(replay.open_waits.values())))
        if replay.pending or replay.deferred:
            # a new hook may come back as hook_conflict, which needs another replay: keep the delivery until then
            creates_hooks = any(ev.event_type is EventType.HOOK_CREATED for ev in replay.pending)
            written = replay.write([], deliveries, final=not creates_hooks)
            if any(ev.event_type is EventType.HOOK_CONFLICT for ev in written):
                raise Restart()  # replay again so the workflow sees the conflict
        elif deliveries or replay.pending_deliveries:
            self.world.enqueue([*replay.pending_deliveries, *deliveries])
        return Handled("suspended")

    def _hand_over(self, run: RunView, replay: Replay, successor_input: Any) -> Handled:
        """Create the successor (gated: only a check delivery), then complete this run naming it, with its wake-up
        (see :mod:`.continuation`). A successor id already taken by other arguments (an earlier attempt of this
        delivery that replayed differently and never completed) is cancelled and the next id used."""
        queue = run.queue or self.default_queue
        for skip in range(MAX_RESTARTS):
            succ = continuation.successor_id(run.run_id, skip=skip)
            check = self.dispatcher.workflow_delivery(
                succ,
                run.workflow_name,
                queue,
                not_before=self.clock() + continuation.CHECK_AFTER,
                idempotency_key="check",
            )
            # the successor keeps the chain's deadline (a timeout bounds the whole loop, not each hand-over)
            # and a child's link to its parent: the chain's last run wakes the parent
            new = NewRun(
                succ,
                run.workflow_name,
                successor_input,
                run.queue,
                continues=run.run_id,
                deadline=replay.deadline,
                traceparent=self.telemetry.traceparent(),  # the successor's deliveries continue this trace
                parent=replay.parent,
            )
            try:
                view, created = self.world.create_run(new, [check, *self._deadline_deliveries(new)])
            except EntityExists:
                continue  # the id belongs to another workflow's run
            if created or (view.input == successor_input and view.status is RunStatus.PENDING):
                break
            if view.status is RunStatus.PENDING:
                with suppress(RunTerminal):
                    self.cancel(succ, f"superseded: run {run.run_id} handed over to another successor")
        else:
            raise WorldError(f"run {run.run_id}: no free successor id after {MAX_RESTARTS} tries")
        wake = self.wake_delivery(view)
        done = NewEvent.of(RunCompletedData(output=None, continued_as=succ, continued_with=successor_input))
        replay.write([done], [wake], final=True)
        return Handled("continued")

    # -- step deliveries -------------------------------------------------------------------------------------------

    @delivered("step")
    def handle_step(
        self,
        run_id: str,
        step_id: str,
        *,
        delivery_id: str,
        claim: Claim | None = None,
        step_name: str | None = None,
    ) -> Handled:
        """Run one attempt of a queued step, record its outcome, and wake the workflow (or schedule the retry).

        ``claim``: as for :meth:`handle_workflow` (its receipt acks the delivery with the step's outcome).
        ``step_name``: the step the delivery's task names; a delivery naming another step than the one recorded is
        dropped. The step runs with the input the World recorded, never one the message carries."""
        receipt = claim.receipt if claim is not None else None
        try:
            run = self.world.get_run(run_id)
            step = self.world.get_step(run_id, step_id)
        except NotFound:
            log.warning("delivery %s: step %s of run %s does not exist; dropping it", delivery_id, step_id, run_id)
            return Handled("missing")
        if step_name is not None and step_name != step.step_name:
            log.warning(
                "delivery %s names step %r, but step %s of run %s is %r; dropping it",
                delivery_id,
                step_name,
                step_id,
                run_id,
                step.step_name,
            )
            return Handled("mismatch")
        sdef = self.registry.step(step.step_name)
        if step.status.terminal:
            self.world.enqueue([self.wake_delivery(run)])
            return Handled("done")
        if run.status.terminal:
            return Handled("ended")
        if step.owner not in (None, delivery_id) and step.status.value == "running":
            return Handled("owned")
        if self._past_deadline(run):
            self.world.enqueue([self.wake_delivery(run)])  # the workflow delivery fails the run
            return Handled("timed_out")
        queue = self._step_queue(run, sdef)
        try:
            res = self.world.append(
                run_id,
                [NewEvent.of(StepStartedData(owner=delivery_id), step_id)],
                durable=self.every_write_durable,
            )
        except TooEarly as exc:
            self.world.enqueue(
                [
                    self.dispatcher.step_delivery(
                        run_id, run.workflow_name, sdef.name, step_id, queue, not_before=exc.retry_after
                    )
                ]
            )
            return Handled("early")
        except RunTerminal:
            return Handled("ended")
        except EntityTerminal:
            self.world.enqueue([self.wake_delivery(run)])
            return Handled("done")
        started = res.events[-1]
        n = started.data_as(StepStartedData).attempt
        crash_loop = steps.exceeded_starts(sdef, step_id, n)
        if crash_loop is not None:
            return self._record_step(run, step_id, crash_loop, receipt)
        outcome = steps.execute(
            self.world,
            sdef,
            run_id=run_id,
            workflow_name=run.workflow_name,
            step_id=step_id,
            data_input=step.input,
            attempt=n,
            started_at=started.created_at,
            timeout_errors=self.timeout_errors,
        )
        event, when = steps.record(sdef, step_id, outcome, n, self.clock())
        if when is None:
            return self._record_step(run, step_id, event, receipt)
        again = self.dispatcher.step_delivery(run_id, run.workflow_name, sdef.name, step_id, queue, not_before=when)
        try:
            self.world.append(run_id, [event], deliveries=[again], ack=receipt)
        except RunTerminal:
            return Handled("ended")
        except EntityTerminal:
            return Handled("done")
        except (EventInvalid, PayloadError) as exc:
            return self._refused_step(run, step_id, exc, receipt)
        return Handled("retrying", error=event.data.get("error") or {}, retry_at=when)

    def _past_deadline(self, run: RunView) -> bool:
        """Whether ``run`` is past the deadline its ``run_created`` records. Read only when the run's workflow, as
        registered here, has a timeout (one read more per step delivery); the workflow delivery checks the recorded
        deadline whatever the code says."""
        wdef = self.registry.workflows.get(run.workflow_name)
        if wdef is None or wdef.timeout is None:
            return False
        first = self.world.list_events(run.run_id, limit=1)
        created = first[0].body if first else None
        deadline = created.deadline if isinstance(created, RunCreatedData) else None
        return deadline is not None and self.clock() >= deadline

    def _record_step(self, run: RunView, step_id: str, event: NewEvent, receipt: str | None) -> Handled:
        try:
            self.world.append(run.run_id, [event], deliveries=[self.wake_delivery(run)], ack=receipt)
        except EntityTerminal:
            self.world.enqueue([self.wake_delivery(run)])
            return Handled("duplicate")
        except (EventInvalid, PayloadError) as exc:
            if event.event_type is EventType.STEP_FAILED:
                raise  # the failure itself was refused: the delivery is retried, then dead-lettered
            return self._refused_step(run, step_id, exc, receipt)
        if event.event_type is EventType.STEP_COMPLETED:
            return Handled("completed")
        return Handled("failed", failure=event.data.get("error") or {})

    def _refused_step(self, run: RunView, step_id: str, exc: Exception, receipt: str | None) -> Handled:
        """The World refused an attempt's outcome as malformed (a result it cannot store): the step fails at once
        with that cause, as a result over ``max_payload`` does, instead of being retried into the dead letters."""
        log.error("run %s: the World refused the outcome of step %s (%s); failing the step", run.run_id, step_id, exc)
        failed = NewEvent.of(StepFailedData(error=steps.error_info(exc)), step_id)
        return self._record_step(run, step_id, failed, receipt)
