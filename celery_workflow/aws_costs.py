"""What an AWS deployment pays per workflow: DynamoDB units and SQS/Scheduler requests, counted off the boto3 calls.

.. code-block:: python

    from celery_workflow.aws_costs import CostCounter, TableSpec
    from celery_workflow.world_sqs import table_definition

    counter = CostCounter([TableSpec.from_definition(table_definition("workflow"))])
    dynamodb = counter.attach(boto3.client("dynamodb"))   # the same client, now counted
    sqs = counter.attach(boto3.client("sqs"))
    ...                                                   # run workflows on an AWSWorld built on these clients
    usage = counter.usage()
    print(usage.cost(), usage.breakdown()[:10])

Units are **computed** from each call's items by AWS's documented sizing rules (:mod:`celery_workflow._aws.billing`),
not read from ``ReturnConsumedCapacity``: emulators report it wrongly (moto reports nothing for a transaction and one
unit for a 3 KB put), and AWS does not report index writes per call. Updates are billed on the larger of the item's
size before and after, so the counter keeps a shadow of the items it saw written or read and applies update
expressions to it: attach it before the items it should know are written (a fresh table), or an item written
earlier is taken as new the first time it is updated. What it cannot model exactly (an update expression it does not
parse, a ``Query`` whose ``FilterExpression`` dropped items it was billed for) is counted from what it sees and
reported in :attr:`Usage.estimated`.

The counter records, per ``(unit, operation, item kind)``: DynamoDB write units (transactions doubled; a write whose
condition failed on the larger of the item as it is and as it would have been) and index write units, read units, SQS
requests (standard and FIFO, one per started 64 KB), and EventBridge Scheduler invocations (a one-time schedule fires
once, and its SQS send counts as a request). What no client call shows is added with :meth:`CostCounter.record`
(Lambda invocations), :meth:`CostCounter.duration` (Lambda GB-seconds at the function's memory) and
:meth:`CostCounter.storage` (DynamoDB storage and point-in-time recovery per GB-month for the time items are kept).
:data:`PRICES` are us-east-1 on-demand list prices.
"""

from __future__ import annotations

import copy
import math
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_workflow._aws.billing import (
    index_entry,
    index_write_units,
    message_payload,
    query_read_units,
    read_units,
    sqs_requests,
    write_units,
)
from celery_workflow._aws.expressions import ExpressionError, apply_update
from celery_workflow._aws.items import item_size

__all__ = [
    "DURABLE_OPERATION",
    "INDEX_WRITE_UNITS",
    "LAMBDA_GB_SECONDS",
    "LAMBDA_REQUESTS",
    "PITR_GB_MONTHS",
    "PRICES",
    "READ_UNITS",
    "SCHEDULER_INVOCATIONS",
    "SQS_FIFO_REQUESTS",
    "SQS_REQUESTS",
    "STEP_FUNCTIONS_EXPRESS_GB_SECOND",
    "STEP_FUNCTIONS_EXPRESS_REQUEST",
    "STEP_FUNCTIONS_TRANSITION",
    "STORAGE_GB_MONTHS",
    "STORAGE_ITEM_OVERHEAD",
    "WRITE_UNITS",
    "CostCounter",
    "IndexSpec",
    "TableSpec",
    "Usage",
    "item_kind",
    "item_size",
]

WRITE_UNITS = "DynamoDB write units"
INDEX_WRITE_UNITS = "DynamoDB index write units"
READ_UNITS = "DynamoDB read units"
SQS_REQUESTS = "SQS requests"
SQS_FIFO_REQUESTS = "SQS FIFO requests"
SCHEDULER_INVOCATIONS = "Scheduler invocations"
LAMBDA_REQUESTS = "Lambda requests"
LAMBDA_GB_SECONDS = "Lambda GB-seconds"
STORAGE_GB_MONTHS = "DynamoDB storage GB-months"
PITR_GB_MONTHS = "DynamoDB PITR GB-months"
#: DynamoDB bills 100 bytes of storage per item (and per index entry) beyond its size.
STORAGE_ITEM_OVERHEAD = 100

