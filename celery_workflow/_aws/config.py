"""Configuration of the AWS World: :class:`AWSConfig`, :class:`QueueConfig`, :class:`SchedulerConfig`.

Everything is checked when the config is built, before any AWS call, and a mistake is a
:class:`~celery_workflow.errors.ConfigurationError` naming the field:

* a route to a queue that ``queues`` does not name;
* a FIFO queue without a Scheduler (FIFO queues take no per-message delay: every delayed FIFO delivery goes through
  the Scheduler into the run's message group);
* a FIFO queue, or any queue when a Scheduler is set, without its ARN (the ARN is the Scheduler's target);
* a retention over 15 minutes without a Scheduler (the expiry is a delivery due that far ahead);
* an empty (or blank) table name, queue URL or ARN, queue or workflow name, Scheduler ARN or group, or an empty
  ``base_url`` / ``control_url`` (None means none);
* a FIFO default queue (``queue_url``: it carries every unrouted workflow without a message group), and a queue in
  ``queues`` under the default queue's name.

:meth:`AWSConfig.from_env` reads the Terraform module's ``environment`` output: ``WORKFLOW_TABLE``,
``WORKFLOW_QUEUE_URL``, ``WORKFLOW_QUEUES`` (JSON ``{"<name>": {"url": …, "arn": …, "fifo": false}}``),
``WORKFLOW_QUEUE_ARN``, ``WORKFLOW_SCHEDULER_GROUP``, ``WORKFLOW_SCHEDULER_ROLE_ARN``, and ``WORKFLOW_BASE_URL``,
``WORKFLOW_CONTROL_URL``. boto3 clients built there take no arguments, so ``AWS_ENDPOINT_URL``, the region and the
credentials come from the environment as boto3 reads them: the same code runs against AWS and an emulator.

Time bounds: a boto3 client built without a ``config`` uses botocore's defaults, 60 s to connect, 60 s per read and
(legacy retry mode) up to 5 attempts, 10 for DynamoDB, so an unreachable endpoint can hold one call for many minutes
before the World raises :class:`~celery_workflow.errors.WorldUnavailable`. :func:`client_config` is a botocore
``Config`` under which a call gives up within about a given time (10 s by default); :meth:`AWSConfig.from_env` builds
the Scheduler client with it. Pass it to the clients you give the World (``boto3.client("dynamodb",
config=client_config())``); an SQS client whose ``receive_message`` long-polls needs ``long_poll=20`` on top.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from celery_workflow.errors import ConfigurationError
from celery_workflow.world import DEFAULT_QUEUE

__all__ = ["MAX_SQS_DELAY", "AWSConfig", "QueueConfig", "SchedulerConfig", "client_config"]

#: The longest per-message delay SQS takes (DelaySeconds); later deliveries go through the Scheduler.
MAX_SQS_DELAY = timedelta(minutes=15)

#: Attempts per call under :func:`client_config` (botocore's "standard" retry mode: throttling and transient errors).
CLIENT_ATTEMPTS = 2


def client_config(unavailable_timeout: float = 10.0, *, long_poll: float = 0.0) -> Any:
    """A ``botocore.config.Config`` under which one call of a boto3 client gives up within about
    ``unavailable_timeout`` seconds when the endpoint is unreachable or does not answer (the World then raises
    :class:`~celery_workflow.errors.WorldUnavailable`).

    :data:`CLIENT_ATTEMPTS` attempts in the "standard" retry mode share the bound, less a tenth (at most 1 s) set
    aside for the backoff between them. Within an attempt botocore may wait for a read twice (it opens a second
    connection after a read timeout: measured with botocore 1.43), so the read timeout is half of what the attempt has
    left after a third of it for connecting. botocore has no deadline for a whole call: the bound is approximate.
    ``long_poll``: seconds added to the read timeout for a client whose calls wait on purpose (SQS
    ``receive_message`` with ``WaitTimeSeconds``)."""
    if not unavailable_timeout > 0 or not long_poll >= 0:
        raise ConfigurationError("client_config: unavailable_timeout must be positive and long_poll not negative")
    from botocore.config import Config

    per_attempt = (unavailable_timeout - min(1.0, unavailable_timeout / 10)) / CLIENT_ATTEMPTS
    connect = per_attempt / 3
    return Config(
        connect_timeout=connect,
        read_timeout=(per_attempt - connect) / 2 + long_poll,
        retries={"mode": "standard", "max_attempts": CLIENT_ATTEMPTS},
    )


@dataclass(frozen=True)
class QueueConfig:
    """An SQS queue: its URL, its ARN (needed for FIFO queues and when a Scheduler is set) and whether it is FIFO."""

    url: str
    arn: str | None = None
    fifo: bool = False

    @property
    def name(self) -> str:
        """The queue's name (the last part of its URL)."""
        return self.url.rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class SchedulerConfig:
    """EventBridge Scheduler: a boto3 ``scheduler`` client, the default queue's ARN (``target_arn``), the role the
    Scheduler assumes to send to the queues, and the schedule group."""

    client: Any
    target_arn: str
    role_arn: str
    group: str = "default"


