"""DynamoDB update expressions applied to an item in memory (not part of the public API).

The cost counter (:mod:`celery_workflow.aws_costs`) keeps a shadow of the items it has seen written, because an
update is billed on the larger of the item's size before and after it. :func:`apply_update` computes the "after":
``SET`` (``path = operand``, ``operand + operand``, ``operand - operand``, ``if_not_exists(path, operand)``,
``list_append(operand, operand)``), ``REMOVE path``, ``ADD path :value`` (numbers and sets) and ``DELETE path
:set``, on attribute paths with ``#names``, ``.`` and ``[index]``. Anything else raises :class:`ExpressionError`
(the counter then says its figure is an estimate).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from celery_workflow.errors import CeleryWorkflowError

__all__ = ["ExpressionError", "apply_update"]

Item = dict[str, Any]
Path = list[str | int]

_SECTION = re.compile(r"\b(SET|REMOVE|ADD|DELETE)\b", re.IGNORECASE)
_PATH_PART = re.compile(r"(#\w+|[A-Za-z_]\w*)|\[(\d+)\]")


class ExpressionError(CeleryWorkflowError, ValueError):
    """An update expression this module does not model."""


def apply_update(
    item: Mapping[str, Any] | None,
    expression: str,
    names: Mapping[str, str] | None = None,
    values: Mapping[str, Any] | None = None,
) -> Item:
    """The item (typed attribute values) after ``expression``; ``item`` is not changed (None: a new item)."""
    names = names or {}
    values = values or {}
    result: Item = copy.deepcopy(dict(item or {}))
    for action, clause in _clauses(expression):
        if action == "SET":
            target, _, operand = clause.partition("=")
            if not _:
                raise ExpressionError(f"SET needs 'path = value': {clause!r}")
            _put(result, _path(target, names), _operand(result, operand.strip(), names, values))
        elif action == "REMOVE":
            _remove(result, _path(clause, names))
        else:
            target, _, value_name = clause.strip().rpartition(" ")
            path, value = _path(target, names), _value(value_name, values)
            current = _get(result, path)
            changed = _add(current, value) if action == "ADD" else _without(current, value)
            if changed is None:
                _remove(result, path)
            else:
                _put(result, path, changed)
    return result


def _clauses(expression: str) -> list[tuple[str, str]]:
    parts = _SECTION.split(expression)
    if parts[0].strip():
        raise ExpressionError(f"an update expression starts with SET, REMOVE, ADD or DELETE: {expression!r}")
    found = []
    for keyword, body in zip(parts[1::2], parts[2::2], strict=True):
        found += [(keyword.upper(), clause) for clause in _split_top(body) if clause.strip()]
    return found


def _split_top(text: str) -> list[str]:
    """``text`` split on the commas outside parentheses."""
    pieces, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            pieces.append(text[start:i])
            start = i + 1
    pieces.append(text[start:])
    return pieces


def _path(text: str, names: Mapping[str, str]) -> Path:
    path: Path = []
    for segment in text.strip().split("."):
        position = 0
        for match in _PATH_PART.finditer(segment):
            if match.start() != position:
                raise ExpressionError(f"not an attribute path: {text!r}")
            position = match.end()
            if match.group(2) is not None:
                path.append(int(match.group(2)))
            else:
                name = match.group(1)
                if name.startswith("#"):
                    if name not in names:
                        raise ExpressionError(f"{name} is not in ExpressionAttributeNames")
                    name = names[name]
                path.append(name)
        if position != len(segment) or not segment:
            raise ExpressionError(f"not an attribute path: {text!r}")
    if not path or not isinstance(path[0], str):
        raise ExpressionError(f"not an attribute path: {text!r}")
    return path


def _value(name: str, values: Mapping[str, Any]) -> Any:
    name = name.strip()
    if name not in values:
        raise ExpressionError(f"{name} is not in ExpressionAttributeValues")
    return copy.deepcopy(values[name])


def _operand(item: Item, text: str, names: Mapping[str, str], values: Mapping[str, Any]) -> Any:
    pieces = _split_arithmetic(text)
    if len(pieces) == 3:
        left = _operand(item, pieces[0], names, values)
        right = _operand(item, pieces[2], names, values)
        if "N" not in left or "N" not in right:
            raise ExpressionError(f"arithmetic needs numbers: {text!r}")
        total = Decimal(left["N"]) + (Decimal(right["N"]) if pieces[1] == "+" else -Decimal(right["N"]))
        return {"N": _number(total)}
    text = text.strip()
    call = re.fullmatch(r"(if_not_exists|list_append)\s*\((.*)\)", text, re.DOTALL)
    if call:
        arguments = _split_top(call.group(2))
        if len(arguments) != 2:
            raise ExpressionError(f"{call.group(1)} takes two arguments: {text!r}")
        if call.group(1) == "if_not_exists":
            existing = _get(item, _path(arguments[0], names))
            return existing if existing is not None else _operand(item, arguments[1], names, values)
        first = _operand(item, arguments[0], names, values)
        second = _operand(item, arguments[1], names, values)
        if "L" not in first or "L" not in second:
            raise ExpressionError(f"list_append needs lists: {text!r}")
        return {"L": first["L"] + second["L"]}
    if text.startswith(":"):
        return _value(text, values)
    found = _get(item, _path(text, names))
    if found is None:
        raise ExpressionError(f"{text} does not exist in the item")
    return found


def _split_arithmetic(text: str) -> list[str]:
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char in "+-" and depth == 0 and i > 0 and text[:i].strip():
            return [text[:i], char, text[i + 1 :]]
    return [text]


def _number(value: Decimal) -> str:
    text = format(value.normalize(), "f")
    return text if "." not in text else text.rstrip("0").rstrip(".")


def _container(node: Any, key: str | int) -> Any:
    if isinstance(key, int):
        return node.get("L") if isinstance(node, dict) else None
    return node.get("M") if isinstance(node, dict) else None


def _get(item: Item, path: Path) -> Any:
    node: Any = item.get(str(path[0]))
    for key in path[1:]:
        inner = _container(node, key)
        if inner is None:
            return None
        node = (inner[key] if key < len(inner) else None) if isinstance(key, int) else inner.get(key)
    return node


def _parent(item: Item, path: Path) -> Any:
    """The dict or list holding the path's last element."""
    if len(path) == 1:
        return item
    node = _get(item, path[:-1])
    inner = _container(node, path[-1])
    if inner is None:
        raise ExpressionError(
            f"the document path {path[:-1]} is not a {'list' if isinstance(path[-1], int) else 'map'}"
        )
    return inner


