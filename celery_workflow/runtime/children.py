"""Child runs: ``other_workflow.start(...)`` inside a workflow.

Starting a child is recorded once in the parent's log, ``child_started`` (correlation id ``child:<n>``, the n-th
child the run starts; data: the child's run id and workflow, and its ``parent_close`` policy). The child's id is
``<parent id>!<n>`` unless the call names one (user run ids cannot contain ``!``, so the two never collide). The
child is created first (idempotent by its id: a replay that meets the call again finds it), its ``run_created``
carrying the parent link (:class:`~celery_workflow._backend.children.ParentLink`); the ``child_started`` is written
with the parent's next write. A replay that meets a recorded ``child_started`` returns the same child.

``ChildRun.result()`` inside the workflow returns the child's output from the parent's ``child_ended`` event, or
raises :class:`~celery_workflow.errors.WorkflowFailed` / :class:`~celery_workflow.errors.RunCancelled` as
``Run.result`` does; until that event exists the parent suspends (no worker waits). The World writes
``child_ended`` and the parent's wake-up in the same transaction as the child's end, whoever ends it (its own
delivery, a cancel from the CLI or a client, a dead letter).

When the parent ends (completed, failed, timed out, cancelled, diverged, or handed over with ``continue_as_new``)
its children still running are cancelled (``parent_close="cancel"``, the default) or left to run
(``parent_close="abandon"``): :func:`celery_workflow._backend.children.close_children`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from celery_workflow import codec
from celery_workflow._backend.children import ParentLink, link_of
from celery_workflow.client import Run
from celery_workflow.errors import ConfigurationError, EntityExists, EventInvalid, RunCancelled, run_failure
from celery_workflow.event_data import ChildEndedData, ChildStartedData
from celery_workflow.events import EventType, NewEvent
from celery_workflow.ids import USER_RUN_ID
from celery_workflow.runtime import context
from celery_workflow.runtime.control import Diverged, Suspend
from celery_workflow.world import NewRun

if TYPE_CHECKING:
    from celery_workflow.runtime.handlers import Runtime
    from celery_workflow.runtime.registry import WorkflowDef
    from celery_workflow.runtime.replay import Replay

__all__ = ["PARENT_CLOSE", "SEPARATOR", "ChildRun", "child_id", "create_child", "start_child"]

R = TypeVar("R")

#: What a parent's end does to its children still running.
PARENT_CLOSE = ("cancel", "abandon")
#: Child ids are ``<parent id>!<n>``: user-chosen run ids cannot contain ``!``.
SEPARATOR = "!"
_MAX_RUN_ID = 200


def child_id(parent_id: str, n: int) -> str:
    """The id of the ``n``-th child of run ``parent_id``, cut and suffixed with a hash when it would pass 200
    characters (ids stay bounded however deep children nest)."""
    suffix = f"{SEPARATOR}{n}"
    if len(parent_id) + len(suffix) > _MAX_RUN_ID:
        digest = hashlib.blake2b(parent_id.encode(), digest_size=8).hexdigest()
        parent_id = f"{parent_id[:150]}-{digest}"
    return parent_id + suffix


class ChildRun(Run[R]):
    """A run started by a workflow (``other_workflow.start(...)`` inside it). Inside the workflow that started it,
    :meth:`result` suspends the parent durably until the child ends; its other attributes (``status``, ``events()``
    …) read the World as :class:`~celery_workflow.client.Run`'s do (not deterministic: use them for display only)."""

    def __init__(self, replay: Replay, run_id: str, correlation_id: str, wdef: WorkflowDef) -> None:
        super().__init__(getattr(replay.effects, "runtime", None), run_id, returns=wdef.signature.returns)  # type: ignore[arg-type]
        self._replay = replay
        self.correlation_id = correlation_id
        self.child_workflow = wdef.name

    def result(self, timeout: float | None = None, *, follow: bool = True) -> R:
        """Inside the workflow that started it: the child's output, recorded in the parent's log (the parent
        suspends until the child ends); WorkflowFailed / RunCancelled as ``Run.result``. Elsewhere (a handle kept
        past its replay), ``Run.result``."""
        if context.current_replay() is not self._replay:
            return super().result(timeout, follow=follow)
        ended = self._ended()
        if ended is None:
            raise Suspend()
        self._replay._advance(ended[0])
        body = ended[1]
        if body.status == "completed":
            value: R = codec.from_json(body.output, self._returns)
            return value
        if body.status == "failed":
            raise run_failure(body.run_id, dict(body.error or {}))
        raise RunCancelled(run_id=body.run_id)

    def done(self) -> bool:
        """Whether the child has ended, as far as the parent's log records (deterministic inside the workflow)."""
        return self._ended() is not None

    def _ended(self) -> tuple[Any, ChildEndedData] | None:
        for ev in self._replay._of(self.correlation_id, EventType.CHILD_ENDED):
            return ev, ev.data_as(ChildEndedData)
        return None

    def __repr__(self) -> str:
        return f"<ChildRun {self.id} ({self.child_workflow})>"


