"""The workflow app of ``python -m bench.chaos``: runs with inline steps, parallel steps, durable sleeps and a hook.

The World comes from ``CELERY_WORKFLOW_URL``; ``CW_AWS_FAULTS`` injects faults into boto3 calls
(:mod:`bench.aws_faults`); ``CW_LEASE`` sets the transport lease (short, so a killed worker's
deliveries come back quickly). Every execution of a step body appends one line ``<run id> <step id> <attempt> <pid>``
to ``$CW_CHAOS_DIR/executions.log`` (one ``write`` of an ``O_APPEND`` file: lines never interleave), so the driver
can count bodies that ran more than once (allowed: steps run at least once and are recorded exactly once).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery import Celery

from bench.aws_faults import install_from_env
from celery_workflow import Workflows, create_hook, gather, sleep, step_metadata

install_from_env()  # CW_AWS_FAULTS (AWS World): faults in this process's boto3 calls, before the World's clients exist
celery_app = Celery("chaos_app")
wf = Workflows(
    celery_app,
    transport_options={"lease_seconds": float(os.environ.get("CW_LEASE", "2"))},
)
CHAOS_DIR = Path(os.environ.get("CW_CHAOS_DIR", "/tmp"))
#: How long each step body works (seconds), so that kills land inside steps too.
STEP_SECONDS = float(os.environ.get("CW_CHAOS_STEP_SECONDS", "0.15"))
#: Parallel (queued) steps per run, beside the inline ones.
PARALLEL = 2


def hook_token(i: int) -> str:
    return f"chaos-approve-{i}"


def expected_output(i: int, steps: int) -> dict[str, int]:
    """What run ``i`` of ``chaos_flow(i, steps, nap)`` returns (the driver resumes its hook with ``{"v": i * 7}``)."""
    inline = sum(i * 1000 + k for k in range(steps))
    parallel = sum(i * 1000 + 100 + k for k in range(PARALLEL))
    return {"total": inline + parallel, "hook": i * 7}


def _record_execution() -> None:
    meta = step_metadata()
    line = f"{meta.run_id} {meta.step_id} {meta.attempt} {os.getpid()}\n".encode()
    fd = os.open(CHAOS_DIR / "executions.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


@wf.step(max_retries=5, retry_backoff=0.2)
def work(i: int, k: int) -> int:
    _record_execution()
    time.sleep(STEP_SECONDS)
    return i * 1000 + k


@wf.workflow
def chaos_flow(i: int, steps: int, nap: float) -> dict[str, Any]:
    total = 0
    for k in range(steps):  # inline steps: run in the workflow's own delivery
        total += work(i, k)
    sleep(nap)
    decision = create_hook(token=hook_token(i)).wait()  # resumed by the driver, from the client side
    parts = gather(*[work.start(i, 100 + k) for k in range(PARALLEL)])  # queued steps: deliveries of their own
    sleep(nap)
    return {"total": total + sum(parts), "hook": int(decision["v"])}
