"""A table prefix for SQLite (``sqlite:///file.db?prefix=app1_``): apps share one file without seeing each other.

The World and the Kombu transport with different prefixes on one file keep their runs, hook tokens, queues,
bindings and consumers apart; every table and index of a prefixed database carries the prefix, its schema version
included; bad prefixes and unknown URL parameters are refused with clear errors.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Consumer, Exchange, Producer, Queue

from celery_workflow import Workflows, create_hook
from celery_workflow._backend.migrations import migrations
from celery_workflow._sqlite.database import Database, database_path, database_url, parse_database_url, prefixed
from celery_workflow.errors import ConfigurationError, SchemaVersionError
from celery_workflow.testing import LocalWorker
from celery_workflow.transport.sqlite import Transport
from celery_workflow.world import open_world
from celery_workflow.world_sqlite import SQLiteWorld
from tests.integration.transport_suite import collector, drain

TRANSPORT = "celery_workflow.transport.sqlite:Transport"
LATEST = migrations("sqlite")[-1].version


def _names(path: Path) -> set[str]:
    """The tables, indexes, views and triggers of the file (SQLite's own ``sqlite_…`` objects left out)."""
    conn = sqlite3.connect(path)
    try:
        return {
            r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite\\_%' ESCAPE '\\'")
        }
    finally:
        conn.close()


# -- URLs and prefixes ---------------------------------------------------------------------------------------------


def test_url_carries_the_prefix_and_nothing_else(tmp_path: Path) -> None:
    db = tmp_path / "shared.db"
    assert parse_database_url(f"sqlite:///{db}?prefix=app1_") == (str(db), "app1_")
    assert parse_database_url(f"sqlite:///{db}") == (str(db), "")
    assert parse_database_url(f"sqlite:///{db}?prefix=") == (str(db), "")
    assert parse_database_url("sqlite:///rel.db?prefix=B9") == (str(Path("rel.db").resolve()), "B9")
    assert database_path(f"sqlite:///{db}?prefix=app1_") == str(db)  # existing callers keep working
    # database_url writes what parse_database_url reads, a "?" in the file name escaped
    odd = str(tmp_path / "a?b c.db")
    assert database_url(odd, "x_").endswith("/a%3Fb%20c.db?prefix=x_")
    assert parse_database_url(database_url(odd, "x_")) == (odd, "x_")
    assert parse_database_url(database_url(odd)) == (odd, "")

    for query, words in (
        ("?y=1", "unknown 'y'"),
        ("?prefix=a_&y=1", "unknown 'y'"),
        ("?mode=ro", "unknown 'mode'"),
        ("?prefix=a_&prefix=b_", "repeated"),
        ("?", "empty"),
        ("?prefix=a_&", "malformed"),
        ("?prefix", "malformed"),  # no "=": not a parameter
    ):
        with pytest.raises(ValueError, match="takes one query parameter, 'prefix'") as info:
            parse_database_url(f"sqlite:///{db}{query}")
        assert words in str(info.value)
        with pytest.raises(ConfigurationError, match=words):
            SQLiteWorld.from_url(f"sqlite:///{db}{query}")
    for bad in ("1a", "_a", "a-b", "a b", "a.b", "a;b", "é_", "a" * 32):
        with pytest.raises(ValueError, match="invalid table prefix"):
            parse_database_url(f"sqlite:///{db}?prefix={bad}")
        with pytest.raises(ConfigurationError, match="invalid table prefix"):
            Database(db, prefix=bad)
        with pytest.raises(ConfigurationError, match="invalid table prefix"):
            open_world(f"sqlite:///{db}?prefix={bad}")
        with pytest.raises(ConfigurationError, match="invalid table prefix"):
            database_url(str(db), bad)
    assert Database(db, prefix="a" * 31, migrate=False).prefix == "a" * 31
    assert not db.exists() or _names(db) == set()  # nothing was created by the refused prefixes
    with pytest.raises(ConfigurationError, match="contradicts"):
        SQLiteWorld.from_url(f"sqlite:///{db}?prefix=a_", prefix="b_")


def test_the_rewrite_leaves_literals_and_comments_alone() -> None:
    sql = (
        "-- celery_workflow_runs in a comment, it's kept\n"
        "SELECT h.token, 'celery_workflow_runs', 'it''s celery_workflow_x' FROM celery_workflow_hooks AS h"
        ' JOIN "celery_workflow_runs" AS r ON r.run_id = h.run_id /* celery_workflow_ too */'
        " WHERE xcelery_workflow_y = ? AND [celery_workflow_waits].run_id = ?"
    )
    assert prefixed(sql, "p_") == (
        "-- celery_workflow_runs in a comment, it's kept\n"
        "SELECT h.token, 'celery_workflow_runs', 'it''s celery_workflow_x' FROM p_celery_workflow_hooks AS h"
        ' JOIN "p_celery_workflow_runs" AS r ON r.run_id = h.run_id /* celery_workflow_ too */'
        " WHERE xcelery_workflow_y = ? AND [p_celery_workflow_waits].run_id = ?"
    )
    assert prefixed(sql, "") is sql


# -- the World -----------------------------------------------------------------------------------------------------


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    return tmp_path / "shared.sqlite3"


def _app(url: str, name: str) -> Workflows:
    """An app whose workflow doubles through a step and waits for the hook token ``approve`` (the same token in
    every app: token ownership is per prefix too)."""
    wf = Workflows(Celery(name), world=url)

    @wf.step
    def double(x: int) -> int:
        return 2 * x

    @wf.workflow
    def flow(x: int) -> dict[str, Any]:
        doubled = double(x)
        decision = create_hook(token="approve").wait()
        return {"app": name, "doubled": doubled, "decision": decision}

    return wf


def test_worlds_with_different_prefixes_share_a_file_apart(shared: Path) -> None:
    urls = {"a_": f"sqlite:///{shared}?prefix=a_", "b_": f"sqlite:///{shared}?prefix=b_", "": f"sqlite:///{shared}"}
    apps = {prefix: _app(url, prefix or "plain") for prefix, url in urls.items()}
    try:
        for prefix, wf in apps.items():
            world = wf.world
            assert isinstance(world, SQLiteWorld) and world.prefix == prefix and world.path == str(shared)
            # the app hands Celery the World's URL, prefix included, and the transport it builds opens those tables
            assert wf.celery_app.conf.broker_url == database_url(str(shared), prefix)
            with wf.celery_app.connection_for_write() as conn:
                conn.connect()
                assert conn.transport.store.db.prefix == prefix
                assert conn.transport.store.db.path == str(shared)
        # the same run id in every app: three runs, no conflict
        runs = {prefix: wf.start("flow", 10 + i, run_id="same-id") for i, (prefix, wf) in enumerate(apps.items())}
        for prefix, wf in apps.items():
            LocalWorker(wf).run_until_idle()
            assert runs[prefix].status == "running"  # waiting for its own hook "approve"
        for prefix, wf in apps.items():
            wf.resume_hook("approve", {"ok": prefix})
            LocalWorker(wf).run_until_complete(runs[prefix])
        for i, (prefix, wf) in enumerate(apps.items()):
            assert runs[prefix].result(timeout=5) == {
                "app": prefix or "plain",
                "doubled": 2 * (10 + i),
                "decision": {"ok": prefix},
            }
            listed = wf.list_runs()
            assert [r.id for r in listed] == ["same-id"]
            assert wf.world.get_run("same-id").input == {"args": [10 + i], "kwargs": {}}
    finally:
        for wf in apps.values():
            wf.close()

    plain = SQLiteWorld(shared)
    assert [r.run_id for r in plain.list_runs().items] == ["same-id"]
    plain.close()
    fresh = SQLiteWorld(shared, prefix="c_")  # a new prefix in the same file starts empty
    assert fresh.list_runs().items == [] and fresh.store.queues() == []
    fresh.close()


def test_a_prefixed_database_names_every_table_and_index_with_its_prefix(tmp_path: Path) -> None:
    SQLiteWorld(tmp_path / "plain.db").close()
    SQLiteWorld(tmp_path / "a.db", prefix="a_").close()
    plain, prefixed_names = _names(tmp_path / "plain.db"), _names(tmp_path / "a.db")
    assert "celery_workflow_runs" in plain and "celery_workflow_schema_version" in plain
    assert all(name.startswith("a_celery_workflow_") for name in prefixed_names)
    assert prefixed_names == {f"a_{name}" for name in plain}
    # both prefixes and the unprefixed tables in one file
    SQLiteWorld.from_url(f"sqlite:///{tmp_path / 'plain.db'}?prefix=b_").close()
    SQLiteWorld(tmp_path / "plain.db", prefix="a_").close()
    assert _names(tmp_path / "plain.db") == plain | {f"{p}{name}" for p in ("a_", "b_") for name in plain}


def test_a_prefixed_database_migrates_and_reopens(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    db = Database(path, prefix="m_", migrate=False)
    assert db.migrate(up_to=1) == 1
    db.close()
    db = Database(path, prefix="m_")  # reopens: reads its version with the prefix and applies the rest
    assert db.migrate() == LATEST
    db.close()
    raw = sqlite3.connect(path)
    versions = [r[0] for r in raw.execute("SELECT version FROM m_celery_workflow_schema_version ORDER BY version")]
    assert versions == list(range(1, LATEST + 1))
    assert "celery_workflow_schema_version" not in _names(path)
    # each prefix has its own schema version: a newer m_ is refused, n_ in the same file is not affected
    raw.execute("INSERT INTO m_celery_workflow_schema_version VALUES (?, 'future.sql', 0)", (LATEST + 1,))
    raw.commit()
    raw.close()
    with pytest.raises(SchemaVersionError):
        Database(path, prefix="m_")
    other = SQLiteWorld(path, prefix="n_")
    assert other.db.migrate() == LATEST
    other.close()


# -- the transport -------------------------------------------------------------------------------------------------


@pytest.fixture
def connect(shared: Path) -> Iterator[Callable[..., Connection]]:
    opened: list[Connection] = []

    def make(query: str = "", **options: Any) -> Connection:
        conn = Connection(f"sqlite:///{shared}{query}", transport=TRANSPORT, transport_options=options)
        conn.connect()
        opened.append(conn)
        return conn

    yield make
    for conn in opened:
        conn.release()


def test_transports_with_different_prefixes_do_not_see_each_others_messages(
    connect: Callable[..., Connection], shared: Path
) -> None:
    a, b = connect("?prefix=a_"), connect("?prefix=b_")
    b_by_option, plain = connect(table_prefix="b_"), connect()
    assert a.transport.store.db.prefix == "a_" and b_by_option.transport.store.db.prefix == "b_"
    assert b.transport.store is b_by_option.transport.store  # one store per (file, prefix) and process
    assert isinstance(a.transport, Transport) and a.as_uri() == f"sqlite:///{shared}?prefix=a_"

    queue = Queue("jobs", Exchange("jobs", type="direct"), routing_key="jobs")
    got: dict[str, list[Any]] = {"a": [], "b": [], "plain": []}
    consumers = []
    for name, conn in (("a", a), ("b", b), ("plain", plain)):
        consumer = Consumer(conn.channel(), [queue], callbacks=[collector(got[name])], accept=["json"])
        consumer.consume()
        consumers.append(consumer)
    Producer(a.channel()).publish({"to": "a"}, exchange="jobs", routing_key="jobs", serializer="json")
    drain(a, lambda: bool(got["a"]))
    for conn in (b, plain):
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.3)
    assert [body for body, _ in got["a"]] == [{"to": "a"}] and got["b"] == got["plain"] == []

    # a message put through the table_prefix option reaches the consumer of the ?prefix=b_ URL only
    Producer(b_by_option.channel()).publish({"to": "b"}, exchange="jobs", routing_key="jobs", serializer="json")
    drain(b, lambda: bool(got["b"]))
    with pytest.raises(TimeoutError):
        plain.drain_events(timeout=0.3)
    assert [body for body, _ in got["b"]] == [{"to": "b"}] and len(got["a"]) == 1 and got["plain"] == []

    # queues, exchanges, bindings and consumers are per prefix
    fresh = SQLiteWorld(shared, prefix="c_").store
    assert fresh.queues() == [] and fresh.bindings() == [] and fresh.consumers() == {} and fresh.exchanges() == []
    assert "jobs" in a.transport.store.queues() and a.transport.store.bindings("jobs")
    for consumer in consumers:
        consumer.cancel()


def test_a_table_prefix_option_contradicting_the_url_is_refused(connect: Callable[..., Connection]) -> None:
    with pytest.raises(ValueError, match="contradicts"):
        connect("?prefix=a_", table_prefix="b_")
    with pytest.raises(ValueError, match="takes one query parameter, 'prefix'"):
        connect("?prefix=a_&timeout=3")
    with pytest.raises(ConfigurationError, match="invalid table prefix"):
        connect(table_prefix="no-dashes")
    assert connect("?prefix=a_", table_prefix="a_").transport.store.db.prefix == "a_"
