"""A faster moto for the fan-out bench: ``TransactWriteItems`` without a copy of the whole table per action.

moto 5.x backs a DynamoDB transaction up by deep-copying the whole table once per action (up to 100 times a
transaction) and puts the copy back if the transaction is cancelled; with tens of thousands of items that is most of
what a bench on moto measures (issue #33, item 4). :func:`install` keeps moto's transaction as it is but replaces the
backup with an undo log: the items the transaction names, as they were, put back (or deleted) when it is cancelled.
That is the same outcome only because :class:`celery_workflow.testing.moto_server.MotoServer` serves DynamoDB requests
one at a time (nothing else changes the table during a transaction): use it with that server only, in benches.
"""

from __future__ import annotations

import copy
import json
import types
from typing import Any

__all__ = ["install"]


def install() -> None:
    """Patch moto's ``DynamoDBBackend.transact_write_items`` in this process (idempotent)."""
    from moto.dynamodb import models
    from moto.dynamodb.models.table import Table

    backend = models.DynamoDBBackend
    original = backend.transact_write_items
    if getattr(original, "_undo_log", False):
        return
    active = {"on": False}

    def deepcopy(value: Any, memo: Any = None) -> Any:
        if active["on"] and isinstance(value, Table):
            return value  # moto's whole-table backup: the undo log below stands in for it
        return copy.deepcopy(value, memo)

    setattr(models, "copy", types.SimpleNamespace(copy=copy.copy, deepcopy=deepcopy))  # noqa: B010 - a module global of moto

    def transact_write_items(self: Any, transact_items: list[dict[str, Any]]) -> None:
        undo: list[tuple[str, dict[str, Any], dict[str, Any] | None]] = []
        seen: set[tuple[str, str]] = set()
        for entry in transact_items:
            op = next(iter(entry.values()))
            name = op.get("TableName")
            if name not in self.tables:
                continue
            table = self.tables[name]
            attrs = op["Item"] if "Item" in op else op.get("Key", {})
            key = {table.hash_key_attr: attrs.get(table.hash_key_attr)}
            if table.range_key_attr is not None:
                key[table.range_key_attr] = attrs.get(table.range_key_attr)
            ident = (name, json.dumps(key, sort_keys=True, default=str))
            if ident in seen or None in key.values():
                continue
            seen.add(ident)
            current = self.get_item(name, key)
            undo.append((name, key, None if current is None else copy.deepcopy(current.to_json()["Attributes"])))
        active["on"] = True
        try:
            original(self, transact_items)
        except BaseException:
            for name, key, old in reversed(undo):
                if old is None:
                    if self.get_item(name, key) is not None:
                        self.delete_item(name, key)
                else:
                    self.put_item(name, old)
            raise
        finally:
            active["on"] = False

    transact_write_items._undo_log = True  # type: ignore[attr-defined]
    backend.transact_write_items = transact_write_items  # type: ignore[method-assign]
