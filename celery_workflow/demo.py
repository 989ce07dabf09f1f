"""The demo app behind ``celery-workflow demo``: an order workflow with every feature in a few lines.

Run it yourself with a worker::

    CELERY_WORKFLOW_URL=sqlite:///demo.sqlite3 celery -A celery_workflow.demo worker
"""

from __future__ import annotations

from celery import Celery

from celery_workflow import RetryableError, Workflows, create_hook, get_writable, sleep, step_metadata

celery_app = Celery("celery_workflow_demo")
wf = Workflows(celery_app)

ITEMS = ["kettle", "teapot", "mugs"]
STAGES = 3 + len(ITEMS)  # what the progress stream counts up to: fetch, charge, each item, ship


def progress(stage: str) -> None:
    get_writable("progress").write({"stage": stage})


@wf.step
def fetch_order(order_id: str) -> dict[str, object]:
    progress("order fetched")
    return {"order_id": order_id, "cents": 4200, "items": ITEMS}


@wf.step(max_retries=3, retry_backoff=0.5)
def charge_card(order_id: str, cents: int) -> str:
    if step_metadata().attempt == 1:  # the payment provider times out once: the step is retried durably
        raise RetryableError("payment provider timed out", retry_after=0.5)
    progress(f"card charged {cents / 100:.2f} (attempt {step_metadata().attempt})")
    return f"rcpt_{order_id}"


@wf.step
def pack_item(order_id: str, item: str) -> str:
    progress(f"packed {item}")
    return item


@wf.step
def ship(order_id: str, items: list[str]) -> str:
    progress("shipped")
    get_writable("progress").close()
    return f"trk_{order_id}"


@wf.workflow
def process_order(order_id: str) -> dict[str, object]:
    order = fetch_order(order_id)
    receipt = charge_card(order_id, int(str(order["cents"])))
    approval = create_hook(token=f"approve:{order_id}")
    decision = approval.wait()  # suspends the run until someone calls wf.resume_hook("approve:<id>", ...)
    if not decision.get("ok"):
        return {"status": "rejected", "receipt": receipt}
    sleep(1)  # durable: the worker is free meanwhile
    packed = [pack_item.start(order_id, item) for item in ITEMS]  # in parallel, each its own delivery
    items = [p.result() for p in packed]
    tracking = ship(order_id, items)
    return {"status": "shipped", "receipt": receipt, "tracking": tracking, "items": items}
