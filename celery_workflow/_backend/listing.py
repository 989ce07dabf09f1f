"""Listing runs the same way in every World: newest first by creation time (ties by run id), filters, cursor paging.

:class:`RunFilter` validates the arguments of :meth:`World.list_runs <celery_workflow.world.World.list_runs>` once
(a limit below 1 is a ``ValueError``, an unknown status too, a cursor no listing returned an
:class:`~celery_workflow.errors.InvalidCursor`) and offers what each kind of backend needs: a SQL ``WHERE`` clause
with its parameters, a predicate for an in-memory World, and the cut of one extra row into a
:class:`~celery_workflow.world.Page`.

The order is the run's ``created_at``, newest first, then its run id (descending) among runs created in the same
microsecond: what a caller sees as "newest" whatever ids it chose (run ids are caller-chosen; only generated ones sort
by time). A cursor is the position of the last run returned, ``<created_at in µs, 16 digits>#<run id>`` (the sort
key of the AWS World's listing index, so its cursors read the same), and the next page is the keyset after it:
``(created_at, run_id) < (cursor's)``, one index range in every SQL World.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from celery_workflow import ids
from celery_workflow.errors import InvalidCursor
from celery_workflow.events import RunStatus, RunView
from celery_workflow.world import Page

__all__ = ["RunFilter", "position", "position_of"]

_CURSOR = re.compile(r"([0-9]{16})#(.+)", re.DOTALL)


def position(run: RunView) -> str:
    """The cursor that points after ``run`` (its creation time in µs, zero-padded, then its id)."""
    return f"{ids.to_micros(run.created_at):016d}#{run.run_id}"


def position_of(cursor: str) -> tuple[int, str]:
    """The (creation time in µs, run id) a cursor names; InvalidCursor for anything no listing returned."""
    found = _CURSOR.fullmatch(cursor)
    if found is None or _unencodable(found.group(2)):
        raise InvalidCursor(f"not a cursor of list_runs: {cursor[:100]!r}")
    return int(found.group(1)), found.group(2)


def _unencodable(text: str) -> bool:
    """Whether ``text`` has no UTF-8 form (a lone surrogate): no stored run id has one."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


@dataclass(frozen=True, slots=True)
class RunFilter:
    workflow: str | None
    status: RunStatus | None
    limit: int
    cursor: tuple[int, str] | None  # (created_at in µs, run id) of the last run of the previous page
    run_id_prefix: str | None = None
    created_from: int | None = None  # µs, inclusive
    created_until: int | None = None  # µs, exclusive

    @classmethod
    def of(
        cls, *, workflow: str | None = None, status: RunStatus | str | None = None, limit: int = 100,
        cursor: str | None = None, run_id_prefix: str | None = None, created_from: datetime | None = None,
        created_until: datetime | None = None,
    ) -> RunFilter:  # fmt: skip
        """``ValueError`` for a limit below 1, an unknown status, an empty or unencodable run id prefix, or a naive
        time; ``InvalidCursor`` for a cursor no listing returned."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        if run_id_prefix is not None and (run_id_prefix == "" or _unencodable(run_id_prefix)):
            raise ValueError("run_id_prefix must be a non-empty string")
        return cls(
            workflow,
            None if status is None else RunStatus(status),
            limit,
            None if cursor is None else position_of(cursor),
            run_id_prefix,
            None if created_from is None else ids.to_micros(ids.to_utc(created_from)),
            None if created_until is None else ids.to_micros(ids.to_utc(created_until)),
        )

    def where(self, mark: str, time: Callable[[datetime], Any]) -> tuple[str, list[Any]]:
        """``" WHERE …"`` (or ``""``) and its parameters, with ``mark`` as the placeholder (``?``, ``%s``) and
        ``time`` turning a creation time into the stored value."""
        conditions: list[str] = []
        params: list[Any] = []
        for sql, value in (
            ("workflow_name", self.workflow),
            ("status", None if self.status is None else self.status.value),
        ):
            if value is not None:
                conditions.append(f"{sql} = {mark}")
                params.append(value)
        if self.run_id_prefix is not None:
            conditions.append(f"substr(run_id, 1, {len(self.run_id_prefix)}) = {mark}")
            params.append(self.run_id_prefix)
        if self.created_from is not None:
            conditions.append(f"created_at >= {mark}")
            params.append(time(ids.from_micros(self.created_from)))
        if self.created_until is not None:
            conditions.append(f"created_at < {mark}")
            params.append(time(ids.from_micros(self.created_until)))
        if self.cursor is not None:
            micros, run_id = self.cursor
            conditions.append(f"(created_at, run_id) < ({mark}, {mark})")
            params += [time(ids.from_micros(micros)), run_id]
        return (" WHERE " + " AND ".join(conditions) if conditions else ""), params

    def sql(self, columns: str, table: str, mark: str, time: Callable[[datetime], Any]) -> tuple[str, list[Any]]:
        """The whole query: one row more than :attr:`limit`, newest first (pass the rows to :meth:`page`)."""
        where, params = self.where(mark, time)
        return (
            f"SELECT {columns} FROM {table}{where} ORDER BY created_at DESC, run_id DESC LIMIT {mark}",
            [*params, self.limit + 1],
        )

    def matches(self, run: RunView) -> bool:
        created = ids.to_micros(run.created_at)
        return (
            (self.workflow is None or run.workflow_name == self.workflow)
            and (self.status is None or run.status is self.status)
            and (self.run_id_prefix is None or run.run_id.startswith(self.run_id_prefix))
            and (self.created_from is None or created >= self.created_from)
            and (self.created_until is None or created < self.created_until)
            and (self.cursor is None or (created, run.run_id) < self.cursor)
        )

    @staticmethod
    def newest_first(runs: Sequence[RunView]) -> list[RunView]:
        """``runs`` in listing order (for a World that sorts in memory)."""
        return sorted(runs, key=lambda run: (ids.to_micros(run.created_at), run.run_id), reverse=True)

    def page(self, runs: Sequence[RunView]) -> Page[RunView]:
        """The page of runs read newest first, up to one more than :attr:`limit` (which says there is more)."""
        items = list(runs[: self.limit])
        return Page(items, position(items[-1]) if len(runs) > self.limit else None)
