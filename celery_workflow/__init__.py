"""celery_workflow: durable workflows on Celery.

A workflow is a decorated function that calls durable steps, sleeps, waits for hooks and webhooks, and streams
progress. Its state is an event log in a World (embedded SQLite by default); its deliveries are Celery task messages.
"""

from __future__ import annotations

from celery_workflow.app import Step, Workflow, Workflows
from celery_workflow.client import Run
from celery_workflow.errors import (
    CeleryWorkflowError,
    ConfigurationError,
    EventRejected,
    FatalError,
    HookConflict,
    HookNotFound,
    PayloadError,
    ReplayDivergence,
    ResultTimeout,
    RetryableError,
    RunCancelled,
    RunNotFound,
    RunTerminal,
    RunTimedOut,
    StepFailed,
    StepTimedOut,
    WorkflowFailed,
    WorkflowNotFound,
    WorldError,
    WorldUnavailable,
)
from celery_workflow.events import Event, EventType, RunStatus, StepStatus
from celery_workflow.runtime.children import ChildRun
from celery_workflow.runtime.context import (
    Hook,
    StepFuture,
    StepMetadata,
    StreamWriter,
    Webhook,
    WebhookRequest,
    WorkflowMetadata,
    continue_as_new,
    create_hook,
    create_webhook,
    gather,
    get_writable,
    now,
    patched,
    random,
    sleep,
    step_metadata,
    uuid4,
    workflow_metadata,
)

__version__ = "0.1.0"

__all__ = [
    "CeleryWorkflowError",
    "ChildRun",
    "ConfigurationError",
    "Event",
    "EventRejected",
    "EventType",
    "FatalError",
    "Hook",
    "HookConflict",
    "HookNotFound",
    "PayloadError",
    "ReplayDivergence",
    "ResultTimeout",
    "RetryableError",
    "Run",
    "RunCancelled",
    "RunNotFound",
    "RunStatus",
    "RunTerminal",
    "RunTimedOut",
    "Step",
    "StepFailed",
    "StepFuture",
    "StepMetadata",
    "StepStatus",
    "StepTimedOut",
    "StreamWriter",
    "Webhook",
    "WebhookRequest",
    "Workflow",
    "WorkflowFailed",
    "WorkflowMetadata",
    "WorkflowNotFound",
    "Workflows",
    "WorldError",
    "WorldUnavailable",
    "__version__",
    "continue_as_new",
    "create_hook",
    "create_webhook",
    "gather",
    "get_writable",
    "now",
    "patched",
    "random",
    "sleep",
    "step_metadata",
    "uuid4",
    "workflow_metadata",
]
