"""The SQLite World: the embedded default, one database file in WAL mode shared by the processes of one machine.

``SQLiteWorld(path)`` or the URL ``sqlite:///relative.db`` / ``sqlite:////abs/path.db`` (``Workflows(app,
world=…)``, :func:`celery_workflow.world.open_world`). Every append is one ``BEGIN IMMEDIATE`` transaction with its
deliveries; the queue table in the same file is what the SQLite Kombu transport
(:mod:`celery_workflow.transport.sqlite`) consumes, so Celery workers on the machine run the steps.

``SQLiteWorld(path, prefix="app1_")`` or ``sqlite:///path.db?prefix=app1_`` names every table
``app1_celery_workflow_…``, so apps with different prefixes share one file without seeing each other's runs or
queues; the World hands its transport the same prefix in the broker URL (:meth:`SQLiteWorld.broker`).

This module is the public face of the backend; its internals live in :mod:`celery_workflow._sqlite`.
"""

from __future__ import annotations

from celery_workflow._sqlite.world import COLUMNS, SQLiteWorld

__all__ = ["COLUMNS", "SQLiteWorld"]
