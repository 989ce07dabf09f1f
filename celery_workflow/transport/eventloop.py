"""Our transports on Celery's event loop (kombu's :class:`~kombu.asynchronous.Hub`).

A Celery worker whose transport says ``implements.asynchronous`` runs its non-blocking loop (``asynloop``) and its
own prefork pool (AsynPool: a pipe pair per child, no shared lock); the consumer hands the hub to the transport in
``register_with_event_loop``. :class:`HubConsumer` is what a :class:`~celery_workflow.transport.base.StoreTransport`
registers there: one reader (a :class:`Waker`, a self-pipe) and hub timers, and every claim made in the hub's thread,
where Celery's consumer expects its messages.

What wakes it:

* **the Waker**, written to by whatever learns of a change off the hub's thread: the Postgres listener thread when a
  notification of a consumed queue (or a hand-off to this consumer's standing claim) arrives, a thread waiting on
  SQLite's ``PRAGMA data_version`` (:class:`ChangeWaiter`), the SQS receivers when they buffer a message (and the
  Redis control channel's subscriber), and every ack or reject of a consuming channel (acks may come from the pool's
  threads: new prefetch room). A woken check compares the transport's change token (taken before its last poll), so a
  change nobody here consumes polls nothing;
* **a hub timer at the next due time** the last poll saw (a delayed row, a lease running out), and the short pause
  before polling again a due row another transaction holds;
* **a repeating hub timer** (``polling_interval``, or the heartbeat or gc interval if shorter): queue heartbeats,
  garbage collection and the dead letters nobody settled (:meth:`StoreTransport.maintain`), and a poll if none ran
  for half a polling interval (a lost notification costs at most that).

A check never claims once the worker is stopping; a delivery is followed by another check soon (``call_soon``: the
hub runs its other callbacks in between), which polls again while the last poll left a message due.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from time import monotonic
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery_workflow.transport.base import StoreTransport

__all__ = ["ChangeWaiter", "HubConsumer", "Waker", "worker_stopping"]

logger = logging.getLogger("celery_workflow.transport.base")

#: The shortest period of the repeating timer (seconds).
MIN_TICK = 0.05


def worker_stopping() -> bool:
    """Whether a Celery worker in this process was asked to stop (SIGTERM, SIGQUIT, ``celery control shutdown``).

    Celery's signal handlers only set a flag, which its loops read between turns. A transport reads the flag too and
    claims nothing more (its blocking ``drain_events`` returns early, so a warm shutdown starts at once). Read through
    ``sys.modules``: the transport does not import Celery, and outside a worker this is False."""
    state = sys.modules.get("celery.worker.state")
    if state is None:
        return False
    flags = (getattr(state, "should_stop", None), getattr(state, "should_terminate", None))
    return any(flag is not None and flag is not False for flag in flags)  # EX_OK is 0: a stop, though falsy


class Waker:
    """A non-blocking self-pipe: any thread writes a byte (:meth:`wake`), the hub reads them (:meth:`drain`).

    Writes and the close share a lock: a descriptor number is reused by the next ``open`` or ``socket`` of the
    process, so a thread that wakes a closed waker would otherwise write its byte into whatever took the number (a
    pool child's job pipe, a database socket)."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._lock = threading.Lock()
        self.closed = False

    def fileno(self) -> int:
        return self._r

    def wake(self) -> None:
        """Wake the hub (any thread). A full pipe already holds a wake-up; a closed one has nobody to wake."""
        with self._lock:
            if self.closed:
                return
            try:
                os.write(self._w, b"\0")
            except OSError:
                pass

    def drain(self) -> None:
        """Empty the pipe (the hub's thread, which also closes it: no lock needed against the close)."""
        if self.closed:
            return
        try:
            while os.read(self._r, 4096):
                pass
        except OSError:  # BlockingIOError: empty
            pass

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            os.close(self._r)
            os.close(self._w)


class ChangeWaiter(threading.Thread):
    """Waits on a store's change token (``change_token`` / ``wait_for_change``) and wakes the hub on each change: for
    a store without a socket to watch (SQLite's ``PRAGMA data_version``). It takes the new token *before* waking the
    hub, so a change after the hub's next poll starts is always seen by the next wait."""

    def __init__(self, store: Any, wake: Callable[[], None], period: float) -> None:
        super().__init__(name="celery_workflow-changes", daemon=True)
        self.store = store
        self.wake = wake
        self.period = period
        self.stopped = threading.Event()

    def run(self) -> None:
        token: Any = None
        while not self.stopped.is_set():
            try:
                if token is None:
                    token = self.store.change_token()
                if self.store.wait_for_change(token, self.period):
                    token = self.store.change_token()
                    self.wake()
            except Exception as exc:  # the hub's periodic poll goes on; try again shortly
                logger.warning("cannot watch the store for changes (%s); retrying", exc)
                token = None
                self.stopped.wait(1.0)

    def stop(self) -> None:
        self.stopped.set()


class HubConsumer:
    """Drives one :class:`StoreTransport` from a kombu hub (see the module docstring)."""

    def __init__(self, transport: StoreTransport, hub: Any) -> None:
        self.transport = transport
        self.hub = hub
        self.waker = Waker()
        self.closed = False
        self._unwatch: Callable[[], None] | None = None
        self._due_timer: Any = None
        self._due_at = math.inf
        hub.add_reader(self.waker.fileno(), self.on_readable, self.waker.fileno())
        period = max(MIN_TICK, min(transport.polling_interval, transport._heartbeat_period(), transport.gc_interval))
        self._tick = hub.call_repeatedly(period, self.check, True)
        hub.call_soon(self.check)

    def wake(self) -> None:
        """Have the hub check the queues soon (any thread)."""
        self.waker.wake()

    def on_readable(self, fileno: int | None = None) -> None:
        self.waker.drain()
        self.check(woken=True)

    def check(self, periodic: bool = False, woken: bool = False) -> None:
        """Look at the queues and claim (on the hub's thread) if something may have changed since the last look."""
        t = self.transport
        if self.closed:
            return
        if worker_stopping():  # no new claims (nor receivers) once the worker is shutting down
            t.stopping()
            return
        t.maintain()
        queues = t.consumable_queues()
        if not queues:
            return
        if self._unwatch is None:
            self._unwatch = t.watch_changes(self.wake)
        if woken and t._token is not None and t.wait_for_change(t._token, 0.0):
            t._dirty = True
        if t._should_poll(queues) or (periodic and monotonic() - t._last_poll >= t.polling_interval / 2):
            token = t.change_token(queues)  # before the poll: a change during it wakes the hub again
            delivered = t._poll(queues)
            t._token = token
            if delivered:
                self.hub.call_soon(self.check)
        self._schedule(queues)

    def _schedule(self, queues: list[str]) -> None:
        """A hub timer at the next due time of ``queues`` (or after the pause before a held row), unless an earlier
        one is set."""
        t = self.transport
        delay = max(t._next_due(queues) - time.time(), t._held_backoff)
        if delay == math.inf:
            return
        at = monotonic() + max(delay, 0.0)
        if self._due_timer is not None and self._due_at <= at:
            return
        if self._due_timer is not None:
            self._due_timer.cancel()
        self._due_at = at
        self._due_timer = self.hub.call_later(max(delay, 0.0), self._due)

    def _due(self) -> None:
        self._due_timer, self._due_at = None, math.inf
        self.check()

    def close(self) -> None:
        """Leave the hub: its reader, timers and change watch (the hub may be gone or reset already)."""
        if self.closed:
            return
        self.closed = True
        for timer in (self._tick, self._due_timer):
            if timer is not None:
                timer.cancel()
        try:
            self.hub.remove_reader(self.waker.fileno())
        except Exception:  # a hub reset after a connection error already forgot it
            pass
        unwatch, self._unwatch = self._unwatch, None
        if unwatch is not None:
            unwatch()
        self.waker.close()
