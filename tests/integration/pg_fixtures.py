"""Shared PostgreSQL fixtures: a schema of its own per test, on the server named by ``DATABASE_URL``.

Import the fixture functions into a test module (pytest finds them there by their ``name``; the functions have other
names so that test parameters do not shadow an import)::

    from tests.integration.pg_fixtures import pg_admin_fixture, pg_schema_fixture, pg_url_fixture  # noqa: F401

Importing this module skips the importing test module when the server cannot be reached, with the reason in the
report.

* ``pg_url``: a ``postgresql://`` URL whose ``search_path`` is a fresh schema ``cw_test_<random>`` (dropped after the
  test) and whose ``application_name`` is the schema's name, so a test can find (and terminate) its own connections.
* ``pg_admin``: an autocommit connection outside the test's schema (terminate backends, inspect the catalog).
* ``pg_db``: a migrated ``PgDatabase`` (a pool of 4) on that schema; ``pg_world``: a ``PostgresWorld`` on it.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

import psycopg
import pytest

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


def _unreachable() -> str | None:
    try:
        with psycopg.connect(DATABASE_URL, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return f"PostgreSQL is not reachable at DATABASE_URL={DATABASE_URL!r}: {exc}"
    return None


UNREACHABLE = _unreachable()
if UNREACHABLE is not None:
    pytest.skip(UNREACHABLE, allow_module_level=True)


def schema_url(schema: str) -> str:
    """``DATABASE_URL`` with ``search_path`` set to ``schema`` and ``application_name`` set to its name."""
    sep = "&" if "?" in DATABASE_URL else "?"
    options = quote(f"-csearch_path={schema}", safe="")
    return f"{DATABASE_URL}{sep}options={options}&application_name={schema}"


def admin_connection() -> psycopg.Connection[Any]:
    return psycopg.connect(DATABASE_URL, autocommit=True)


def terminate_backends(admin: psycopg.Connection[Any], application_name: str) -> int:
    """Terminate every connection with this application name (the test's own); return how many were terminated."""
    rows = admin.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s AND pid <> pg_backend_pid()",
        (application_name,),
    ).fetchall()
    return sum(1 for (done,) in rows if done)


@pytest.fixture(name="pg_admin")
def pg_admin_fixture() -> Iterator[psycopg.Connection[Any]]:
    conn = admin_connection()
    try:
        yield conn
    finally:
        conn.close()


@contextmanager
def fresh_schema(prefix: str = "cw_test") -> Iterator[str]:
    """The name of a fresh, empty schema; afterwards the connections that carry its name as ``application_name``
    are terminated and it is dropped."""
    schema = f"{prefix}_{secrets.token_hex(6)}"
    with admin_connection() as admin:
        admin.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield schema
    finally:
        with admin_connection() as admin:
            terminate_backends(admin, schema)
            admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture(name="pg_schema")
def pg_schema_fixture() -> Iterator[str]:
    """A fresh, empty schema; dropped (with whatever connections still use it) after the test."""
    with fresh_schema() as schema:
        yield schema


@pytest.fixture(name="pg_url")
def pg_url_fixture(pg_schema: str) -> str:
    """A connection URL on a schema of this test's own."""
    return schema_url(pg_schema)


@pytest.fixture(name="pg_world")
def pg_world_fixture(pg_url: str) -> Iterator[Any]:
    """A PostgresWorld with its own pool on this test's schema."""
    from celery_workflow.world_pg import PostgresWorld

    w = PostgresWorld.open(pg_url)
    yield w
    w.close()


@pytest.fixture(name="pg_db")
def pg_db_fixture(pg_url: str) -> Iterator[Any]:
    """A migrated PgDatabase (a pool of 4) on this test's schema."""
    from celery_workflow._postgres.database import PgDatabase

    database = PgDatabase.open(pg_url, max_size=4)
    database.migrate()
    yield database
    database.close()
