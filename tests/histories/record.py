"""Record the checked-in histories: ``python -m tests.histories.record [scenario ...]`` (all scenarios by default).

Each scenario starts a run of a workflow of :mod:`tests.histories.workflows` with a fixed run id and input, drives
it with :class:`~celery_workflow.testing.LocalWorker` (moving the manual clock to the next due delivery of the run
when a sleep or a retry makes it wait), checks the status it ends in, and writes ``tests/histories/<scenario>.json``
with ``History.from_world(...).dump(...)``. Each written history is replayed at once, so a recording the current code
cannot replay is never written silently. Re-recording gives the same files except for delivery ids (step owners).

Record a scenario anew only when its recorded run is no longer one a deployed version can have in flight: the point
of a checked-in history is that it stays as the old code wrote it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from celery_workflow import Run, RunStatus, WebhookRequest
from celery_workflow.testing import History, LocalWorker, replay_history
from tests.histories import workflows as w

HERE = Path(__file__).parent
worker = LocalWorker(w.wf)


def idle() -> None:
    """Handle every delivery that is due now."""
    worker.run_until_idle()


def finish(run: Run[Any]) -> None:
    """Handle deliveries until the run ends, moving the clock to the run's next due delivery when none is due."""
    for _ in range(100):
        idle()
        if run.status.terminal:
            return
        due = [d.not_before for d in w.world.pending() if d.run_id == run.id and d.not_before is not None]
        if not due:
            raise RuntimeError(f"run {run.id} is {run.status} with nothing queued")
        w.clock.advance_to(min(due))
    raise RuntimeError(f"run {run.id} did not end")


# -- scenarios: each returns the run it recorded ---------------------------------------------------------------------


def sequential() -> Run[Any]:
    run = w.sequential.start([w.Item("book", 2, 1_200), w.Item("lamp", 1, 4_500)], run_id="hist-sequential")
    finish(run)
    return run


def retrying() -> Run[Any]:
    run = w.retrying.start("GET /v1/quote?sku=book", run_id="hist-retrying")
    finish(run)
    return run


def sleep_woke() -> Run[Any]:
    run = w.sleeper.start(60.0, run_id="hist-sleep-woke")
    finish(run)
    return run


def sleep_asleep() -> Run[Any]:
    run = w.sleeper.start(3_600.0, run_id="hist-sleep-asleep")
    idle()
    return run


def hook_resumed() -> Run[Any]:
    run = w.approvals.start(2, run_id="hist-hook-resumed")
    idle()
    w.wf.resume_hook("approvals:hist-hook-resumed", {"by": "ada", "ok": True})
    idle()
    w.wf.resume_hook("approvals:hist-hook-resumed", {"by": "grace", "ok": True})
    finish(run)
    return run


def hook_waiting() -> Run[Any]:
    run = w.approvals.start(3, run_id="hist-hook-waiting")
    idle()
    w.wf.resume_hook("approvals:hist-hook-waiting", {"by": "ada", "ok": False})
    idle()
    return run


def webhook() -> Run[Any]:
    run = w.webhook.start(run_id="hist-webhook")
    idle()
    request = WebhookRequest.build("POST", {"content-type": "application/json"}, b'{"paid": true}', "ref=42")
    w.wf.runtime.resume_webhook("webhook:hist-webhook", request)
    finish(run)
    return run


def fan_out() -> Run[Any]:
    run = w.fan_out.start(4, run_id="hist-fan-out")
    finish(run)
    return run


def fan_out_waiting() -> Run[Any]:
    run = w.fan_out.start(3, run_id="hist-fan-out-waiting")
    worker.run_once()  # the workflow delivery only: the steps are queued, none has run
    return run


def streaming() -> Run[Any]:
    run = w.streaming.start(3, run_id="hist-streaming")
    finish(run)
    return run


def cancelled() -> Run[Any]:
    run = w.waits_forever.start("order-7", run_id="hist-cancelled")
    idle()
    run.cancel("the customer changed their mind")
    return run


def failed() -> Run[Any]:
    run = w.fails.start("order-9", run_id="hist-failed")
    finish(run)
    return run


def step_failed_caught() -> Run[Any]:
    run = w.recovers.start("colour", run_id="hist-step-failed-caught")
    finish(run)
    return run


#: scenario -> (how to record it, the status its run must have when recorded); the asleep run goes last, so that no
#: other scenario moves the clock past its wake-up time before it is written
SCENARIOS: dict[str, tuple[Callable[[], Run[Any]], RunStatus]] = {
    "sequential": (sequential, RunStatus.COMPLETED),
    "retrying": (retrying, RunStatus.COMPLETED),
    "sleep_woke": (sleep_woke, RunStatus.COMPLETED),
    "hook_resumed": (hook_resumed, RunStatus.COMPLETED),
    "hook_waiting": (hook_waiting, RunStatus.RUNNING),
    "webhook": (webhook, RunStatus.COMPLETED),
    "fan_out": (fan_out, RunStatus.COMPLETED),
    "fan_out_waiting": (fan_out_waiting, RunStatus.RUNNING),
    "streaming": (streaming, RunStatus.COMPLETED),
    "cancelled": (cancelled, RunStatus.CANCELLED),
    "failed": (failed, RunStatus.FAILED),
    "step_failed_caught": (step_failed_caught, RunStatus.COMPLETED),
    "sleep_asleep": (sleep_asleep, RunStatus.RUNNING),
}


def main(argv: Sequence[str] | None = None) -> int:
    names = list(argv if argv is not None else sys.argv[1:]) or list(SCENARIOS)
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        print(f"unknown scenarios {unknown}; known: {sorted(SCENARIOS)}", file=sys.stderr)
        return 2
    for name, (record, expected) in SCENARIOS.items():  # in table order, whatever order they were named in
        if name not in names:
            continue
        run = record()
        history = History.from_world(w.world, run.id)
        if history.status is not expected:
            raise RuntimeError(f"scenario {name}: run {run.id} is {history.status}, expected {expected}")
        if worker.failures:
            raise RuntimeError(f"scenario {name}: deliveries failed: {worker.failures}")
        path = HERE / f"{name}.json"
        history.dump(path)
        result = replay_history(w.wf, History.load(path))
        print(
            f"{path.relative_to(HERE.parent.parent)}: {len(history.events)} events, {history.status}, {result.status}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
