"""The workflow of the README's "AWS on your machine": steps inline, one step on the ``backfill`` queue, a durable
sleep. The World comes from ``$CELERY_WORKFLOW_URL`` (``aws://`` after ``celery-workflow provision``).

celery -A examples.local_aws worker -Q celery,backfill      # a Celery worker on the SQS transport
python -m examples.local_aws 3                              # starts a run, prints its id
celery-workflow runs watch RUN_ID                           # exit code 0 once it completed
"""

from __future__ import annotations

import sys

from celery import Celery

from celery_workflow import Workflows, sleep

celery_app = Celery("local_aws")
wf = Workflows(celery_app)  # the World from $CELERY_WORKFLOW_URL; on aws:// Celery's transport is SQS


@wf.step
def square(n: int) -> int:
    return n * n


@wf.step(queue="backfill")
def total(values: list[int]) -> int:  # a delivery of its own, on the SQS queue <name>-backfill
    return sum(values)


@wf.workflow
def sum_of_squares(n: int) -> dict[str, int]:
    squares = [square(k) for k in range(1, n + 1)]  # inline: run by the workflow's own delivery
    sleep(1)  # durable: an SQS message delayed by a second resumes the run
    return {"n": n, "sum": total(squares)}


def main(argv: list[str]) -> None:
    run = sum_of_squares.start(int(argv[0]) if argv else 3)
    print(run.id)


if __name__ == "__main__":
    main(sys.argv[1:])
