"""The Postgres backend's internals (the public face is :mod:`celery_workflow.world_pg`).

* :mod:`.database`: the pool, retried transactions, pipelined scripts, migrations and the LISTEN connection;
* :mod:`.world`: :class:`~celery_workflow._postgres.world.PostgresWorld`; :mod:`.append` (how a batch is read under
  lock and written), :mod:`.rows` (tables and row mapping), :mod:`.streams`, :mod:`.retention`, :mod:`.config`;
* :mod:`.queue` and :mod:`.queue_sql`: :class:`~celery_workflow._postgres.queue.PostgresQueue`, the deliveries and
  broker state the World and the Postgres Kombu transport (:mod:`celery_workflow.transport.postgres`) share, composed
  of its parts: :mod:`.deliveries`, :mod:`.letters` (dead letters), :mod:`.broker_state`, :mod:`.standing` (standing
  claims) and :mod:`.changes` (notifications), on one :mod:`.queue_base` ``Statements``.
"""

from __future__ import annotations

try:  # the optional driver: pip install 'celery-workflow[postgres]'
    import psycopg as _psycopg  # noqa: F401
    import psycopg_pool as _psycopg_pool  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from celery_workflow.errors import ConfigurationError

    raise ConfigurationError("the Postgres World needs psycopg: pip install 'celery-workflow[postgres]'") from exc
