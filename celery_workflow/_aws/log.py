"""The AWS World's event log: the events of one append in one item (not part of the public API).

**Packs.** An append's events are written as ONE item, ``pk=RUN#<runId>``, ``sk=EVENT#<slot of its first event, 26
digits>`` (:func:`pack_items`), instead of one item per event: DynamoDB bills a transactional write 2 write units
per started KB *per item*, so three small events cost 6 units as three items and 2 as one. The item holds:

* ``events``: a list with one entry per event, in slot order: ``[type, correlation id or NULL, data]`` (the type's
  value, the id, the codec-tagged JSON as binary), and a fourth entry, the event's time in µs, only when it is not
  the item's ``created_at`` (the events of one append share their time);
* ``created_at`` (µs) and ``write_id`` (the append that wrote it: a retry recognises its own commit); the run id is
  the partition key's and each event's slot is the first slot plus its place in the list.

An append whose events do not fit in one item (DynamoDB's 400 KB, :data:`~celery_workflow._aws.table.MAX_ITEM_BYTES`)
is written as several items at consecutive first slots, each as full as it can be; an event that does not fit in an
item by itself is :class:`~celery_workflow.errors.EventTooLarge`, as before. The items' key is still
``EVENT#<slot>``, so a run's log is one ``Query`` of its ``EVENT#`` range in slot order; what reads from a slot that
may be inside an item (``after_slot``) finds the item that holds it first: ``sk <= EVENT#<slot>``, newest first,
one item (:func:`read_events`).

**Items of earlier versions** (one event per item: ``run_id``, ``slot``, ``event_type``, ``correlation_id``,
``data``, ``created_at``) are read as packs of one (:func:`events_of`): tables written before packs need no
migration. An earlier version cannot read packs: upgrade every writer and reader of a table together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from celery_workflow import ids
from celery_workflow._aws.items import CODEC, item_size, plain, value_size
from celery_workflow._aws.table import MAX_ITEM_BYTES, TTL_ATTRIBUTE, event_sk, run_pk
from celery_workflow.errors import EventTooLarge
from celery_workflow.events import Event

__all__ = ["EVENTS", "events_of", "last_slot", "pack_items", "read_events"]

Item = dict[str, Any]

#: The attribute of a pack that holds its events (an item without it is an earlier version's single event).
EVENTS = "events"
#: The highest key of the ``EVENT#`` range.
LAST_SK = "EVENT#" + "9" * 26


def _entry(e: Event, created: int) -> dict[str, Any]:
    _, _, kind, cid, data, at = CODEC.event_record(e)
    values: list[dict[str, Any]] = [{"S": kind}, {"NULL": True} if cid is None else {"S": cid}, {"B": data}]
    if at != created:
        values.append({"N": str(at)})
    return {"L": values}


def _pack(events: Sequence[Event], entries: Sequence[dict[str, Any]], write_id: str | None, created: int) -> Item:
    item: Item = {
        "pk": {"S": run_pk(events[0].run_id)},
        "sk": {"S": event_sk(events[0].slot)},
        "created_at": {"N": str(created)},
        EVENTS: {"L": list(entries)},
    }
    if write_id is not None:
        item["write_id"] = {"S": write_id}
    return item


def pack_items(events: Sequence[Event], write_id: str | None = None, ttl: int | None = None) -> list[Item]:
    """The items of one append's events (consecutive slots of one run): one item, or several at consecutive first
    slots when they do not fit in one (see the module docstring); ``ttl``: their time to live (a run's end)."""
    if not events:
        return []
    created = ids.to_micros(events[0].created_at)
    extra = {TTL_ATTRIBUTE: {"N": str(ttl)}} if ttl is not None else {}
    items: list[Item] = []
    start = 0
    entries: list[dict[str, Any]] = []
    size = 0
    for i, e in enumerate(events):
        entry = _entry(e, created)
        if not entries:  # a new item: its keys and attributes, then this event
            first = {**_pack(events[i : i + 1], [], write_id, created), **extra}
            size = item_size(first)
        grown = size + 1 + value_size(entry)
        if grown > MAX_ITEM_BYTES:
            if not entries:
                raise EventTooLarge(
                    f"{e.event_type} at slot {e.slot} of run {e.run_id} needs an item of {grown} bytes; DynamoDB"
                    f" stores at most {MAX_ITEM_BYTES}"
                )
            items.append({**_pack(events[start:i], entries, write_id, created), **extra})
            start, entries = i, []
            size = item_size({**_pack(events[i : i + 1], [], write_id, created), **extra})
            grown = size + 1 + value_size(entry)
            if grown > MAX_ITEM_BYTES:
                raise EventTooLarge(
                    f"{e.event_type} at slot {e.slot} of run {e.run_id} needs an item of {grown} bytes; DynamoDB"
                    f" stores at most {MAX_ITEM_BYTES}"
                )
        entries.append(entry)
        size = grown
    items.append({**_pack(events[start:], entries, write_id, created), **extra})
    return items


def events_of(item: Mapping[str, Any]) -> list[Event]:
    """The events an ``EVENT#`` item holds, in slot order: a pack's, or an earlier version's single event."""
    if EVENTS not in item:  # one event per item (earlier versions)
        v = {name: plain(value) for name, value in item.items()}
        record = (v["run_id"], v["slot"], v["event_type"], v.get("correlation_id"), v["data"], v["created_at"])
        return [CODEC.event(record)]
    run_id = item["pk"]["S"][len("RUN#") :]
    first = int(item["sk"]["S"][len("EVENT#") :])
    created = int(item["created_at"]["N"])
    out = []
    for i, entry in enumerate(item[EVENTS]["L"]):
        values = entry["L"]
        cid = values[1].get("S")
        at = int(values[3]["N"]) if len(values) > 3 else created
        out.append(CODEC.event((run_id, first + i, values[0]["S"], cid, bytes(values[2]["B"]), at)))
    return out


def last_slot(item: Mapping[str, Any]) -> int:
    """The slot of the last event an ``EVENT#`` item holds."""
    first = int(item["sk"]["S"][len("EVENT#") :])
    return first + len(item[EVENTS]["L"]) - 1 if EVENTS in item else first


def read_events(table: Any, run_id: str, *, after_slot: int = 0, limit: int | None = None) -> list[Event]:
    """The run's events after ``after_slot`` (at most ``limit``), in slot order, by consistent queries: the item that
    holds slot ``after_slot + 1`` when it may begin before it (newest ``EVENT#`` key at or below it), then the items
    after it. ``table``: the World's :class:`~celery_workflow._aws.dynamo.Table`."""
    if limit is not None and limit <= 0:
        return []
    pk = {"S": run_pk(run_id)}
    out: list[Event] = []
    start = after_slot + 1
    if after_slot > 0:  # slot 1 begins the first item (create_run's): from 0, the forward query finds everything
        covering = table.query(
            "Query (events: the item holding a slot)",
            KeyConditionExpression="pk = :pk AND sk BETWEEN :lo AND :hi",
            ExpressionAttributeValues={":pk": pk, ":lo": {"S": "EVENT#"}, ":hi": {"S": event_sk(start)}},
            ScanIndexForward=False,
            Limit=1,
        )
        found = next(covering, None)
        if found is not None and last_slot(found) >= start:
            out += [e for e in events_of(found) if e.slot > after_slot]
            start = last_slot(found) + 1
        else:
            start = after_slot + 1
    if limit is None or len(out) < limit:
        items = table.query(
            "Query (events)",
            KeyConditionExpression="pk = :pk AND sk BETWEEN :lo AND :hi",
            ExpressionAttributeValues={":pk": pk, ":lo": {"S": event_sk(start)}, ":hi": {"S": LAST_SK}},
        )
        for item in items:
            out += events_of(item)
            if limit is not None and len(out) >= limit:
                break
    return out if limit is None else out[:limit]
