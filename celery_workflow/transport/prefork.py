"""The prefork pool of a worker on our transports: billiard's blocking pool, safe against a child that dies holding one
of the pool's pipe locks.

Our Kombu transports have no event loop, so a Celery worker runs them in its blocking loop, whose prefork pool is
billiard's ``Pool``: one pipe carries the jobs to every child and one carries the results back, each guarded by a
semaphore shared by the children. An idle child waits for its next job *holding* the read semaphore, blocked in the
read. A child that dies there, or while writing a result (SIGKILL by the OOM killer or an operator; or SIGTERM to the
worker's whole process group, as systemd's default ``KillMode=control-group`` stops a service, when the child's
Python handler for it runs between taking the semaphore and the ``with`` that would give it back: pool children
that ran a workflow have threads, so the signal lands in another thread and the handler runs at the main thread's
next bytecode) never releases it: every other child, and each replacement the pool starts, waits for it for ever, so
the worker takes messages it never runs, and on shutdown its main process waits for it in billiard's exit handler,
so it never exits (found by ``python -m bench.chaos``: warm shutdowns that took over 15 minutes).

Here the two pipe locks are POSIX record locks (``lockf``) on unlinked files of their own, which the kernel
releases when the process holding one ends, however it ends. A child reads a job only once the pipe has one, and
writes a result whole, with the deadly signals deferred (blocked in its thread, their Python handlers replaced by a
recorder, then raised again), so a message is never cut in half by a handler, and the pipes stay in step. Only with
the fork start method (Celery's default on Linux); with spawn, billiard's own queues are used.

:mod:`celery_workflow.transport.pool_hook` puts :class:`TaskPool` in place of Celery's own prefork pool in a worker
whose broker is one of our transports, so ``celery worker`` and ``--pool=prefork`` get it; another pool (``solo``,
``threads``, ``gevent``) or an event-loop transport is left as is.
"""

from __future__ import annotations

import fcntl
import importlib
import logging
import os
import select
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from billiard import pool as billiard_pool
from billiard.queues import SimpleQueue
from billiard.reduction import ForkingPickler
from celery.concurrency import prefork as celery_prefork

__all__ = ["DirectJobs", "ExitSafeBlockingPool", "GuardedQueue", "ProcessLock", "TaskPool"]

log = logging.getLogger(__name__)

