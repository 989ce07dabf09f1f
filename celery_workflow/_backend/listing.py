"""Listing runs the same way in every World: newest first by run id, filters, cursor paging.

:class:`RunFilter` validates the arguments of :meth:`World.list_runs <celery_workflow.world.World.list_runs>` once
(a limit below 1 is a ``ValueError``, an unknown status too) and offers what each kind of backend needs: a SQL
``WHERE`` clause with its parameters, a predicate for an in-memory World, and the cut of one extra row into a
:class:`~celery_workflow.world.Page` whose cursor is the last run id returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery_workflow.events import RunStatus, RunView
from celery_workflow.world import Page

__all__ = ["RunFilter"]


@dataclass(frozen=True, slots=True)
class RunFilter:
    workflow: str | None
    status: RunStatus | None
    limit: int
    cursor: str | None

    @classmethod
    def of(
        cls, *, workflow: str | None = None, status: RunStatus | str | None = None, limit: int = 100,
        cursor: str | None = None,
    ) -> RunFilter:  # fmt: skip
        if limit < 1:
            raise ValueError("limit must be at least 1")
        return cls(workflow, None if status is None else RunStatus(status), limit, cursor)

    def where(self, mark: str) -> tuple[str, list[Any]]:
        """``" WHERE …"`` (or ``""``) and its parameters, with ``mark`` as the placeholder (``?``, ``%s``)."""
        conditions: list[str] = []
        params: list[Any] = []
        for sql, value in (
            ("workflow_name", self.workflow),
            ("status", None if self.status is None else self.status.value),
        ):
            if value is not None:
                conditions.append(f"{sql} = {mark}")
                params.append(value)
        if self.cursor is not None:
            conditions.append(f"run_id < {mark}")
            params.append(self.cursor)
        return (" WHERE " + " AND ".join(conditions) if conditions else ""), params

    def sql(self, columns: str, table: str, mark: str) -> tuple[str, list[Any]]:
        """The whole query: one row more than :attr:`limit`, newest first (pass the rows to :meth:`page`)."""
        where, params = self.where(mark)
        return f"SELECT {columns} FROM {table}{where} ORDER BY run_id DESC LIMIT {mark}", [*params, self.limit + 1]

    def matches(self, run: RunView) -> bool:
        return (
            (self.workflow is None or run.workflow_name == self.workflow)
            and (self.status is None or run.status is self.status)
            and (self.cursor is None or run.run_id < self.cursor)
        )

    def page(self, runs: Sequence[RunView]) -> Page[RunView]:
        """The page of runs read newest first, up to one more than :attr:`limit` (which says there is more)."""
        items = list(runs[: self.limit])
        return Page(items, items[-1].run_id if len(runs) > self.limit else None)
