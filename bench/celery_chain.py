"""Plain Celery baseline: a chain of no-op tasks on Redis (not durable)."""

from __future__ import annotations

import os

from celery import Celery

redis_url = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
celery_app = Celery("bench_chain", broker=redis_url, backend=redis_url)
celery_app.conf.update(worker_prefetch_multiplier=1, task_acks_late=True, result_expires=600)


@celery_app.task(name="bench.noop")  # type: ignore[untyped-decorator]
def noop(previous: int | None = None, i: int = 0) -> int:
    return i
