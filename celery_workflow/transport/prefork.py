"""The prefork pool of a worker on our transports: billiard's blocking pool, safe against a child that dies holding one
of the pool's pipe locks.

Our Kombu transports have no event loop, so a Celery worker runs them in its blocking loop, whose prefork pool is
billiard's ``Pool``: one pipe carries the jobs to every child and one carries the results back, each guarded by a
lock shared by the children. An idle child waits for its next job *holding* the read lock, blocked in the read. A
child that dies there, or while writing a result (SIGKILL by the OOM killer or an operator, or SIGTERM to the
worker's whole process group, as systemd's default ``KillMode=control-group`` stops a service, which pool children do
not survive), never releases the lock: every other child, and each replacement the pool starts, waits for it for
ever, so the worker takes messages it never runs, and on shutdown its main process waits for the lock in its exit
handler, so it never exits (found by ``python -m bench.chaos``: warm shutdowns that took over 15 minutes).

Here each lock's holder is recorded in shared memory (its pid, written with the deadly signals blocked, so the
record and the lock go together), and the main process releases a lock whose holder no longer exists: when it
reaps dead children (every 0.1 s while the pool runs), while it waits for children to exit, and before its exit
handler drains the job pipe. A child reads a job only once the pipe has one, with those signals blocked, so it
never dies halfway through a message and leaves the pipe out of step. What remains: a SIGKILL in the few bytecodes
between taking a lock and recording it (a lock with no recorded holder is never taken away).

:func:`use_exit_safe_pool` puts :class:`TaskPool` in place of Celery's own prefork pool in a worker whose broker is
one of our transports (:func:`connect`, which the transports call, hands it ``celery.signals.worker_init``), so ``celery worker`` and
``--pool=prefork`` get it; another pool (``solo``, ``threads``, ``gevent``) or an event-loop transport is left as is.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from billiard import pool as billiard_pool
from billiard.queues import SimpleQueue
from celery import signals
from celery.concurrency import get_implementation
from celery.concurrency import prefork as celery_prefork

__all__ = ["ExitSafeBlockingPool", "GuardedQueue", "TaskPool", "connect", "use_exit_safe_pool"]

log = logging.getLogger(__name__)

#: Signals whose default action ends a pool child: blocked while a child takes or gives back a lock.
_DEADLY = frozenset(
    {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM}
)
#: How long a child waits for a lock with those signals blocked before it lets them through, s.
_TAKE_POLL = 0.25
#: How often the main process looks for a dead holder while it waits for a lock or a child, s.
_RECOVER_POLL = 0.25
_READ, _WRITE = 0, 1


@contextmanager
def _deadly_signals_blocked() -> Iterator[None]:
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _DEADLY)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user has the pid now: not ours, but we cannot tell; keep it
        return True
    return True


class GuardedQueue(SimpleQueue):  # type: ignore[misc]
    """billiard's locked pipe, whose read and write locks record their holder's pid in shared memory so that the
    main process can release a lock a dead child held (:meth:`recover`)."""

    def __init__(self, *, ctx: Any) -> None:
        super().__init__(ctx=ctx)
        self._holders = ctx.RawArray("i", 2)  # pid holding the read lock, the write lock (0: none recorded)
        self._recovering = threading.Lock()  # the main process's threads recover one at a time

    def __getstate__(self) -> Any:  # the spawn start method sends the queue to each child
        return (super().__getstate__(), self._holders)

    def __setstate__(self, state: Any) -> None:
        base, self._holders = state
        super().__setstate__(base)
        self._recovering = threading.Lock()

    def _lock(self, which: int) -> Any:
        return self._rlock if which == _READ else self._wlock

    def _take(self, which: int) -> None:
        lock = self._lock(which)
        while True:
            with _deadly_signals_blocked():  # taken and recorded together; a signal that came meanwhile ends us
                if lock.acquire(True, _TAKE_POLL):  # after, with the holder recorded for the main process
                    self._holders[which] = os.getpid()
                    return

    def _give(self, which: int) -> None:
        with _deadly_signals_blocked():
            self._holders[which] = 0
            self._lock(which).release()

    def get_payload(self) -> bytes:
        self._take(_READ)
        try:
            self._reader.poll(None)  # an idle child waits here: dying now leaves the pipe as it was
            with _deadly_signals_blocked():  # a message is read whole or not at all
                payload: bytes = self._reader.recv_bytes()
            return payload
        finally:
            self._give(_READ)

    def send_payload(self, value: bytes) -> None:
        if self._wlock is None:
            super().send_payload(value)
            return
        self._take(_WRITE)
        try:
            with _deadly_signals_blocked():
                self._writer.send_bytes(value)
        finally:
            self._give(_WRITE)

    def holder(self, which: int) -> int:
        return int(self._holders[which])

    def recover(self) -> list[int]:
        """Release each lock whose recorded holder no longer exists (in the main process); the pids it was held by."""
        freed = []
        with self._recovering:
            for which in (_READ, _WRITE):
                pid = int(self._holders[which])
                if pid and self._lock(which) is not None and not _exists(pid):
                    self._holders[which] = 0
                    self._lock(which).release()
                    freed.append(pid)
                    log.warning(
                        "pool child %d died holding the pool's %s lock; released it, so the other children go on",
                        pid,
                        "job" if which == _READ else "result",
                    )
        return freed


class ExitSafeBlockingPool(billiard_pool.Pool):  # type: ignore[misc]
    """billiard's blocking pool over :class:`GuardedQueue` pipes, releasing the locks of dead children."""

    def _setup_queues(self) -> None:
        super()._setup_queues()
        self._inqueue = GuardedQueue(ctx=self._ctx)
        self._outqueue = GuardedQueue(ctx=self._ctx)
        self._quick_put = self._inqueue._writer.send
        self._quick_get = self._outqueue._reader.recv
        outqueue = self._outqueue

        def _poll_result(timeout: float) -> tuple[bool, Any]:
            if outqueue._reader.poll(timeout):
                return True, outqueue._reader.recv()
            return False, None

        self._poll_result = _poll_result

    def _recover_locks(self) -> None:
        for queue in (self._inqueue, self._outqueue):
            if isinstance(queue, GuardedQueue):
                queue.recover()

    def _join_exited_workers(self, shutdown: bool = False) -> Any:
        try:
            return super()._join_exited_workers(shutdown=shutdown)
        finally:
            self._recover_locks()

    def join(self) -> None:
        """billiard's join, except that while it waits for children it keeps releasing the locks of dead ones (a
        child waiting for such a lock would never read its stop sentinel)."""
        for p in list(self._pool):
            if p._popen is None:
                continue
            while p.exitcode is None:
                p.join(_RECOVER_POLL)
                self._recover_locks()
        super().join()

    @staticmethod
    def _help_stuff_finish(inqueue: Any, task_handler: Any, _pool: Any) -> None:
        """Drain the job pipe (billiard's exit handler), taking its read lock only once it is free or its holder gone."""
        if isinstance(inqueue, GuardedQueue):
            while not inqueue._rlock.acquire(True, _RECOVER_POLL):
                inqueue.recover()
        else:  # pragma: no cover - billiard's own queue
            inqueue._rlock.acquire()
        while task_handler.is_alive() and inqueue._reader.poll():
            inqueue._reader.recv()
            time.sleep(0)


class TaskPool(celery_prefork.TaskPool):  # type: ignore[misc]
    """Celery's prefork pool (``--pool=prefork``) with :class:`ExitSafeBlockingPool` as its blocking pool."""

    BlockingPool = ExitSafeBlockingPool


def use_exit_safe_pool(sender: Any = None, **_: Any) -> None:
    """``celery.signals.worker_init`` receiver: a worker on one of our transports (no event loop) that would run
    Celery's prefork pool runs :class:`TaskPool` instead."""
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
        worker.pool_cls = TaskPool
        log.debug("celery_workflow: prefork pool with dead-child lock recovery")


def connect() -> None:
    """Connect :func:`use_exit_safe_pool` to ``celery.signals.worker_init`` (once; the transports call it)."""
    signals.worker_init.connect(use_exit_safe_pool, weak=False, dispatch_uid="celery_workflow.exit_safe_pool")
