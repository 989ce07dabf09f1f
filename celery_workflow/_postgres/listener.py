"""Notifications of the Postgres World and transport: the channels, how senders name them, and the one ``LISTEN``
connection of a process (:class:`Listener`).

Waiters take a generation mark, check the database, then wait for a notification after that mark or their timeout,
so a notification that arrives between the check and the wait is never missed, and a lost one only costs one poll
interval. The connection reconnects by itself and wakes every waiter when it does (notifications may have been lost
meanwhile).

A process listens only on the channels it waits on, from the first mark of each on: a worker hears its queues, not
every run's end; a client waiting for results hears runs' ends, not every message put on a queue. Every payload a
process hears costs it a wake-up of its listener thread (and of the waiters on the same channel), so with many
clients and workers, hearing everything grows with the whole deployment's traffic rather than with one's own.
"""

from __future__ import annotations

import logging
import random
import select
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import psycopg

from celery_workflow._backend.recent import Recent

__all__ = [
    "ALIVE_LOCK",
    "CHANNEL_QUEUE",
    "CHANNEL_RUNS",
    "CHANNEL_STREAMS",
    "SCHEMA_TAG",
    "Listener",
    "notify_sql",
]

log = logging.getLogger("celery_workflow.postgres")

CHANNEL_QUEUE = "celery_workflow_queue"
CHANNEL_RUNS = "celery_workflow_runs"
CHANNEL_STREAMS = "celery_workflow_streams"
#: NOTIFY channels are per database, so each logical channel above is suffixed with a tag of the schema the tables
#: are in (the session's ``current_schema()``, the first schema of its search_path that exists): two apps in two
#: schemas of one database never hear each other. Senders compute it in SQL, the listener once per connection.
SCHEMA_TAG = "left(md5(coalesce(current_schema(), '')), 12)"

#: Class id of the session-level advisory lock each listener connection holds while it is connected (the object id is
#: :attr:`Listener.lock_key`): another session sees that the process is alive by failing to take a shared lock on
#: it, and that it is gone (killed, or its connection lost) by taking one. Standing claims of the transport's idle
#: consumers rely on it (:mod:`celery_workflow._postgres.standing`).
ALIVE_LOCK = 0x63777363  # "cwsc"

_MAX_KEYS = 10_000
_MAX_CARRIED = 1_024


def notify_sql(channel: str, payload: str = "%s") -> str:
    """``pg_notify`` on ``channel`` of the session's schema, with ``payload`` (an SQL expression or placeholder)."""
    return f"pg_notify('{channel}_' || {SCHEMA_TAG}, {payload})"


