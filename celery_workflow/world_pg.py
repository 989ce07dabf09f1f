"""The Postgres World: workflow state in PostgreSQL, safe for many processes on many hosts (seed
``postgres-world.txt``).

``PostgresWorld.open(url)`` (or the URL ``postgresql://…`` given to ``Workflows(app, world=…)``) opens and owns a
connection pool; ``PostgresWorld(pool)`` uses a caller's :class:`psycopg_pool.ConnectionPool`. Tables are migrated
under an advisory lock; a newer schema is refused. Appends lock the run row and write their events, views and
deliveries in one transaction; the queue table is what the Postgres Kombu transport
(:mod:`celery_workflow.transport.postgres`) consumes, with LISTEN/NOTIFY wake-ups. :class:`PostgresConfig` holds
the poll interval, lease, routes and retention.

This module is the public face of the backend; its internals live in :mod:`celery_workflow._postgres`.
"""

from __future__ import annotations

from celery_workflow._postgres.config import PostgresConfig, postgres_url
from celery_workflow._postgres.world import PostgresWorld

__all__ = ["PostgresConfig", "PostgresWorld", "postgres_url"]
