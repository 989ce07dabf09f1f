"""The AWS World's table: one DynamoDB table with string keys ``pk``/``sk`` and two global secondary indexes.

=================================  =======================  ====================================================
item                               ``pk``                   ``sk``
=================================  =======================  ====================================================
run view and event count           ``RUN#<runId>``          ``META``
events of one append               ``RUN#<runId>``          ``EVENT#<slot of its first event, 26 digits>``
wait view                          ``RUN#<runId>``          ``WAIT#<waitId>``
stream state                       ``RUN#<runId>``          ``STREAM#<base64url(name)>``
stream chunk                       ``RUN#<runId>``          ``CHUNK#<base64url(name)>#<index, 10 digits>``
hook (live)                        ``HOOK#<runId>#<hookId>``  ``META``
token owner                        ``TOKEN#<token>``        ``META``
queue record                       ``QUEUE#<deliveryId>``   ``META``
workflow schedule                  ``SCHEDULES``            ``SCHEDULE#<scheduleId>``
=================================  =======================  ====================================================

A run's ``run_created`` (slot 1) is kept in its META item (:data:`CREATED`; its own ``EVENT#1`` item in runs of
earlier versions, or when too large). The events of one append are one item (:mod:`celery_workflow._aws.log`: several at consecutive first slots when they
exceed an item; items of earlier versions, one event each, read as packs of one), so an event is found by the newest
``EVENT#`` key at or below its slot. Steps have no items: their views are folded from the log (``STEP#<stepId>``
items that earlier versions wrote are not read, and are deleted with their run's partition).

Hook ids are per run here (``hook:1``, ``hook:2`` … in every run), so the hook item's key carries the run id: the
seed's ``HOOK#<hookId>`` would make two runs' first hooks one item. Indexes: ``list`` (``list_pk`` = ``RUNS`` or
``HOOKS``, projecting the keys and ``status``) and ``list_group`` (``list_group_pk`` = ``RUNS#<workflow>`` or
``HOOKS#<runId>``, projecting the keys only: a run's status changes then write nothing to it; its readers take the
status from META), sorted by ``<createdAt, 16 digits of µs>#<id>``. Index membership is eventually consistent; every
other read is a consistent read of the base table. A table of an earlier version (``list_group`` projecting
``status``) works as it is; :func:`rebuild_indexes` (``celery-workflow create-table NAME --rebuild-indexes``, or
``terraform apply`` of the module) rebuilds the index with this projection.

Time to live: the table's TTL attribute is :data:`TTL_ATTRIBUTE` (``expires_at``, epoch seconds). The append that
ends a run of a workflow with a retention writes it on every item it writes (the run's view, its last events and
views), and on the run's items written before when it knows them all (:mod:`celery_workflow._aws.append`; META
:data:`CREATED` and :data:`STREAMS` say whether it can), so DynamoDB deletes them for free once the retention is
over; readers treat an item past it as gone (DynamoDB deletes expired items within days, not at once). A stream
first written after its run's end takes the run's. :func:`create_table` enables it.

Limits (DynamoDB's): 400 KB per item, 100 actions per transaction; a stream write holds at most 99 chunks (with the
stream's state, 100 actions).
"""

from __future__ import annotations

import base64
import logging
import time
from typing import Any

from celery_workflow import ids
from celery_workflow.errors import WorldError

log = logging.getLogger("celery_workflow.aws")

__all__ = [
    "CREATED",
    "MAX_ACTIONS",
    "MAX_CHUNKS_PER_WRITE",
    "MAX_ITEM_BYTES",
    "STREAMS",
    "TTL_ATTRIBUTE",
    "chunk_sk",
    "create_table",
    "enable_ttl",
    "event_sk",
    "expired",
    "hook_pk",
    "list_sk",
    "outdated_indexes",
    "queue_pk",
    "rebuild_indexes",
    "run_pk",
    "stream_sk",
    "table_definition",
    "token_pk",
]

#: The table's time-to-live attribute: epoch seconds after which DynamoDB deletes the item, and readers ignore it.
TTL_ATTRIBUTE = "expires_at"
#: A run's META attribute holding its ``run_created`` event (slot 1: :mod:`celery_workflow._aws.log`), or, for one too
#: large to sit beside the view, the sort key of its ``EVENT#1`` item. Versions before it (issue #31, item 3) did not
#: write it (their runs have ``EVENT#1``, and may have ``STEP#`` items: what a run's end gives its time to live is
#: known only for runs that have it).
CREATED = "run_created"
#: A run's META attribute: the names of its streams (a string set, added by a stream's first write or close), so a
#: run's end knows its partition holds ``STREAM#`` and ``CHUNK#`` items.
STREAMS = "streams"