#: Dollars per unit, us-east-1 on-demand list prices (2026-12-01), free tiers left out.
PRICES: Mapping[str, float] = {
    WRITE_UNITS: 0.625e-6,
    INDEX_WRITE_UNITS: 0.625e-6,
    READ_UNITS: 0.125e-6,
    SQS_REQUESTS: 0.40e-6,
    SQS_FIFO_REQUESTS: 0.50e-6,
    SCHEDULER_INVOCATIONS: 1.00e-6,
    LAMBDA_REQUESTS: 0.20e-6,
    LAMBDA_GB_SECONDS: 0.0000166667,  # x86
    STORAGE_GB_MONTHS: 0.25,  # Standard table class
    PITR_GB_MONTHS: 0.20,  # continuous backups, on the table's size
}
#: AWS Step Functions Standard: dollars per state transition.
STEP_FUNCTIONS_TRANSITION = 25e-6
#: AWS Step Functions Express: dollars per request (execution) and per GB-second (first tier: $0.06 per GB-hour),
#: billed per 100 ms at 64 MB steps.
STEP_FUNCTIONS_EXPRESS_REQUEST = 1.00e-6
STEP_FUNCTIONS_EXPRESS_GB_SECOND = 0.06 / 3600
#: AWS Lambda durable functions: dollars per durable operation (a step is at least one), beside Lambda's requests
#: and duration.
DURABLE_OPERATION = 8.00e-6

Item = dict[str, Any]
Key = tuple[str, tuple[tuple[str, str], ...]]


def item_kind(key: Mapping[str, Any]) -> str:
    """The kind of a single-table item, from its key values' prefixes: ``RUN#1/EVENT#2`` → ``RUN/EVENT``."""
    parts = []
    for value in key.values():
        inner = next(iter(value.values())) if isinstance(value, Mapping) and value else value
        parts.append(str(inner).split("#", 1)[0])
    return "/".join(parts) or "?"


@dataclass(frozen=True)
class IndexSpec:
    """A global secondary index: its key attributes and projection (``None``: ``ALL``)."""

    name: str
    keys: tuple[str, ...]
    projection: tuple[str, ...] | None = ()


@dataclass(frozen=True)
class TableSpec:
    """A table's key attributes and global secondary indexes."""

    name: str
    keys: tuple[str, ...]
    indexes: tuple[IndexSpec, ...] = ()

    @classmethod
    def from_definition(cls, definition: Mapping[str, Any]) -> TableSpec:
        """From a ``CreateTable`` request or ``DescribeTable``'s ``Table``."""

        def keys(schema: Sequence[Mapping[str, str]]) -> tuple[str, ...]:
            ordered = sorted(schema, key=lambda k: k["KeyType"] != "HASH")
            return tuple(k["AttributeName"] for k in ordered)

        indexes = []
        for index in definition.get("GlobalSecondaryIndexes", []):
            projection = index.get("Projection", {})
            kind = projection.get("ProjectionType", "ALL")
            included = None if kind == "ALL" else tuple(projection.get("NonKeyAttributes", ()))
            indexes.append(IndexSpec(index["IndexName"], keys(index["KeySchema"]), included))
        return cls(definition["TableName"], keys(definition["KeySchema"]), tuple(indexes))

    @classmethod
    def describe(cls, client: Any, name: str) -> TableSpec:
        """From the table itself (``client``: a boto3 DynamoDB client)."""
        return cls.from_definition(client.describe_table(TableName=name)["Table"])


