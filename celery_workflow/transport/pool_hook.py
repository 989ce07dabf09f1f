"""Which pool a Celery worker on our transports runs: :class:`celery_workflow.transport.prefork.TaskPool` where it
would run Celery's own prefork pool (see that module for why).

The transports call :func:`connect` when they are imported; the pool itself (billiard's pool, Celery's prefork) is
imported only by a worker that gets it, not by every process that publishes through a transport.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals

__all__ = ["connect", "use_exit_safe_pool"]

log = logging.getLogger(__name__)


def use_exit_safe_pool(sender: Any = None, **_: Any) -> None:
    """``celery.signals.worker_init`` receiver: a worker on one of our transports (no event loop) that would run
    Celery's prefork pool runs :class:`~celery_workflow.transport.prefork.TaskPool` instead."""
    from celery.concurrency import get_implementation
    from celery.concurrency import prefork as celery_prefork

    from celery_workflow.transport.base import StoreTransport

    worker = sender
    conninfo = getattr(worker, "_conninfo", None)
    if conninfo is None or getattr(worker, "use_eventloop", True):
        return
    try:
        transport_cls = conninfo.get_transport_cls()
        stock = get_implementation(worker.pool_cls) is celery_prefork.TaskPool
    except Exception:  # an unknown pool or transport: Celery reports it itself
        return
    if stock and isinstance(transport_cls, type) and issubclass(transport_cls, StoreTransport):
        from celery_workflow.transport.prefork import TaskPool

        worker.pool_cls = TaskPool
        log.debug("celery_workflow: prefork pool with pipe locks the kernel releases")


def connect() -> None:
    """Connect :func:`use_exit_safe_pool` to ``celery.signals.worker_init`` (once; the transports call it)."""
    signals.worker_init.connect(use_exit_safe_pool, weak=False, dispatch_uid="celery_workflow.exit_safe_pool")
