"""The effects one workflow delivery applies for its replay (:class:`~.control.Effects`): appends relative to what
the replay has seen, split to fit the World's limits; step execution with its timing; the delivery's time budget; a
forced hook claim's takeover of another run's token; the step deliveries it queues.

:class:`~.handlers.Runtime` makes one per replay; this module knows the runtime only as a type.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from celery_workflow._backend.children import ParentLink
from celery_workflow.errors import EntityExists, EntityTerminal, NotFound, RunTerminal, StaleLog
from celery_workflow.event_data import HookDisposedData
from celery_workflow.events import Event, NewEvent, RunView
from celery_workflow.runtime import batches, children, holding, steps
from celery_workflow.runtime.control import Restart
from celery_workflow.runtime.registry import StepDef, WorkflowDef
from celery_workflow.runtime.task_events import InlineStepEvents
from celery_workflow.world import Delivery, append_limits

if TYPE_CHECKING:
    from celery_workflow.runtime.handlers import Runtime
    from celery_workflow.runtime.replay import Replay

log = logging.getLogger("celery_workflow")

#: A new run's first inline step starts without its own write when its body took less than this the last time
#: (seconds): the start rides with the delivery's next write. A longer step is started in the World first.
HOLD_START_BELOW = 0.01


class RunEnded(BaseException):
    """The run ended under this delivery (another writer ended it): nothing more to do."""


class WorkflowEffects:
    """The I/O of one replay: appends relative to what the replay has seen, step execution, the time budget."""

    def __init__(
        self,
        runtime: Runtime,
        run: RunView,
        delivery_id: str,
        started: float,
        receipt: str | None,
        *,
        inline_until: float | None = None,
        task_events: InlineStepEvents | None = None,
    ) -> None:
        self.runtime = runtime
        self.run = run
        self.delivery_id = delivery_id
        self.started = started
        self.receipt = receipt
        self.inline_until = inline_until
        self.defer_writes = not runtime.every_write_durable
        #: what one append may carry, and whether the World wants quick steps batched (``batch_steps``)
        self.limits = append_limits(runtime.world)
        self._costs = holding.Costs(self.limits)
        self.replay: Replay | None = None
        #: where the inline step attempts are reported as Celery task events (None: not reported)
        self.task_events = task_events

    def append(
        self, events: Sequence[NewEvent], deliveries: Sequence[Delivery], *, conditional: bool, final: bool = False
    ) -> list[Event]:
        """Write a batch of the replay as the appends the World's limits allow (:mod:`.batches`): one where any size
        goes; else several, in order, a step's delivery with its creation, the ack and the durable commit with the
        last. Another writer's events between two of them leave a gap in what is returned: the replay then reads the
        log again (Restart), keeping what was written."""
        assert self.replay is not None
        expected = self.replay.count if conditional else None
        try:
            return batches.append_split(
                self.runtime.world,
                self.run.run_id,
                events,
                deliveries,
                expected_count=expected,
                ack=self.receipt if final else None,
                durable=self.runtime.every_write_durable,
                last_durable=final or self.runtime.every_write_durable,
            )
        except (StaleLog, EntityExists, EntityTerminal):
            raise Restart() from None
        except RunTerminal:
            raise RunEnded() from None

    def wall_now(self) -> datetime:
        return self.runtime.clock()

    def inline_allowed(self) -> bool:
        now = time.monotonic()
        return now - self.started < self.runtime.inline_budget and (
            self.inline_until is None or now < self.inline_until
        )

    def take_token(self, token: str) -> None:
        """Dispose the other run's live hook owning ``token`` in that run's log (``taken_by`` this run) and wake it.
        Two appends of one run each, never one transaction over two runs: no lock order to keep, and it works the
        same on every World. A owner that ended or let go meanwhile is left alone."""
        world = self.runtime.world
        try:
            owner = world.get_hook_by_token(token)
            if owner.run_id == self.run.run_id:
                return
            owner_run = world.get_run(owner.run_id)
            world.append(
                owner.run_id,
                [NewEvent.of(HookDisposedData(taken_by=self.run.run_id), owner.hook_id)],
                deliveries=[self.runtime.wake_delivery(owner_run)],
            )
        except (NotFound, RunTerminal, EntityTerminal):
            return
        log.info("run %s took hook token %r over from run %s", self.run.run_id, token, owner.run_id)

    def step_delivery(self, sdef: StepDef, step_id: str, not_before: datetime | None) -> Delivery:
        queue = self.runtime._step_queue(self.run, sdef)
        return self.runtime.dispatcher.step_delivery(
            self.run.run_id, self.run.workflow_name, sdef.name, step_id, queue, not_before=not_before
        )

    def execute_step(
        self, sdef: StepDef, step_id: str, input: Any, attempt: int, started_at: datetime
    ) -> steps.StepOutcome:
        events = self.task_events
        watch = events.attempt(sdef.name, self.run.run_id, step_id, attempt) if events is not None else None
        began = time.monotonic()
        try:
            outcome = steps.execute(
                self.runtime.world,
                sdef,
                run_id=self.run.run_id,
                workflow_name=self.run.workflow_name,
                step_id=step_id,
                data_input=input,
                attempt=attempt,
                started_at=started_at,
            )
        except Exception as exc:
            if watch is not None:
                watch.interrupted(exc)
            raise
        finally:
            self.runtime.inline_seconds[sdef.name] = time.monotonic() - began
        if watch is not None:
            watch.ended(steps.verdict(sdef, outcome, attempt), result=outcome.result, error=outcome.error)
        return outcome

    def start_child(self, wdef: WorkflowDef, run_id: str, data_input: Any, correlation_id: str) -> None:
        wake = self.runtime.wake_delivery(self.run)  # the parent's wake-up, copied by the World at the child's end
        link = ParentLink.of(self.run.run_id, correlation_id, wake)
        children.create_child(self.runtime, wdef, run_id, data_input, link)

    def may_hold_start(self, sdef: StepDef) -> bool:
        """A new run's first step may start unwritten (the run was read from the World just now, pending: no other
        delivery of it exists) when the step's body took less than :data:`HOLD_START_BELOW` the last time it ran
        here. A step not seen yet, or a slow one, is started in the World first, so a run in a long step shows as
        running."""
        last = self.runtime.inline_seconds.get(sdef.name)
        return last is not None and last < HOLD_START_BELOW

    def may_batch_start(self, sdef: StepDef, unwritten: Sequence[NewEvent], oldest: datetime | None) -> bool:
        """A new inline step of a run this delivery has written to (or of a running run) may start unwritten on a
        World that wants batched appends (``AppendLimits.batch_steps``), when writes wait for the delivery's end
        (durability per delivery), the step is known to be quick (as for :meth:`may_hold_start`) and the batch is
        young and small enough (:func:`.holding.may_batch`)."""
        return (
            self.defer_writes
            and self.limits.batch_steps
            and self.may_hold_start(sdef)
            and holding.may_batch(self._costs, unwritten, oldest, self.wall_now())
        )
