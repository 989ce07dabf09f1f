"""The AWS World: workflow state in one DynamoDB table, deliveries on SQS (seed ``aws-world.txt``).

``AWSWorld(config, dynamodb_client, sqs_client)`` makes no AWS call; the clients carry the region, credentials,
retry policy and endpoint (boto3 clients built with no arguments honour ``AWS_ENDPOINT_URL``, so the same code runs
against AWS and an emulator). :meth:`AWSWorld.from_env` builds all of it from the Terraform module's ``environment``
output.

Guarantees (the table layout is in :mod:`celery_workflow._aws.table`):

* **Appends** follow the template of :mod:`celery_workflow._backend.template` with the steps of
  :mod:`celery_workflow._aws.append`: one ``TransactWriteItems`` conditioned on the run's event count, so any number
  of processes and Lambda functions can share a run: concurrent writers never lose or reorder events (a loser
  retries on fresh reads, with jittered backoff). A rejected batch writes nothing.
* **Reads** are consistent reads of the base table; listings read an index (eventually consistent: a run created a
  moment ago may be missing) and then fetch the items with a consistent ``BatchGetItem``.
* **Deliveries** (:mod:`celery_workflow._aws.queue`): ``QUEUE#`` records written with the append, then SQS messages
  or Scheduler schedules; an outbox on the run makes a publication its writer never made happen later. A run's start
  has no record: the pending run's META holds it until it is done, its message carries its payload, and the outbox
  sweep of a worker's upkeep sends a start its writer never sent (:mod:`celery_workflow._aws.starts`). Standard SQS
  does not order, deduplicate or keep sub-second times: :attr:`AWSWorld.capabilities` says so.
* **Limits**: an item over 400 KB is :class:`~celery_workflow.errors.EventTooLarge` (an ``EventInvalid``); an append
  needing more than 100 actions is ``EventInvalid``; throttling and service errors are
  :class:`~celery_workflow.errors.WorldUnavailable`, never a lost write.
* **Retention**: a terminal append gives every item of the run's partition its time to live (``expires_at``, the
  retention's end) in its own transaction, the items written before by updates, when it knows them all (planned on
  the delivery's read of the log: :attr:`celery_workflow._aws.kept.Kept.items`) and they fit in it; DynamoDB then
  deletes the run for free, and nothing is queued. Otherwise (a run that retains a token, an end planned on fresh
  reads such as a CLI cancel, a run with streams or created by an earlier version, too many earlier items) it queues
  ``QUEUE#expire-<runId>`` (seed), due the workflow's retention later; its delivery deletes the run's hooks, tokens
  and the partition's items without a time to live, the run's view last, so a cleanup cut short is retried while the
  run still exists. Pending and running runs never expire. A delivery that comes before the run may expire (the
  retention was lengthened, or the run retains a token) keeps the record, due then, and is sent again.
* **Token retention** (:mod:`celery_workflow.rules`): a live hook's retention end is a ``retention#<hookId>``
  attribute of its run's META; a run's end turns the ``TOKEN#`` items the rules retain into holdings of the ended run
  (``retained_until``, no hook view), lists them in META ``retained`` (what its expiry waits for, then deletes), and a
  claim that finds a holding over replaces it under a condition on what it read.
"""

from __future__ import annotations

