"""Kombu transports over the stores of the Worlds (SQLite, Postgres, SQS): see :mod:`.base`.

Importing a transport connects :func:`.scheduled.connect`: a worker on one of them answers ``celery inspect scheduled``
with the countdown/ETA tasks its store holds for its queues.
"""

from celery_workflow.transport import scheduled as _scheduled

_scheduled.connect()
