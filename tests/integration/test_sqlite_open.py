"""Opening a SQLite World while another process holds the file: a lock met by the WAL pragma waits, it is not an error.

SQLite may answer ``database is locked`` to a new connection's ``PRAGMA journal_mode = WAL`` without calling the busy
handler (another process creating the file, recovering the WAL, or cleaning it up on close). CI met it once with two
processes opening one new World at the same moment; the timing cannot be forced, so the lock is injected here."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from celery_workflow._sqlite import database
from celery_workflow._sqlite.database import Database
from celery_workflow.errors import WorldError


def _locked(code: int = sqlite3.SQLITE_BUSY) -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError("database is locked")
    exc.sqlite_errorcode = code
    return exc


def _refusing(monkeypatch: pytest.MonkeyPatch, times: int, error: sqlite3.OperationalError) -> list[int]:
    """Make the next ``times`` WAL pragmas of new connections fail with ``error``; returns the count of refusals."""
    refused = [0]
    connect = sqlite3.connect

    class Refusing(sqlite3.Connection):
        def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
            if sql == "PRAGMA journal_mode = WAL" and refused[0] < times:
                refused[0] += 1
                raise error
            return super().execute(sql, *args)

    def connect_refusing(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        assert kwargs.get("factory") is sqlite3.Connection
        kwargs["factory"] = Refusing
        return connect(*args, **kwargs)

    monkeypatch.setattr(database.sqlite3, "connect", connect_refusing)
    return refused


def test_a_locked_wal_pragma_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    refused = _refusing(monkeypatch, 3, _locked())
    db = Database(tmp_path / "w.sqlite3")
    try:
        assert refused[0] == 3
        assert db.connection().execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.connection().execute("SELECT MAX(version) FROM celery_workflow_schema_version").fetchone()[0] > 0
    finally:
        db.close()


def test_other_errors_of_the_pragma_are_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    refused = _refusing(monkeypatch, 100, _locked(sqlite3.SQLITE_IOERR))
    with pytest.raises(WorldError, match="cannot open SQLite database"):
        Database(tmp_path / "w.sqlite3")
    assert refused[0] == 1


def test_a_lock_that_outlasts_the_busy_timeout_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(database, "BUSY_TIMEOUT_MS", 50)
    refused = _refusing(monkeypatch, 10_000, _locked())
    with pytest.raises(WorldError, match="database is locked"):
        Database(tmp_path / "w.sqlite3")
    assert 2 <= refused[0] < 100


OPEN = """
import sys
from celery_workflow.world import open_world
open_world(sys.argv[1]).close()
"""


def test_processes_opening_one_new_world_together_all_succeed(tmp_path: Path) -> None:
    for trial in range(2):
        url = f"sqlite:///{tmp_path / f'w{trial}.sqlite3'}"
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", OPEN, url], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            for _ in range(4)
        ]
        outputs = [proc.communicate(timeout=60)[0] for proc in procs]
        assert [proc.returncode for proc in procs] == [0] * 4, outputs