import math
import os
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from celery_workflow import codec, ids, rules
from celery_workflow._aws.append import APPEND_LIMITS, AWSAppend
from celery_workflow._aws.config import AWSConfig, QueueConfig
from celery_workflow._aws.dead_letters import SQSDeadLetters
from celery_workflow._aws.dynamo import Cancelled, ConditionFailed, Table
from celery_workflow._aws.items import (
    from_item,
    item_size,
    retained_of,
    run_item,
    run_of,
    to_item,
    value_size,
    view_of,
)
from celery_workflow._aws.kept import Kept
from celery_workflow._aws.log import created_entry, pack_items, read_events, step_views
from celery_workflow._aws.queue import Record, SQSQueue
from celery_workflow._aws.retention import outlive_runs
from celery_workflow._aws.schedule_items import DynamoSchedules
from celery_workflow._aws.schedules import Schedules
from celery_workflow._aws.starts import OutboxSweeper, Start
from celery_workflow._aws.streams import AWSStreams
from celery_workflow._aws.table import (
    CREATED,
    MAX_ITEM_BYTES,
    META,
    TTL_ATTRIBUTE,
    event_sk,
    hook_pk,
    run_pk,
    token_pk,
)
from celery_workflow._backend import template
from celery_workflow._backend.base import StoreStreams, TemplateWorld
from celery_workflow._backend.checks import check_deliveries
from celery_workflow._backend.listing import RunFilter
from celery_workflow._backend.waiting import wait_until
from celery_workflow.dead_letters import DeadLetter
from celery_workflow.errors import ConfigurationError, EventTooLarge, HookNotFound, RunNotFound, StepNotFound
from celery_workflow.events import Event, HookView, RunStatus, RunView, StepView, WaitView
from celery_workflow.world import (
    DEFAULT_MAX_PAYLOAD,
    AppendLimits,
    BrokerSpec,
    Capabilities,
    ClaimedDelivery,
    Delivery,
    NewRun,
    Page,
    Upkeep,
)

__all__ = ["AWSWorld"]

#: What an item keeps beside its two largest values: a recorded error (twice its text, for JSON escapes) and the
#: attributes (keys, ids and names up to 512 characters, times, index keys).
_ITEM_ROOM = 2 * codec.MAX_ERROR_BYTES + 8 * 1024


