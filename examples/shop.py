"""The order workflow of DESIGN §1: charge, wait for approval, sleep, ship.

celery -A examples.shop worker -Q celery,orders       # a worker for the default queue and "orders"
python -c "from examples.shop import fulfil; print(fulfil.start('o-1', 1200).id)"
celery-workflow runs list
python -c "from examples.shop import wf; wf.resume_hook('approve:o-1', {'ok': True})"
"""

from __future__ import annotations

from datetime import timedelta

from celery import Celery

from celery_workflow import RetryableError, Workflows, create_hook, get_writable, sleep, step_metadata

celery_app = Celery("shop")
wf = Workflows(celery_app)  # embedded SQLite World + transport; Workflows(celery_app, world="postgresql://…")


@wf.step(max_retries=5)
def charge(order_id: str, cents: int) -> str:
    # step_metadata() identifies the run and step: stable across retries, an idempotency key for the provider
    meta = step_metadata()
    if cents <= 0:
        raise RetryableError("amount not settled yet", retry_after=30)
    return f"rcpt_{order_id}@{meta.run_id}/{meta.step_id}"


@wf.step
def ship(order_id: str) -> None:
    get_writable("progress").write({"stage": "shipped", "order": order_id})


@wf.workflow(queue="orders")
def fulfil(order_id: str, cents: int) -> dict[str, str]:
    receipt = charge(order_id, cents)
    decision = create_hook(token=f"approve:{order_id}").wait()  # the run suspends until resumed
    if not decision["ok"]:
        return {"status": "rejected"}
    sleep(timedelta(hours=1))  # durable: no worker waits, no ETA in memory
    ship(order_id)
    return {"status": "shipped", "receipt": receipt}
