"""The workflows whose recorded runs are checked in next to this module (``<scenario>.json``).

Each covers a feature a code change could break for runs in flight: sequential inline steps, retries, durable
sleeps, hooks, webhooks, parallel steps, streams, cancellation, failure, and a StepFailed caught by the workflow.
``tests/unit/test_histories.py`` replays every history against these functions, so a change here that would break a
recorded run fails that test with a :class:`~celery_workflow.errors.ReplayDivergence`.

Time is a :class:`ManualClock` shared by the World and the runtime, so that recording is deterministic: the same
timestamps, ``now()`` values and retry times on every recording. Inputs, run ids and hook tokens are fixed too.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery

from celery_workflow import (
    FatalError,
    RetryableError,
    StepFailed,
    Workflows,
    create_hook,
    create_webhook,
    gather,
    get_writable,
    now,
    sleep,
    step_metadata,
    uuid4,
    workflow_metadata,
)
from celery_workflow.testing import MemoryWorld

BASE_URL = "https://example.test/wf"
START = datetime(2025, 1, 6, 9, 0, tzinfo=UTC)


class ManualClock:
    """Deterministic time: starts at ``start``, moves 1 ms per reading, and jumps forward with :meth:`advance_to`."""

    TICK = timedelta(milliseconds=1)

    def __init__(self, start: datetime) -> None:
        self.current = start

    def __call__(self) -> datetime:
        value = self.current
        self.current += self.TICK
        return value

    def advance_to(self, when: datetime) -> None:
        self.current = max(self.current, when)


clock = ManualClock(START)
world = MemoryWorld(clock=clock)
wf = Workflows(Celery("histories"), world=world, broker="app", base_url=BASE_URL)
wf.runtime.clock = clock  # retry times and sleep decisions follow the same clock as the World


@dataclasses.dataclass
class Item:
    sku: str
    qty: int
    price: int  # cents


# -- steps -----------------------------------------------------------------------------------------------------------


@wf.step
def reserve(order_id: str, items: list[Item]) -> int:
    return sum(item.qty for item in items)


@wf.step
def charge(order_id: str, amount: int) -> str:
    return f"charge-{order_id[:8]}-{amount}"


@wf.step(max_retries=3)
def call_flaky_api(request: str) -> dict[str, Any]:
    attempt = step_metadata().attempt
    if attempt < 3:
        raise RetryableError(f"503 from the API (attempt {attempt})", retry_after=5)
    return {"request": request, "attempts": attempt}


@wf.step
def stamp(label: str, at: str) -> str:
    return f"{label}@{at}"


@wf.step
def notify(url: str) -> str:
    return f"sent {url}"


@wf.step
def square(x: int) -> int:
    return x * x


@wf.step
def produce(n: int) -> int:
    out = get_writable("progress")
    for i in range(n):
        out.write({"done": i + 1, "of": n})
    out.close()
    return n


@wf.step(max_retries=5)
def ship(order_id: str) -> str:
    raise FatalError(f"no carrier serves order {order_id}")


@wf.step(max_retries=1, retry_backoff=2.0)
def lookup(key: str) -> str:
    raise KeyError(key)


@wf.step
def fallback(key: str) -> str:
    return f"default-{key}"


# -- workflows -------------------------------------------------------------------------------------------------------


@wf.workflow
def sequential(items: list[Item]) -> dict[str, Any]:
    """Inline steps one after the other; a step argument derived from ``uuid4()``."""
    order_id = str(uuid4())
    count = reserve(order_id, items)
    total = sum(item.qty * item.price for item in items)
    receipt = charge(order_id, total)
    return {"order_id": order_id, "count": count, "total": total, "receipt": receipt}


@wf.workflow
def retrying(request: str) -> dict[str, Any]:
    """A step that fails twice with RetryableError (retried by step deliveries), then succeeds."""
    return call_flaky_api(request)


@wf.workflow
def sleeper(seconds: float) -> str:
    """A durable sleep, then a step whose argument is the replayed clock."""
    before = stamp("before", now().isoformat())
    sleep(seconds)
    after = stamp("after", now().isoformat())
    return f"{before} {after}"


@wf.workflow
def approvals(needed: int) -> list[Any]:
    """A hook resumed with several payloads."""
    hook = create_hook(token=f"approvals:{workflow_metadata().run_id}", metadata={"needed": needed})
    got: list[Any] = []
    for payload in hook:
        got.append(payload)
        if len(got) == needed:
            break
    return got


@wf.workflow
def webhook() -> dict[str, Any]:
    """A webhook: its URL goes to a step, the request comes back from the log."""
    hook = create_webhook(token=f"webhook:{workflow_metadata().run_id}")
    sent = notify(hook.url)
    request = hook.wait()
    return {"sent": sent, "method": request.method, "body": request.json(), "query": request.query}


@wf.workflow
def fan_out(n: int) -> int:
    """Parallel steps with ``.start()`` and ``gather``."""
    squares = gather(*[square.start(i) for i in range(n)])
    return sum(squares)


@wf.workflow
def streaming(n: int) -> int:
    """A step writing a stream (stream chunks are not events: the log holds the step's result only)."""
    return produce(n)


@wf.workflow
def waits_forever(order_id: str) -> str:
    """Reserves, then waits on a hook; recorded after the run was cancelled."""
    reserve(order_id, [Item("pen", 1, 150)])
    return str(create_hook(token=f"cancel:{order_id}").wait())


@wf.workflow
def fails(order_id: str) -> str:
    """A step failing for good with FatalError, uncaught: the run fails."""
    reserve(order_id, [Item("desk", 1, 25_000)])
    return ship(order_id)


@wf.workflow
def recovers(key: str) -> dict[str, str]:
    """A step exhausting its retries; the workflow catches StepFailed and runs a fallback step."""
    try:
        value = lookup(key)
    except StepFailed as exc:
        return {"error": f"{exc.error_type}: {exc.error['message']}", "value": fallback(key)}
    return {"value": value}