class AWSWorld(TemplateWorld, StoreStreams):
    """A World in DynamoDB and SQS (and EventBridge Scheduler for long delays). Thread-safe.

    ``dynamodb_client`` and ``sqs_client`` are boto3 clients (``boto3.client("dynamodb")``, ``…("sqs")``); the
    Scheduler's client is in ``config.scheduler``.
    """

    #: Standard SQS does not order claims, keeps whole seconds and does not deduplicate; the indexes behind
    #: ``list_runs`` are eventually consistent.
    capabilities = Capabilities(
        ordered_claims=False, subsecond_times=False, dedup_pending=False, consistent_listings=False
    )
    #: The largest value it stores: a run's item holds its input and its output, a step's item its input, result and
    #: last error, all within DynamoDB's 400 KB (:data:`MAX_ITEM_BYTES`): half of what is left after the room for an
    #: error and the item's other attributes (:data:`_ITEM_ROOM`), and never more than any World's event data holds.
    max_payload: int = min(DEFAULT_MAX_PAYLOAD, (MAX_ITEM_BYTES - _ITEM_ROOM) // 2)
    #: What one append may carry: DynamoDB's 100 actions and 4 MB per transaction, as the append counts them
    #: (:data:`celery_workflow._aws.append.APPEND_LIMITS`); the runtime splits a wider fan-out into several appends.
    #: Every append is a paid TransactWriteItems: the quick inline steps of a delivery share them (``batch_steps``).
    append_limits: AppendLimits = replace(APPEND_LIMITS, batch_steps=True)

    def __init__(self, config: AWSConfig, dynamodb_client: Any, sqs_client: Any) -> None:
        if not isinstance(config, AWSConfig):
            raise ConfigurationError(f"AWSWorld needs an AWSConfig, got {type(config).__name__}")
        _fork_safe(dynamodb_client, sqs_client, config.scheduler.client if config.scheduler else None)
        self.config = config
        self.poll_interval = config.poll_interval
        self.routes: Mapping[str, str] = MappingProxyType(dict(config.routes))
        self.base_url = config.base_url  # Workflows builds webhook URLs from it unless given its own
        self.table = Table(dynamodb_client, config.table_name)
        self.queue = SQSQueue(self, sqs_client)
        #: The EventBridge Scheduler schedules of long delays (their names, a finished run's cleanup).
        self.schedules = Schedules(self)
        #: The workflow schedules (:mod:`celery_workflow.schedules`), items under ``pk=SCHEDULES``.
        self.schedule_store = DynamoSchedules(self.table)
        #: Each queue's SQS dead-letter queue (celery_workflow.dead_letters.DeadLetterStore).
        self.dead_letters = SQSDeadLetters(self)
        self.streams = AWSStreams(self)
        self._append = AWSAppend(self)
        self._steps = self._append

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> AWSWorld:
        """The World the Terraform module's ``environment`` output describes (``AWSConfig.from_env``), with boto3
        clients built from the environment (region, credentials, ``AWS_ENDPOINT_URL``)."""
        import boto3

        config = AWSConfig.from_env(environ, **overrides)
        return cls(config, boto3.client("dynamodb"), boto3.client("sqs"))

    @classmethod
    def from_url(cls, url: str, **options: Any) -> AWSWorld:
        """``aws://``: the World of this environment (see :meth:`from_env`); ``options`` are AWSConfig fields."""
        parts = urlsplit(url)
        if parts.scheme.lower() != "aws" or parts.netloc or parts.path.strip("/") or parts.query:
            raise ConfigurationError(f"an AWS World URL is 'aws://' (its settings come from WORKFLOW_*), got {url!r}")
        return cls.from_env(**options)

    def __repr__(self) -> str:
        return f"AWSWorld(table={self.config.table_name!r}, queue={self.config.queue_url!r})"

    @property
    def queue_names(self) -> frozenset[str]:
        """The queues this World delivers to: Celery's default queue (``queue_url``) and ``config.queues``."""
        return frozenset({self.config.default_queue, *self.config.queues})

    def queue_config(self, name: str) -> QueueConfig:
        """The SQS queue named ``name``; ConfigurationError for a name the config does not know."""
        return self.config.queue(name)

    def queue_of_arn(self, arn: str) -> str:
        """The name (as routes use it) of the configured queue with this ARN (an SQS event's
        ``eventSourceARN``); ConfigurationError for a queue the config does not know."""
        sqs_name = arn.rsplit(":", 1)[-1]
        for name in sorted(self.queue_names):
            if self.queue_config(name).name == sqs_name:
                return name
        raise ConfigurationError(f"messages from {arn}: no queue of the AWS World's config has that name")

    def accept_message(self, message: Mapping[str, Any]) -> ClaimedDelivery | None:
        """Take one message of an SQS event (a Lambda event source mapping's ``Records`` entry): None when it was
        handled here and needs nothing more (not ours, already done, early, an expiry), else the claimed delivery
        to run (its receipt acks it; its ``attempts`` is the message's receive count). The World never deletes
        such a message: the event source mapping deletes it once the handler leaves it out of ``batchItemFailures``
        (one ``DeleteMessageBatch`` for the batch), and a message reported there stays for SQS to deliver again."""
        queue = self.queue_of_arn(str(message["eventSourceARN"]))
        count = int((message.get("attributes") or {}).get("ApproximateReceiveCount", "1"))
        return self.queue.accept(queue, str(message["receiptHandle"]), str(message.get("body", "")), count, esm=True)

    def return_message(self, message: Mapping[str, Any], delay: float = 0.0) -> None:
        """Make a message of an SQS event visible again in ``delay`` seconds (0: at once), by its receipt handle:
        for messages a handler hands back without running them, or whose run failed before they were accepted."""
        queue = self.queue_of_arn(str(message["eventSourceARN"]))
        self.queue.change_visibility(queue, str(message["receiptHandle"]), delay)

    # -- storage: writes -----------------------------------------------------------------------------------------

    def create_run(self, run: NewRun, deliveries: Sequence[Delivery] = ()) -> tuple[RunView, bool]:
        view, first = template.prepare_run(run, deliveries, ids.utcnow())
        self.queue.check(deliveries)
        # the run's start (its delivery due now) has no record: META holds it (celery_workflow._aws.starts)
        due_now = (d for d in deliveries if d.run_id == run.run_id and d.not_before is None)
        starting = None if self.config.start_records else next(due_now, None)
        start = Start.of(starting) if starting is not None else None
        records = [Record.of(d, view.created_at) for d in deliveries if d is not starting]
        meta = {
            **run_item(view),
            **to_item({"created_hooks": {}, "outbox": {r.id: ids.to_micros(view.created_at) for r in records}}),
            **(start.attributes() if start is not None else {}),
        }
        if item_size(meta) > MAX_ITEM_BYTES:
            raise EventTooLarge(
                f"run {run.run_id}'s view is {item_size(meta)} bytes; DynamoDB stores at most {MAX_ITEM_BYTES}"
            )
        # run_created (slot 1) is kept in META, with room left for what the view takes later (its output, an error);
        # one that does not fit beside it has its own EVENT#1 item, which META names (see celery_workflow._aws.log)
        entry = created_entry(first)
        inline = item_size(meta) + len(CREATED) + value_size(entry) + self.max_payload + _ITEM_ROOM <= MAX_ITEM_BYTES
        meta[CREATED] = entry if inline else {"S": event_sk(first.slot)}  # and: this run has no STEP# items
        actions: list[dict[str, Any]] = [
            {"Put": {"TableName": self.table.name, "Item": meta, "ConditionExpression": "attribute_not_exists(pk)"}},
        ]
        if not inline:
            actions += [{"Put": {"TableName": self.table.name, "Item": item}} for item in pack_items([first])]
        actions += [{"Put": {"TableName": self.table.name, "Item": r.item()}} for r in records]
        try:
            self.table.transact("TransactWriteItems (create_run)", actions)
        except Cancelled:
            existing = self.table.get({"pk": run_pk(run.run_id), "sk": META})
            if existing is None:  # pragma: no cover - deleted between the two calls
                raise
            found = template.existing_run(run_of(existing), run)
            self.queue.republish(run.run_id)  # a start retried after its first publication failed
            return found
        self.queue.publish(run.run_id, records, start)
        return view, True

    # -- storage: reads ------------------------------------------------------------------------------------------

    def _meta(self, run_id: str) -> dict[str, Any]:
        item = self.table.get({"pk": run_pk(run_id), "sk": META})
        if item is None:
            raise RunNotFound(f"run {run_id} does not exist")
        return item

    def get_run(self, run_id: str) -> RunView:
        return run_of(self._meta(run_id))

    def get_run_with_events(self, run_id: str) -> tuple[RunView, list[Event]]:
        """The run and its log: the view first, then the events up to its event count (a later append is left out,
        so the two agree). What was read is kept for the run's next appends (:mod:`celery_workflow._aws.kept`)."""
        meta = self._meta(run_id)
        view = run_of(meta)
        sizes: dict[str, int] = {}  # the log's items: what the run's end gives its time to live
        log = read_events(self.table, run_id, limit=view.event_count, sizes=sizes, meta=meta)
        kept = Kept.read(meta, log, sizes) if len(log) == view.event_count else None
        if kept is not None:
            self._append.kept.put(kept)
        else:
            self._append.kept.forget(run_id)
        return view, log

    def list_runs(
        self,
        *,
        workflow: str | None = None,
        status: RunStatus | str | None = None,
        limit: int = 100,
        cursor: str | None = None,
        run_id_prefix: str | None = None,
        created_from: datetime | None = None,
        created_until: datetime | None = None,
    ) -> Page[RunView]:
        """Runs newest first (by creation time) through an index, then their views by consistent reads. The cursor
        is the index position of the last run returned. ``list`` (every workflow) projects ``status``, so a status
        filter is the query's; ``list_group`` (one workflow) projects only keys, so its runs are filtered by their
        views (read in pages of ``limit + 1`` until the page is full or the index ends)."""
        wanted = RunFilter.of(
            workflow=workflow,
            status=status,
            limit=limit,
            cursor=cursor,
            run_id_prefix=run_id_prefix,
            created_from=created_from,
            created_until=created_until,
        )  # the cursor checked
        index, key, value = (
            ("list", "list_pk", "RUNS") if workflow is None else ("list_group", "list_group_pk", f"RUNS#{workflow}")
        )
        sort_key = "list_sk" if workflow is None else "list_group_sk"
        names = {"#k": key}
        values: dict[str, Any] = {":k": {"S": value}}
        condition = "#k = :k"
        # the sort key is a position (``<µs, 16 digits>#<run id>``): a time bound is a digits-only key between
        # positions; one key condition takes both ends (BETWEEN, inclusive), and the upper end, which only a
        # cursor can equal, is dropped below
        upper = cursor
        if wanted.created_until is not None:
            until = f"{wanted.created_until:016d}"
            upper = until if upper is None else min(upper, until)
        if upper is not None or wanted.created_from is not None:
            names["#sk"] = sort_key
            values[":hi"] = {"S": "9" * 17 if upper is None else upper}
            if wanted.created_from is None:
                condition += " AND #sk < :hi"
            else:
                condition += " AND #sk BETWEEN :lo AND :hi"
                values[":lo"] = {"S": f"{wanted.created_from:016d}"}
        query: dict[str, Any] = {
            "IndexName": index,
            "KeyConditionExpression": condition,
            "ExpressionAttributeNames": names,
            "ExpressionAttributeValues": values,
            "ScanIndexForward": False,
        }
        filters = []
        if wanted.status is not None and index == "list":  # list_group projects no status: the views say it
            names["#s"] = "status"
            values[":s"] = {"S": wanted.status.value}
            filters.append("#s = :s")
        if wanted.run_id_prefix is not None:
            values[":p"] = {"S": run_pk(wanted.run_id_prefix)}
            filters.append("begins_with(pk, :p)")
        if filters:
            query["FilterExpression"] = " AND ".join(filters)
        found: list[tuple[RunView, str]] = []  # (view, index sort key) of the matching runs, newest first
        batch: list[tuple[str, str]] = []  # (run id, index sort key) not read yet

        def read(positions: list[tuple[str, str]]) -> None:
            views = {
                v.run_id: v
                for v in map(run_of, self.table.get_many([{"pk": run_pk(r), "sk": META} for r, _ in positions]))
            }
            found.extend((views[r], at) for r, at in positions if r in views and wanted.matches(views[r]))

        for item in self.table.query("Query (list_runs)", **query):
            if item[sort_key]["S"] == upper:
                continue  # BETWEEN's inclusive upper end: the cursor's own run
            batch.append((item["pk"]["S"][len("RUN#") :], item[sort_key]["S"]))
            if len(batch) > limit - len(found):
                read(batch)
                batch = []
                if len(found) > limit:
                    break
        if batch and len(found) <= limit:
            read(batch)
        page = found[:limit]
        return Page([view for view, _ in page], page[-1][1] if len(found) > limit and page else None)

    def list_events(self, run_id: str, *, after_slot: int = 0, limit: int | None = None) -> list[Event]:
        """The run's events after ``after_slot``, from its ``EVENT#`` items (an append's events in one item, or an
        earlier version's single event) and, from slot 1, its META item, which keeps ``run_created``
        (:mod:`celery_workflow._aws.log`)."""
        out = read_events(self.table, run_id, after_slot=after_slot, limit=limit)
        if not out:
            self._meta(run_id)
        return out

    def get_step(self, run_id: str, step_id: str) -> StepView:
        """The step's view as the run's log leaves it (no step items: :mod:`celery_workflow._aws.log`). The run is read
        as a delivery reads it (:meth:`get_run_with_events`: META, then the log), so a queued step's delivery, which
        reads its step and then appends its outcome, plans that append on what it read."""
        _, log = self.get_run_with_events(run_id)
        step = step_views(log).get(step_id)
        if step is None:
            raise StepNotFound(f"step {step_id} of run {run_id} does not exist")
        return step

    def _step_views(self, run_id: str) -> dict[str, StepView]:
        """Every step's view, folded from the run's log (one Query); RunNotFound for a run that does not exist."""
        return step_views(self.list_events(run_id))

    def _in_partition(self, run_id: str, table: str, prefix: str) -> list[Any]:
        """The wait views of a run, in creation order (their creation events' slots)."""
        items = list(self.table.partition(run_pk(run_id), prefix, what=f"Query ({table})"))
        if not items:
            self._meta(run_id)
        items.sort(key=_created_slot)
        return [view_of(table, i) for i in items]

    def list_steps(self, run_id: str) -> list[StepView]:
        """The steps in creation order, from the log (``STEP#`` items of earlier versions are not read)."""
        return list(self._step_views(run_id).values())

    def get_hook_by_token(self, token: str) -> HookView:
        item = self.table.get({"pk": token_pk(token), "sk": META})
        held = None if item is None else retained_of(item)
        if item is None or held is not None:
            if held is not None and held.holds(ids.utcnow()):
                raise rules.retained_error(held)
            raise HookNotFound(f"no live hook owns token {token!r}")
        return view_of("hooks", item)  # type: ignore[no-any-return]

    def list_hooks(self, run_id: str) -> list[HookView]:
        hooks = from_item(self._meta(run_id)).get("hooks") or {}
        items = self.table.get_many([{"pk": hook_pk(run_id, h), "sk": META} for h in hooks])
        return [view_of("hooks", i) for i in sorted(items, key=_created_slot)]

    def list_waits(self, run_id: str) -> list[WaitView]:
        return self._in_partition(run_id, "waits", "WAIT#")

    def wait_for_terminal(self, run_id: str, timeout: float | None) -> RunView:
        return wait_until(
            lambda: self.get_run(run_id),
            lambda view: view.status.terminal,
            timeout=timeout,
            poll_interval=self.poll_interval,
            mark=lambda: None,
            wait=lambda _mark, seconds: time.sleep(seconds),
        )

    # -- queue ---------------------------------------------------------------------------------------------------

    def enqueue(self, deliveries: Sequence[Delivery]) -> list[bool]:
        check_deliveries(deliveries)
        return self.queue.enqueue(deliveries)

    def claim(self, queues: Sequence[str], *, limit: int = 1, lease: float = 60.0) -> list[ClaimedDelivery]:
        if lease <= 0:
            raise ValueError("lease must be positive")
        if limit <= 0:
            return []
        return self.queue.claim(queues, limit=limit, lease=lease)

    def ack(self, receipt: str) -> None:
        self.queue.ack(receipt)

    def release(self, receipt: str) -> None:
        self.queue.set_visibility([receipt], 0)

    def dead_letter(self, receipt: str, *, reason: str, error: str | None = None) -> DeadLetter | None:
        """Move a claimed delivery to its queue's dead-letter queue (see :mod:`celery_workflow._aws.dead_letters`);
        None when nothing moved."""
        return self.queue.dead_letter(receipt, reason=reason, error=error)

    def retry_later(self, receipt: str, delay: float, *, error: str | None = None) -> None:
        self.queue.set_visibility([receipt], max(delay, 0.0))

    def extend(self, receipts: Sequence[str], lease: float) -> None:
        self.queue.set_visibility(receipts, lease)

    def hold_wakes(self, run_id: str, receipt: str) -> bool:
        """``WakeHolds``: standard SQS does not deduplicate a run's wake-ups (see :meth:`SQSQueue.hold_wakes`)."""
        self._append.kept.forget(run_id)  # its pending wake-up changes without an event
        return self.queue.hold_wakes(run_id, receipt)

    def release_wakes(self, run_id: str, receipt: str) -> None:
        self._append.kept.forget(run_id)
        self.queue.release_wakes(run_id, receipt)

    # -- retention -----------------------------------------------------------------------------------------------

    def expiry_record(self, plan: rules.Plan) -> Record | None:
        """The ``QUEUE#expire-<runId>`` record a terminal append writes, when the workflow's runs expire."""
        retained = [kept.until for kept in plan.tokens_retained.values()]
        due = rules.expires_at(plan.run, self.config.retention_of(plan.run.workflow_name), retained)
        if due is None:
            return None
        return Record(f"expire-{plan.run.run_id}", self.config.default_queue, b"", plan.run.run_id, due, "expire")

    def expire_run(self, record: Record) -> datetime | None:
        """Delete an expired run: its hooks and their tokens, then every item of its partition, the view last. None
        when the record is done (the run is gone now, or is not a finished run, or is kept for good); else the time
        the run may expire, not reached yet (its retention was lengthened since the record was written, or it still
        retains a token: :func:`celery_workflow.rules.expires_at`): the caller keeps the record, due then
        (:meth:`SQSQueue.defer`). An error leaves the message to SQS, which delivers it again."""
        run_id = record.run_id
        if run_id is None:
            return None
        meta = self.table.get({"pk": run_pk(run_id), "sk": META}, raw=True)  # past its time to live, still the run's
        if meta is None:  # gone (its time to live ran out first): what has none is deleted here
            self.table.delete_many(self._untimed(run_id))
            return None
        run = run_of(meta)
        retained = {str(t): ids.from_micros(int(until)) for t, until in (from_item(meta).get("retained") or {}).items()}
        due = rules.expires_at(run, self.config.retention_of(run.workflow_name), retained.values())
        if due is None:
            return None  # pending and running runs never expire; a retention switched off meanwhile keeps the run
        if due > ids.utcnow() + timedelta(seconds=1):
            self._outlive(run_id, meta, due)
            return due
        for token in sorted(retained):  # the run's holdings, unless another run's hook claimed the token since
            try:
                self.table.delete(
                    {"pk": token_pk(token), "sk": META},
                    ConditionExpression="run_id = :r AND attribute_exists(retained_until)",
                    ExpressionAttributeValues={":r": {"S": run_id}},
                )
            except ConditionFailed:
                pass
        hooks = from_item(meta).get("hooks") or {}
        keys: list[dict[str, Any]] = [{"pk": {"S": hook_pk(run_id, h)}, "sk": {"S": META}} for h in hooks]
        keys += [{"pk": {"S": token_pk(t)}, "sk": {"S": META}} for t in hooks.values()]
        keys += [key for key in self._untimed(run_id) if key["sk"]["S"] != META]
        self.table.delete_many(keys)
        if TTL_ATTRIBUTE not in meta:  # else DynamoDB deletes it for free, and readers take it as gone already
            self.table.delete({"pk": run_pk(run_id), "sk": META})
        return None

    def outlive_runs(self, workflow: str | None = None) -> int:
        """After a retention was lengthened: the ended runs (of ``workflow``, else all) whose time to live ends before
        their retention now says get the later one (:func:`celery_workflow._aws.retention.outlive_runs`); returns
        how many. A run's end that queued no expiry is not visited again before DynamoDB deletes it."""
        return outlive_runs(self, workflow)

    def _outlive(self, run_id: str, meta: Mapping[str, Any], due: datetime) -> None:
        """The run may expire later than its end's time to live says (its retention was lengthened since): its items
        that have one get the later one (a write each, paid only then)."""
        ttl = math.ceil(due.timestamp())
        if TTL_ATTRIBUTE not in meta or int(meta[TTL_ATTRIBUTE]["N"]) >= ttl:
            return
        for item in self.table.partition(run_pk(run_id), what="Query (outlive)", raw=True):
            if TTL_ATTRIBUTE in item:
                try:
                    self.table.update(
                        "UpdateItem (outlive)",
                        Key={"pk": item["pk"], "sk": item["sk"]},
                        UpdateExpression="SET #t = :t",
                        ConditionExpression="attribute_exists(pk)",
                        ExpressionAttributeNames={"#t": TTL_ATTRIBUTE},
                        ExpressionAttributeValues={":t": {"N": str(ttl)}},
                    )
                except ConditionFailed:
                    pass  # deleted meanwhile

    def _untimed(self, run_id: str) -> list[dict[str, Any]]:
        """The keys of the run's partition items that have no time to live (written before the run's end): what its
        expiry deletes; those with one are DynamoDB's to delete, for free."""
        items = self.table.partition(run_pk(run_id), what="Query (expire)", raw=True)
        return [{"pk": item["pk"], "sk": item["sk"]} for item in items if TTL_ATTRIBUTE not in item]

    # -- wiring --------------------------------------------------------------------------------------------------

    def broker(self) -> BrokerSpec:
        """The SQS transport on this World's queues (:mod:`celery_workflow.transport.sqs`). Without a control
        channel (``control_url``), remote control and events are turned off in the Celery app: SQS cannot carry
        them."""
        settings: dict[str, Any] = {}
        if not self.config.control_url:
            settings = {"worker_enable_remote_control": False, "worker_send_task_events": False,
                        "task_send_sent_event": False}  # fmt: skip
        return BrokerSpec(
            transport="celery_workflow.transport.sqs:Transport",
            url="aws://",
            options={"world": self, "polling_interval": self.poll_interval},
            settings=settings,
        )

    def __json__(self) -> dict[str, str]:
        """What Kombu's JSON shows of this World, which the app's transport options carry (``broker()``): the replies
        to ``inspect stats`` (the broker connection's info) and ``inspect conf`` encode it, as Flower asks for them."""
        return {"world": "aws", "table": self.config.table_name}

    def start_upkeep(self) -> Upkeep | None:
        """The outbox sweep (:class:`~celery_workflow._aws.starts.OutboxSweeper`): every minute, what the pending runs
        of the last minutes left unsent (a start whose writer stopped before sending it) is sent. The retention
        travels as deliveries."""
        return OutboxSweeper(self.queue.starts).start()

    def sweep_outbox(self, since: datetime, until: datetime | None = None) -> int:
        """Send what the pending runs created between ``since`` and ``until`` (default: a minute ago) left unsent:
        their start, and outbox entries their writer never published; how many runs had something sent (one
        ``Query`` of the ``list`` index, then their META). A worker's upkeep does this every minute."""
        return self.queue.starts.sweep(since, until)

    def close(self) -> None:
        """Nothing to close: the boto3 clients are the caller's."""


_CLIENTS: weakref.WeakSet[Any] = weakref.WeakSet()


def _fork_safe(*clients: Any) -> None:
    """After a fork (Celery's prefork pool), a child must not share the parent's HTTP connections: botocore's
    connection pools are not fork-safe. The child drops the pools it inherited; the clients open new connections."""
    for client in clients:
        if client is not None:
            try:
                _CLIENTS.add(client)
            except TypeError:  # pragma: no cover - a client that cannot be weakly referenced (a test double)
                pass


def _drop_inherited_connections() -> None:
    for client in list(_CLIENTS):
        session = getattr(getattr(client, "_endpoint", None), "http_session", None)
        close = getattr(session, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # pragma: no cover - best effort: a fresh pool is made on the next request anyway
                pass


os.register_at_fork(after_in_child=_drop_inherited_connections)


def _created_slot(item: Mapping[str, Any]) -> int:
    return int(item.get("created_slot", {}).get("N", "0"))
