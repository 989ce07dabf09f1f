"""The workflows the acceptance tests run on real `celery -A wfapp worker` processes.

The World URL comes from CELERY_WORKFLOW_URL; CW_LEASE sets the transport lease (short, so a killed worker's
delivery comes back quickly); CW_MARKERS is a folder steps use to signal the test and wait for it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery import Celery

from celery_workflow import (
    FatalError,
    StepFailed,
    Workflows,
    continue_as_new,
    create_hook,
    gather,
    get_writable,
    sleep,
    step_metadata,
)

celery_app = Celery("wfapp")
wf = Workflows(celery_app, transport_options={"lease_seconds": float(os.environ.get("CW_LEASE", "60"))})
MARKERS = Path(os.environ.get("CW_MARKERS", "/tmp"))
_read_log = wf.world.get_run_with_events


def _noting_reads(run_id: str) -> Any:
    """Leaves a marker for each read of a run whose id starts with ``noted-`` (the tests count them)."""
    if run_id.startswith("noted-"):
        with (MARKERS / f"reads-{run_id}").open("a") as f:
            f.write("read\n")
    return _read_log(run_id)


wf.world.get_run_with_events = _noting_reads  # type: ignore[method-assign]


def wait_for_file(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.02)


@wf.step
def add(a: int, b: int) -> int:
    return a + b


@wf.workflow
def sequential(n: int, padding: str = "") -> int:
    total = 0
    for i in range(n):
        total = add(total, i)
    return total


@wf.step(max_retries=3, retry_backoff=0.1)
def flaky(fail_times: int) -> int:
    attempt = step_metadata().attempt
    if attempt <= fail_times:
        raise RuntimeError(f"attempt {attempt} fails")
    return attempt


@wf.workflow
def counting(n: int, done: int = 0, total: int = 0, chunk: int = 3) -> int:
    """Adds 0..n-1 with a step each, handing over to a fresh run every ``chunk`` additions."""
    for i in range(done, n):
        total = add(total, i)
        if (i + 1) % chunk == 0 and i + 1 < n:
            continue_as_new(n, i + 1, total, chunk)
    return total


@wf.workflow
def retrying(fail_times: int) -> int:
    return flaky(fail_times)


@wf.step(max_retries=5)
def declined() -> None:
    raise FatalError("card declined")


@wf.workflow
def catches_fatal() -> str:
    try:
        declined()
    except StepFailed as exc:
        return f"caught: {exc.error['message']}"
    return "not reached"


@wf.step(max_retries=0)
def broken() -> None:
    raise ValueError("broken step")


@wf.workflow
def fails() -> None:
    broken()


@wf.workflow
def sleeper(seconds: float) -> str:
    sleep(seconds)
    return "woke"


@wf.workflow
def waits_for_hook(token: str) -> object:
    return create_hook(token=token).wait()


@wf.step
def rendezvous(name: str, other: str) -> str:
    (MARKERS / f"rv-{name}").touch()
    wait_for_file(MARKERS / f"rv-{other}", timeout=20)  # only succeeds if both steps run at the same time
    return name


@wf.workflow
def parallel() -> list[str]:
    return gather(rendezvous.start("left", "right"), rendezvous.start("right", "left"))


@wf.step
def produce(n: int) -> None:
    out = get_writable("ticks")
    for i in range(n):
        out.write({"tick": i})
        wait_for_file(MARKERS / f"tick-{i}-read", timeout=20)  # the reader sees each value while the step runs
    out.close()


@wf.workflow
def streaming(n: int) -> None:
    produce(n)


@wf.step
def slow_once(tag: str) -> str:
    attempt = step_metadata().attempt
    (MARKERS / f"slow-{tag}-started-{attempt}").touch()
    wait_for_file(MARKERS / f"slow-{tag}-release", timeout=60)
    return f"{tag}@{attempt}"


@wf.workflow
def killable(tag: str) -> str:
    return slow_once(tag)


@wf.step
def leave_mark(tag: str) -> str:
    (MARKERS / f"mark-{tag}").touch()
    return tag


@wf.workflow
def marking(tag: str) -> str:
    return leave_mark(tag)


@wf.workflow(queue="backfill")
def backfill(x: int) -> int:
    return add(x, 1)


@celery_app.task(name="wfapp.plain")
def plain(path: str, text: str) -> None:
    Path(path).write_text(text)


@wf.step
def first_step() -> str:
    return "first"


@wf.step
def other_step() -> str:
    return "other"


@wf.workflow
def diverges(token: str) -> str:
    # deliberately nondeterministic: once the marker exists, replay meets another step than the log recorded
    (other_step if (MARKERS / f"diverge-{token}").exists() else first_step)()
    return str(create_hook(token=token).wait())


@wf.workflow
def fan(n: int) -> list[int]:
    return gather(*[add.start(i, i) for i in range(n)])
