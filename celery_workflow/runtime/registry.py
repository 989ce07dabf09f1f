"""What is registered: workflow and step definitions, looked up by name."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from celery_workflow.codec import Signature
from celery_workflow.errors import ConfigurationError, WorkflowNotFound

_NAME = re.compile(r"^[A-Za-z0-9_\-.@/]{1,200}$")


def check_timeout(what: str, timeout: timedelta | float | None) -> timedelta | None:
    """A ``timeout=`` option as a timedelta (a number is seconds); ConfigurationError unless it is positive."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, timedelta | int | float):
        raise ConfigurationError(f"{what}: timeout must be a timedelta or a number of seconds, not {timeout!r}")
    if isinstance(timeout, timedelta):
        value = timeout
    elif math.isfinite(timeout):
        value = timedelta(seconds=timeout)
    else:
        value = timedelta(0)  # NaN and infinities are no duration
    if not value > timedelta(0):
        raise ConfigurationError(f"{what}: timeout must be a positive duration, not {timeout!r}")
    return value


def check_name(kind: str, name: str) -> str:
    if not _NAME.match(name):
        raise ConfigurationError(f"invalid {kind} name {name!r}: use letters, digits and _ - . @ / (1-200 characters)")
    return name


@dataclass(eq=False)
class StepDef:
    name: str
    func: Callable[..., Any]
    max_retries: int = 3
    queue: str | None = None
    retry_backoff: float = 1.0  # first retry delay in seconds; doubles per attempt, capped at 300 s
    #: how long one attempt may run: past it the attempt fails (StepTimedOut); the step then runs as its own
    #: delivery, under the worker's time limits
    timeout: timedelta | None = None
    signature: Signature = field(init=False)

    def __post_init__(self) -> None:
        check_name("step", self.name)
        if self.max_retries < 0:
            raise ConfigurationError(f"step {self.name}: max_retries must be >= 0")
        if self.retry_backoff < 0:
            raise ConfigurationError(f"step {self.name}: retry_backoff must be >= 0")
        self.timeout = check_timeout(f"step {self.name}", self.timeout)
        self.signature = Signature(self.func)


@dataclass(eq=False)
class WorkflowDef:
    name: str
    func: Callable[..., Any]
    queue: str | None = None
    #: how long a run may take from its start (recorded as its deadline when it is created)
    timeout: timedelta | None = None
    signature: Signature = field(init=False)

    def __post_init__(self) -> None:
        check_name("workflow", self.name)
        self.timeout = check_timeout(f"workflow {self.name}", self.timeout)
        self.signature = Signature(self.func)


class Registry:
    """Workflows and steps by name. Names are what runs record, so they must stay stable across deploys."""

    def __init__(self) -> None:
        self.workflows: dict[str, WorkflowDef] = {}
        self.steps: dict[str, StepDef] = {}

    def add_workflow(self, wdef: WorkflowDef) -> None:
        existing = self.workflows.get(wdef.name)
        if existing is not None and existing.func is not wdef.func:
            raise ConfigurationError(f"a workflow named {wdef.name!r} is already registered")
        self.workflows[wdef.name] = wdef

    def add_step(self, sdef: StepDef) -> None:
        existing = self.steps.get(sdef.name)
        if existing is not None and existing.func is not sdef.func:
            raise ConfigurationError(f"a step named {sdef.name!r} is already registered")
        self.steps[sdef.name] = sdef

    def workflow(self, name: str) -> WorkflowDef:
        try:
            return self.workflows[name]
        except KeyError:
            raise WorkflowNotFound(f"no workflow named {name!r} is registered") from None

    def step(self, name: str) -> StepDef:
        try:
            return self.steps[name]
        except KeyError:
            raise WorkflowNotFound(f"no step named {name!r} is registered") from None
