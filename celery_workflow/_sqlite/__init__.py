"""The SQLite backend's internals (the public face is :mod:`celery_workflow.world_sqlite`).

* :mod:`.database`: connections per process and thread, transactions, migrations, change detection, URLs;
* :mod:`.world`: :class:`~celery_workflow._sqlite.world.SQLiteWorld`, the World on one file;
* :mod:`.queue`: :class:`~celery_workflow._sqlite.queue.SQLiteQueue`, the deliveries and broker state the World
  and the SQLite Kombu transport (:mod:`celery_workflow.transport.sqlite`) share, composed of its parts:
  :mod:`.deliveries`, :mod:`.letters` (dead letters) and :mod:`.broker_state`, on one :mod:`.queue_base`
  ``Transactions``.
"""
