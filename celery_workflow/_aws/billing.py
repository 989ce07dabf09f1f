"""AWS's billing rules for DynamoDB on-demand and SQS, as pure functions of item and message sizes (not public API).

DynamoDB (Developer Guide, "Read/write capacity mode" and "Managing capacity for transactions"):

* a **write** costs 1 write unit per started KB of the item, taking the larger of its size before and after (a put
  that replaces an item, an update); a delete costs the size of the deleted item; every write costs at least 1 unit,
  and a write whose condition fails still costs the size of the item as it is (at least 1);
* a **transactional** write or condition check costs twice that;
* a **read** costs 1 read unit per started 4 KB when strongly consistent, half as much when eventually consistent,
  twice as much in a transaction; a ``GetItem`` of no item still costs the minimum; ``BatchGetItem`` rounds each item
  up on its own; ``Query`` and ``Scan`` add up the sizes of the items a page read, then round up once;
* a **global secondary index** is written (1 unit per started KB of the index entry, never doubled) when a write
  adds an entry, removes one, or changes its projected attributes; a write that changes the index key removes the
  old entry and adds the new one (two writes). An index entry holds the table's keys, the index's keys and the
  projected attributes.

SQS: every API call is a request; each started 64 KB of a call's payload (message bodies and attributes, the
messages sent or received) counts as one more request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from celery_workflow._aws.items import item_size

__all__ = [
    "index_entry",
    "index_write_units",
    "message_payload",
    "query_read_units",
    "read_units",
    "sqs_requests",
    "write_units",
]

KB = 1024
READ_BLOCK = 4 * KB
SQS_CHUNK = 64 * KB


def write_units(*sizes: int, transactional: bool = False) -> float:
    """The write units of writing an item whose size before/after are ``sizes`` (bytes): the larger one, per started
    KB, at least 1; doubled in a transaction."""
    units = max(1, math.ceil(max(sizes, default=0) / KB))
    return float(units * (2 if transactional else 1))


def read_units(size: int, *, consistent: bool, transactional: bool = False) -> float:
    """The read units of reading one item of ``size`` bytes (0: no item), per started 4 KB, at least one block."""
    blocks = max(1, math.ceil(size / READ_BLOCK))
    if transactional:
        return 2.0 * blocks
    return float(blocks) if consistent else blocks / 2


def query_read_units(sizes: Iterable[int], *, consistent: bool) -> float:
    """The read units of one ``Query``/``Scan`` page that read items of ``sizes``: their sum, rounded up once."""
    return read_units(sum(sizes), consistent=consistent)


def index_entry(
    item: Mapping[str, Any] | None,
    table_keys: Sequence[str],
    index_keys: Sequence[str],
    projection: Sequence[str] | None,
) -> dict[str, Any] | None:
    """The entry ``item`` has in an index keyed on ``index_keys`` (None: the item is not in the index).
    ``projection``: the projected non-key attributes, or None for ``ALL``."""
    if item is None or any(key not in item for key in index_keys):
        return None
    if projection is None:
        return dict(item)
    wanted = {*table_keys, *index_keys, *projection}
    return {name: value for name, value in item.items() if name in wanted}


def index_write_units(
    before: Mapping[str, Any] | None, after: Mapping[str, Any] | None, index_keys: Sequence[str]
) -> float:
    """The index write units of an entry going from ``before`` to ``after`` (:func:`index_entry`'s answers)."""
    if before is None and after is None:
        return 0.0
    if before is None or after is None:
        return write_units(item_size(before or after or {}))
    if any(before.get(key) != after.get(key) for key in index_keys):
        return write_units(item_size(before)) + write_units(item_size(after))
    if before == after:
        return 0.0
    return write_units(item_size(before), item_size(after))


def message_payload(body: str | bytes, attributes: Mapping[str, Any] | None = None) -> int:
    """The billed payload of one SQS message: its body plus its message attributes' names, types and values."""
    size = len(body.encode() if isinstance(body, str) else body)
    for name, value in (attributes or {}).items():
        size += len(name.encode()) + len(str(value.get("DataType", "")).encode())
        for field in ("StringValue", "BinaryValue"):
            if field in value:
                inner = value[field]
                size += len(inner.encode() if isinstance(inner, str) else inner)
    return size


def sqs_requests(payload: int) -> int:
    """How many requests one SQS call is billed as: one per started 64 KB of payload, at least one."""
    return max(1, math.ceil(payload / SQS_CHUNK))
