"""Tools for working on celery_workflow that are not part of the shipped package (run from the repository root):

* :mod:`tools.move_tasks`: a stand-in for SQS's message move task API in front of a moto server, used by the tests,
  ``docker-compose.yml`` and the re-drive example (``python -m tools.move_tasks --upstream URL``).
"""
