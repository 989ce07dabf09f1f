"""A moto server in this process, for tests and benchmarks of the AWS World (``pip install 'moto[server]'``).

.. code-block:: python

    with MotoServer() as endpoint:            # http://127.0.0.1:<free port>
        dynamodb = boto3.client("dynamodb", endpoint_url=endpoint, region_name="us-east-1", ...)

moto's WSGI application (DynamoDB, SQS, EventBridge Scheduler … on one endpoint) in a threaded werkzeug server on
loopback. DynamoDB requests are served one at a time: moto runs a transaction by copying the whole table, applying
the actions and, on a failed condition, putting the copy back, so two concurrent requests could undo each other's
writes. Real DynamoDB isolates transactions; serialising moto's DynamoDB requests gives that isolation (and nothing
more: conflicts between a World's writers still happen, between their reads and their writes). SQS and Scheduler
requests run concurrently. :meth:`MotoServer.reset` empties every backend.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from types import TracebackType
from typing import Any

__all__ = ["MotoServer"]


class _OneDynamoDBRequestAtATime:
    """WSGI middleware: DynamoDB requests (``X-Amz-Target: DynamoDB_…``) run one at a time."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        if not str(environ.get("HTTP_X_AMZ_TARGET", "")).startswith("DynamoDB"):
            return self.app(environ, start_response)
        with self.lock:
            return list(self.app(environ, start_response))


class MotoServer:
    """moto on ``127.0.0.1`` and a free port (``port=0``) until :meth:`stop`; a context manager yielding the
    endpoint URL."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        app = _OneDynamoDBRequestAtATime(DomainDispatcherApplication(create_backend_app))
        self._server = make_server(host, port, app, threaded=True)
        bound_host, bound_port = self._server.server_address[:2]
        self.endpoint = f"http://{bound_host!s}:{bound_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="moto", daemon=True)
        self._thread.start()

    def reset(self) -> None:
        """Empty every moto backend (tables, queues, schedules)."""
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(request, timeout=10).close()

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(10)

    def __enter__(self) -> str:
        return self.endpoint

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
