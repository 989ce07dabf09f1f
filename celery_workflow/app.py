"""The Celery binding: :class:`Workflows`, the ``@wf.workflow`` / ``@wf.step`` decorators and their Celery tasks.

This module and :mod:`celery_workflow.celery_tasks` are the ones that know Celery's task API: this one binds the
app (its broker, the decorators) and builds delivery messages (:func:`build_message`, with Celery's own protocol-2
builder); ``celery_tasks`` registers the tasks, ``workflow.<name>`` and ``step.<name>`` (what Flower shows), reads
the transport's claim back from a request and says what Celery reports for each delivery.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Generic, ParamSpec, TypeVar, overload

from celery.exceptions import SoftTimeLimitExceeded
from kombu import serialization

from celery_workflow import celery_tasks, task_names, worker_setup
from celery_workflow.broker_choice import DEFAULT_RELAY_LEASE, broker_choice
from celery_workflow.client import Run
from celery_workflow.errors import ConfigurationError, PayloadError
from celery_workflow.events import HookView, RunStatus
from celery_workflow.ids import isoformat, new_delivery_id
from celery_workflow.runtime import children, context
from celery_workflow.runtime.context import NotInWorkflow, StepFuture
from celery_workflow.runtime.handled import Handled
from celery_workflow.runtime.handlers import Runtime
from celery_workflow.runtime.registry import Registry, StepDef, WorkflowDef, check_timeout
from celery_workflow.schedules.api import Scheduling
from celery_workflow.task_names import step_task_name, workflow_task_name
from celery_workflow.telemetry import Telemetry
from celery_workflow.world import DEFAULT_QUEUE, Claim, Delivery, World, open_world

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("celery_workflow")

#: Where the embedded default World lives unless ``CELERY_WORKFLOW_URL`` or ``world=`` says otherwise.
DEFAULT_URL = "sqlite:///celery_workflow.sqlite3"
#: Seconds between a step's soft time limit and its hard time limit (see :mod:`celery_workflow.celery_tasks`).
HARD_LIMIT_GRACE = celery_tasks.HARD_LIMIT_GRACE


@dataclass(frozen=True, slots=True)
class TaskMessage:
    """A decoded delivery: the Celery task name, its id and its positional arguments."""

    name: str
    id: str
    args: list[Any]


def decode_message(payload: bytes) -> TaskMessage:
    """The task of a stored virtual-transport message (what :func:`build_message` writes); else PayloadError."""
    try:
        message = json.loads(payload)
        headers = message["headers"]
        body = message["body"]
        if (message.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args, _kwargs, _embed = json.loads(body)
        return TaskMessage(name=str(headers["task"]), id=str(headers["id"]), args=list(args))
    except (KeyError, TypeError, ValueError) as exc:
        raise PayloadError(f"not a Celery task message: {exc}") from exc


class CeleryDispatcher:
    """Builds deliveries as Celery task messages for the World to store."""

    def __init__(self, celery_app: Any) -> None:
        self.celery_app = celery_app

    def workflow_delivery(
        self,
        run_id: str,
        workflow_name: str,
        queue: str,
        *,
        not_before: datetime | None,
        idempotency_key: str,
    ) -> Delivery:
        payload = build_message(
            self.celery_app,
            workflow_task_name(workflow_name),
            [run_id],
            {},
            queue=queue,
            task_id=new_delivery_id(),
            not_before=not_before,
        )
        return Delivery(queue, payload, run_id, not_before, idempotency_key)

    def step_delivery(
        self, run_id: str, workflow_name: str, step_name: str, step_id: str, queue: str, *, not_before: datetime | None
    ) -> Delivery:
        payload = build_message(
            self.celery_app,
            step_task_name(step_name),
            [run_id, step_id],
            {},
            queue=queue,
            task_id=new_delivery_id(),
            not_before=not_before,
        )
        return Delivery(queue, payload, run_id, not_before, f"step:{step_id}")


class Workflow(Generic[P, R]):
    """A registered workflow. ``start(...)`` begins a durable run; calling it runs the function as plain Python."""

    def __init__(self, workflows: Workflows, wdef: WorkflowDef) -> None:
        self._workflows = workflows
        self.definition = wdef
        self.name = wdef.name
        self.__wrapped__ = wdef.func
        self.__doc__ = wdef.func.__doc__

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        result: R = self.definition.func(*args, **kwargs)
        return result

    def start(self, *args: Any, run_id: str | None = None, parent_close: str | None = None, **kwargs: Any) -> Run[R]:
        """Start a run (idempotent by ``run_id``) and return its handle.

        Inside a workflow it starts a *child run* and returns a :class:`~celery_workflow.ChildRun`: recorded once in
        the parent's log, its ``result()`` suspends the parent until the child ends (see docs/concepts.md, "Child
        runs"). ``parent_close``: what the parent's end does to the child if it still runs, ``"cancel"`` (the
        default) or ``"abandon"``; only inside a workflow."""
        replay = context.current_replay()
        if replay is not None and not context.in_step():
            child: Run[R] = children.start_child(
                replay, self.definition, args, kwargs, run_id=run_id, parent_close=parent_close or "cancel"
            )
            return child
        if parent_close is not None:
            raise ConfigurationError("parent_close is an option of a child run: start() inside a workflow")
        return self._workflows._start(self.name, args, kwargs, run_id=run_id)

    def __repr__(self) -> str:
        return f"<Workflow {self.name}>"


class Step(Generic[P, R]):
    """A registered step. Called inside a workflow it runs durably; elsewhere it is the plain function."""

    def __init__(self, workflows: Workflows, sdef: StepDef) -> None:
        self._workflows = workflows
        self.definition = sdef
        self.name = sdef.name
        self.__wrapped__ = sdef.func
        self.__doc__ = sdef.func.__doc__

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        replay = context.current_replay()
        if replay is not None and not context.in_step():
            result: R = replay.start_step(self.definition, args, kwargs, inline=True).result()
            return result
        value: R = self.definition.func(*args, **kwargs)
        return value

    def start(self, *args: P.args, **kwargs: P.kwargs) -> StepFuture[R]:
        """Start the step as its own delivery (in parallel); ``.result()`` or ``gather()`` waits for it."""
        replay = context.current_replay()
        if replay is None or context.in_step():
            raise NotInWorkflow(f"{self.name}.start() can only be called inside a workflow")
        future: StepFuture[R] = replay.start_step(self.definition, args, kwargs, inline=False)
        return future

    def __repr__(self) -> str:
        return f"<Step {self.name}>"


class Workflows(Scheduling):
    """Durable workflows on a Celery app.

    ``world`` is a World or a URL (``sqlite:///path``, ``postgresql://…``); ``None`` means the embedded SQLite World
    at ``$CELERY_WORKFLOW_URL`` or ``sqlite:///celery_workflow.sqlite3``. ``broker`` says what carries the
    deliveries (see :func:`broker_choice`): ``"world"`` sets the Celery app's broker to the World's queue
    (``broker_transport``/``broker_url``, prefetch multiplier 1); ``"app"`` keeps the app's own broker, and a relay
    (:mod:`celery_workflow.relay`) publishes the World's due deliveries to it. A worker started without ``-Q``
    serves every queue these workflows use (:mod:`celery_workflow.worker_setup`).
    """

    def __init__(
        self,
        celery_app: Any,
        world: World | str | None = None,
        *,
        base_url: str | None = None,
        routes: Mapping[str, str] | None = None,
        queues: Sequence[str] | None = None,
        inline_budget: float = 30.0,
        durability: str = "delivery",
        transport_options: Mapping[str, Any] | None = None,
        broker: str | None = None,
        configure_broker: bool | None = None,
        relay_lease: float = DEFAULT_RELAY_LEASE,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.celery_app = celery_app
        #: ``"world"`` or ``"app"``: what carries this app's workflow deliveries (see :func:`broker_choice`).
        self.broker = broker_choice(celery_app, broker, configure_broker)
        if relay_lease <= 0:
            raise ConfigurationError(f"relay_lease must be a positive number of seconds, not {relay_lease!r}")
        #: How long a relayed delivery stays leased in the World before the relay publishes it again (broker="app").
        self.relay_lease = float(relay_lease)
        if world is None:
            world = os.environ.get("CELERY_WORKFLOW_URL") or DEFAULT_URL
        self.world: World = open_world(world) if isinstance(world, str) else world
        if base_url is None:  # the World's own setting (PostgresConfig.base_url, AWSConfig / WORKFLOW_BASE_URL)
            base_url = getattr(self.world, "base_url", None)
        self.base_url = base_url
        self.registry = Registry()
        #: The queues given as ``queues=`` (None: not given); a worker without ``-Q`` serves them too.
        self.declared_queues = frozenset(queues) if queues is not None else None
        self.routes: dict[str, str] = {}
        self.runtime = Runtime(
            self.world,
            self.registry,
            CeleryDispatcher(celery_app),
            base_url=base_url,
            routes=self.routes,
            default_queue=self._default_queue(),
            inline_budget=inline_budget,
            durability=durability,
        )
        self.runtime.timeout_errors = (SoftTimeLimitExceeded,)  # a step's timeout, as Celery's time limit raises it
        for name, queue in {**self.world.routes, **(routes or {})}.items():
            self.route(name, queue)
        if self.broker == "world":
            self._configure_celery(transport_options or {})
        worker_setup.connect_worker_signals(self)  # queues without -Q, pools per process, upkeep
        if telemetry is not None:  # spans, metrics and log fields (celery_workflow.telemetry)
            telemetry.bind(self)
        try:
            _BOUND[celery_app] = weakref.ref(self)
        except TypeError:  # an app object that cannot be weakly referenced: not found by workflows_of
            pass

    # -- configuration ---------------------------------------------------------------------------------------------

    def _default_queue(self) -> str:
        return str(getattr(self.celery_app.conf, "task_default_queue", None) or DEFAULT_QUEUE)

    def _configure_celery(self, transport_options: Mapping[str, Any]) -> None:
        spec = self.world.broker()
        conf = self.celery_app.conf
        conf.broker_url = spec.url
        conf.broker_transport = spec.transport
        conf.broker_transport_options = {
            **spec.options,
            **dict(conf.broker_transport_options or {}),
            **transport_options,
        }
        conf.worker_prefetch_multiplier = 1
        conf.broker_connection_retry_on_startup = True
        self._pin_json(conf)
        for name, value in spec.settings.items():
            setattr(conf, name, value)
        for name, value in spec.defaults.items():  # the app's own setting wins
            if getattr(conf, name, None) is None:
                setattr(conf, name, value)

    @staticmethod
    def _pin_json(conf: Any) -> None:
        """Messages on the World's queue are JSON, and nothing else is accepted: anyone who can write a row of the
        queue table (or a message on its SQS queue) can then start tasks, but never run code of their choosing
        through a pickle. A different setting made before is replaced, with a warning."""
        pinned = {
            "accept_content": ["json"],
            "task_serializer": "json",
            "result_serializer": "json",
            "result_accept_content": ["json"],
            "event_serializer": "json",
        }
        for name, value in pinned.items():
            current = getattr(conf, name, None)
            if current is not None and current != value and not (isinstance(value, list) and list(current) == value):
                log.warning(
                    "celery_workflow: %s=%r replaced by %r (the World's queue takes JSON only)", name, current, value
                )
            setattr(conf, name, value)

    def _check_queue(self, queue: str, what: str) -> str:
        """Known queues: those the World can deliver to, when it says (an AWS World's configured queues); and
        ``queues=`` if given, else Celery's ``task_queues`` if set; otherwise any name goes."""
        world_known = self.world.queue_names
        if world_known is not None and queue not in world_known:
            raise ConfigurationError(
                f"{what} routes to queue {queue!r}, which the World does not have; its queues: {sorted(world_known)}"
            )
        known: set[str] | frozenset[str] | None = self.declared_queues
        if known is None and self.celery_app.conf.task_queues:
            known = {q.name for q in self.celery_app.conf.task_queues}
        if known is not None and queue not in known and queue != self._default_queue():
            raise ConfigurationError(f"{what} routes to unknown queue {queue!r}; known queues: {sorted(known)}")
        return queue

    def route(self, workflow_name: str, queue: str) -> None:
        """Send every delivery of ``workflow_name``'s runs to ``queue``."""
        self.routes[workflow_name] = self._check_queue(queue, f"route of workflow {workflow_name!r}")

    # -- decorators ------------------------------------------------------------------------------------------------

    @overload
    def workflow(self, func: Callable[P, R], /) -> Workflow[P, R]: ...

    @overload
    def workflow(
        self,
        func: None = None,
        /,
        *,
        name: str | None = None,
        queue: str | None = None,
        timeout: timedelta | float | None = None,
    ) -> Callable[[Callable[P, R]], Workflow[P, R]]: ...

    def workflow(
        self,
        func: Callable[P, R] | None = None,
        /,
        *,
        name: str | None = None,
        queue: str | None = None,
        timeout: timedelta | float | None = None,
    ) -> Workflow[P, R] | Callable[[Callable[P, R]], Workflow[P, R]]:
        """Register a workflow: a deterministic function that calls steps, sleeps and waits for hooks.

        ``timeout`` (a timedelta or seconds): a run's deadline, counted from its creation and recorded with it; a run
        past it fails with RunTimedOut, its steps no longer run, and a sleeping or waiting run is woken to fail."""

        def register(fn: Callable[P, R]) -> Workflow[P, R]:
            if queue is not None:
                self._check_queue(queue, f"workflow {name or fn.__name__!r}")
            limit = check_timeout(f"workflow {name or fn.__name__!r}", timeout)
            wdef = WorkflowDef(name=name or fn.__name__, func=fn, queue=queue, timeout=limit)
            self.registry.add_workflow(wdef)
            self._register_workflow_task(wdef)
            return Workflow(self, wdef)

        return register(func) if func is not None else register

    @overload
    def step(self, func: Callable[P, R], /) -> Step[P, R]: ...

    @overload
    def step(
        self,
        func: None = None,
        /,
        *,
        name: str | None = None,
        max_retries: int = 3,
        queue: str | None = None,
        retry_backoff: float = 1.0,
        timeout: timedelta | float | None = None,
    ) -> Callable[[Callable[P, R]], Step[P, R]]: ...

    def step(
        self,
        func: Callable[P, R] | None = None,
        /,
        *,
        name: str | None = None,
        max_retries: int = 3,
        queue: str | None = None,
        retry_backoff: float = 1.0,
        timeout: timedelta | float | None = None,
    ) -> Step[P, R] | Callable[[Callable[P, R]], Step[P, R]]:
        """Register a step: any code, run at least once and recorded exactly once, retried on errors.

        ``timeout`` (a timedelta or seconds): how long one attempt may run. An attempt past it fails with
        StepTimedOut and is retried like any failed attempt. Such a step runs as its own delivery, under Celery's
        soft time limit (the timeout) and hard time limit (:data:`HARD_LIMIT_GRACE` later)."""

        def register(fn: Callable[P, R]) -> Step[P, R]:
            if queue is not None:
                self._check_queue(queue, f"step {name or fn.__name__!r}")
            limit = check_timeout(f"step {name or fn.__name__!r}", timeout)
            sdef = StepDef(
                name=name or fn.__name__,
                func=fn,
                max_retries=max_retries,
                queue=queue,
                retry_backoff=retry_backoff,
                timeout=limit,
            )
            self.registry.add_step(sdef)
            self._register_step_task(sdef)
            return Step(self, sdef)

        return register(func) if func is not None else register

    def _register_workflow_task(self, wdef: WorkflowDef) -> None:
        celery_tasks.register_workflow_task(self, wdef)

    def _register_step_task(self, sdef: StepDef) -> None:
        celery_tasks.register_step_task(self, sdef)

    # -- outside calls ---------------------------------------------------------------------------------------------

    def _start(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any], *, run_id: str | None) -> Run[Any]:
        view, _created = self.runtime.start(name, args, kwargs, run_id=run_id)
        return Run(self.runtime, view.run_id)

    def start(self, workflow_name: str, *args: Any, run_id: str | None = None, **kwargs: Any) -> Run[Any]:
        """Start a run of a workflow by name (idempotent by ``run_id``)."""
        return self._start(workflow_name, args, kwargs, run_id=run_id)

    def get_run(self, run_id: str) -> Run[Any]:
        """A handle on an existing run; RunNotFound if there is none."""
        self.world.get_run(run_id)
        return Run(self.runtime, run_id)

    def list_runs(
        self, workflow: str | None = None, status: RunStatus | str | None = None, limit: int = 100
    ) -> list[Run[Any]]:
        """Runs, newest first."""
        page = self.world.list_runs(workflow=workflow, status=status, limit=limit)
        return [Run(self.runtime, view.run_id) for view in page.items]

    def resume_hook(self, token: str, payload: Any = None, *, wait: float = 0.0) -> HookView:
        """Deliver ``payload`` to the hook with ``token`` and wake its run. HookNotFound if no live hook has it
        (after ``wait`` seconds of looking again, for a run that has not reached its ``create_hook`` yet)."""
        return self.runtime.resume_hook(token, payload, wait=wait)

    def handle_delivery(
        self, payload: bytes, claim: Claim | None = None, *, inline_until: float | None = None
    ) -> Handled:
        """Run one stored delivery of this app (a workflow or step task message) without a Celery worker, as the
        Lambda queue handler and ``testing.LocalWorker`` do; returns what the handler did. ``claim``: the
        transport's claim (its receipt acks the delivery with the last write); ``inline_until``: see
        :meth:`Runtime.handle_workflow`. ConfigurationError for a message that is not a task of this app's workflows
        or steps (a plain Celery task needs a Celery worker)."""
        task = decode_message(payload)
        named = task_names.parse(task.name)
        if named is not None and named.kind == "workflow" and len(task.args) == 1:
            return self.runtime.handle_workflow(
                str(task.args[0]), delivery_id=task.id, claim=claim, inline_until=inline_until, workflow_name=named.name
            )
        if named is not None and named.kind == "step" and len(task.args) == 2:
            return self.runtime.handle_step(
                str(task.args[0]), str(task.args[1]), delivery_id=task.id, claim=claim, step_name=named.name
            )
        raise ConfigurationError(f"task {task.name!r} is not a workflow or step delivery; it needs a Celery worker")

    def cancel(self, run_id: str, reason: str | None = None) -> None:
        self.runtime.cancel(run_id, reason)

    def blueprint(self, *, name: str = "celery_workflow", authorize: Callable[[Any, str], bool] | None = None) -> Any:
        """A Flask blueprint serving the RPC and webhook endpoints (``celery_workflow.api.blueprint``); ``authorize``
        (``(request, method) -> bool``) guards the RPC."""
        from celery_workflow import api

        return api.blueprint(self, name=name, authorize=authorize)

    def close(self) -> None:
        self.world.close()


#: The Workflows created on each Celery app (weakly both ways: this table keeps neither alive).
_BOUND: weakref.WeakKeyDictionary[Any, weakref.ref[Workflows]] = weakref.WeakKeyDictionary()


def workflows_of(celery_app: Any) -> Workflows | None:
    """The :class:`Workflows` created on ``celery_app`` (the latest, if there were several), or None: how
    ``celery -A app workflow …`` finds the app's World."""
    try:
        ref = _BOUND.get(celery_app)
    except TypeError:
        return None
    return ref() if ref is not None else None


#: The longest string argument a message's ``argsrepr`` shows with ``repr`` (Celery's saferepr cuts at 1024).
_PLAIN_REPR = 512


def build_message(
    celery_app: Any,
    task_name: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    queue: str,
    task_id: str,
    not_before: datetime | None = None,
    headers: Mapping[str, Any] | None = None,
) -> bytes:
    """The UTF-8 JSON of the virtual-transport message that runs ``task_name(*args, **kwargs)`` on ``queue``.

    The World inserts deliveries into its queue itself (in the same transaction as the events), so the message must
    be exactly what a Kombu virtual transport would have stored had Celery published it: ``{"body" (base64 of the
    JSON ``[args, kwargs, embed]``), "content-type", "content-encoding", "headers" (protocol 2), "properties"}``,
    built with Celery's own protocol-2 builder. ``not_before`` goes in the properties, where our transports read
    the due time. ``headers``: more message headers (a Celery worker shows them to the task as ``task.request``
    attributes).
    """
    args, kwargs = list(args), dict(kwargs)
    msg = celery_app.amqp.as_task_v2(
        task_id,
        task_name,
        args,
        kwargs,
        ignore_result=True,
        origin="celery_workflow",
        root_id=task_id,
        # what Celery's saferepr would show for ids (short strings), without its cost; anything else goes to it
        argsrepr=repr(args) if all(isinstance(a, str) and len(a) <= _PLAIN_REPR for a in args) else None,
        kwargsrepr="{}" if not kwargs else None,
    )
    content_type, content_encoding, body = serialization.dumps(msg.body, serializer="json")  # type: ignore[no-untyped-call]
    if isinstance(body, str):
        body = body.encode(content_encoding or "utf-8")
    properties: dict[str, Any] = {
        **msg.properties,
        "delivery_mode": 2,
        "priority": 0,
        "body_encoding": "base64",
        "delivery_tag": str(uuid.uuid4()),
        "delivery_info": {"exchange": "", "routing_key": queue},
    }
    if not_before is not None:
        properties["not_before"] = isoformat(not_before)
    message = {
        "body": base64.b64encode(body).decode(),
        "content-encoding": content_encoding,
        "content-type": content_type,
        "headers": {**msg.headers, **(headers or {})},
        "properties": properties,
    }
    return json.dumps(message, default=str).encode()
