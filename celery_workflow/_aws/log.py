"""The AWS World's event log: the events of one append in one item, and the step views the log gives (not part of
the public API).

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

**Slot 1** (``run_created``) has no item of its own: the run's META item keeps it (attribute ``run_created``, one
entry as above with its time, :func:`created_entry` / :func:`created_of`), so a run's creation writes one item and a
delivery's read of a new run is META alone. Readers from slot 1 take it from META (:func:`read_events`: the META the
caller read, or one ``GetItem``). A ``run_created`` too large to sit beside the view with room for its output gets its
own ``EVENT#1`` item, as earlier versions wrote every run's; META ``run_created`` then names that item (a string),
and earlier versions' runs have no such attribute: both read from ``EVENT#1``.

**Items of earlier versions** (one event per item: ``run_id``, ``slot``, ``event_type``, ``correlation_id``,
``data``, ``created_at``) are read as packs of one (:func:`events_of`): tables written before packs need no
migration. An earlier version cannot read packs: upgrade every writer and reader of a table together.

**Step views** are not stored (no ``STEP#`` items): :func:`step_views` folds them from the log, with the transitions
of :mod:`celery_workflow.rules` (whose checks the log passed when it was written). A delivery reads its run's whole
log anyway (:mod:`celery_workflow._aws.kept` keeps every step's view from it); ``get_step``, ``list_steps`` and an
append planned on fresh reads that names steps read the log (one ``Query``) instead of ``STEP#`` items. ``STEP#``
items that earlier versions wrote are not read (the log is the truth) and go with the run's partition at its expiry.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from celery_workflow import ids
from celery_workflow._aws.items import CODEC, item_size, plain, value_size
from celery_workflow._aws.table import CREATED, MAX_ITEM_BYTES, META, TTL_ATTRIBUTE, event_sk, run_pk
from celery_workflow.errors import EventTooLarge, RunNotFound
from celery_workflow.events import STEP_EVENTS, Event, EventType, StepView
from celery_workflow.rules import step_after

__all__ = [
    "EVENTS",
    "created_entry",
    "created_of",
    "events_of",
    "last_slot",
    "pack_items",
    "read_events",
    "step_views",
]

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

    def item(begin: int, end: int, held: list[dict[str, Any]]) -> Item:
        return {**_pack(events[begin : end + 1], held, write_id, created), **extra}

    items: list[Item] = []
    entries: list[dict[str, Any]] = []
    start = size = 0
    for i, e in enumerate(events):
        entry = _entry(e, created)
        grown = size + 1 + value_size(entry)  # a list element: its value and 1 byte
        if entries and grown > MAX_ITEM_BYTES:  # full: this event begins the next item
            items.append(item(start, i - 1, entries))
            start, entries = i, []
        if not entries:
            grown = item_size(item(i, i, [])) + 1 + value_size(entry)
            if grown > MAX_ITEM_BYTES:
                raise EventTooLarge(
                    f"{e.event_type} at slot {e.slot} of run {e.run_id} needs an item of {grown} bytes; DynamoDB"
                    f" stores at most {MAX_ITEM_BYTES}"
                )
        entries.append(entry)
        size = grown
    items.append(item(start, len(events) - 1, entries))
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


def created_entry(first: Event) -> dict[str, Any]:
    """The run's ``run_created`` event (slot 1) as its META item keeps it (:data:`~celery_workflow._aws.table.CREATED`):
    an entry of a pack, its time included."""
    return _entry(first, -1)


def created_of(meta: Mapping[str, Any]) -> Event | None:
    """The ``run_created`` event a run's META item keeps; None when it is in an ``EVENT#`` item (a run created by an
    earlier version, or whose ``run_created`` did not fit beside the view: META ``run_created`` names that item, or
    is absent)."""
    value = meta.get(CREATED)
    if value is None or "L" not in value:
        return None
    kind, cid, data, at = value["L"]
    run_id = meta["pk"]["S"][len("RUN#") :]
    return CODEC.event((run_id, 1, kind["S"], cid.get("S"), bytes(data["B"]), int(at["N"])))


def read_events(
    table: Any,
    run_id: str,
    *,
    after_slot: int = 0,
    limit: int | None = None,
    sizes: dict[str, int] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> list[Event]:
    """The run's events after ``after_slot`` (at most ``limit``), in slot order, by consistent reads: from slot 1, the
    run's META item (``meta``, when the caller read it; else one ``GetItem``), which keeps ``run_created``
    (:func:`created_of`); the item that holds slot ``after_slot + 1`` when it may begin before it (newest ``EVENT#``
    key at or below it); then the items after it (one ``Query``). ``table``: the World's
    :class:`~celery_workflow._aws.dynamo.Table`. ``sizes``: filled with the sort key and size of every ``EVENT#``
    item read (what a run's end gives its time to live: :mod:`celery_workflow._aws.kept`). RunNotFound when slot 1 is
    asked for and the run does not exist."""
    if limit is not None and limit <= 0:
        return []
    pk = {"S": run_pk(run_id)}
    out: list[Event] = []
    start = after_slot + 1
    if after_slot == 0:
        if meta is None:
            meta = table.get({"pk": run_pk(run_id), "sk": META})
            if meta is None:
                raise RunNotFound(f"run {run_id} does not exist")
        created = created_of(meta)
        if created is not None:  # no EVENT#1 item: the log's items begin at slot 2
            out.append(created)
            start = 2
            if limit is not None and len(out) >= limit:
                return out
            if int(meta.get("event_count", {}).get("N", "0")) <= 1:
                return out  # nothing else was written when META was read
    elif after_slot > 0:  # slot 1 begins the first item (create_run's): from 0, the forward query finds everything
        covering = table.query(
            "Query (events: the item holding a slot)",
            KeyConditionExpression="pk = :pk AND sk BETWEEN :lo AND :hi",
            ExpressionAttributeValues={":pk": pk, ":lo": {"S": "EVENT#"}, ":hi": {"S": event_sk(start)}},
            ScanIndexForward=False,
            Limit=1,
        )
        found = next(covering, None)
        if found is not None and last_slot(found) >= start:
            if sizes is not None:
                sizes[found["sk"]["S"]] = item_size(found)
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
            if sizes is not None:
                sizes[item["sk"]["S"]] = item_size(item)
            out += events_of(item)
            if limit is not None and len(out) >= limit:
                break
    return out if limit is None else out[:limit]


def step_views(events: Iterable[Event]) -> dict[str, StepView]:
    """Every step's view as the log leaves it, by step id in creation order: the transitions of
    :func:`celery_workflow.rules.step_after` replayed without the rules' checks, which the log passed when it was
    written."""
    steps: dict[str, StepView] = {}
    for e in events:
        if e.event_type not in STEP_EVENTS or e.correlation_id is None:
            continue
        before = steps.get(e.correlation_id)
        if before is None and e.event_type is not EventType.STEP_CREATED:
            continue  # pragma: no cover - the rules write no step event before its step_created
        steps[e.correlation_id] = step_after(before, e, e.run_id, e.created_at)
    return steps