class Listener:
    """One ``LISTEN`` connection and a thread that counts notifications per (channel, key).

    A payload's first line is its key (a queue name, a run id, a stream's key, a standing claim's token); what follows
    it, if anything, is kept as the last thing carried for that key (:meth:`carried`; a queue's notification may carry
    the row id of the message it announces, a hand-off its claim's serial and row id), for the :data:`_MAX_CARRIED`
    keys heard last among those this process marked: what is carried for keys nobody here waits on (other consumers'
    hand-offs) is not kept. Payloads are ids and tokens, never data: any role that can connect to the database may
    LISTEN on these channels (their names are predictable), so no run input or output and no message is sent.

    A channel is listened on from its first :meth:`mark` on (that call waits until the server listens on it, so a
    notification sent after the mark returned is heard).
    """

    def __init__(self, conninfo: str, *, ready_timeout: float = 5.0) -> None:
        """``ready_timeout``: how long the constructor waits for the first connection (or its failure), and a first
        mark of a channel for its ``LISTEN``."""
        self.conninfo = conninfo
        self.tag = ""  # the schema's tag, set on connecting (see SCHEMA_TAG)
        self.ready_timeout = ready_timeout
        self._cond = threading.Condition()
        self._wanted: set[str] = set()
        self._listening: frozenset[str] = frozenset()  # on the current connection
        self._generations: dict[tuple[str, str | None], int] = {}
        self._carried: Recent[tuple[str, str], str] = Recent(_MAX_CARRIED)
        # the keys marked here, least recently marked first (see _record); guarded by _cond, which mark() holds anyway
        self._interest: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._epoch = 0  # bumped on (re)connect: every waiter re-checks
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._conn: psycopg.Connection[Any] | None = None
        self._lock_key: int | None = None
        self._watchers: tuple[Callable[[str | None, str | None], None], ...] = ()
        self._wake_r, self._wake_w = socket.socketpair()  # a new channel wanted: the thread listens on it at once
        self._wake_r.setblocking(False)
        self._thread = threading.Thread(target=self._loop, name="celery_workflow-listener", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=ready_timeout)

    @property
    def channels(self) -> frozenset[str]:
        """The channels the connection listens on now."""
        return self._listening

    @property
    def lock_key(self) -> int | None:
        """The object id of the :data:`ALIVE_LOCK` this process's connection holds now (None: not connected)."""
        return self._lock_key

    def listens(self, channel: str) -> bool:
        """Whether a notification on ``channel`` sent now would be heard."""
        return channel in self._listening

    def mark(self, channel: str, key: str | None = None) -> tuple[int, int]:
        """A mark to pass to :meth:`wait`; take it *before* checking the database."""
        if channel not in self._listening:
            self._subscribe(channel)
        with self._cond:
            if key is not None:
                self._interest[(channel, key)] = None
                self._interest.move_to_end((channel, key))
                if len(self._interest) > _MAX_KEYS:
                    self._interest.popitem(last=False)
            return self._epoch, self._generations.get((channel, key), 0)

    def wait(self, channel: str, mark: tuple[int, int], timeout: float, key: str | None = None) -> bool:
        """Block until a notification on ``channel`` (with payload ``key``, if given) after ``mark``, or timeout."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while (self._epoch, self._generations.get((channel, key), 0)) == mark:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def poke(self, channel: str, key: str | None = None) -> None:
        """Wake this process's waiters on ``channel`` (and ``key``) as a notification would, without a round trip."""
        self._record(channel, key or "")

    def watch(self, heard: Callable[[str | None, str | None], None]) -> None:
        """Call ``heard(channel, key)`` on the listener's thread after each notification (or poke) is counted, and
        ``heard(None, None)`` when every waiter must check again (a new connection): how a transport on Celery's
        event loop wakes its hub. ``heard`` must be quick and must not raise."""
        with self._cond:
            self._watchers = (*self._watchers, heard)

    def unwatch(self, heard: Callable[[str | None, str | None], None]) -> None:
        with self._cond:
            self._watchers = tuple(w for w in self._watchers if w is not heard)

    def _tell(self, channel: str | None, key: str | None) -> None:
        for heard in self._watchers:  # outside the lock: a watcher may mark or wait
            try:
                heard(channel, key)
            except Exception:  # pragma: no cover - a watcher's bug must not stop the listener
                log.exception("Postgres listener: a watcher failed")

    def carried(self, channel: str, key: str) -> str | None:
        """What the last notification on ``channel`` for ``key`` carried after its key (None: nothing, or not
        heard, or forgotten)."""
        return self._carried.get((channel, key))

    def close(self) -> None:
        self._stop.set()
        self._nudge()
        conn = self._conn
        if conn is not None:
            try:
                conn.close()
            except psycopg.Error:  # pragma: no cover
                pass
        self._thread.join(timeout=2)
        self._wake_r.close()
        self._wake_w.close()

    # -- the thread ------------------------------------------------------------------------------------------------

    def _subscribe(self, channel: str) -> None:
        """Have the connection listen on ``channel`` and wait until it does, the connection drops, or
        ``ready_timeout``. Without a connection there is nothing to wait for: the next one listens on every wanted
        channel and bumps the epoch, which wakes every waiter to check again."""
        with self._cond:
            self._wanted.add(channel)
            if self._conn is None:
                return
        self._nudge()
        deadline = time.monotonic() + self.ready_timeout
        with self._cond:
            while channel not in self._listening and self._conn is not None and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning(
                        "Postgres listener: no LISTEN on %s after %.1f s; its waiters poll", channel, self.ready_timeout
                    )
                    return
                self._cond.wait(left)

    def _nudge(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # closed, or full of nudges already
            pass

    def _loop(self) -> None:
        delay = 0.1
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True) as conn:
                    row = conn.execute(f"SELECT {SCHEMA_TAG}").fetchone()
                    self.tag = str(row[0]) if row else ""
                    self._lock_key = self._take_lock(conn)
                    with self._cond:
                        self._conn = conn
                    self._listen(conn, reconnected=True)
                    self._ready.set()
                    delay = 0.1
                    nudges = self._wake_r.fileno()
                    while not self._stop.is_set():
                        readable, _, _ = select.select([conn.fileno(), nudges], [], [], 1.0)
                        if nudges in readable:
                            self._drain_nudges()
                            self._listen(conn)
                        # also what arrived while LISTEN ran (psycopg keeps it for the next notifies())
                        for note in conn.notifies(timeout=0):
                            self._record(note.channel.removesuffix(f"_{self.tag}"), note.payload)
            except (psycopg.Error, OSError, ValueError) as exc:  # ValueError: select on a closed connection
                if self._stop.is_set():
                    return
                log.warning("Postgres listener lost its connection (%s); reconnecting in %.1f s", exc, delay)
                self._ready.set()
                self._forget_connection(lost=True)
                self._stop.wait(delay)
                delay = min(delay * 2, 5.0)
            finally:
                self._forget_connection()

    @staticmethod
    def _take_lock(conn: psycopg.Connection[Any]) -> int:
        """Take an :data:`ALIVE_LOCK` of a random object id nobody holds, for the connection's lifetime."""
        while True:
            key = random.getrandbits(31)
            row = conn.execute("SELECT pg_try_advisory_lock(%s::integer, %s::integer)", (ALIVE_LOCK, key)).fetchone()
            if row and row[0]:
                return key

    def _forget_connection(self, *, lost: bool = False) -> None:
        """No connection listens any more (waiters of a new channel stop waiting for it); ``lost``: it broke, so
        every waiter checks again (notifications may have been lost)."""
        with self._cond:
            self._lock_key = None
            self._conn = None
            self._listening = frozenset()
            if lost:
                self._epoch += 1
            self._cond.notify_all()
        if lost:
            self._tell(None, None)

    def _drain_nudges(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _listen(self, conn: psycopg.Connection[Any], *, reconnected: bool = False) -> None:
        """LISTEN on the wanted channels the connection does not listen on yet; on a new connection, bump the epoch
        (every waiter checks again: what was sent while there was none is lost)."""
        with self._cond:
            new = sorted(self._wanted - self._listening)
        for channel in new:
            conn.execute(f'LISTEN "{channel}_{self.tag}"')
        with self._cond:
            self._listening = self._listening | frozenset(new)
            if reconnected:
                self._epoch += 1
            self._cond.notify_all()
        if reconnected:
            self._tell(None, None)

    def _record(self, channel: str, payload: str) -> None:
        forgot = False
        with self._cond:
            if len(self._generations) > _MAX_KEYS:
                # bounded memory in long-lived workers: forget per-payload counters; the new epoch wakes every
                # waiter, which re-checks the database (a spurious wake-up, never a missed one)
                self._generations = {k: v for k, v in self._generations.items() if k[1] is None}
                self._epoch += 1
                forgot = True
            key, _, carried = payload.partition("\n")
            for counted in ((channel, None), (channel, key)):
                self._generations[counted] = self._generations.get(counted, 0) + 1
            if carried and (channel, key) in self._interest:
                self._carried.put((channel, key), carried)
            else:
                self._carried.pop((channel, key))  # the last notification of the key carried nothing
            self._cond.notify_all()
        if forgot:
            self._tell(None, None)
        else:
            self._tell(channel, key)
