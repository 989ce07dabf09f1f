"""SQLite transport for Celery: the queue table of the SQLite World, consumed by unmodified Celery workers.

A thin layer over :mod:`celery_workflow.transport.base` and :class:`celery_workflow._sqlite.queue.SQLiteQueue`: every
process on the machine (workers, their pool children, ``celery inspect``, Flower, the application) opens the same
SQLite file in WAL mode, so messages, exchanges, bindings and queue declarations are shared.

Features
========
* Type: Virtual, asynchronous (Celery's event loop and its own prefork pool; a thread watching ``PRAGMA
  data_version`` wakes the hub).
* Supports Direct: Yes
* Supports Topic: Yes
* Supports Fanout: Yes (bindings stored in the database: ``celery inspect``, remote control and Flower work)
* Supports Priority: No
* Supports TTL: Yes (``x-message-ttl``, ``x-expires``, auto_delete, and a message's own ``expiration``)
* Delayed delivery: Yes (``properties["not_before"]`` or Celery's ``eta``/``countdown``: rows are not received
  before they are due)
* Leases: received messages are hidden for ``lease_seconds`` and the lease is extended while the consumer holds
  them; ack deletes, requeue/shutdown releases, reject without requeue backs off (1 s, 2 s, 4 s … 5 min).
* Idempotency: ``apply_async(..., idempotency_key="k", run_id="r")`` deduplicates against a pending message.
* Wake-up: waiting consumers notice a commit by any process within milliseconds (``PRAGMA data_version``).

Connection String
=================
Select the transport with ``broker_transport`` and give the database file as the broker URL:

.. code-block::

    broker_transport = "celery_workflow.transport.sqlite:Transport"
    broker_url = "sqlite:////absolute/path/to/workflows.db"   # four slashes: absolute path
    broker_url = "sqlite:///relative/workflows.db"            # three slashes: relative to the working directory
    broker_url = "sqlite:////abs/workflows.db?prefix=app1_"   # the tables app1_celery_workflow_… of the file

The transport parses the URL itself (``can_parse_url``), so Kombu keeps it whole; percent-escapes are decoded, the
only query parameter allowed is ``prefix`` (a table prefix: apps with different prefixes share the file without
seeing each other's queues, exchanges, bindings or consumers; see :mod:`celery_workflow._sqlite.database`), and an
in-memory database is refused (it cannot be shared by processes). This is the same URL form as the SQLite World's,
whose ``broker()`` gives the transport its prefix in the URL. Register an alias if you prefer a scheme over
``broker_transport``: Kombu has no entry points for transports and a dotted path as URL scheme does not survive
``urlparse``.

Transport Options
=================
* ``lease_seconds`` (60): how long a received, unacked message stays hidden without being extended; it only
  bounds how quickly a crashed worker's message is delivered again.
* ``polling_interval`` (1.0): longest wait between checks when nothing wakes the consumer.
* ``heartbeat_interval`` (5.0): how often consumers refresh their queues (at most a quarter of ``x-expires``).
* ``gc_interval`` (10.0): how often each connection collects expired queues and messages.
* ``consumer_timeout`` (60.0): a consumer silent that long is dead; its auto_delete queues are deleted.
* ``table_prefix`` (none): the table prefix when the URL has none; one that contradicts the URL's is refused.
  Prefer the URL: ``celery inspect`` and Flower rebuild a connection from the broker URL alone in places.
"""

from __future__ import annotations

import sqlite3
import threading
from typing import Any

from kombu.transport import TRANSPORT_ALIASES

from celery_workflow._sqlite.database import Database, database_path, parse_database_url
from celery_workflow._sqlite.queue import SQLiteQueue
from celery_workflow.transport.base import BrokerStore, StoreChannel, StoreTransport

__all__ = ["Channel", "Transport", "database_path", "parse_database_url", "store_location"]

_lock = threading.Lock()
_stores: dict[tuple[str, str], SQLiteQueue] = {}


def shared_queue(path: str, prefix: str = "") -> SQLiteQueue:
    """One migrated :class:`SQLiteQueue` per database file, table prefix and process (the Database is fork-safe).

    A missing file is created (and migrated), in a directory that must exist: a broker URL in a directory that is
    not there is a failed connection (WorldError, one of the transport's ``connection_errors``, so Kombu retries or
    reports it as for any broker that cannot be reached), never a new tree of directories."""
    with _lock:
        queue = _stores.get((path, prefix))
        if queue is None:
            queue = _stores[path, prefix] = SQLiteQueue(Database(path, prefix=prefix, parents=False))
        return queue


def store_location(url: str, options: dict[str, Any] | None = None) -> tuple[str, str]:
    """``(path, prefix)`` of a broker URL and transport options: the URL's ``?prefix=``, else the ``table_prefix``
    option; ValueError when they contradict each other (or the URL is not a SQLite one)."""
    path, prefix = parse_database_url(url)
    option = (options or {}).get("table_prefix")
    if option is not None and option != prefix:
        if prefix:
            raise ValueError(f"transport option table_prefix={option!r} contradicts the broker URL's prefix: {url!r}")
        prefix = str(option)
    return path, prefix


class Channel(StoreChannel):
    """SQLite channel: all behaviour comes from :class:`~celery_workflow.transport.base.StoreChannel`."""


class Transport(StoreTransport):
    """Kombu transport over a SQLite file (``driver_type`` ``celery_workflow_sqlite``)."""

    Channel = Channel

    can_parse_url = True
    default_port = None
    driver_type = "celery_workflow_sqlite"
    driver_name = "sqlite3"

    connection_errors = (*StoreTransport.connection_errors, sqlite3.OperationalError)
    channel_errors = (*StoreTransport.channel_errors, sqlite3.OperationalError)

    def open_store(self) -> BrokerStore:
        return shared_queue(*store_location(self.client.hostname, self.client.transport_options))

    def open_world(self) -> Any:
        """The SQLite World of this file and prefix (it fails runs whose deliveries are dead-lettered)."""
        from celery_workflow._sqlite.world import SQLiteWorld

        path, prefix = store_location(self.client.hostname, self.client.transport_options)
        return SQLiteWorld(path, prefix=prefix)

    def driver_version(self) -> str:
        return sqlite3.sqlite_version

    def as_uri(self, uri: str, include_password: bool = False, mask: str = "**") -> str:
        return uri

    @property
    def default_connection_params(self) -> dict[str, Any]:
        return {"hostname": "sqlite:///celery_workflow.db"}


# `celery inspect conf` (and Flower, which calls it) rebuild a Connection from the broker URL alone: make the
# scheme resolve to this transport (kombu has no "sqlite" transport of its own).
TRANSPORT_ALIASES.setdefault("sqlite", "celery_workflow.transport.sqlite:Transport")
