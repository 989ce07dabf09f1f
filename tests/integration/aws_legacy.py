"""The AWS World's items as versions before packed events wrote them (issue #31, item 2), for the compatibility
tests: one item per event, and a step's ``STEP#`` view item; and ``run_created`` in its own ``EVENT#1`` item, as
versions before issue #31, item 3 wrote it. The builders are the earlier code's, kept here."""

from __future__ import annotations

from typing import Any

from celery_workflow._aws.items import CODEC, to_item, view_item
from celery_workflow._aws.log import created_of, pack_items
from celery_workflow._aws.table import event_sk, run_pk
from celery_workflow.events import Event, StepView

__all__ = ["created_out_of_meta", "rewrite_as_single_events", "single_event_item", "step_item"]


def single_event_item(e: Event, write_id: str | None = None) -> dict[str, Any]:
    """An event's item as earlier versions wrote it (``items.event_item`` before packs)."""
    run_id, slot, kind, cid, data, created = CODEC.event_record(e)
    return to_item(
        {
            "write_id": write_id,
            "pk": run_pk(run_id),
            "sk": event_sk(slot),
            "run_id": run_id,
            "slot": slot,
            "event_type": kind,
            "correlation_id": cid,
            "data": data,
            "created_at": created,
        }
    )


def rewrite_as_single_events(dynamodb: Any, table: str, run_id: str, events: list[Event]) -> None:
    """Replace a run's ``EVENT#`` items by one item per event, as an earlier version would have written its log
    (``run_created`` in an ``EVENT#1`` item too: META without ``run_created``, :func:`created_out_of_meta`)."""
    created_out_of_meta(dynamodb, table, run_id)
    items = dynamodb.query(
        TableName=table,
        KeyConditionExpression="pk = :pk AND begins_with(sk, :e)",
        ExpressionAttributeValues={":pk": {"S": run_pk(run_id)}, ":e": {"S": "EVENT#"}},
        ConsistentRead=True,
    )["Items"]
    for item in items:
        dynamodb.delete_item(TableName=table, Key={"pk": item["pk"], "sk": item["sk"]})
    for e in events:
        dynamodb.put_item(TableName=table, Item=single_event_item(e))


def created_out_of_meta(dynamodb: Any, table: str, run_id: str) -> None:
    """Move a run's ``run_created`` from its META item to an ``EVENT#1`` pack, as versions before issue #31, item 3
    wrote it (they kept no ``run_created`` attribute in META)."""
    key = {"pk": {"S": run_pk(run_id)}, "sk": {"S": "META"}}
    meta = dynamodb.get_item(TableName=table, Key=key, ConsistentRead=True)["Item"]
    created = created_of(meta)
    if created is not None:
        dynamodb.put_item(TableName=table, Item=pack_items([created])[0])
    dynamodb.update_item(TableName=table, Key=key, UpdateExpression="REMOVE run_created")


def step_item(view: StepView, created_slot: int) -> dict[str, Any]:
    """A step's ``STEP#`` view item as earlier versions wrote it (no version since issue #31, item 2 writes one)."""
    return view_item("steps", view, created_slot)
