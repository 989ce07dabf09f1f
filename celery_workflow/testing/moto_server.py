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

From a shell, the same server in the foreground until SIGINT (Ctrl-C) or SIGTERM::

    python -m celery_workflow.testing.moto_server --port 4566

It prints the endpoint on stderr and, on stdout, the ``export`` lines of what boto3 (and so the AWS World) needs to
talk to it: ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION`` and dummy credentials (``--port 0`` takes a free port).
Its state lives in memory: it is gone when the server stops.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import urllib.request
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import Any

__all__ = ["EMULATOR_CREDENTIALS", "MotoServer", "emulator_environment", "main"]

#: The region and dummy credentials of the emulator's environment (moto accepts any).
EMULATOR_REGION = "us-east-1"
EMULATOR_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


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


def emulator_environment(endpoint: str, region: str = EMULATOR_REGION) -> dict[str, str]:
    """The variables that point boto3 (and so the AWS World, the SQS transport and ``celery-workflow``) at the
    emulator at ``endpoint``: ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION`` and dummy credentials."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": region, **EMULATOR_CREDENTIALS}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m celery_workflow.testing.moto_server``: serve until SIGINT or SIGTERM, then exit 0."""
    parser = argparse.ArgumentParser(
        prog="python -m celery_workflow.testing.moto_server",
        description="moto (DynamoDB, SQS, EventBridge Scheduler …) on one endpoint, DynamoDB requests one at a time,"
        " until Ctrl-C or SIGTERM. Prints the export lines that point boto3 at it.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=4566, help="port (0: a free one; default: %(default)s)")
    args = parser.parse_args(argv)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            server = MotoServer(args.host, args.port)
        except OSError as exc:
            print(f"cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
            return 2
        try:
            print(
                f"moto server on {server.endpoint} (DynamoDB requests one at a time); Ctrl-C stops it", file=sys.stderr
            )
            for name, value in emulator_environment(server.endpoint).items():
                print(f"export {name}={value}")
            sys.stdout.flush()
            stop.wait()
        finally:
            server.stop()
        print("moto server stopped", file=sys.stderr)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    raise SystemExit(main())
