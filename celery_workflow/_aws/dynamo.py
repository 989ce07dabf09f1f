"""DynamoDB calls with the AWS World's error mapping (not part of the public API).

* A transaction (``TransactWriteItems``, ``TransactGetItems``) cancelled for contention (``TransactionConflict``:
  another writer on one of its items) or throttling, and a single-item request refused because a transaction holds
  its item (``TransactionConflictException``, ``ReplicatedWriteConflictException``), wrote nothing and is sent again
  after a jittered pause, a few times (:data:`CONTENTION_TRIES`).
* Throttling (``ThrottlingException``, ``ProvisionedThroughputExceededException``, and the cancellation reasons'
  spellings ``ThrottlingError`` and ``ProvisionedThroughputExceeded`` wherever they appear), contention that outlasted
  those tries, service errors and unreachable endpoints (after botocore's own retries) are
  :class:`~celery_workflow.errors.WorldUnavailable`: nothing was written that the caller does not know about, and the
  HTTP edge answers 503.
* An item over DynamoDB's size limit is :class:`~celery_workflow.errors.EventTooLarge` (an ``EventInvalid``: the
  HTTP edge answers 413).
* A request refused as malformed (``ValidationException``) is :class:`~celery_workflow.errors.EventInvalid`: bad
  data is refused again if retried.
* A missing table says how to create it; any other client error is a :class:`~celery_workflow.errors.WorldError`.
* A transaction cancelled by a failed condition is :class:`Cancelled`, with the reason of each action, for the caller
  to decide (a stale snapshot, a token someone else owns); a single write whose condition failed is
  :class:`ConditionFailed`.

Reads are consistent; ``BatchGetItem`` and ``Query`` are followed through their unprocessed keys and pages. An item
past its time to live (:data:`~celery_workflow._aws.table.TTL_ATTRIBUTE`) is gone for readers: DynamoDB deletes
expired items within days, and may serve them meanwhile (``raw=True`` reads them anyway: the run's expiry).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from botocore.exceptions import BotoCoreError, ClientError, ConnectionError, HTTPClientError

from celery_workflow._aws.table import expired
from celery_workflow.errors import EventInvalid, EventTooLarge, WorldError, WorldUnavailable

__all__ = ["Cancelled", "ConditionFailed", "Table"]

T = TypeVar("T")
Item = dict[str, Any]

#: Error codes that mean "try again later" (throttling, capacity, the service itself).
UNAVAILABLE = frozenset(
    {
        "ProvisionedThroughputExceededException",
        "ThrottlingException",
        "RequestLimitExceeded",
        "InternalServerError",
        "ServiceUnavailable",
        "LimitExceededException",
        "TransactionInProgressException",
    }
)
#: Cancellation reasons of a transaction that mean the same (DynamoDB names them without "Exception"), and
#: ``TransactionConflict``: another transaction touched one of its items at the same time.
UNAVAILABLE_REASONS = frozenset({"ThrottlingError", "ProvisionedThroughputExceeded", "TransactionConflict"})
#: Error codes of a single-item request refused for contention: a transaction holds the item (or a replica's write
#: conflicts with it). Nothing was written: retried like a cancelled transaction.
CONTENDED = frozenset({"TransactionConflictException", "ReplicatedWriteConflictException"})


#: How often a transaction cancelled for contention is sent in all, and the first pause's upper bound (seconds).
CONTENTION_TRIES = 5
CONTENTION_PAUSE = 0.01


def _contended(exc: ClientError) -> bool:
    """Whether DynamoDB refused a request for contention or cancelled a transaction for contention or throttling
    (nothing written; worth a retry)."""
    code = exc.response.get("Error", {}).get("Code")
    if code in CONTENDED:
        return True
    if code != "TransactionCanceledException":
        return False
    reasons = [r.get("Code") or "None" for r in exc.response.get("CancellationReasons", [])]
    return any(r in UNAVAILABLE_REASONS for r in reasons)


class Cancelled(Exception):
    """A transaction was cancelled; ``reasons`` has one code per action (``"None"`` for the ones that were fine);
    ``items``: per action, the item as it was when its condition failed, for actions sent with
    ``ReturnValuesOnConditionCheckFailure=ALL_OLD`` (None otherwise, or when there was no item)."""

    def __init__(self, reasons: Sequence[str], items: Sequence[Item | None] = ()) -> None:
        super().__init__(", ".join(reasons))
        self.reasons = list(reasons)
        self.items: list[Item | None] = [*items, *[None] * (len(self.reasons) - len(items))]

    @property
    def conditions_failed(self) -> list[int]:
        """The indexes of the actions whose condition failed."""
        return [i for i, code in enumerate(self.reasons) if code == "ConditionalCheckFailed"]

    @property
    def only_conditions(self) -> bool:
        return all(code in ("None", "ConditionalCheckFailed", "") for code in self.reasons)


class ConditionFailed(Exception):
    """A single-item write whose condition did not hold (nothing was written)."""


class Table:
    """One DynamoDB table through a boto3 client, with the World's error mapping."""

    def __init__(self, client: Any, name: str) -> None:
        self.client = client
        self.name = name

    def call(self, what: str, fn: Callable[..., T], **kwargs: Any) -> T:
        """``fn(**kwargs)`` with the World's error mapping. A transaction cancelled for contention (another writer on
        one of its items, throttling: it wrote nothing), or a single-item request refused for contention, is tried again after a jittered, doubling pause, up to
        :data:`CONTENTION_TRIES` times, before it is WorldUnavailable."""
        pause = CONTENTION_PAUSE
        for attempt in range(1, CONTENTION_TRIES + 1):
            try:
                return fn(**kwargs)
            except ClientError as exc:
                if attempt < CONTENTION_TRIES and _contended(exc):
                    time.sleep(random.uniform(0.0, pause))
                    pause *= 2
                    continue
                raise self.error(what, exc) from exc
            except (ConnectionError, HTTPClientError) as exc:
                raise WorldUnavailable(f"DynamoDB {what}: {exc}") from exc
            except BotoCoreError as exc:
                raise WorldError(f"DynamoDB {what}: {exc}") from exc
        raise AssertionError("unreachable")  # pragma: no cover - the last attempt returns or raises

    def error(self, what: str, exc: ClientError) -> Exception:
        code = exc.response.get("Error", {}).get("Code", "")
        message = exc.response.get("Error", {}).get("Message", str(exc))
        if code == "TransactionCanceledException":
            found = exc.response.get("CancellationReasons", [])
            reasons = [r.get("Code", "None") or "None" for r in found]
            cancelled = Cancelled(reasons, [r.get("Item") or None for r in found])
            if cancelled.only_conditions and cancelled.conditions_failed:
                return cancelled
            if any(r in UNAVAILABLE or r in UNAVAILABLE_REASONS for r in reasons):
                return WorldUnavailable(f"DynamoDB {what}: transaction cancelled ({', '.join(reasons)})")
            if any(r == "ValidationError" for r in reasons):
                if "size" in message.lower():
                    return EventTooLarge(f"DynamoDB {what}: an item exceeds 400 KB ({message})")
                return EventInvalid(f"DynamoDB {what}: refused as malformed ({message})")
            return WorldError(f"DynamoDB {what}: transaction cancelled ({', '.join(reasons)}): {message}")
        if code == "ConditionalCheckFailedException":
            return ConditionFailed(f"DynamoDB {what}: the condition did not hold")
        if code in UNAVAILABLE or code in UNAVAILABLE_REASONS or code in CONTENDED:
            return WorldUnavailable(f"DynamoDB {what}: {code}: {message}")
        if code == "ValidationException":
            # a request DynamoDB refuses as malformed is refused again if retried: bad data, not an outage
            if "size" in message.lower():
                return EventTooLarge(f"DynamoDB {what}: an item exceeds 400 KB ({message})")
            return EventInvalid(f"DynamoDB {what}: refused as malformed ({message})")
        if code == "ResourceNotFoundException":
            return WorldError(
                f"DynamoDB {what}: table {self.name} not found ({message}); create it with"
                f" `celery-workflow create-table {self.name}` or the Terraform module"
            )
        return WorldError(f"DynamoDB {what}: {code}: {message}")

    # -- reads -------------------------------------------------------------------------------------------------------

    def get(self, key: Mapping[str, str], *, raw: bool = False) -> Item | None:
        answer = self.call(
            "GetItem",
            self.client.get_item,
            TableName=self.name,
            Key={k: {"S": v} for k, v in key.items()},
            ConsistentRead=True,
        )
        found: Item | None = answer.get("Item")
        return None if found is not None and not raw and expired(found) else found

    def get_snapshot(self, first: Mapping[str, str], others: Sequence[Mapping[str, str]]) -> list[Item]:
        """``first`` (a run's ``META``) and ``others``, read so that ``others`` are no older than ``first``.

        An append plans on what this returns and commits only if ``first``'s event count is still the same, and every
        change of the run moves that count; so ``first`` must not be read after the others (a change in between would
        then go unnoticed). Up to 25 items are read together with ``TransactGetItems`` (one point in time; 25 is the
        limit DynamoDB Local and moto keep); more are read as ``first``, then a ``BatchGetItem`` of the others.
        """
        keys = list({tuple(sorted(k.items())): k for k in [first, *others]}.values())
        if len(keys) <= 25:
            answer = self.call(
                "TransactGetItems",
                self.client.transact_get_items,
                TransactItems=[
                    {"Get": {"TableName": self.name, "Key": {k: {"S": v} for k, v in key.items()}}} for key in keys
                ],
            )
            return [r["Item"] for r in answer.get("Responses", []) if r.get("Item") and not expired(r["Item"])]
        head = self.get(first)
        return ([head] if head is not None else []) + self.get_many(keys[1:])

    def get_many(self, keys: Sequence[Mapping[str, str]], *, raw: bool = False) -> list[Item]:
        """Consistent ``BatchGetItem`` of any number of keys (100 at a time, unprocessed keys retried)."""
        wanted = [{k: {"S": v} for k, v in key.items()} for key in {tuple(sorted(k.items())): k for k in keys}.values()]
        found: list[Item] = []
        delay = 0.05
        while wanted:
            batch, wanted = wanted[:100], wanted[100:]
            request: dict[str, Any] = {self.name: {"Keys": batch, "ConsistentRead": True}}
            while request:
                answer = self.call("BatchGetItem", self.client.batch_get_item, RequestItems=request)
                found.extend(i for i in answer.get("Responses", {}).get(self.name, []) if raw or not expired(i))
                request = answer.get("UnprocessedKeys") or {}
                if request:
                    time.sleep(delay * (0.5 + random.random()))
                    delay = min(delay * 2, 1.0)
        return found

    def query(self, what: str, *, raw: bool = False, **kwargs: Any) -> Iterator[Item]:
        """Every item of a ``Query``, page after page (consistent unless an index is named; items past their time to
        live left out unless ``raw``)."""
        request = {"TableName": self.name, **kwargs}
        if "IndexName" not in request:
            request.setdefault("ConsistentRead", True)
        while True:
            answer = self.call(what, self.client.query, **request)
            yield from (i for i in answer.get("Items", []) if raw or not expired(i))
            last = answer.get("LastEvaluatedKey")
            if not last:
                return
            request["ExclusiveStartKey"] = last

    def partition(
        self, pk: str, prefix: str | None = None, *, what: str = "Query", raw: bool = False
    ) -> Iterator[Item]:
        """The items of partition ``pk`` (whose sort key starts with ``prefix``), in sort-key order."""
        if prefix is None:
            return self.query(
                what, raw=raw, KeyConditionExpression="pk = :pk", ExpressionAttributeValues={":pk": {"S": pk}}
            )
        return self.query(
            what,
            raw=raw,
            KeyConditionExpression="pk = :pk AND begins_with(sk, :p)",
            ExpressionAttributeValues={":pk": {"S": pk}, ":p": {"S": prefix}},
        )

    # -- writes ------------------------------------------------------------------------------------------------------

    def transact(self, what: str, actions: Sequence[Mapping[str, Any]]) -> None:
        """One ``TransactWriteItems``: all or nothing; Cancelled when a condition failed."""
        self.call(what, self.client.transact_write_items, TransactItems=list(actions))

    def update(self, what: str, **kwargs: Any) -> Item:
        answer = self.call(what, self.client.update_item, TableName=self.name, **kwargs)
        attributes: Item = answer.get("Attributes", {})
        return attributes

    def delete(self, key: Mapping[str, str], **kwargs: Any) -> None:
        self.call(
            "DeleteItem",
            self.client.delete_item,
            TableName=self.name,
            Key={k: {"S": v} for k, v in key.items()},
            **kwargs,
        )

    def delete_each(self, keys: Sequence[Mapping[str, Any]]) -> None:
        """One ``DeleteItem`` per key (typed key attributes): what a run's end leaves beyond its transaction, on either
        side of the World (the API's role has no ``BatchWriteItem``, seed "IAM"; the same write units either way)."""
        for key in keys:
            self.call("DeleteItem", self.client.delete_item, TableName=self.name, Key=dict(key))

    def delete_many(self, keys: Sequence[Mapping[str, Any]]) -> None:
        """``BatchWriteItem`` deletes, 25 at a time, unprocessed ones retried (``keys`` are typed key attributes)."""
        pending = [{"DeleteRequest": {"Key": dict(key)}} for key in keys]
        delay = 0.05
        while pending:
            batch, pending = pending[:25], pending[25:]
            request: dict[str, Any] = {self.name: batch}
            while request:
                answer = self.call("BatchWriteItem", self.client.batch_write_item, RequestItems=request)
                request = answer.get("UnprocessedItems") or {}
                if request:
                    time.sleep(delay * (0.5 + random.random()))
                    delay = min(delay * 2, 1.0)
