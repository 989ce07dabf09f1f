"""Two plain Celery apps on the SQS transport from the environment (``aws://``), one after the other in one process:
the second app's remote control reaches the second World's control channel (issue #28).

Kombu keeps process-wide connection and producer pools keyed by a connection's URL and transport options, and Celery's
remote control publishes through them. ``aws://`` with the same options is the same key for every World of the
environment, so a pooled connection opened on the first World's environment served the second app's broadcasts: they
went to the first World's control channel, whose bindings were gone, and no worker of the second heard them. This is
what kept the SQS case of ``test_plain_celery`` red in whole runs of the suite (an earlier SQS case of that module
ran in the same test process). ``imported_app`` now resets Kombu's pools when an app is done with.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integration.aws_fixtures import moto_fixture  # noqa: F401

from .workers import aws_environment, imported_app

pytestmark = pytest.mark.acceptance

REDIS = os.environ.get("PLAIN_REDIS", "redis://127.0.0.1:6379")


def _settings(aws: dict[str, str], root: Path) -> dict[str, str]:
    return {
        **aws,
        "PLAIN_BROKER_URL": "aws://",
        "PLAIN_TRANSPORT": "celery_workflow.transport.sqs:Transport",
        "PLAIN_TRANSPORT_OPTIONS": '{"wait_time_seconds": 1}',
        "PLAIN_BACKEND": f"{REDIS}/14",
        "PLAIN_RESULTS": str(root / "results.jsonl"),
    }


def test_a_second_app_s_broadcasts_reach_its_own_world(moto: str, tmp_path: Path) -> None:
    from celery_workflow._redis.store import RedisStore

    with aws_environment(moto) as first, imported_app("plainapp", _settings(first, tmp_path)) as module:
        assert module.app.control.ping(timeout=0.2) == []  # no worker: the broadcast only fills the pools
    with aws_environment(moto) as second:
        # what a worker of the second World does: its pidbox queue, bound to the broadcast exchange
        store = RedisStore(second["WORKFLOW_CONTROL_URL"], prefix=f"celery_workflow:{second['WORKFLOW_TABLE']}:")
        try:
            store.declare_exchange("celery.pidbox", "fanout")
            store.declare_queue("w@probe.celery.pidbox", auto_delete=True)
            store.bind("celery.pidbox", "", None, "w@probe.celery.pidbox")
            with imported_app("plainapp", _settings(second, tmp_path)) as module:
                assert module.app.control.ping(timeout=0.2) == []
            assert store.size("w@probe.celery.pidbox") == 1, "the broadcast went to the first World's channel"
        finally:
            store.close()
