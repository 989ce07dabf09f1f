"""The AWS World's workflow schedules (:mod:`celery_workflow.schedules`; not EventBridge's, see
:mod:`celery_workflow._aws.schedules`): one item per schedule in the World's table, ``pk=SCHEDULES``,
``sk=SCHEDULE#<id>``, holding the schedule as JSON (``doc``) and its ``version`` (a number). An item is created with
``attribute_not_exists(pk)`` and replaced on the condition that its version is still the one read (a
compare-and-set: see :mod:`celery_workflow.schedules.model`). The partition is read with a consistent query."""

from __future__ import annotations

import json
from typing import Any

from celery_workflow._aws.dynamo import ConditionFailed, Table
from celery_workflow.errors import ScheduleNotFound
from celery_workflow.schedules.model import Schedule, check_schedule_id

__all__ = ["SCHEDULES_PK", "DynamoSchedules"]

SCHEDULES_PK = "SCHEDULES"


def _key(schedule_id: str) -> dict[str, str]:
    return {"pk": SCHEDULES_PK, "sk": f"SCHEDULE#{check_schedule_id(schedule_id)}"}


def _item(schedule: Schedule) -> dict[str, Any]:
    return {
        **{k: {"S": v} for k, v in _key(schedule.schedule_id).items()},
        "doc": {"S": json.dumps(schedule.to_data(), sort_keys=True)},
        "version": {"N": str(schedule.version)},
    }


def _schedule(item: dict[str, Any]) -> Schedule:
    return Schedule.from_data(json.loads(item["doc"]["S"]))


class DynamoSchedules:
    """A :class:`~celery_workflow.schedules.model.ScheduleStore` in the AWS World's table."""

    def __init__(self, table: Table) -> None:
        self.table = table

    def _put(self, what: str, schedule: Schedule, condition: str, values: dict[str, Any] | None = None) -> bool:
        request: dict[str, Any] = {
            "TableName": self.table.name,
            "Item": _item(schedule),
            "ConditionExpression": condition,
        }
        if values:
            request["ExpressionAttributeValues"] = values
        try:
            self.table.call(what, self.table.client.put_item, **request)
        except ConditionFailed:
            return False
        return True

    def add_schedule(self, schedule: Schedule) -> bool:
        return self._put("PutItem (add_schedule)", schedule, "attribute_not_exists(pk)")

    def get_schedule(self, schedule_id: str) -> Schedule:
        found = self.table.get(_key(schedule_id))
        if found is None:
            raise ScheduleNotFound(f"no schedule {schedule_id!r}")
        return _schedule(found)

    def list_schedules(self) -> list[Schedule]:
        return [_schedule(i) for i in self.table.partition(SCHEDULES_PK, "SCHEDULE#", what="Query (schedules)")]

    def replace_schedule(self, schedule: Schedule, expected_version: int) -> bool:
        return self._put(
            "PutItem (replace_schedule)", schedule, "version = :v", {":v": {"N": str(int(expected_version))}}
        )

    def delete_schedule(self, schedule_id: str) -> bool:
        answer = self.table.call(
            "DeleteItem (delete_schedule)",
            self.table.client.delete_item,
            TableName=self.table.name,
            Key={k: {"S": v} for k, v in _key(schedule_id).items()},
            ReturnValues="ALL_OLD",
        )
        return bool(answer.get("Attributes"))
