"""Starting and stopping real Celery worker processes for acceptance tests."""

from __future__ import annotations

import importlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import kombu.pools
import pytest

APPS = Path(__file__).parent / "apps"

T = TypeVar("T")


def wait_for(condition: Callable[[], T | None], timeout: float, describe: Callable[[], str] = str) -> T:
    """The first truthy value of ``condition()``, polled every 50 ms; AssertionError (with ``describe()``) after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s\n{describe()}")
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Worker:
    """A `celery -A <app> worker` subprocess in its own process group, started in ``cwd`` (default: ``apps/``),
    which is put first on its ``PYTHONPATH``."""

    def __init__(self, app: str, env: dict[str, str], log: Path, args: Sequence[str] = (), *, cwd: Path = APPS) -> None:
        self.log = log
        self._log_file = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", app, "worker", "--loglevel=INFO", "--without-heartbeat", *args],
            cwd=cwd,
            env={**os.environ, "PYTHONPATH": f"{cwd}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env},
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while b"ready." not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the whole process group: the main process and its pool children."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._log_file.close()

    def stop(self) -> None:
        """Warm shutdown: SIGTERM to the main process only, which stops its pool children itself."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
                return
        self._log_file.close()


@contextmanager
def imported_app(name: str, env: dict[str, str], *, path: Path = APPS) -> Iterator[ModuleType]:
    """Import the app module ``name`` from ``path`` (default ``apps/``) in the test process (the client side), bound
    to ``env``; its ``wf`` is closed afterwards."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    sys.path.insert(0, str(path))
    sys.modules.pop(name, None)
    try:
        yield importlib.import_module(name)
    finally:
        module = sys.modules.pop(name, None)
        if module is not None and hasattr(module, "wf"):
            module.wf.close()
        # Kombu's process-wide connection and producer pools key a connection by its URL and options, and Celery's
        # remote control publishes through them: a later app with the same URL (``aws://``, whose World comes from
        # the environment) would be served this app's connections (test_sqs_apps_in_one_process)
        kombu.pools.reset()
        sys.path.remove(str(path))
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def postgres_schema_named() -> Iterator[str]:
    """The name of a fresh Postgres schema (skips when the server is unreachable); afterwards its connections (those
    with its name as ``application_name``) are terminated and it is dropped."""
    try:
        from tests.integration import pg_fixtures
    except pytest.skip.Exception as exc:  # the server is unreachable
        pytest.skip(str(exc))
    with pg_fixtures.fresh_schema("cw_accept") as schema:
        yield schema


@contextmanager
def postgres_schema() -> Iterator[str]:
    """A World URL on a fresh Postgres schema (skips when the server is unreachable); dropped afterwards."""
    with postgres_schema_named() as schema:
        from tests.integration import pg_fixtures

        yield pg_fixtures.schema_url(schema)


@contextmanager
def aws_environment(moto_url: str) -> Iterator[dict[str, str]]:
    """The environment of an AWS World on the moto server at ``moto_url`` (what the Terraform module's
    ``environment`` output gives a real deployment): a table and its task and ``backfill`` queues of their own,
    the Scheduler, and Redis as the control channel (skips when Redis is unreachable). Deleted afterwards."""
    try:
        from tests.integration import aws_fixtures, redis_fixtures
    except pytest.skip.Exception as exc:  # Redis is unreachable
        pytest.skip(str(exc))
    import boto3

    from celery_workflow.world_sqs import create_table

    table = f"cw_accept_{secrets.token_hex(5)}"
    clients = {s: boto3.client(s, endpoint_url=moto_url, **aws_fixtures.CREDENTIALS) for s in ("dynamodb", "sqs")}
    create_table(clients["dynamodb"], table, poll=0.05)
    queues = {}
    dead_letter_urls = []
    for name in ("tasks", "backfill"):
        # each with its dead-letter queue, as the Terraform module makes them (maxReceiveCount 10)
        dlq = clients["sqs"].create_queue(QueueName=f"{table}-{name}-dlq")["QueueUrl"]
        dead_letter_urls.append(dlq)
        dlq_arn = clients["sqs"].get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]
        policy = json.dumps({"deadLetterTargetArn": dlq_arn["QueueArn"], "maxReceiveCount": 10})
        url = clients["sqs"].create_queue(QueueName=f"{table}-{name}", Attributes={"RedrivePolicy": policy})["QueueUrl"]
        arn = clients["sqs"].get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        queues[name] = {"url": url, "arn": arn, "fifo": False}
    env = {
        "CELERY_WORKFLOW_URL": "aws://",
        "AWS_ENDPOINT_URL": moto_url,
        "AWS_DEFAULT_REGION": aws_fixtures.REGION,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "WORKFLOW_TABLE": table,
        "WORKFLOW_QUEUE_URL": queues["tasks"]["url"],
        "WORKFLOW_QUEUE_ARN": queues["tasks"]["arn"],
        "WORKFLOW_QUEUES": json.dumps({"backfill": queues["backfill"]}),
        "WORKFLOW_SCHEDULER_GROUP": "default",
        "WORKFLOW_SCHEDULER_ROLE_ARN": aws_fixtures.ROLE_ARN,
        "WORKFLOW_CONTROL_URL": redis_fixtures.REDIS_URL,
    }
    try:
        yield env
    finally:
        clients["dynamodb"].delete_table(TableName=table)
        for url in [q["url"] for q in queues.values()] + dead_letter_urls:
            clients["sqs"].delete_queue(QueueUrl=url)
        redis_fixtures.delete_prefix(f"celery_workflow:{table}:")
