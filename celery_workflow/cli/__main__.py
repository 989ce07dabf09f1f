"""``python -m celery_workflow.cli``: the ``celery-workflow`` command."""

from celery_workflow.cli import main

raise SystemExit(main())