#: Signals that end a pool child (by default or through billiard's handler): deferred while it moves a message.
_DEADLY = frozenset(
    {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM}
)
_DEADLY_NUMBERS = tuple(sorted(int(sig) for sig in _DEADLY))
#: The C module behind ``signal``, whose functions take and return plain numbers (see _signals_deferred).
_signal: Any = importlib.import_module("_signal")
#: The length prefix billiard writes before each pickled message.
_LENGTH_PREFIX = 4


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold back the deadly signals for the block: blocked in this thread and, in the main thread, their Python
    handlers replaced by a recorder; afterwards the handlers are put back and each signal that came is raised again.
    (A signal whose action is the default and that the kernel hands to another thread still ends the process at
    once; then the kernel releases its locks.)

    It runs twice per task (the job in, the result out), so it calls ``_signal``, the C module behind ``signal``:
    the ``signal`` module's wrappers turn every number they return into an enum member, which made this 60 µs
    instead of 4."""
    caught: list[int] = []
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        record = caught.append

        def recorder(signum: int, _frame: Any) -> None:
            record(signum)

        for sig in _DEADLY_NUMBERS:
            handler = _signal.getsignal(sig)
            if callable(handler):
                previous[sig] = _signal.signal(sig, recorder)
    mask = _signal.pthread_sigmask(_signal.SIG_BLOCK, _DEADLY_NUMBERS)
    try:
        yield
    finally:
        _signal.pthread_sigmask(_signal.SIG_SETMASK, mask)
        for number, handler in previous.items():
            _signal.signal(number, handler)
        for signum in caught:
            signal.raise_signal(signum)


class ProcessLock:
    """A lock between processes that the kernel releases when its holder ends, whatever ends it: a POSIX record lock
    on an unlinked file of its own, shared by the processes forked after it was made (unlike a semaphore, which a
    process killed while holding it keeps for ever). Between the threads of one process it does not exclude."""

    def __init__(self) -> None:
        fd, path = tempfile.mkstemp(prefix="celery-workflow-pool-", suffix=".lock")
        os.unlink(path)
        self._fd = fd

    def acquire(self, block: bool = True) -> bool:
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX if block else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # not blocking, and another process holds it
            return False
        return True

    def release(self) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    def close(self) -> None:
        os.close(self._fd)


class GuardedQueue(SimpleQueue):  # type: ignore[misc]
    """billiard's locked pipe with :class:`ProcessLock` locks, moving each message whole with the deadly signals
    deferred."""

    def __init__(self, *, ctx: Any) -> None:
        super().__init__(ctx=ctx)
        self._rlock = ProcessLock()
        self._wlock = ProcessLock()

    def get_payload(self) -> bytes:
        with self._rlock:
            self._reader.poll(None)  # an idle child waits here: ending now leaves the pipe as it was
            with _signals_deferred():
                payload: bytes = self._reader.recv_bytes()
            return payload

    def send_payload(self, value: bytes) -> None:
        with self._wlock, _signals_deferred():
            self._writer.send_bytes(value)

    def close(self) -> None:
        super().close()
        for lock in (self._rlock, self._wlock):
            try:
                lock.close()
            except OSError:  # pragma: no cover - closed already
                pass


class _Pickled(tuple):  # type: ignore[type-arg]
    """A job (billiard's task tuple, which its task handler slices on errors) with the pickle :class:`DirectJobs`
    made of it."""

    payload: bytes

    def __new__(cls, job: Any, payload: bytes) -> _Pickled:
        self = super().__new__(cls, job)
        self.payload = payload
        return self


class DirectJobs:
    """Where the blocking pool's ``apply_async`` puts a job: written to the children's pipe at once by the thread that
    submits it (the worker's consumer), instead of handed to billiard's task handler thread, which wrote it a thread
    switch and a wait for the interpreter lock later (about 0.2 ms of a one-step run's latency, ``bench/RESULTS.md``).

    Only when the write cannot block: the job pickles to at most ``PIPE_BUF`` bytes (written whole, at once) and the
    pipe has that much room; otherwise (a large message, children busy with a full pipe) the job goes to the handler
    thread as before, so the consumer never waits for a child. So do the handler's stop sentinel and a map's
    batches. Both threads write the pipe under one lock (:meth:`send`, the pool's ``_quick_put``)."""

    def __init__(self, pool: ExitSafeBlockingPool) -> None:
        self._pool = pool
        self._handler_queue: Any = None  # the queue the task handler thread reads (set once the pool made it)
        self._lock = threading.Lock()

    def send(self, obj: Any) -> None:
        """Write ``obj`` to the pipe (blocking while it is full): the task handler's way. A job :meth:`put` pickled
        already is written as it was pickled."""
        with self._lock:
            if isinstance(obj, _Pickled):
                self._pool._inqueue._writer.send_bytes(obj.payload)
            else:
                self._pool._inqueue._writer.send(obj)

    def put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        if item is not None and item[1] is None and len(item[0]) == 1:
            job = self._send_now(item[0][0])
            if job is None:
                return
            item = ([job], None)
        self._handler_queue.put(item, *args, **kwargs)

    def _send_now(self, job: Any) -> Any:
        """Write ``job`` now if that cannot block and return None; else return what the handler thread should write
        (the job, with its pickle when it was made: a large job is not pickled twice)."""
        if self._pool._state != billiard_pool.RUN:
            return job
        payload = ForkingPickler.dumps(job)
        if len(payload) + _LENGTH_PREFIX > select.PIPE_BUF:
            return _Pickled(job, payload)
        writer = self._pool._inqueue._writer
        with self._lock:
            try:
                if not select.select([], [writer.fileno()], [], 0)[1]:
                    return _Pickled(job, payload)  # less than PIPE_BUF bytes of room: the handler thread waits
                writer.send_bytes(payload)
            except (OSError, ValueError):  # the pool is going away with its pipe: dropped, as billiard's handler
                log.debug("could not put a job on the pool's pipe", exc_info=True)  # does (its lease runs out)
            return None

    def __getattr__(self, name: str) -> Any:  # get, qsize … for the handler thread that reads the queue
        return getattr(self._handler_queue, name)


class ExitSafeBlockingPool(billiard_pool.Pool):  # type: ignore[misc]
    """billiard's blocking pool over :class:`GuardedQueue` pipes (with the fork start method), whose jobs go to the
    pipe from the submitting thread when that cannot block (:class:`DirectJobs`)."""

    _inqueue: Any
    _outqueue: Any
    _taskqueue: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._jobs._handler_queue = self._taskqueue  # what the task handler thread reads
        if self.threads:
            self._taskqueue = self._jobs

    def _setup_queues(self) -> None:
        super()._setup_queues()  # its _poll_result reads self._outqueue and self._quick_get when called
        if self._ctx.get_start_method() == "fork":
            for stock in (self._inqueue, self._outqueue):
                stock.close()
            self._inqueue = GuardedQueue(ctx=self._ctx)
            self._outqueue = GuardedQueue(ctx=self._ctx)
            self._quick_get = self._outqueue._reader.recv
        self._jobs = DirectJobs(self)
        self._quick_put = self._jobs.send


class TaskPool(celery_prefork.TaskPool):  # type: ignore[misc]
    """Celery's prefork pool (``--pool=prefork``) with :class:`ExitSafeBlockingPool` as its blocking pool."""

    BlockingPool = ExitSafeBlockingPool
