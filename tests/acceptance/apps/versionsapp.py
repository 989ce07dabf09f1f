"""Two versions of one workflow, as two deployments would run them: CW_CODE_VERSION=1 is the code before a change,
2 the code after it, the change guarded with ``patched("audit-first")``. The World URL comes from
CELERY_WORKFLOW_URL; both versions register the same workflow and step names.
"""

from __future__ import annotations

import os

from celery import Celery

from celery_workflow import Workflows, create_hook, patched

celery_app = Celery("versionsapp")
wf = Workflows(celery_app, transport_options={"lease_seconds": 60.0})
VERSION = int(os.environ.get("CW_CODE_VERSION", "2"))


@wf.step
def audit(order_id: str) -> str:
    return f"audited {order_id}"


@wf.step
def ship(order_id: str) -> str:
    return f"shipped {order_id}"


if VERSION == 1:

    @wf.workflow(name="order")
    def order(order_id: str) -> list[str]:
        done = [create_hook(token=f"go:{order_id}").wait()]
        done.append(ship(order_id))
        return done

else:

    @wf.workflow(name="order")
    def order(order_id: str) -> list[str]:
        done = [audit(order_id)] if patched("audit-first") else []
        done.append(create_hook(token=f"go:{order_id}").wait())
        done.append(ship(order_id))
        return done
