"""The actions of an AWS World append's ``TransactWriteItems`` (not part of the public API).

:func:`append_actions` turns a plan of the append template into the transaction's actions (the ``META`` update, the
events' item, the earlier items' time to live at a run's end, the waits, hooks and tokens it changes, the new
``QUEUE#`` records) and a run end's deletes of what the run still has; :func:`transaction_size` measures a
transaction as DynamoDB's 4 MB limit does. :mod:`celery_workflow._aws.append` sends them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery_workflow import ids, rules
from celery_workflow._aws.append_meta import AppendTx, meta_update, typed
from celery_workflow._aws.items import (
    CODEC,
    hook_item,
    item_size,
    retained_item,
    token_item,
    value_size,
    view_item,
)
from celery_workflow._aws.log import pack_items
from celery_workflow._aws.queue import Record
from celery_workflow._aws.table import MAX_ITEM_BYTES, META, TTL_ATTRIBUTE, hook_pk, run_pk, token_pk, wait_sk
from celery_workflow._backend.records import MUTABLE, created_slots
from celery_workflow._backend.template import AppendRequest
from celery_workflow.errors import EventTooLarge
from celery_workflow.events import EventType

if TYPE_CHECKING:
    from celery_workflow._aws.world import AWSWorld

__all__ = ["append_actions", "transaction_size", "update_action"]


def update_action(table: str, key: dict[str, str], values: dict[str, Any], condition: str) -> dict[str, Any]:
    """A transaction ``Update`` that sets ``values`` (a None value removes the attribute) under ``condition``."""
    names: dict[str, str] = {}
    attrs: dict[str, Any] = {}
    sets, removes = [], []
    for i, (name, value) in enumerate(values.items()):
        names[f"#a{i}"] = name
        if value is None:
            removes.append(f"#a{i}")
        else:
            attrs[f":a{i}"] = value
            sets.append(f"#a{i} = :a{i}")
    expression = ("SET " + ", ".join(sets) if sets else "") + (" REMOVE " + ", ".join(removes) if removes else "")
    update: dict[str, Any] = {
        "TableName": table,
        "Key": {k: {"S": v} for k, v in key.items()},
        "UpdateExpression": expression.strip(),
        "ConditionExpression": condition,
        "ExpressionAttributeNames": names,
    }
    if attrs:
        update["ExpressionAttributeValues"] = attrs
    return {"Update": update}


def append_actions(
    world: AWSWorld, tx: AppendTx, request: AppendRequest, plan: rules.Plan, records: list[Record]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The transaction's actions, and a run end's deletes of the hooks, tokens and waits the run still has
    (tokens first, then hooks, then waits: as many go in the transaction as fit, the rest right after it)."""
    table = world.table.name
    run = plan.run
    pk = run_pk(run.run_id)
    actions: list[dict[str, Any]] = []
    cleanup: list[dict[str, Any]] = []

    def lived(item: dict[str, Any]) -> dict[str, Any]:
        return item if tx.ttl is None else {**item, TTL_ATTRIBUTE: {"N": str(tx.ttl)}}

    def put(item: dict[str, Any], condition: str | None = None, values: dict[str, Any] | None = None) -> None:
        size = item_size(item)
        if size > MAX_ITEM_BYTES:
            raise EventTooLarge(
                f"an item of {size} bytes exceeds DynamoDB's {MAX_ITEM_BYTES} bytes ({item['sk']['S']} of {item['pk']['S']})"
            )
        action: dict[str, Any] = {"TableName": table, "Item": item}
        if condition:
            action["ConditionExpression"] = condition
        if values:
            action["ExpressionAttributeValues"] = values
        actions.append({"Put": action})

    def delete(
        key: dict[str, str],
        condition: str | None = None,
        values: dict[str, Any] | None = None,
        *,
        to: list[dict[str, Any]] = actions,
    ) -> None:
        action: dict[str, Any] = {"TableName": table, "Key": {k: {"S": v} for k, v in key.items()}}
        if condition:
            action["ConditionExpression"] = condition
        if values:
            action["ExpressionAttributeValues"] = values
        to.append({"Delete": action})

    actions.append(meta_update(world, tx, plan, records, request.write_id))
    if not plan.events:
        for record in records:
            put(record.item())
        return actions, cleanup
    for item in pack_items(plan.events, request.write_id, tx.ttl):  # see celery_workflow._aws.log
        put(item, "attribute_not_exists(pk)")
        tx.written[item["sk"]["S"]] = item_size(item)
    if tx.ttl_only and tx.earlier is not None:  # the run's items written before: DynamoDB deletes them too
        ttl = {TTL_ATTRIBUTE: {"N": str(tx.ttl)}}
        for sk in sorted(tx.earlier):
            actions.append(update_action(table, {"pk": pk, "sk": sk}, ttl, "attribute_exists(pk)"))
    created = created_slots(plan.events)
    for wait_id, view in plan.waits.items():  # steps have no items: their views are the log's
        slot = created.get((EventType.WAIT_CREATED, wait_id))
        if slot is not None:
            put(lived(view_item("waits", view, slot)), "attribute_not_exists(pk)")
            continue
        values = CODEC.record("waits", view, created_slot=None)
        changed = {c: typed(values[c]) for c in MUTABLE["waits"]}
        if tx.ttl is not None:
            changed[TTL_ATTRIBUTE] = {"N": str(tx.ttl)}
        actions.append(update_action(table, {"pk": pk, "sk": wait_sk(wait_id)}, changed, "attribute_exists(pk)"))
    released = {hook.token: hook_id for hook_id, hook in plan.hooks_deleted.items()}  # token -> its hook here
    deleted = set(plan.hooks_deleted)
    if plan.run_ended:  # every live hook of the run goes, not only those the batch named
        released.update({token: hook_id for hook_id, token in tx.hooks.items()})
        deleted.update(tx.hooks)
    moved: set[str] = set()
    for hook_id, hook in plan.hooks_inserted.items():
        slot = created[(EventType.HOOK_CREATED, hook_id)]
        put(hook_item(hook, slot), "attribute_not_exists(pk)")
        previous = released.get(hook.token)
        held = tx.retained.get(hook.token) if hook.token in plan.tokens_reclaimed else None
        if held is not None:  # an ended run's retention is over: replace its holding, as it was read
            put(
                token_item(hook, slot),
                "run_id = :r AND hook_id = :h AND retained_until = :u",
                {":r": {"S": held.run_id}, ":h": {"S": held.hook_id}, ":u": {"N": str(ids.to_micros(held.until))}},
            )
        elif previous is None:
            put(token_item(hook, slot), "attribute_not_exists(pk)")
        else:  # a token released and claimed again in one batch: one write of its item
            moved.add(hook.token)
            put(
                token_item(hook, slot),
                "run_id = :r AND hook_id = :h",
                {":r": {"S": run.run_id}, ":h": {"S": previous}},
            )
    # a run's end: its hooks, tokens and waits, however many, go to the cleanup (see write); the tokens the rules
    # retain become the ended run's holdings instead (a hook of this very batch has no token item yet)
    gone = cleanup if plan.run_ended else actions
    for kept in plan.tokens_retained.values():
        action: dict[str, Any] = {
            "TableName": table,
            "Item": retained_item(kept),
            "ConditionExpression": "attribute_not_exists(pk) OR (run_id = :r AND hook_id = :h)",
            "ExpressionAttributeValues": {":r": {"S": run.run_id}, ":h": {"S": kept.hook_id}},
        }
        cleanup.append({"Put": action})
    for token, hook_id in released.items():
        if token not in moved and token not in plan.tokens_retained:
            delete(
                {"pk": token_pk(token), "sk": META},
                "attribute_not_exists(pk) OR (run_id = :r AND hook_id = :h)",
                {":r": {"S": run.run_id}, ":h": {"S": hook_id}},
                to=gone,
            )
    for hook_id in sorted(deleted):
        delete({"pk": hook_pk(run.run_id, hook_id), "sk": META}, to=gone)
    if plan.run_ended:
        for wait_id in tx.waits:
            if wait_id not in plan.waits:
                delete({"pk": pk, "sk": wait_sk(wait_id)}, to=gone)
    for record in records:
        put(record.item())
    return actions, cleanup


def transaction_size(actions: list[dict[str, Any]]) -> int:
    """The aggregate size of a transaction's items as :data:`MAX_TRANSACTION_BYTES` measures it: every Put's item,
    every Update's key and values, every Delete's key."""
    total = 0
    for action in actions:
        ((kind, body),) = action.items()
        if kind == "Put":
            total += item_size(body["Item"])
        else:
            total += item_size(body["Key"]) + sum(
                value_size(v) for v in body.get("ExpressionAttributeValues", {}).values()
            )
    return total
