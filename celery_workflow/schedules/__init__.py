"""Schedules: a workflow started at every tick of a cron expression, durably in the World (issue #30, item 3).

``wf.schedule(workflow, cron="*/5 * * * *", id="nightly", args=..., kwargs=..., timezone="UTC",
overlap="skip" | "allow" | "cancel_previous", catch_up=timedelta(minutes=1))`` stores the schedule in the World
(:mod:`.manage`); every worker's ticker (:mod:`.ticker`) fires its ticks, exactly one run per tick whatever the
number of workers (:mod:`.model`); :mod:`.cron` reads the expression.
"""

from __future__ import annotations

from celery_workflow.schedules.cron import Cron, parse_cron
from celery_workflow.schedules.manage import Schedules
from celery_workflow.schedules.model import OVERLAPS, Schedule, ScheduleStore, schedules_of, tick_run_id
from celery_workflow.schedules.ticker import Clock, SpedUpClock, SystemClock, Ticker, TickReport, WorldStarter

__all__ = [
    "OVERLAPS",
    "Clock",
    "Cron",
    "Schedule",
    "ScheduleStore",
    "Schedules",
    "SpedUpClock",
    "SystemClock",
    "TickReport",
    "Ticker",
    "WorldStarter",
    "parse_cron",
    "schedules_of",
    "tick_run_id",
]
