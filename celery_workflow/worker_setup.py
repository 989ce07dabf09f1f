"""What a Celery worker of a :class:`~celery_workflow.Workflows` app does at start, and who serves a run's queue.

* **Queues** (issue #27, item 11). ``celery -A app worker`` without ``-Q`` serves every queue the app's Workflows
  knows (:func:`known_queues`: the default queue, the routes, the workflows' and steps' own queues, ``queues=``, and
  the queues the World itself has), as the seed's "a worker without queues claims every queue". They are added on
  Celery's ``celeryd_init`` signal, which the worker program sends with its options before it applies ``-Q`` and
  ``-X``: ``-Q x`` still restricts the worker to ``x`` (nothing is added), and ``-X`` still excludes. Celery alone
  would consume the default queue (or ``task_queues``) only, and a routed run would stay pending with nothing said.
* **Pools per process** (issue #27, item 10). A World that sizes its connections (:class:`PoolSized`, the Postgres
  World) is told how many deliveries its process runs at once: the worker's concurrency in the main process
  (``worker_init``; a prefork main process runs none, but its pool only opens what is used), one in each prefork
  child (``worker_process_init``).
* **Upkeep**: the World's background work (:meth:`~celery_workflow.world.World.start_upkeep`) runs in the worker's
  main process while it lives, and so does the schedules' ticker (:func:`start_ticker`, issue #30 item 3).
* **Relay** (``Workflows(broker="app")``, issue #29): the worker's main process also runs the relay of the queues it
  consumes and keeps the World leases of the relayed deliveries it holds (:mod:`celery_workflow.relay_celery`); a
  relayed task that returned, or reported its delivery's outcome (:mod:`celery_workflow.celery_tasks`), acks its
  claim in the World (``task_postrun``).
* :func:`queue_consumers` / :func:`unserved`: which queues have no live consumer, when the World's queue store
  records its consumers (the SQLite and Postgres transports do; SQS does not, so None: unknown). ``runs list``,
  ``runs show`` and the inspector say so for a run that waits on such a queue.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from celery_workflow.errors import DeliveryReport
from celery_workflow.events import RunView

if TYPE_CHECKING:
    from celery_workflow.app import Workflows
    from celery_workflow.schedules import Ticker
    from celery_workflow.world import Upkeep, World

__all__ = [
    "PoolSized",
    "connect_worker_signals",
    "known_queues",
    "queue_consumers",
    "serve_known_queues",
    "start_ticker",
    "ticker_of",
    "unserved",
]

log = logging.getLogger("celery_workflow")


@runtime_checkable
class PoolSized(Protocol):
    """A World whose connections are sized by the deliveries its process runs at once."""

    def size_pool(self, deliveries: int) -> None: ...


def known_queues(wf: Workflows) -> list[str]:
    """Every queue ``wf`` may deliver to, the default queue first."""
    names = [wf.runtime.default_queue, *wf.routes.values()]
    names += [w.queue for w in wf.registry.workflows.values() if w.queue]
    names += [s.queue for s in wf.registry.steps.values() if s.queue]
    names += sorted(wf.declared_queues or ())
    names += sorted(wf.world.queue_names or ())
    return list(dict.fromkeys(names))


def serve_known_queues(wf: Workflows, options: Mapping[str, Any]) -> list[str]:
    """Add :func:`known_queues` to what a worker started with ``options`` (the worker program's) consumes, unless
    ``-Q`` named its queues; return the queues added. Call it before the worker applies ``-Q`` (``celeryd_init``)."""
    if options.get("queues"):
        return []
    queues = wf.celery_app.amqp.queues
    added = []
    for name in known_queues(wf):
        if name in queues.consume_from:
            continue
        # what `-Q name` would consume: the declared queue, else the one Celery makes for a missing name
        queues.select_add(queues[name] if name in queues else queues.new_missing(name))
        added.append(name)
    if added:
        log.info("celery_workflow: serving queues %s besides Celery's defaults (no -Q given)", ", ".join(added))
    return added


def connect_worker_signals(wf: Workflows) -> None:
    """Connect the signal receivers of a worker of ``wf``'s app (see the module docstring)."""
    from celery import signals

    app = wf.celery_app
    background: list[Upkeep] = []

    def init(sender: Any = None, instance: Any = None, options: Mapping[str, Any] | None = None, **_: Any) -> None:
        if getattr(instance, "app", None) is app:
            serve_known_queues(wf, options or {})

    def main_process(sender: Any = None, **_: Any) -> None:
        concurrency = getattr(sender, "concurrency", None)
        if getattr(sender, "app", None) is app and isinstance(concurrency, int) and isinstance(wf.world, PoolSized):
            wf.world.size_pool(concurrency)

    def child_process(**_: Any) -> None:  # a prefork child runs one delivery at a time
        if isinstance(wf.world, PoolSized):
            wf.world.size_pool(1)

    def ready(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is app:
            upkeep = wf.world.start_upkeep()
            if upkeep is not None:
                background.append(upkeep)
            ticker = start_ticker(wf)
            if ticker is not None:
                background.append(ticker)
            if wf.broker == "app":  # the relay of the queues this worker consumes, and its lease keeper
                from celery_workflow.relay_celery import WorkerRelay

                queues = sorted(wf.celery_app.amqp.queues.consume_from)
                if queues:
                    background.append(WorkerRelay(wf, queues).start())

    def postrun(sender: Any = None, task: Any = None, state: str | None = None, retval: Any = None, **_: Any) -> None:
        # a task that returned, or that reported its delivery's outcome (a failed run or step, a retry)
        reported = state == "RETRY" or (state == "FAILURE" and isinstance(retval, DeliveryReport))
        if wf.broker == "app" and (state == "SUCCESS" or reported) and getattr(task, "app", None) is app:
            from celery_workflow.relay_celery import ack_relayed

            ack_relayed(wf, task.request)

    def shutdown(**_: Any) -> None:
        while background:
            background.pop().stop()

    signals.celeryd_init.connect(init, weak=False)
    signals.worker_init.connect(main_process, weak=False)
    signals.worker_process_init.connect(child_process, weak=False)
    signals.worker_ready.connect(ready, weak=False)
    signals.worker_shutdown.connect(shutdown, weak=False)
    signals.task_postrun.connect(postrun, weak=False)


def start_ticker(wf: Workflows) -> Ticker | None:
    """Start the schedules' ticker of ``wf`` in this process (:mod:`celery_workflow.schedules.ticker`), or None when
    its World keeps no schedules or it has no workflow a schedule could start."""
    ticker = ticker_of(wf)
    return ticker.start() if ticker is not None else None


def ticker_of(wf: Workflows, *, period: float = 0.0) -> Ticker | None:
    """The schedules' ticker of ``wf``, not started (a worker's thread runs it; the Lambda tick handler calls its
    ``tick`` once per invocation, every ``period`` seconds), or None when its World keeps no schedules or it has no
    workflow a schedule could start."""
    from celery_workflow.schedules import Ticker, WorldStarter, schedules_of

    store = schedules_of(wf.world)
    if store is None or not wf.registry.workflows:
        return None
    starter = WorldStarter(
        known=lambda name: name in wf.registry.workflows,
        start_run=lambda name, args, kwargs, run_id: wf.runtime.start(name, args, kwargs, run_id=run_id),
        get_status=lambda run_id: wf.world.get_run(run_id).status,
        cancel_run=wf.runtime.cancel,
    )
    return Ticker(store, starter, clock=wf.schedule_clock, period=period)


def queue_consumers(world: World) -> Mapping[str, int] | None:
    """Live consumers per queue, as the World's queue store records them (a consumer's heartbeat lasts until the
    store collects it); None when the World cannot tell (no store, or one that keeps no consumers)."""
    store = getattr(world, "store", None)
    consumers = getattr(store, "consumers", None)
    if not callable(consumers):
        return None
    found = consumers()
    return found if isinstance(found, Mapping) else None


def unserved(world: World, runs: Iterable[RunView]) -> set[str]:
    """The queues of ``runs`` still in progress that no live consumer serves; empty when the World cannot tell."""
    waiting = {run.queue for run in runs if run.queue and not run.status.terminal}
    if not waiting:
        return set()
    consumers = queue_consumers(world)
    if consumers is None:
        return set()
    return {queue for queue in waiting if not consumers.get(queue)}