@dataclass(frozen=True)
class Usage:
    """Counted usage: amounts per ``(unit, operation, item kind or queue)``."""

    counts: Mapping[tuple[str, str, str], float] = field(default_factory=dict)
    #: Calls whose units were estimated (see the module docstring).
    estimated: int = 0

    def total(self, unit: str) -> float:
        return sum(amount for (u, _, _), amount in self.counts.items() if u == unit)

    def totals(self) -> dict[str, float]:
        found: dict[str, float] = {}
        for (unit, _, _), amount in self.counts.items():
            found[unit] = found.get(unit, 0.0) + amount
        return found

    def dollars(self, prices: Mapping[str, float] = PRICES) -> dict[str, float]:
        """Dollars per unit (units without a price cost nothing)."""
        return {unit: amount * prices.get(unit, 0.0) for unit, amount in self.totals().items()}

    def cost(self, prices: Mapping[str, float] = PRICES) -> float:
        return sum(self.dollars(prices).values())

    def breakdown(self, prices: Mapping[str, float] = PRICES) -> list[tuple[str, str, str, float, float]]:
        """``(unit, operation, kind, amount, dollars)``, the most expensive first."""
        rows = [(u, op, kind, amount, amount * prices.get(u, 0.0)) for (u, op, kind), amount in self.counts.items()]
        return sorted(rows, key=lambda row: (-row[4], -row[3], row[:3]))

    def __sub__(self, other: Usage) -> Usage:
        counts = dict(self.counts)
        for key, amount in other.counts.items():
            counts[key] = counts.get(key, 0.0) - amount
        return Usage({k: v for k, v in counts.items() if v}, self.estimated - other.estimated)

    def scaled(self, factor: float) -> Usage:
        """Every amount times ``factor`` (e.g. ``1 / steps`` for the usage per step)."""
        return Usage({k: v * factor for k, v in self.counts.items()}, self.estimated)


