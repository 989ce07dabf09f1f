"""Retention of the AWS World after a retention was lengthened (not part of the public API).

A run's end writes its retention's end as the time to live of the run's items and, when it may, queues no expiry
(:mod:`celery_workflow._aws.append`): nothing comes back to such a run before DynamoDB deletes it. A retention
lengthened later (``Config.Retention`` / ``Retentions``) would not reach it; :func:`outlive_runs` walks the ended runs
(through the ``list`` / ``list_group`` index) and gives those whose time to live ends before their retention now says
the later one, on each item (:meth:`~celery_workflow._aws.world.AWSWorld._outlive`: a write each). Run it once after
lengthening a retention (``AWSWorld.outlive_runs``). Runs whose end queued the expiry are extended by that expiry's
delivery as well (it is deferred when it comes early); runs already past their time to live are gone and stay so.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from celery_workflow import ids, rules
from celery_workflow._aws.items import from_item, run_of
from celery_workflow._aws.table import META, TTL_ATTRIBUTE, expired, run_pk

if TYPE_CHECKING:
    from celery_workflow._aws.world import AWSWorld

__all__ = ["outlive_runs"]


def outlive_runs(world: AWSWorld, workflow: str | None = None) -> int:
    """Give every ended run (of ``workflow``, else of every workflow) whose time to live ends before its retention
    now says the later one; returns how many runs were extended. Reads every run's META (an index ``Query``, then
    ``BatchGetItem``): an operator's step after lengthening a retention, not a routine."""
    index, key, value = (
        ("list", "list_pk", "RUNS") if workflow is None else ("list_group", "list_group_pk", f"RUNS#{workflow}")
    )
    found = world.table.query(
        "Query (outlive runs)",
        IndexName=index,
        KeyConditionExpression="#k = :k",
        ExpressionAttributeNames={"#k": key},
        ExpressionAttributeValues={":k": {"S": value}},
    )
    run_ids = [item["pk"]["S"][len("RUN#") :] for item in found]
    extended = 0
    for at in range(0, len(run_ids), 100):
        keys = [{"pk": run_pk(r), "sk": META} for r in run_ids[at : at + 100]]
        for meta in world.table.get_many(keys, raw=True):
            if TTL_ATTRIBUTE in meta and not expired(meta) and _outlived(world, meta):
                extended += 1
    return extended


def _outlived(world: AWSWorld, meta: dict[str, Any]) -> bool:
    run = run_of(meta)
    retained = [ids.from_micros(int(u)) for u in (from_item(meta).get("retained") or {}).values()]
    due = rules.expires_at(run, world.config.retention_of(run.workflow_name), retained)
    if due is None or math.ceil(due.timestamp()) <= int(meta[TTL_ATTRIBUTE]["N"]):
        return False
    world._outlive(run.run_id, meta, due)
    return True
