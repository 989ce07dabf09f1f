"""Postgres counters for the benchmark: commits and WAL flushes, read so that pending statistics have settled."""

from __future__ import annotations

import time
from dataclasses import dataclass

import psycopg


@dataclass(frozen=True)
class Counters:
    commits: int  # pg_stat_database.xact_commit of the database
    wal_syncs: int  # pg_stat_wal.wal_sync: WAL flushes to disk (fdatasync), cluster-wide
    wal_writes: int

    def __sub__(self, other: Counters) -> Counters:
        return Counters(
            self.commits - other.commits, self.wal_syncs - other.wal_syncs, self.wal_writes - other.wal_writes
        )


def _read(conn: psycopg.Connection[tuple[int, int, int]]) -> Counters:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT d.xact_commit, w.wal_sync, w.wal_write FROM pg_stat_database d, pg_stat_wal w"
        " WHERE d.datname = current_database()"
    ).fetchone()
    assert row is not None
    return Counters(int(row[0]), int(row[1]), int(row[2]))


def settled(url: str, *, quiet_for: float = 11.0, timeout: float = 60.0) -> Counters:
    """The counters once they have stopped moving for ``quiet_for`` s.

    Backends report statistics lazily: PostgreSQL 15 flushes an idle backend's counters about every 10 s, so a
    pooled connection's commits and WAL flushes appear only after that; the default waits just past it.
    """
    with psycopg.connect(url, autocommit=True) as conn:
        last = _read(conn)
        still_since = time.monotonic()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = _read(conn)
            if (now.wal_syncs, now.wal_writes) != (last.wal_syncs, last.wal_writes):
                last, still_since = now, time.monotonic()
            elif time.monotonic() - still_since >= quiet_for:
                break
        # our own polling commits nothing (autocommit SELECTs on a read-only snapshot): no correction needed
        return last
