"""EventBridge Scheduler schedules of the AWS World's deliveries (not part of the public API; seed "Queue delivery").

A delivery due more than 15 minutes ahead, or delayed at all on a FIFO queue, is a one-time schedule in the
Scheduler group that sends its record's message to the queue at the due time and is deleted after it runs
(:meth:`Schedules.create`). Names:

* ``celery-workflow-<record id>`` for a record's first publication;
* ``celery-workflow-<record id>-<claim>`` when the record is sent again after its claim ``claim`` (a message that
  arrived early, an expiry deferred): the schedule that brought that message may not be deleted yet (the Scheduler
  deletes a one-time schedule after it runs, not as it runs), and a second schedule of its name would be refused with
  ``ConflictException``, which reads as "already scheduled": the record would be left without a message. Claims only
  grow, so each re-send has a name of its own;
* an id the Scheduler's names cannot hold (with the prefix over 64 characters, or with characters other than letters,
  digits, ``-``, ``_`` and ``.``: an expiry's id carries its run id) is replaced by 32 hex digits of its SHA-256.

A run's pending schedules are the records listed in its ``META`` item's ``schedules`` string set (see
:mod:`celery_workflow._aws.append`). When the run ends (completed, failed, cancelled), :meth:`Schedules.cancel`
deletes their schedules (one already gone, ``ResourceNotFoundException``, is fine) and then their records, so no
timer of a finished run fires later.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from botocore.exceptions import BotoCoreError, ClientError

from celery_workflow import ids
from celery_workflow._aws.config import QueueConfig
from celery_workflow._aws.queue import Record
from celery_workflow._aws.table import META, queue_pk
from celery_workflow.errors import ConfigurationError, WorldError, WorldUnavailable

if TYPE_CHECKING:
    from celery_workflow._aws.world import AWSWorld

__all__ = ["SCHEDULE_PREFIX", "Schedules", "schedule_name"]

log = logging.getLogger("celery_workflow.aws")

SCHEDULE_PREFIX = "celery-workflow-"
#: The longest schedule name the Scheduler takes, and the characters it allows.
MAX_NAME = 64
_NAME = re.compile(r"[0-9A-Za-z_.-]+")


def schedule_name(record_id: str, claim: int = 0) -> str:
    """The name of the schedule of record ``record_id`` sent after its claim ``claim`` (0: its first publication);
    see the module docstring."""
    suffix = f"-{claim}" if claim else ""
    name = f"{SCHEDULE_PREFIX}{record_id}{suffix}"
    if len(name) <= MAX_NAME and _NAME.fullmatch(record_id):
        return name
    return f"{SCHEDULE_PREFIX}{hashlib.sha256(record_id.encode()).hexdigest()[:32]}{suffix}"


class Schedules:
    """The Scheduler facet of an :class:`~celery_workflow._aws.world.AWSWorld`."""

    def __init__(self, world: AWSWorld) -> None:
        self.world = world

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code == "ConflictException" and what == "CreateSchedule":
                return None  # already scheduled (a second publication of the same delivery)
            if code == "ResourceNotFoundException" and what == "DeleteSchedule":
                return None  # it ran and was deleted, or was never made: gone either way
            if code in ("ThrottlingException", "ServiceQuotaExceededException", "InternalServerException"):
                raise WorldUnavailable(f"Scheduler {what}: {code}") from exc
            raise WorldError(f"Scheduler {what}: {code}: {exc}") from exc
        except BotoCoreError as exc:
            raise WorldUnavailable(f"Scheduler {what}: {exc}") from exc

    def create(self, record: Record, queue: QueueConfig, group: str) -> None:
        """Schedule ``record``'s message for its due time (``group``: a FIFO queue's message group)."""
        scheduler = self.world.config.scheduler
        if scheduler is None:
            raise ConfigurationError(
                f"delivery {record.id} is due at {ids.isoformat(record.due)}: more than 15 minutes ahead (or delayed"
                " on a FIFO queue) needs the Scheduler; configure AWSConfig(scheduler=…)"
            )
        target: dict[str, Any] = {"Arn": queue.arn, "RoleArn": scheduler.role_arn, "Input": record.body()}
        if queue.fifo:
            target["SqsParameters"] = {"MessageGroupId": group}
        self._call(
            "CreateSchedule",
            scheduler.client.create_schedule,
            Name=schedule_name(record.id, record.claim),
            GroupName=scheduler.group,
            ScheduleExpression=f"at({record.due:%Y-%m-%dT%H:%M:%S})",
            ScheduleExpressionTimezone="UTC",
            FlexibleTimeWindow={"Mode": "OFF"},
            Target=target,
            ActionAfterCompletion="DELETE",
        )

    def delete(self, name: str) -> None:
        """Delete one schedule of the group (one already gone is fine)."""
        scheduler = self.world.config.scheduler
        if scheduler is not None:
            self._call("DeleteSchedule", scheduler.client.delete_schedule, Name=name, GroupName=scheduler.group)

    def cancel(self, run_id: str, record_ids: Sequence[str]) -> int:
        """Delete the schedules of a finished run's pending deliveries, then their records; how many records went.

        Best effort, after the run's end committed: an error is logged and what is left fires as before (its
        delivery finds the run ended). Without a Scheduler in this World's config (an API that only serves HTTP)
        nothing is deleted: the schedules fire and are acknowledged."""
        if not record_ids or self.world.config.scheduler is None:
            return 0
        table = self.world.table
        try:
            found = [Record.from_item(i) for i in table.get_many([{"pk": queue_pk(r), "sk": META} for r in record_ids])]
            pending = [r for r in found if r.kind == "delivery" and r.run_id == run_id]
            for record in pending:
                for claim in sorted({0, record.claim}):
                    self.delete(schedule_name(record.id, claim))
            table.delete_each([{"pk": {"S": queue_pk(r.id)}, "sk": {"S": META}} for r in pending])
        except (WorldError, ConfigurationError) as exc:
            log.warning("run %s ended: cannot delete the schedules of its pending deliveries: %s", run_id, exc)
            return 0
        return len(pending)
