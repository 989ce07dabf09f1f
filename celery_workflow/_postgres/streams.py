"""Streams of the Postgres World: ordered chunks per (run, name), outside the event log (reference P11).

Guarantees:

* A write is one transaction: it locks the run row against deletion (``FOR KEY SHARE``: appends to the run are not
  blocked), creates the stream row if missing, locks it ``FOR UPDATE`` (writers of one stream queue up, so indexes
  are contiguous), inserts the chunks at ``chunk_count, chunk_count + 1, …`` and sends
  ``pg_notify('celery_workflow_streams', '<run_id>:<name>')``, delivered at commit.
* Each write_stream call tags its chunks with a ``write_id``: a retry after a connection lost once the server had
  committed finds them and does not write them again.
* A closed stream takes no more chunks (:class:`~celery_workflow.errors.EventConflict`); closing is idempotent and
  notifies too. Streams outlive their run's end, not its deletion (retention).
* A read is one statement (the run's status, the stream's state and chunks from one snapshot). A waiting read takes a
  listener mark *before* it reads, then waits for a notification on its stream or ``poll_interval`` at most, and
  reads again, so a lost notification only adds latency. A read of an ended run's stream never waits (nobody is
  left to write or close it): it returns what is there, and a waiter returns within ``poll_interval`` of the end.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import psycopg

from celery_workflow import ids
from celery_workflow._backend.checks import check_chunks, check_stream_name
from celery_workflow._backend.waiting import wait_until
from celery_workflow._postgres.database import PgDatabase
from celery_workflow._postgres.listener import CHANNEL_STREAMS, notify_sql
from celery_workflow._postgres.script import Script, query
from celery_workflow.errors import EventConflict, RunNotFound
from celery_workflow.events import RunStatus
from celery_workflow.world import StreamChunk, StreamPage

__all__ = ["PgStreams", "stream_key"]

Conn = psycopg.Connection[Any]


_NOTIFY_STREAM = f"SELECT {notify_sql(CHANNEL_STREAMS)}"


def stream_key(run_id: str, name: str) -> str:
    """The NOTIFY payload (and listener key) of a stream."""
    return f"{run_id}:{name}"


def _lock_run(conn: Conn, run_id: str) -> None:
    """Share-lock the run row (it cannot be deleted until commit); RunNotFound when there is none."""
    if query(conn, "SELECT 1 FROM celery_workflow_runs WHERE run_id = %s FOR KEY SHARE", (run_id,)).one() is None:
        raise RunNotFound(f"run {run_id} does not exist")


class PgStreams:
    """The stream facet of :class:`~celery_workflow.world_pg.PostgresWorld`."""

    def __init__(self, db: PgDatabase, poll_interval: float) -> None:
        self.db = db
        self.poll_interval = poll_interval

    def write(self, run_id: str, name: str, chunks: Sequence[bytes]) -> int:
        check_stream_name(name)
        data = check_chunks(chunks)
        write_id = uuid.uuid4().hex
        attempts = 0

        def tx(conn: Conn) -> int:
            nonlocal attempts
            attempts += 1
            now = ids.utcnow()
            _lock_run(conn, run_id)
            if attempts > 1 and data:  # did an earlier attempt commit before its connection was lost?
                done = query(
                    conn,
                    "SELECT max(idx) FROM celery_workflow_stream_chunks WHERE run_id = %s AND name = %s"
                    " AND write_id = %s",
                    (run_id, name, write_id),
                ).one()
                if done is not None and done[0] is not None:
                    return int(done[0]) + 1
            query(
                conn,
                "INSERT INTO celery_workflow_streams (run_id, name, closed, chunk_count, created_at, updated_at)"
                " VALUES (%s, %s, false, 0, %s, %s) ON CONFLICT (run_id, name) DO NOTHING",
                (run_id, name, now, now),
            )
            state = query(
                conn,
                "SELECT closed, chunk_count FROM celery_workflow_streams WHERE run_id = %s AND name = %s FOR UPDATE",
                (run_id, name),
            ).one()
            assert state is not None  # inserted above, and the run (so the stream) cannot be deleted meanwhile
            if state[0]:
                raise EventConflict(f"stream {name!r} of run {run_id} is closed")
            count = int(state[1])
            if data:
                script = Script(conn)  # one round trip: the chunks, the count, the notification
                for i, chunk in enumerate(data):
                    script.add(
                        "INSERT INTO celery_workflow_stream_chunks (run_id, name, idx, data, created_at, write_id)"
                        " VALUES (%s, %s, %s, %s, %s, %s)",
                        (run_id, name, count + i, chunk, now, write_id),
                    )
                script.add(
                    "UPDATE celery_workflow_streams SET chunk_count = %s, updated_at = %s WHERE run_id = %s AND name = %s",
                    (count + len(data), now, run_id, name),
                )
                script.add(_NOTIFY_STREAM, (stream_key(run_id, name),))
                script.send()
            return count + len(data)

        return self.db.run(tx, what="stream write")

    def close(self, run_id: str, name: str) -> None:
        check_stream_name(name)

        def tx(conn: Conn) -> None:
            now = ids.utcnow()
            _lock_run(conn, run_id)
            query(
                conn,
                "INSERT INTO celery_workflow_streams (run_id, name, closed, chunk_count, created_at, updated_at)"
                " VALUES (%s, %s, true, 0, %s, %s) ON CONFLICT (run_id, name) DO UPDATE SET closed = true,"
                " updated_at = excluded.updated_at WHERE celery_workflow_streams.closed = false",
                (run_id, name, now, now),
            )
            query(conn, _NOTIFY_STREAM, (stream_key(run_id, name),))

        self.db.run(tx, what="stream close")

    def read(
        self, run_id: str, name: str, *, start: int = 0, limit: int | None = None, wait: float = 0.0
    ) -> StreamPage:
        if start < 0:
            raise ValueError("start must be >= 0")
        key = stream_key(run_id, name)
        page, _ = wait_until(  # a reader of an ended run waits for nothing: it reads what is there
            lambda: self._read(run_id, name, start, limit),
            lambda read: bool(read[0].chunks or read[0].closed or read[1]),
            timeout=wait,
            poll_interval=self.poll_interval,
            mark=lambda: self.db.listener.mark(CHANNEL_STREAMS, key),
            wait=lambda mark, left: self.db.listener.wait(CHANNEL_STREAMS, mark, left, key=key),
        )
        return page

    def _read(self, run_id: str, name: str, start: int, limit: int | None) -> tuple[StreamPage, bool]:
        """The page, and whether the run has ended (one statement: one snapshot)."""

        def tx(conn: Conn) -> tuple[StreamPage, bool]:
            rows = query(
                conn,
                "SELECT r.status, s.closed, s.chunk_count, c.idx, c.data FROM celery_workflow_runs AS r"
                " LEFT JOIN celery_workflow_streams AS s ON s.run_id = r.run_id AND s.name = %s"
                " LEFT JOIN LATERAL (SELECT idx, data FROM celery_workflow_stream_chunks"
                "  WHERE run_id = s.run_id AND name = s.name AND idx >= %s ORDER BY idx LIMIT %s) AS c ON true"
                " WHERE r.run_id = %s ORDER BY c.idx",
                (name, start, None if limit is None else max(limit, 0), run_id),
            ).rows
            if not rows:
                raise RunNotFound(f"run {run_id} does not exist")
            ended = RunStatus(rows[0][0]).terminal
            if rows[0][1] is None:  # no such stream (yet)
                return StreamPage([], False, start), ended
            closed, count = bool(rows[0][1]), int(rows[0][2])
            chunks = [StreamChunk(int(idx), bytes(data)) for _, _, _, idx, data in rows if idx is not None]
            next_index = start + len(chunks)
            return StreamPage(chunks, closed and next_index >= count, next_index), ended

        return self.db.run(tx, what="stream read")

    def names(self, run_id: str) -> list[str]:
        def tx(conn: Conn) -> list[str]:
            rows = query(
                conn, "SELECT name FROM celery_workflow_streams WHERE run_id = %s ORDER BY name", (run_id,)
            ).rows
            if (
                not rows
                and query(conn, "SELECT 1 FROM celery_workflow_runs WHERE run_id = %s", (run_id,)).one() is None
            ):
                raise RunNotFound(f"run {run_id} does not exist")
            return [str(r[0]) for r in rows]

        return self.db.run(tx, what="stream listing")