@dataclass(frozen=True)
class AWSConfig:
    """Settings of an AWS World (the seed's ``Config``).

    * ``base_url``: public URL of the HTTP endpoints, including their prefix (for webhook URLs);
    * ``table_name``: the DynamoDB table, laid out as :func:`~celery_workflow.world_sqs.create_table` creates it;
    * ``queue_url``: the standard queue that carries the deliveries of unrouted workflows (Celery's default queue);
    * ``queues``: further queues by name, standard or FIFO; ``routes``: workflow name -> queue name;
    * ``scheduler``: delivers work due more than 15 minutes ahead and every delayed delivery to a FIFO queue;
    * ``retention`` / ``retentions``: how long finished runs are kept, by default and per workflow (``None``:
      forever);
    * ``control_url``: a Redis URL for Celery's events and remote control (used by the SQS transport);
    * ``poll_interval``: longest sleep of waiters (``wait_for_terminal``, stream reads): DynamoDB has no
      notifications;
    * ``start_records`` (``WORKFLOW_START_RECORDS=1``): write a ``QUEUE#`` record for each run's start, as versions
      before issue #31 did, instead of keeping the start in the run's META (:mod:`celery_workflow._aws.starts`). For
      a rolling upgrade only, while consumers of an earlier version still receive from the queues: they acknowledge
      a start without a record unrun. Turn it off once every worker and Lambda function runs this version.
    """

    base_url: str | None
    table_name: str
    queue_url: str
    queues: Mapping[str, QueueConfig] = field(default_factory=dict)
    routes: Mapping[str, str] = field(default_factory=dict)
    scheduler: SchedulerConfig | None = None
    retention: timedelta | None = None
    retentions: Mapping[str, timedelta | None] = field(default_factory=dict)
    control_url: str | None = None
    poll_interval: float = 0.25
    default_queue: str = DEFAULT_QUEUE
    start_records: bool = False

    def __post_init__(self) -> None:
        if not _text(self.table_name):
            raise ConfigurationError("table_name: the AWS World needs a DynamoDB table")
        if not _text(self.queue_url):
            raise ConfigurationError("queue_url: the AWS World needs the URL of its default SQS queue")
        if self.queue_url.rstrip("/").endswith(".fifo"):
            raise ConfigurationError(
                "queue_url: the default queue must be a standard SQS queue (it carries every unrouted workflow's"
                " deliveries without a message group); put a FIFO queue in queues and route workflows to it"
            )
        for where, optional in (("base_url", self.base_url), ("control_url", self.control_url)):
            if optional is not None and not _text(optional):
                raise ConfigurationError(f"{where}: empty; leave it None when there is none")
        if not _text(self.default_queue):
            raise ConfigurationError("default_queue: the default queue needs a name (Celery's is 'celery')")
        if not self.poll_interval > 0:
            raise ConfigurationError("poll_interval must be positive")
        if self.scheduler is not None:
            if not isinstance(self.scheduler, SchedulerConfig):
                raise ConfigurationError(f"scheduler must be a SchedulerConfig, got {type(self.scheduler).__name__}")
            for part in ("target_arn", "role_arn", "group"):
                if not _text(getattr(self.scheduler, part)):
                    raise ConfigurationError(f"scheduler.{part}: empty (the Scheduler needs it)")
            if self.scheduler.client is None:
                raise ConfigurationError("scheduler.client: a boto3 scheduler client is needed")
        for name, queue in self.queues.items():
            if not _text(name):
                raise ConfigurationError("queues: a queue needs a name (the key routes use)")
            if name == self.default_queue:
                raise ConfigurationError(f"queues[{name!r}]: that is the default queue's name (queue_url)")
            if not isinstance(queue, QueueConfig):
                raise ConfigurationError(f"queues[{name!r}] must be a QueueConfig, got {type(queue).__name__}")
            if not _text(queue.url):
                raise ConfigurationError(f"queues[{name!r}].url: empty")
            if queue.arn is not None and not _text(queue.arn):
                raise ConfigurationError(f"queues[{name!r}].arn: empty; leave it None when there is none")
            if queue.fifo and self.scheduler is None:
                raise ConfigurationError(
                    f"queues[{name!r}]: a FIFO queue needs a scheduler (FIFO queues take no per-message delay)"
                )
            if (queue.fifo or self.scheduler is not None) and not queue.arn:
                why = "a FIFO queue" if queue.fifo else "with a scheduler, every queue"
                raise ConfigurationError(f"queues[{name!r}].arn: {why} needs its ARN (the Scheduler's target)")
            if queue.fifo and not queue.url.endswith(".fifo"):
                raise ConfigurationError(f"queues[{name!r}].url: a FIFO queue's name ends in .fifo")
        for workflow, queue_name in self.routes.items():
            if not _text(workflow):
                raise ConfigurationError("routes: a route needs a workflow name")
            if queue_name not in self.queues and queue_name != self.default_queue:
                raise ConfigurationError(
                    f"routes[{workflow!r}]: queue {queue_name!r} is not in queues (known: {sorted(self.queues)})"
                )
        for name, keep in {"": self.retention, **self.retentions}.items():
            where = f"retentions[{name!r}]" if name else "retention"
            if keep is None:
                continue
            if not isinstance(keep, timedelta) or keep <= timedelta(0):
                raise ConfigurationError(f"{where} must be a positive timedelta")
            if keep > MAX_SQS_DELAY and self.scheduler is None:
                raise ConfigurationError(f"{where}: a retention over 15 minutes needs a scheduler")

    def retention_of(self, workflow: str) -> timedelta | None:
        """How long a finished run of ``workflow`` is kept (None: forever)."""
        return self.retentions.get(workflow, self.retention)

    @property
    def default_queue_config(self) -> QueueConfig:
        arn = self.scheduler.target_arn if self.scheduler is not None else None
        return QueueConfig(self.queue_url, arn, False)

    def queue(self, name: str) -> QueueConfig:
        """The queue named ``name`` (the default queue's name is Celery's, ``celery``); ConfigurationError when the
        config does not know it (queues come from Terraform, never created on the fly)."""
        if name == self.default_queue:
            return self.default_queue_config
        found = self.queues.get(name)
        if found is None:
            known = sorted({self.default_queue, *self.queues})
            raise ConfigurationError(f"no SQS queue named {name!r} in the AWS World's config (known: {known})")
        return found

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        scheduler_client: Any = None,
        **overrides: Any,
    ) -> AWSConfig:
        """The config the Terraform module's ``environment`` output describes (see the module docstring).

        A Scheduler is configured when ``WORKFLOW_SCHEDULER_ROLE_ARN`` is set; its client is ``scheduler_client``,
        else ``boto3.client("scheduler", config=client_config())``. ``overrides`` replace fields (e.g.
        ``retention``)."""
        env = os.environ if environ is None else environ

        def need(name: str) -> str:
            value = env.get(name)
            if not value:
                raise ConfigurationError(f"{name} is not set (the Terraform module's environment output sets it)")
            return value

        try:
            raw = json.loads(env.get("WORKFLOW_QUEUES") or "{}")
        except json.JSONDecodeError as exc:
            raise ConfigurationError(f"WORKFLOW_QUEUES is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigurationError("WORKFLOW_QUEUES must be a JSON object of queues by name")
        queues = {}
        for name, spec in raw.items():
            if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
                raise ConfigurationError(f"WORKFLOW_QUEUES[{name!r}] needs a url")
            queues[str(name)] = QueueConfig(str(spec["url"]), spec.get("arn") or None, bool(spec.get("fifo", False)))
        scheduler = None
        role = env.get("WORKFLOW_SCHEDULER_ROLE_ARN")
        if role:
            if scheduler_client is None:
                import boto3

                scheduler_client = boto3.client("scheduler", config=client_config())
            scheduler = SchedulerConfig(
                scheduler_client, need("WORKFLOW_QUEUE_ARN"), role, env.get("WORKFLOW_SCHEDULER_GROUP") or "default"
            )
        settings: dict[str, Any] = {
            "base_url": env.get("WORKFLOW_BASE_URL") or None,
            "table_name": need("WORKFLOW_TABLE"),
            "queue_url": need("WORKFLOW_QUEUE_URL"),
            "queues": queues,
            "scheduler": scheduler,
            "control_url": env.get("WORKFLOW_CONTROL_URL") or None,
            "start_records": (env.get("WORKFLOW_START_RECORDS") or "").strip().lower() in ("1", "true", "yes"),
        }
        settings.update(overrides)
        return cls(**settings)


def _text(value: object) -> bool:
    """``value`` is a string with something in it besides spaces."""
    return isinstance(value, str) and bool(value.strip())
