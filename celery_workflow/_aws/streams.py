"""Streams of the AWS World: a ``STREAM#<name>`` state item and ``CHUNK#<name>#<index>`` items in the run's partition
(not part of the public API).

A write is one transaction: the state item's ``chunk_count`` moves from the count it read to the new one (so
concurrent writers of one stream never take the same indexes; a loser retries on fresh reads) and the chunks are put
at the indexes in between; a write holds at most 99 chunks (with the state item, DynamoDB's 100 actions). A closed
stream takes no more chunks (:class:`~celery_workflow.errors.EventConflict`). Readers query the chunks from an index
on; waiting readers poll (DynamoDB has no notifications), at most every ``poll_interval``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from celery_workflow import ids
from celery_workflow._aws.dynamo import Cancelled, ConditionFailed
from celery_workflow._aws.items import from_item, item_size, to_item
from celery_workflow._aws.table import (
    MAX_CHUNKS_PER_WRITE,
    MAX_ITEM_BYTES,
    META,
    STREAMS,
    TTL_ATTRIBUTE,
    chunk_prefix,
    chunk_sk,
    run_pk,
    stream_sk,
)
from celery_workflow._backend.checks import check_chunks, check_stream_name
from celery_workflow._backend.waiting import wait_until
from celery_workflow.errors import EventConflict, EventInvalid, EventTooLarge, RunNotFound, WorldUnavailable
from celery_workflow.world import StreamChunk, StreamPage

if TYPE_CHECKING:
    from celery_workflow._aws.world import AWSWorld

__all__ = ["AWSStreams"]

MAX_ATTEMPTS = 30


class AWSStreams:
    """The stream facet of :class:`~celery_workflow._aws.world.AWSWorld`."""

    def __init__(self, world: AWSWorld) -> None:
        self.world = world

    def _state(self, run_id: str, name: str) -> dict[str, object] | None:
        item = self.world.table.get({"pk": run_pk(run_id), "sk": stream_sk(name)})
        return None if item is None else from_item(item)

    def _require_run(self, run_id: str) -> dict[str, Any]:
        item = self.world.table.get({"pk": run_pk(run_id), "sk": META})
        if item is None:
            raise RunNotFound(f"run {run_id} does not exist")
        return item

    def _mark(self, run_id: str, name: str) -> int | None:
        """Before a stream's first item is written: its name joins the run's META ``streams`` (a run's end then knows
        its partition holds stream items, and queues the expiry that deletes them), on the condition that the run's
        time to live is still the one read. Returns that time to live (a run that ended has one): the stream's items
        take it, so DynamoDB deletes them with the run's. A mark whose stream is never written costs nothing more."""
        for _ in range(MAX_ATTEMPTS):
            meta = self._require_run(run_id)
            ttl = meta.get(TTL_ATTRIBUTE)
            if name in (meta.get(STREAMS) or {}).get("SS", ()):
                return None if ttl is None else int(ttl["N"])
            values: dict[str, Any] = {":n": {"SS": [name]}}
            condition = "attribute_exists(pk) AND attribute_not_exists(#t)"
            if ttl is not None:
                condition = "attribute_exists(pk) AND #t = :t"
                values[":t"] = ttl
            try:
                self.world.table.update(
                    "UpdateItem (stream mark)",
                    Key={"pk": {"S": run_pk(run_id)}, "sk": {"S": META}},
                    UpdateExpression=f"ADD {STREAMS} :n",
                    ConditionExpression=condition,
                    ExpressionAttributeNames={"#t": TTL_ATTRIBUTE},
                    ExpressionAttributeValues=values,
                )
            except ConditionFailed:
                continue  # the run ended (or went) meanwhile: read it again
            return None if ttl is None else int(ttl["N"])
        raise WorldUnavailable(f"stream {name!r} of run {run_id}: META kept changing ({MAX_ATTEMPTS} attempts)")

    def write(self, run_id: str, name: str, chunks: Sequence[bytes]) -> int:
        check_stream_name(name)
        data = check_chunks(chunks)
        if len(data) > MAX_CHUNKS_PER_WRITE:
            raise EventInvalid(f"a stream write holds at most {MAX_CHUNKS_PER_WRITE} chunks, got {len(data)}")
        table = self.world.table
        delay = 0.01
        for _ in range(MAX_ATTEMPTS):
            state = self._state(run_id, name)
            # the run's time to live, once it ended (a stream's items take it: DynamoDB deletes them with the run's)
            ttl = state.get(TTL_ATTRIBUTE) if state is not None else None
            if state is None:
                if not data:
                    self._require_run(run_id)
                    return 0
                ttl = self._mark(run_id, name)
                count = 0
                condition = "attribute_not_exists(pk)"
                values: dict[str, object] = {}
            elif state.get("closed"):
                raise EventConflict(f"stream {name!r} of run {run_id} is closed")
            else:
                count = int(str(state["chunk_count"]))
                condition = "chunk_count = :old AND closed = :open"
                values = {":old": {"N": str(count)}, ":open": {"BOOL": False}}
            if not data:
                return count
            now = ids.to_micros(ids.utcnow())
            created = int(str(state["created_at"])) if state is not None else now
            head = to_item({
                "pk": run_pk(run_id), "sk": stream_sk(name), "name": name, "closed": False,
                "chunk_count": count + len(data), "created_at": created, "updated_at": now, TTL_ATTRIBUTE: ttl,
            })  # fmt: skip
            put_head: dict[str, object] = {"TableName": table.name, "Item": head, "ConditionExpression": condition}
            if values:
                put_head["ExpressionAttributeValues"] = values
            actions: list[dict[str, object]] = [{"Put": put_head}]
            for i, chunk in enumerate(data):
                item = to_item({"pk": run_pk(run_id), "sk": chunk_sk(name, count + i), "idx": count + i, "data": chunk,
                                "created_at": now, TTL_ATTRIBUTE: ttl})  # fmt: skip
                if item_size(item) > MAX_ITEM_BYTES:  # pragma: no cover - chunks are smaller than items already
                    raise EventTooLarge(f"stream chunk of {len(chunk)} bytes exceeds DynamoDB's item limit")
                actions.append({"Put": {"TableName": table.name, "Item": item}})
            try:
                table.transact("TransactWriteItems (stream)", actions)
            except Cancelled:  # another writer took these indexes (or closed it): read again
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 0.5)
                continue
            return count + len(data)
        raise WorldUnavailable(f"stream {name!r} of run {run_id}: the write kept conflicting ({MAX_ATTEMPTS} attempts)")

    def close(self, run_id: str, name: str) -> None:
        check_stream_name(name)
        ttl = self._mark(run_id, name)  # it may write the stream's first item
        now = ids.to_micros(ids.utcnow())
        values: dict[str, Any] = {
            ":t": {"BOOL": True},
            ":name": {"S": name},
            ":now": {"N": str(now)},
            ":zero": {"N": "0"},
        }
        expression = ("SET closed = :t, #n = :name, updated_at = :now, chunk_count = if_not_exists(chunk_count, :zero),"
                      " created_at = if_not_exists(created_at, :now)")  # fmt: skip
        names = {"#n": "name"}
        if ttl is not None:  # a stream first closed after its run ended takes the run's time to live
            expression += ", #ttl = if_not_exists(#ttl, :ttl)"
            names["#ttl"] = TTL_ATTRIBUTE
            values[":ttl"] = {"N": str(ttl)}
        self.world.table.update(
            "UpdateItem (stream close)",
            Key={"pk": {"S": run_pk(run_id)}, "sk": {"S": stream_sk(name)}},
            UpdateExpression=expression,
            ExpressionAttributeNames=names,
            ExpressionAttributeValues=values,
        )

    def read(
        self, run_id: str, name: str, *, start: int = 0, limit: int | None = None, wait: float = 0.0
    ) -> StreamPage:
        if start < 0:
            raise ValueError("start must be >= 0")
        return wait_until(  # a reader of an ended run waits for nothing (its run is read only when it would wait)
            lambda: self._read(run_id, name, start, limit),
            lambda page: bool(page.chunks or page.closed) or self.world.get_run(run_id).status.terminal,
            timeout=max(wait, 0.0),
            poll_interval=self.world.poll_interval,
            mark=lambda: None,
            wait=lambda _mark, seconds: time.sleep(seconds),
        )

    def _read(self, run_id: str, name: str, start: int, limit: int | None) -> StreamPage:
        state = self._state(run_id, name)
        if state is None:
            self._require_run(run_id)
            return StreamPage([], False, start)
        chunks: list[StreamChunk] = []
        if limit is None or limit > 0:
            query: dict[str, Any] = {
                "KeyConditionExpression": "pk = :pk AND sk BETWEEN :from AND :to",
                "ExpressionAttributeValues": {
                    ":pk": {"S": run_pk(run_id)},
                    ":from": {"S": chunk_sk(name, start)},
                    ":to": {"S": chunk_prefix(name) + "9" * 10},
                },
            }
            for item in self.world.table.query("Query (stream)", **query):
                value = from_item(item)
                chunks.append(StreamChunk(int(value["idx"]), bytes(value["data"])))
                if limit is not None and len(chunks) >= limit:
                    break
        next_index = start + len(chunks)
        closed = bool(state.get("closed")) and next_index >= int(str(state.get("chunk_count", 0)))
        return StreamPage(chunks, closed, next_index)

    def names(self, run_id: str) -> list[str]:
        items = list(self.world.table.partition(run_pk(run_id), "STREAM#", what="Query (streams)"))
        if not items:
            self._require_run(run_id)
        return sorted(str(i["name"]["S"]) for i in items)  # every write and close stores the name