def start_child(
    replay: Replay,
    wdef: WorkflowDef,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    run_id: str | None,
    parent_close: str,
) -> ChildRun[Any]:
    """Start (or, on replay, find) the child run of this call site: see the module docstring."""
    if parent_close not in PARENT_CLOSE:
        raise ConfigurationError(f"parent_close must be one of {', '.join(PARENT_CLOSE)}, not {parent_close!r}")
    cid = replay._next_id("child")
    data_input = wdef.signature.encode_args(args, kwargs)
    ev = replay._match(cid)
    if ev is not None:
        body = ev.body
        if not isinstance(body, ChildStartedData) or body.workflow_name != wdef.name:
            raise Diverged(f"slot {ev.slot} holds {ev.event_type} {cid!r}, not the start of a {wdef.name} run")
        if run_id is not None and body.run_id != run_id:
            raise Diverged(f"child {cid!r} was started as run {body.run_id!r}, the code now names {run_id!r}")
        return ChildRun(replay, body.run_id, cid, wdef)
    if run_id is not None and (not isinstance(run_id, str) or not USER_RUN_ID.match(run_id)):  # as from outside
        raise EventInvalid(f"invalid run id {run_id!r}: 1-200 characters of letters, digits and _ - . : @")
    replay.check_deadline()
    codec.check_size(data_input, replay.max_payload, f"the input of workflow {wdef.name}")
    rid = run_id if run_id is not None else child_id(replay.run.run_id, int(cid.split(":", 1)[1]))
    replay.effects.start_child(wdef, rid, data_input, cid)
    policy: Literal["cancel", "abandon"] = "cancel" if parent_close == "cancel" else "abandon"
    replay.pending.append(NewEvent.of(ChildStartedData(rid, wdef.name, policy), cid))
    return ChildRun(replay, rid, cid, wdef)


def create_child(runtime: Runtime, wdef: WorkflowDef, run_id: str, data_input: Any, link: ParentLink) -> None:
    """Create child run ``run_id`` linked by ``link`` with its first delivery (and its deadline's), as
    ``Runtime.start`` creates a run; EntityExists when ``run_id`` is taken by a run that is not this child."""
    queue = runtime.queue_for(wdef.name)
    deadline = runtime.clock() + wdef.timeout if wdef.timeout is not None else None
    new = NewRun(
        run_id,
        wdef.name,
        data_input,
        queue,
        deadline=deadline,
        traceparent=runtime.telemetry.traceparent(),  # the child's deliveries continue the parent's trace
        parent=link.to_data(),
    )
    first = runtime.dispatcher.workflow_delivery(run_id, wdef.name, queue, not_before=None, idempotency_key="wake")
    _, created = runtime.world.create_run(new, [first, *runtime._deadline_deliveries(new)])
    if created:
        return
    existing = link_of(runtime.world.list_events(run_id, limit=1))
    if existing is None or (existing.run_id, existing.correlation_id) != (link.run_id, link.correlation_id):
        raise EntityExists(
            f"run {run_id} exists and is not child {link.correlation_id} of run {link.run_id}; a child run's id"
            " must be new"
        )
