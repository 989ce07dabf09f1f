"""DynamoDB attribute values and the items the AWS World stores views in (not part of the public API).

The World talks to DynamoDB's low-level API, so values travel in its typed form (``{"S": …}``, ``{"N": …}``,
``{"B": …}``, ``{"BOOL": …}``, ``{"M": …}``, ``{"L": …}``, ``{"SS": …}``). :func:`attr` / :func:`plain` convert
Python values both ways (integers only: times are microseconds since the epoch, never floats), and :data:`CODEC`
maps views to records with the shared :class:`~celery_workflow._backend.records.RecordCodec`: JSON values are
codec-tagged binary, times microseconds.

:func:`item_size` is DynamoDB's own measure of an item (attribute names plus values), so an oversized write is
refused here, with a clear error, before it reaches the service.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_workflow import ids
from celery_workflow._aws.table import META, hook_pk, list_sk, run_pk, step_sk, token_pk, wait_sk
from celery_workflow._backend.records import RecordCodec
from celery_workflow.events import HookView, RunView, StepView, WaitView
from celery_workflow.rules import RetainedToken

__all__ = ["CODEC", "attr", "hook_item", "item_size", "plain", "run_item", "value_size", "view_item"]

Item = dict[str, Any]


def _from_micros(value: Any) -> Any:
    return ids.from_micros(int(value))


CODEC = RecordCodec(time_out=ids.to_micros, time_in=_from_micros)


def attr(value: Any) -> dict[str, Any]:
    """The DynamoDB attribute value of a Python value (str, int, bytes, bool, None, dict, list, set of str)."""
    if value is None:
        return {"NULL": True}
    if isinstance(value, bool):
        return {"BOOL": value}
    if isinstance(value, int):
        return {"N": str(value)}
    if isinstance(value, str):
        return {"S": value}
    if isinstance(value, bytes | bytearray | memoryview):
        return {"B": bytes(value)}
    if isinstance(value, Mapping):
        return {"M": {str(k): attr(v) for k, v in value.items()}}
    if isinstance(value, set | frozenset):
        return {"SS": sorted(str(v) for v in value)}
    if isinstance(value, list | tuple):
        return {"L": [attr(v) for v in value]}
    raise TypeError(f"no DynamoDB attribute for {type(value).__name__}")


def plain(value: Mapping[str, Any]) -> Any:
    """The Python value of a DynamoDB attribute value (numbers come back as int)."""
    (kind, inner), *_ = value.items()
    if kind == "NULL":
        return None
    if kind in ("S", "BOOL"):
        return inner
    if kind == "N":
        return int(inner)
    if kind == "B":
        return bytes(inner)
    if kind == "M":
        return {k: plain(v) for k, v in inner.items()}
    if kind == "L":
        return [plain(v) for v in inner]
    if kind in ("SS", "NS", "BS"):
        return {plain({kind[0]: v}) for v in inner}
    raise TypeError(f"unknown DynamoDB attribute type {kind}")


def to_item(values: Mapping[str, Any]) -> Item:
    """An item from plain values; None values are left out (DynamoDB items have no null columns here)."""
    return {name: attr(value) for name, value in values.items() if value is not None}


def from_item(item: Mapping[str, Any]) -> dict[str, Any]:
    return {name: plain(value) for name, value in item.items()}


def item_size(item: Mapping[str, Any]) -> int:
    """The size DynamoDB counts for an item (typed attribute values): every attribute name plus its value.

    Strings are their UTF-8 bytes, binaries their bytes, a number 1 byte per two significant digits plus 1 (leading
    and trailing zeros trimmed, 21 at most), booleans and nulls 1, maps and lists 3 bytes plus 1 per element (and a
    map's keys), sets the sum of their members."""
    return sum(len(name.encode()) + value_size(value) for name, value in item.items())


def number_size(text: str) -> int:
    """The bytes DynamoDB stores a number in: 1 per two significant digits, plus 1 (21 at most)."""
    mantissa, _, _ = text.strip().lower().partition("e")
    digits = mantissa.lstrip("+-").replace(".", "").lstrip("0").rstrip("0")
    return min(21, (len(digits) + 1) // 2 + 1)


def value_size(value: Mapping[str, Any]) -> int:
    """The size of one typed attribute value (``{"S": "…"}``, ``{"N": "…"}``, ``{"M": {…}}`` …)."""
    (kind, inner), *_ = value.items()
    if kind == "S":
        return len(str(inner).encode())
    if kind == "B":
        return len(inner)
    if kind == "N":
        return number_size(str(inner))
    if kind in ("BOOL", "NULL"):
        return 1
    if kind == "M":
        return 3 + sum(len(k.encode()) + value_size(v) + 1 for k, v in inner.items())
    if kind == "L":
        return 3 + sum(value_size(v) + 1 for v in inner)
    if kind == "SS":
        return sum(len(v.encode()) for v in inner)
    if kind == "NS":
        return sum(number_size(str(v)) for v in inner)
    if kind == "BS":
        return sum(len(v) for v in inner)
    raise ValueError(f"not a DynamoDB attribute value: {kind!r}")


# -- the items views live in -----------------------------------------------------------------------------------------


def run_item(run: RunView, *, hooks: Mapping[str, str] | None = None, record: Mapping[str, Any] | None = None) -> Item:
    """The run's META item: its view, the live hooks (id -> token) and the index attributes. ``record``: the view's
    ``CODEC.record("runs", run)`` when the caller has it already."""
    created = ids.to_micros(run.created_at)
    values: dict[str, Any] = {
        "pk": run_pk(run.run_id),
        "sk": META,
        **(record if record is not None else CODEC.record("runs", run)),
        "hooks": dict(hooks or {}),
        "list_pk": "RUNS",
        "list_sk": list_sk(created, run.run_id),
        "list_group_pk": f"RUNS#{run.workflow_name}",
        "list_group_sk": list_sk(created, run.run_id),
    }
    return to_item(values)


def run_of(item: Mapping[str, Any]) -> RunView:
    return CODEC.run(from_item(item))


def view_item(table: str, view: StepView | WaitView, created_slot: int | None) -> Item:
    """The item of a wait (``table`` ``waits``) view in its run's partition; of a step's (``steps``): the ``STEP#``
    item earlier versions wrote (steps have no items now: :mod:`celery_workflow._aws.log`)."""
    sk = step_sk(view.step_id) if isinstance(view, StepView) else wait_sk(view.wait_id)
    return to_item({"pk": run_pk(view.run_id), "sk": sk, **CODEC.record(table, view, created_slot=created_slot)})


def hook_item(hook: HookView, created_slot: int) -> Item:
    """The live hook's item, in the ``list`` (``HOOKS``) and ``list_group`` (``HOOKS#<runId>``) indexes."""
    created = ids.to_micros(hook.created_at)
    return to_item(
        {
            "pk": hook_pk(hook.run_id, hook.hook_id),
            "sk": META,
            **CODEC.record("hooks", hook, created_slot=created_slot),
            "list_pk": "HOOKS",
            "list_sk": list_sk(created, hook.run_id, hook.hook_id),
            "list_group_pk": f"HOOKS#{hook.run_id}",
            "list_group_sk": list_sk(created, hook.hook_id),
        }
    )


def token_item(hook: HookView, created_slot: int) -> Item:
    """The token's owner: the live hook's view, so a token finds its hook in one read."""
    return to_item({"pk": token_pk(hook.token), "sk": META, **CODEC.record("hooks", hook, created_slot=created_slot)})


#: A run's META attribute holding the token retention end (microseconds) of its live hook ``<hookId>`` that asked for
#: one: ``retention#<hookId>`` (top-level attributes, so runs written before them take them with a plain SET).
RETENTION_PREFIX = "retention#"


def retained_item(held: RetainedToken) -> Item:
    """The ``TOKEN#`` item of a token its ended run retains (see :mod:`celery_workflow.rules`): its holder and the end
    of the retention (``retained_until``, which a live hook's token item never has)."""
    return to_item(
        {
            "pk": token_pk(held.token),
            "sk": META,
            "token": held.token,
            "run_id": held.run_id,
            "hook_id": held.hook_id,
            "retained_until": ids.to_micros(held.until),
        }
    )


def retained_of(item: Mapping[str, Any]) -> RetainedToken | None:
    """The holding a ``TOKEN#`` item describes when its ended run retains the token; None for a live hook's."""
    if "retained_until" not in item:
        return None
    v = from_item(item)
    return RetainedToken(
        str(v["run_id"]), str(v["hook_id"]), str(v["token"]), ids.from_micros(int(v["retained_until"]))
    )


def retentions_of(run_id: str, meta: Mapping[str, Any]) -> dict[str, RetainedToken]:
    """The token retentions of a run's live hooks, by hook id, from its META item (``hooks`` and
    :data:`RETENTION_PREFIX` attributes)."""
    v = from_item(meta)
    hooks = v.get("hooks") or {}
    out: dict[str, RetainedToken] = {}
    for name, until in v.items():
        if name.startswith(RETENTION_PREFIX) and (hook_id := name[len(RETENTION_PREFIX) :]) in hooks:
            out[hook_id] = RetainedToken(run_id, hook_id, str(hooks[hook_id]), ids.from_micros(int(until)))
    return out


def view_of(table: str, item: Mapping[str, Any]) -> Any:
    """The view of a step, hook (or token owner) or wait item."""
    return CODEC.view(table, from_item(item))
