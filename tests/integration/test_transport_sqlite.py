"""The SQLite Kombu transport through kombu.Connection (no worker): routing, acks, leases, TTL and expiry."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection

from celery_workflow._sqlite.queue import SQLiteQueue  # the type of SQLiteWorld.store
from celery_workflow.errors import WorldError
from celery_workflow.transport.sqlite import Transport, database_path
from celery_workflow.world_sqlite import SQLiteWorld
from tests.integration.transport_suite import TransportSuite

TRANSPORT = "celery_workflow.transport.sqlite:Transport"


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'broker.db'}"


@pytest.fixture
def connect(url: str) -> Iterator[Callable[..., Connection]]:
    opened: list[Connection] = []

    def make(**options: Any) -> Connection:
        conn = Connection(url, transport=TRANSPORT, transport_options=options)
        conn.connect()
        opened.append(conn)
        return conn

    yield make
    for conn in opened:
        conn.release()


@pytest.fixture
def store(url: str) -> Iterator[SQLiteQueue]:
    """The same file's queue through a World of the test's own (its clock can change without touching Kombu's)."""
    world = SQLiteWorld.from_url(url)
    yield world.store
    world.close()


def test_url_forms() -> None:
    assert database_path("sqlite:////tmp/x/b.db") == "/tmp/x/b.db"
    assert database_path("sqlite:///rel.db") == str(Path("rel.db").resolve())
    assert database_path("/tmp/a%20b.db") == "/tmp/a b.db"
    for bad in ("sqlite://", "sqlite:///:memory:", "amqp://guest@localhost//", "sqlite://host/x.db", "sqlite:///x?y=1"):
        with pytest.raises(ValueError):
            database_path(bad)
    assert WorldError in Transport.connection_errors
    assert sqlite3.OperationalError in Transport.connection_errors
    assert WorldError in Transport.channel_errors
    assert Transport.driver_type not in {"sql", "redis", "amqp"}


class TestSQLiteTransport(TransportSuite):
    """The shared transport suite on this transport."""


def test_workflows_pin_the_queue_to_json(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Write access to the queue must never be code execution: whatever the app said before, its workers accept
    JSON only (a pickled message is refused, not loaded), and the replaced setting is named in a warning."""
    from celery import Celery

    from celery_workflow import Workflows

    app = Celery("pinned")
    app.conf.accept_content = ["pickle", "json"]
    app.conf.task_serializer = "pickle"
    wf = Workflows(app, world=f"sqlite:///{tmp_path / 'w.sqlite3'}")
    try:
        assert list(app.conf.accept_content) == ["json"]
        assert app.conf.task_serializer == app.conf.result_serializer == app.conf.event_serializer == "json"
        assert list(app.conf.result_accept_content) == ["json"]
        assert "accept_content=['pickle', 'json'] replaced" in caplog.text
        assert "task_serializer='pickle' replaced" in caplog.text
    finally:
        wf.close()