MAX_ITEM_BYTES = 400 * 1024
MAX_ACTIONS = 100
MAX_CHUNKS_PER_WRITE = 99
META = "META"


def run_pk(run_id: str) -> str:
    return f"RUN#{run_id}"


def event_sk(slot: int) -> str:
    return f"EVENT#{slot:026d}"


def step_sk(step_id: str) -> str:
    return f"STEP#{step_id}"


def wait_sk(wait_id: str) -> str:
    return f"WAIT#{wait_id}"


def _b64(name: str) -> str:
    return base64.urlsafe_b64encode(name.encode()).decode().rstrip("=")


def stream_sk(name: str) -> str:
    return f"STREAM#{_b64(name)}"


def chunk_prefix(name: str) -> str:
    return f"CHUNK#{_b64(name)}#"


def chunk_sk(name: str, index: int) -> str:
    return f"{chunk_prefix(name)}{index:010d}"


def hook_pk(run_id: str, hook_id: str) -> str:
    return f"HOOK#{run_id}#{hook_id}"


def token_pk(token: str) -> str:
    return f"TOKEN#{token}"


def queue_pk(delivery_id: str) -> str:
    return f"QUEUE#{delivery_id}"


def list_sk(created_micros: int, *ids: str) -> str:
    """The sort key of both indexes: creation time (µs, zero-padded so text order is time order), then the ids."""
    return "#".join((f"{created_micros:016d}", *ids))


def table_definition(name: str) -> dict[str, Any]:
    """The ``CreateTable`` request of the World's table: on-demand, with the ``list`` and ``list_group`` indexes."""
    keys = ("pk", "sk", "list_pk", "list_sk", "list_group_pk", "list_group_sk")

    def index(index_name: str, hash_key: str, range_key: str, projection: dict[str, Any]) -> dict[str, Any]:
        return {
            "IndexName": index_name,
            "KeySchema": [
                {"AttributeName": hash_key, "KeyType": "HASH"},
                {"AttributeName": range_key, "KeyType": "RANGE"},
            ],
            "Projection": projection,
        }

    return {
        "TableName": name,
        "KeySchema": [{"AttributeName": "pk", "KeyType": "HASH"}, {"AttributeName": "sk", "KeyType": "RANGE"}],
        "AttributeDefinitions": [{"AttributeName": key, "AttributeType": "S"} for key in keys],
        "GlobalSecondaryIndexes": [
            index("list", "list_pk", "list_sk", {"ProjectionType": "INCLUDE", "NonKeyAttributes": ["status"]}),
            index("list_group", "list_group_pk", "list_group_sk", {"ProjectionType": "KEYS_ONLY"}),
        ],
        "BillingMode": "PAY_PER_REQUEST",
        "SSESpecification": {"Enabled": True},
    }


def create_table(client: Any, name: str, *, timeout: float = 300.0, poll: float = 1.0, rebuild: bool = False) -> None:
    """Create the World's table (``client``: a boto3 DynamoDB client), wait until it is active, and enable its time to
    live on :data:`TTL_ATTRIBUTE` (an enabled one is left as it is).

    An existing table is left as it is and waited for; an index of it whose projection is an earlier version's
    (:func:`outdated_indexes`) is logged, or rebuilt with ``rebuild`` (:func:`rebuild_indexes`). WorldError when it
    is not active within ``timeout`` seconds.
    """
    try:
        client.create_table(**table_definition(name))
    except client.exceptions.ResourceInUseException:
        pass  # it exists (or is being created): wait for it like for a new one
    table = _wait_active(client, name, timeout, poll)
    outdated = outdated_indexes(table)
    if outdated and rebuild:
        rebuild_indexes(client, name, timeout=timeout, poll=poll)
    elif outdated:
        log.warning(
            "DynamoDB table %s: index(es) %s project what an earlier version did (the World works with them; the"
            " writes a keys-only list_group saves are paid): rebuild them with `celery-workflow create-table %s"
            " --rebuild-indexes` or `terraform apply` of the module",
            name, ", ".join(outdated), name,
        )  # fmt: skip
    enable_ttl(client, name)


