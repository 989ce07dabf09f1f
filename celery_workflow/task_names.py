"""The Celery task names of celery_workflow's own deliveries: ``workflow.<name>`` and ``step.<name>``.

Everything that builds a task name of a workflow or step, or reads one back (the app registering its tasks and
handling a stored delivery, the transports telling our deliveries from plain Celery tasks), does it here, so the
prefixes are written once. Flower and ``celery inspect`` show these names: a reader sees what ran.
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

__all__ = [
    "DELIVERY_PREFIXES",
    "STEP_TASK_PREFIX",
    "WORKFLOW_TASK_PREFIX",
    "TaskName",
    "is_delivery_task",
    "parse",
    "python_identifier",
    "step_task_name",
    "workflow_task_name",
]

WORKFLOW_TASK_PREFIX = "workflow."
STEP_TASK_PREFIX = "step."
#: Both prefixes, for ``str.startswith``.
DELIVERY_PREFIXES = (WORKFLOW_TASK_PREFIX, STEP_TASK_PREFIX)


class TaskName(NamedTuple):
    """A task name read back: which kind of delivery, and the workflow's or step's registered name."""

    kind: Literal["workflow", "step"]
    name: str


def workflow_task_name(name: str) -> str:
    """The Celery task name of workflow ``name``'s deliveries."""
    return f"{WORKFLOW_TASK_PREFIX}{name}"


def step_task_name(name: str) -> str:
    """The Celery task name of step ``name``'s deliveries."""
    return f"{STEP_TASK_PREFIX}{name}"


def python_identifier(task_name: str) -> str:
    """A Python identifier for the function behind task ``task_name``: Celery compiles a signature from the
    function's ``__name__`` when the app finalizes, and a registered name may hold dots, dashes or anything else."""
    return re.sub(r"\W", "_", task_name)


def parse(task_name: str) -> TaskName | None:
    """The kind and name of a workflow or step task name; None for any other task (a plain Celery task)."""
    if task_name.startswith(WORKFLOW_TASK_PREFIX):
        return TaskName("workflow", task_name.removeprefix(WORKFLOW_TASK_PREFIX))
    if task_name.startswith(STEP_TASK_PREFIX):
        return TaskName("step", task_name.removeprefix(STEP_TASK_PREFIX))
    return None


def is_delivery_task(task_name: object) -> bool:
    """Whether ``task_name`` (a message's ``task`` header, whatever it holds) names a workflow or step delivery."""
    return isinstance(task_name, str) and task_name.startswith(DELIVERY_PREFIXES)
