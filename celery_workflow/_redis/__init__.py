"""The Redis backend's internals: a queue store in Redis (no World lives here).

* :mod:`.store`: :class:`~celery_workflow._redis.store.RedisStore`, the broker store (the whole queue contract of
  :mod:`celery_workflow._backend.queue_contract`) the SQS transport keeps Celery's events and remote control in;
* :mod:`.scripts`: its Lua scripts, one per operation.
"""