def _put(item: Item, path: Path, value: Any) -> None:
    parent, key = _parent(item, path), path[-1]
    if isinstance(key, int):
        if key < len(parent):
            parent[key] = value
        else:
            parent.append(value)
    else:
        parent[key] = value


def _remove(item: Item, path: Path) -> None:
    try:
        parent = _parent(item, path)
    except ExpressionError:
        return  # removing under a missing path changes nothing
    key = path[-1]
    if isinstance(key, int):
        if key < len(parent):
            del parent[key]
    else:
        parent.pop(key, None)


def _add(current: Any, value: Any) -> Any:
    if current is None:
        return value
    if "N" in value and "N" in current:
        return {"N": _number(Decimal(current["N"]) + Decimal(value["N"]))}
    (kind, members), *_ = value.items()
    if kind in ("SS", "NS", "BS") and kind in current:
        return {kind: list(current[kind]) + [m for m in members if m not in current[kind]]}
    raise ExpressionError(f"ADD needs a number or a set of the attribute's type, not {kind}")


def _without(current: Any, value: Any) -> Any:
    if current is None:
        return None
    (kind, members), *_ = value.items()
    if kind not in current:
        raise ExpressionError(f"DELETE needs a set of the attribute's type, not {kind}")
    kept = [m for m in current[kind] if m not in members]
    return {kind: kept} if kept else None
