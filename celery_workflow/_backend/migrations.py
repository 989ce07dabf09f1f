"""The packaged SQL migrations of a backend and the rule for schema versions (shared by SQLite and Postgres).

Migrations are files ``celery_workflow/sql/<dialect>/NNNN_name.sql``, applied in version order inside one
transaction that records each version in ``celery_workflow_schema_version``. A database whose schema is newer than
every migration this library ships is refused (:class:`~celery_workflow.errors.SchemaVersionError`): an older
library must not write to a schema it does not know.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from typing import NamedTuple

from celery_workflow.errors import SchemaVersionError

__all__ = ["SCHEMA_VERSION_TABLE", "Migration", "Table", "check_version", "columns", "migrations"]


class Migration(NamedTuple):
    version: int
    name: str
    sql: str


class Table(NamedTuple):
    """What the code expects of a table: its columns in order, its primary key, and its other indexes (name:
    unique). Each backend declares its tables this way; the migration test compares the migrated catalog with it."""

    columns: tuple[str, ...]
    primary_key: tuple[str, ...]
    indexes: Mapping[str, bool] = {}


def columns(names: str) -> tuple[str, ...]:
    """Column names written as one space-separated string, as a tuple."""
    return tuple(names.split())


#: The table migrations record their versions in (the same in every SQL backend).
SCHEMA_VERSION_TABLE = {"celery_workflow_schema_version": Table(("version", "name", "applied_at"), ("version",))}


def migrations(dialect: str) -> list[Migration]:
    """Every packaged migration of ``dialect`` (``"sqlite"``, ``"postgres"``), in version order."""
    folder = resources.files("celery_workflow") / "sql" / dialect
    found = [
        Migration(int(entry.name[:4]), entry.name, entry.read_text())
        for entry in folder.iterdir()
        if entry.name.endswith(".sql") and entry.name[:4].isdigit()
    ]
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):  # pragma: no cover - a packaging mistake
        raise RuntimeError(f"two {dialect} migrations share a version: {sorted(m.name for m in found)}")
    return sorted(found)


def check_version(current: int, known: list[Migration], where: str) -> int:
    """The latest version of ``known``; SchemaVersionError when ``current`` (the database's) is newer."""
    latest = known[-1].version if known else 0
    if current > latest:
        raise SchemaVersionError(
            f"{where} has celery_workflow schema version {current}, newer than the {latest} this celery_workflow"
            " knows; upgrade celery_workflow"
        )
    return latest
