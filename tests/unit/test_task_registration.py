"""The Celery tasks a Workflows registers: any workflow or step name a user may give, and only on its own app."""

from __future__ import annotations

from celery import Celery

from celery_workflow import Workflows
from celery_workflow.testing import MemoryWorld


def test_dotted_and_dashed_names_register_when_the_app_finalizes() -> None:
    wf = Workflows(Celery("registration-names"), world=MemoryWorld(), broker="app")

    @wf.step(name="billing.charge-card")
    def charge() -> None:
        return None

    @wf.workflow(name="billing.order-2")
    def order() -> None:
        charge()

    tasks = wf.celery_app.tasks  # finalizes the app: Celery builds each task's signature from its function
    assert "workflow.billing.order-2" in tasks
    assert "step.billing.charge-card" in tasks


def test_the_tasks_stay_on_their_own_app() -> None:
    wf = Workflows(Celery("registration-own"), world=MemoryWorld(), broker="app")

    @wf.workflow(name="registration.only-mine")
    def mine() -> None:
        return None

    assert "workflow.registration.only-mine" in wf.celery_app.tasks
    other = Celery("registration-other")
    assert "workflow.registration.only-mine" not in other.tasks
