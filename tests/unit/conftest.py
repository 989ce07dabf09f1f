from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from celery_workflow import Workflows
from celery_workflow.testing import LocalWorker, MemoryWorld


@pytest.fixture
def wf() -> Iterator[Workflows]:
    workflows = Workflows(Celery("unit"), world=MemoryWorld(), broker="app", base_url="https://example.test/wf")
    yield workflows
    workflows.close()


@pytest.fixture
def worker(wf: Workflows) -> LocalWorker:
    return LocalWorker(wf)