def _wait_active(client: Any, name: str, timeout: float, poll: float) -> dict[str, Any]:
    """The table's description once it and its indexes are active; WorldError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        table: dict[str, Any] = client.describe_table(TableName=name)["Table"]
        indexes = table.get("GlobalSecondaryIndexes", [])
        if table.get("TableStatus") == "ACTIVE" and all(i.get("IndexStatus", "ACTIVE") == "ACTIVE" for i in indexes):
            return table
        if time.monotonic() > deadline:
            raise WorldError(f"DynamoDB table {name} is not active after {timeout:.0f} s ({table.get('TableStatus')})")
        time.sleep(poll)


def _projection(index: dict[str, Any]) -> tuple[str, frozenset[str]]:
    found = index.get("Projection", {})
    return str(found.get("ProjectionType", "ALL")), frozenset(found.get("NonKeyAttributes", ()))


def outdated_indexes(table: dict[str, Any]) -> list[str]:
    """The indexes of a table's description (``DescribeTable``'s ``Table``) whose projection or keys are not
    :func:`table_definition`'s (an earlier version's ``list_group`` projected ``status``), or that it lacks."""
    wanted = {i["IndexName"]: i for i in table_definition(str(table.get("TableName", "")))["GlobalSecondaryIndexes"]}
    found = {i["IndexName"]: i for i in table.get("GlobalSecondaryIndexes", [])}
    return sorted(
        name
        for name, index in wanted.items()
        if name not in found
        or _projection(found[name]) != _projection(index)
        or found[name].get("KeySchema") != index["KeySchema"]
    )


def rebuild_indexes(client: Any, name: str, *, timeout: float = 3600.0, poll: float = 5.0) -> list[str]:
    """Rebuild the table's :func:`outdated_indexes` as :func:`table_definition` has them (a global secondary index's
    projection cannot change in place): each is deleted, then created again, and waited for while DynamoDB backfills
    it; the names rebuilt. While one is rebuilt, listings that read it fail (``list_runs(workflow=…)`` for
    ``list_group``); nothing else reads the indexes, and the table's items are untouched."""
    table = _wait_active(client, name, timeout, poll)
    outdated = outdated_indexes(table)
    definition = table_definition(name)
    wanted = {i["IndexName"]: i for i in definition["GlobalSecondaryIndexes"]}
    present = {i["IndexName"] for i in table.get("GlobalSecondaryIndexes", [])}
    for index_name in outdated:
        if index_name in present:
            log.warning("DynamoDB table %s: deleting index %s to build it again", name, index_name)
            client.update_table(TableName=name, GlobalSecondaryIndexUpdates=[{"Delete": {"IndexName": index_name}}])
            deadline = time.monotonic() + timeout
            while any(i["IndexName"] == index_name for i in _indexes(client, name)):
                if time.monotonic() > deadline:
                    raise WorldError(f"DynamoDB table {name}: index {index_name} is not deleted after {timeout:.0f} s")
                time.sleep(poll)
        client.update_table(
            TableName=name,
            AttributeDefinitions=definition["AttributeDefinitions"],
            GlobalSecondaryIndexUpdates=[{"Create": wanted[index_name]}],
        )
        _wait_active(client, name, timeout, poll)
        log.warning("DynamoDB table %s: index %s built again", name, index_name)
    return outdated


def _indexes(client: Any, name: str) -> list[dict[str, Any]]:
    return list(client.describe_table(TableName=name)["Table"].get("GlobalSecondaryIndexes", []))


def enable_ttl(client: Any, name: str) -> None:
    """Turn on the table's time to live on :data:`TTL_ATTRIBUTE` (nothing when it is on already)."""
    found = client.describe_time_to_live(TableName=name).get("TimeToLiveDescription", {})
    if found.get("TimeToLiveStatus") in ("ENABLED", "ENABLING") and found.get("AttributeName") == TTL_ATTRIBUTE:
        return
    client.update_time_to_live(
        TableName=name, TimeToLiveSpecification={"Enabled": True, "AttributeName": TTL_ATTRIBUTE}
    )


def expired(item: Any, now: float | None = None) -> bool:
    """Whether an item is past its time to live (``now``: epoch seconds, default :func:`celery_workflow.ids.utcnow`):
    gone for readers."""
    value = item.get(TTL_ATTRIBUTE) if isinstance(item, dict) else None
    if not value or "N" not in value:
        return False
    return int(value["N"]) <= (ids.utcnow().timestamp() if now is None else now)
