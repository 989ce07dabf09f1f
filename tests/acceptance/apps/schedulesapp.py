"""A schedule on real workers (tests/acceptance/test_schedules.py). The World URL comes from CELERY_WORKFLOW_URL;
the schedules' clock is sped up, the same in every process: it reads CW_CLOCK_START at the epoch time
CW_CLOCK_REAL_START and runs CW_CLOCK_FACTOR times as fast."""

from __future__ import annotations

import os
from datetime import datetime

from celery import Celery

from celery_workflow import Workflows
from celery_workflow.schedules import SpedUpClock

celery_app = Celery("schedulesapp")
wf = Workflows(celery_app)
wf.schedule_clock = SpedUpClock(
    datetime.fromisoformat(os.environ["CW_CLOCK_START"]),
    float(os.environ["CW_CLOCK_FACTOR"]),
    float(os.environ["CW_CLOCK_REAL_START"]),
)


@wf.workflow(name="acceptance.report")
def report(region: str) -> str:
    return f"report {region}"
