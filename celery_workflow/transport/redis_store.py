"""Moved to :mod:`celery_workflow._redis.store` (issue #28, item 3): a store lives in its backend's package. This name
stays importable until the SQS transport imports the store from there."""

from __future__ import annotations

from celery_workflow._redis.store import RedisStore

__all__ = ["RedisStore"]