class CostCounter:
    """Counts what the boto3 clients it is attached to would be billed (see the module docstring).

    ``tables``: the tables whose indexes and keys it should know (index writes are counted only for these);
    ``kind``: names an item's kind from its key (default :func:`item_kind`). Thread-safe.
    """

    def __init__(
        self, tables: Iterable[TableSpec] = (), *, kind: Callable[[Mapping[str, Any]], str] = item_kind
    ) -> None:
        self.tables = {t.name: t for t in tables}
        self.kind = kind
        self._lock = threading.Lock()
        self._counts: defaultdict[tuple[str, str, str], float] = defaultdict(float)
        self._estimated = 0
        self._items: dict[Key, Item] = {}
        self._key_names: dict[str, tuple[str, ...]] = {t.name: t.keys for t in self.tables.values()}

    # -- wiring ------------------------------------------------------------------------------------------------------

    def attach(self, client: Any) -> Any:
        """Count ``client``'s calls from now on (DynamoDB, SQS and Scheduler clients); returns the client."""
        service = client.meta.service_model.service_id.hyphenize()
        client.meta.events.register(f"provide-client-params.{service}", self._before)
        client.meta.events.register(f"after-call.{service}", self._after)
        return client

    def record(self, unit: str, operation: str, kind: str, amount: float = 1.0) -> None:
        """Add usage no client call shows (e.g. ``record(LAMBDA_REQUESTS, "Invoke", "queue")``)."""
        with self._lock:
            self._counts[(unit, operation, kind)] += amount

    def duration(self, seconds: float, memory_mb: int, *, operation: str = "Invoke", kind: str = "function") -> None:
        """Add a Lambda invocation's duration: GB-seconds at ``memory_mb``, billed per started millisecond."""
        billed = math.ceil(max(seconds, 0.0) * 1000) / 1000
        self.record(LAMBDA_GB_SECONDS, operation, kind, billed * memory_mb / 1024)

    def storage(
        self, items: Iterable[Mapping[str, Any]], months: float, *, pitr: bool = True, kind: str = "items kept"
    ) -> None:
        """Add the storage of ``items`` (typed DynamoDB items) kept ``months`` months, and their point-in-time recovery
        (billed on the table's size) when ``pitr``: each item's size plus DynamoDB's 100 bytes, and the same for
        each index entry it has (the tables' indexes this counter knows)."""
        total = 0
        for item in items:
            total += item_size(item) + STORAGE_ITEM_OVERHEAD
            for spec in self.tables.values():
                for index in spec.indexes:
                    entry = index_entry(item, spec.keys, index.keys, index.projection)
                    if entry is not None:
                        total += item_size(entry) + STORAGE_ITEM_OVERHEAD
        gb_months = total / 1024**3 * months
        self.record(STORAGE_GB_MONTHS, "storage", kind, gb_months)
        if pitr:
            self.record(PITR_GB_MONTHS, "point-in-time recovery", kind, gb_months)

    def usage(self) -> Usage:
        with self._lock:
            return Usage({k: v for k, v in self._counts.items() if v}, self._estimated)

    def reset(self) -> None:
        """Forget the counts (the shadow of the tables' items is kept)."""
        with self._lock:
            self._counts.clear()
            self._estimated = 0

    def forget(self) -> None:
        """Forget the items seen (after the tables were emptied or recreated); the counts are kept."""
        with self._lock:
            self._items.clear()

    def _before(self, params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        context["celery_workflow_costs"] = copy.copy(params)

    def _after(
        self, http_response: Any, parsed: Mapping[str, Any], model: Any, context: Mapping[str, Any], **_: Any
    ) -> None:
        params = context.get("celery_workflow_costs")
        if params is None:
            return
        service = model.service_model.service_id.hyphenize()
        status = getattr(http_response, "status_code", 200)
        error = str((parsed.get("Error") or {}).get("Code", "")) if status >= 300 else ""
        handler = getattr(self, f"_{service.replace('-', '_')}", None)
        if handler is None:
            return
        with self._lock:
            handler(model.name, params, parsed, error)

    # -- DynamoDB ----------------------------------------------------------------------------------------------------

    def _dynamodb(self, op: str, params: Mapping[str, Any], parsed: Mapping[str, Any], error: str) -> None:
        if error and error not in ("ConditionalCheckFailedException", "TransactionCanceledException"):
            return  # throttled or refused: not billed
        if op == "GetItem":
            self._read(op, params["TableName"], params["Key"], parsed.get("Item"), params)
        elif op == "BatchGetItem":
            self._batch_get(op, params, parsed)
        elif op in ("Query", "Scan"):
            self._query(op, params, parsed)
        elif op == "TransactGetItems":
            self._transact_get(op, params, parsed)
        elif op in ("PutItem", "UpdateItem", "DeleteItem"):
            action = {"PutItem": "Put", "UpdateItem": "Update", "DeleteItem": "Delete"}[op]
            self._write(op, action, params, parsed.get("Attributes"), failed=bool(error), transactional=False)
        elif op == "BatchWriteItem":
            self._batch_write(op, params, parsed)
        elif op == "TransactWriteItems":
            for entry in params.get("TransactItems", []):
                (action, body), *_ = entry.items()
                self._write(op, action, body, None, failed=bool(error), transactional=True)

    def _key(self, table: str, item: Mapping[str, Any]) -> Key | None:
        names = self._key_names.get(table)
        if names is None or any(n not in item for n in names):
            return None
        return table, tuple((n, repr(item[n])) for n in names)

    def _kind_of(self, table: str, item: Mapping[str, Any]) -> str:
        """The kind of an item, from its key attributes (all of ``item`` when the table's keys are not known)."""
        key = {n: item[n] for n in self._key_names.get(table, ()) if n in item}
        return self.kind(key or item)

    def _learn_keys(self, table: str, key: Mapping[str, Any]) -> None:
        if table not in self._key_names:
            spec = self.tables.get(table)
            self._key_names[table] = spec.keys if spec else tuple(sorted(key))

    def _remember(self, table: str, item: Mapping[str, Any] | None, params: Mapping[str, Any]) -> None:
        if item is None or params.get("ProjectionExpression") or params.get("IndexName"):
            return
        key = self._key(table, item)
        if key is not None:
            self._items[key] = copy.deepcopy(dict(item))

    def _read(self, op: str, table: str, key: Mapping[str, Any], item: Any, params: Mapping[str, Any]) -> None:
        self._learn_keys(table, key)
        size = self._size_of(table, key, item, params)
        units = read_units(size, consistent=bool(params.get("ConsistentRead")))
        self._counts[(READ_UNITS, op, self.kind(key))] += units
        self._remember(table, item, params)

    def _size_of(self, table: str, key: Mapping[str, Any], item: Any, params: Mapping[str, Any]) -> int:
        """A read item's billed size: the whole item, also when a projection returned part of it."""
        if item is None:
            return 0
        if params.get("ProjectionExpression"):
            ref = self._key(table, key)
            known = self._items.get(ref) if ref is not None else None
            if known is not None:
                return item_size(known)
            self._estimated += 1
        return item_size(item)

    def _batch_get(self, op: str, params: Mapping[str, Any], parsed: Mapping[str, Any]) -> None:
        for table, request in params.get("RequestItems", {}).items():
            keys = request.get("Keys", [])
            if keys:
                self._learn_keys(table, keys[0])
            found = {self._key(table, item): item for item in parsed.get("Responses", {}).get(table, [])}
            unprocessed = {
                self._key(table, k) for k in parsed.get("UnprocessedKeys", {}).get(table, {}).get("Keys", [])
            }
            for key in keys:
                ref = self._key(table, key)
                if ref in unprocessed:
                    continue
                self._read(op, table, key, found.get(ref), request)

    def _query(self, op: str, params: Mapping[str, Any], parsed: Mapping[str, Any]) -> None:
        table = params["TableName"]
        items = parsed.get("Items", [])
        index = params.get("IndexName")
        sizes = [item_size(item) for item in items]
        if params.get("FilterExpression") and parsed.get("ScannedCount", len(items)) > len(items):
            self._estimated += 1
        consistent = bool(params.get("ConsistentRead")) and not index
        kind = f"{index} index" if index else (self._kind_of(table, items[0]) if items else "?")
        self._counts[(READ_UNITS, op, kind)] += query_read_units(sizes, consistent=consistent)
        for item in items:
            self._remember(table, item, params)

    def _transact_get(self, op: str, params: Mapping[str, Any], parsed: Mapping[str, Any]) -> None:
        answers = parsed.get("Responses", [])
        for i, entry in enumerate(params.get("TransactItems", [])):
            get = entry["Get"]
            self._learn_keys(get["TableName"], get["Key"])
            item = answers[i].get("Item") if i < len(answers) else None
            size = self._size_of(get["TableName"], get["Key"], item, get)
            self._counts[(READ_UNITS, op, self.kind(get["Key"]))] += read_units(
                size, consistent=True, transactional=True
            )
            self._remember(get["TableName"], item, get)

    def _batch_write(self, op: str, params: Mapping[str, Any], parsed: Mapping[str, Any]) -> None:
        unprocessed = parsed.get("UnprocessedItems", {})
        for table, requests in params.get("RequestItems", {}).items():
            left = unprocessed.get(table, [])
            for request in requests:
                if request in left:
                    continue
                action, inner = (
                    ("Put", request["PutRequest"]) if "PutRequest" in request else ("Delete", request["DeleteRequest"])
                )
                self._write(op, action, {"TableName": table, **inner}, None, failed=False, transactional=False)

    def _write(
        self, op: str, action: str, body: Mapping[str, Any], returned: Any, *, failed: bool, transactional: bool
    ) -> None:
        table = body["TableName"]
        key_values = body["Key"] if "Key" in body else body.get("Item", {})
        if "Key" in body:
            self._learn_keys(table, body["Key"])
        ref = self._key(table, key_values)
        before = self._items.get(ref) if ref is not None else None
        kind = self._kind_of(table, key_values)
        after: Item | None
        if action == "Put":
            after = dict(body["Item"])
        elif action == "Update":
            after = self._updated(before, body, returned)
        elif action == "Delete":
            after = None
        else:  # a ConditionCheck
            after = before
        before_size = item_size(before) if before is not None else 0
        if action == "ConditionCheck":
            self._counts[(WRITE_UNITS, op, kind)] += write_units(before_size, transactional=transactional)
            return
        after_size = item_size(after) if after is not None else 0
        if failed:  # billed on the larger of the item as it is and as the write would have left it
            self._counts[(WRITE_UNITS, op, kind)] += write_units(before_size, after_size, transactional=transactional)
            return
        self._counts[(WRITE_UNITS, op, kind)] += write_units(before_size, after_size, transactional=transactional)
        spec = self.tables.get(table)
        if spec is not None:
            for index in spec.indexes:
                old = index_entry(before, spec.keys, index.keys, index.projection)
                new = index_entry(after, spec.keys, index.keys, index.projection)
                units = index_write_units(old, new, index.keys)
                if units:
                    self._counts[(INDEX_WRITE_UNITS, op, f"{index.name} index {kind}")] += units
        if ref is not None:
            if after is None:
                self._items.pop(ref, None)
            else:
                self._items[ref] = after

    def _updated(self, before: Item | None, body: Mapping[str, Any], returned: Any) -> Item:
        if isinstance(returned, Mapping) and body.get("ReturnValues") == "ALL_NEW":
            return copy.deepcopy(dict(returned))
        start = dict(before or body["Key"])
        try:
            return apply_update(
                start,
                body.get("UpdateExpression", ""),
                body.get("ExpressionAttributeNames"),
                body.get("ExpressionAttributeValues"),
            )
        except ExpressionError:
            self._estimated += 1
            guess = dict(start)
            for name, value in (body.get("ExpressionAttributeValues") or {}).items():
                guess[f"?{name}"] = value
            return guess

    # -- SQS and the Scheduler ---------------------------------------------------------------------------------------

    def _sqs(self, op: str, params: Mapping[str, Any], parsed: Mapping[str, Any], error: str) -> None:
        if error:
            return
        url = str(params.get("QueueUrl", ""))
        queue = url.rsplit("/", 1)[-1] or str(params.get("QueueName", "?"))
        unit = SQS_FIFO_REQUESTS if queue.endswith(".fifo") else SQS_REQUESTS
        if op == "SendMessage":
            payload = message_payload(params.get("MessageBody", ""), params.get("MessageAttributes"))
        elif op == "SendMessageBatch":
            payload = sum(
                message_payload(e.get("MessageBody", ""), e.get("MessageAttributes")) for e in params.get("Entries", [])
            )
        elif op == "ReceiveMessage":
            payload = sum(
                message_payload(m.get("Body", ""), m.get("MessageAttributes")) for m in parsed.get("Messages", [])
            )
            if not parsed.get("Messages"):
                op = "ReceiveMessage (empty)"
        else:
            payload = 0
        self._counts[(unit, op, queue)] += sqs_requests(payload)

    def _scheduler(self, op: str, params: Mapping[str, Any], parsed: Mapping[str, Any], error: str) -> None:
        if error or op != "CreateSchedule":
            return  # the Scheduler's API calls are free; a schedule is billed when it fires
        self._counts[(SCHEDULER_INVOCATIONS, op, str(params.get("GroupName", "default")))] += 1
        target = params.get("Target", {})
        arn = str(target.get("Arn", ""))
        if ":sqs:" in arn:
            queue = arn.rsplit(":", 1)[-1]
            unit = SQS_FIFO_REQUESTS if queue.endswith(".fifo") else SQS_REQUESTS
            self._counts[(unit, "SendMessage (by a schedule)", queue)] += sqs_requests(
                message_payload(str(target.get("Input", "")))
            )
