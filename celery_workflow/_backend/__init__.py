"""What every backend builds on (no backend of its own): the shared pieces a World and its queue store use.

A backend (``_sqlite``, ``_postgres``, …) imports from here and from :mod:`celery_workflow.world` /
:mod:`celery_workflow.events`, never from a sibling backend.
"""
