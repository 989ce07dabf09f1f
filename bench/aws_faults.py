"""Faults injected into a process's boto3 calls for the AWS chaos run (``python -m bench.chaos --world aws``).

:func:`install` registers botocore event handlers on boto3's default session (what ``boto3.client(...)`` and so the
AWS World's ``aws://`` clients use; install before the World is opened). Nothing is global beyond that session, and
nothing happens unless ``CW_AWS_FAULTS`` is set (:func:`install_from_env`)::

    CW_AWS_FAULTS="conflict=0.2,throttle=0.03,dup=0.2" CW_CHAOS_DIR=/tmp/x celery -A bench.chaos_app worker

* ``conflict``: that share of ``TransactWriteItems`` and ``TransactGetItems`` is cancelled with the reason
  ``TransactionConflict`` on every action, as DynamoDB answers when another transaction holds one of the items;
* ``throttle``: that share of every other DynamoDB call fails with ``ThrottlingException`` (a transaction: cancelled
  with the reason ``ThrottlingError``);
* ``dup``: that share of the messages an SQS ``ReceiveMessage`` returns is sent again at once to the same queue with
  the same body: the same delivery arrives twice, and another consumer takes the copy while the first is working on
  it (SQS standard queues deliver at least once).

DynamoDB faults are answered before the request is sent (a ``before-call`` handler returns the error response), so
the emulator never sees them and nothing was written, which is what DynamoDB guarantees for a cancelled transaction
or a throttled request; botocore's own retries do not apply to them (the World's handling does, alone). Each fault is
logged as one line ``<kind> <operation> <pid>`` in ``$CW_CHAOS_DIR/faults.log`` for the driver to count.
"""

from __future__ import annotations

import json
import os
import random
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

__all__ = ["FaultRates", "count_faults", "install", "install_from_env", "record_fault"]

ENV = "CW_AWS_FAULTS"
TRANSACTIONS = frozenset({"TransactWriteItems", "TransactGetItems"})


class FaultRates:
    """Shares of calls to fail, parsed from ``conflict=0.2,throttle=0.03,dup=0.2``."""

    def __init__(self, spec: str) -> None:
        rates = {"conflict": 0.0, "throttle": 0.0, "dup": 0.0}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, _, value = part.partition("=")
            if key not in rates:
                raise ValueError(f"{ENV}: unknown fault {key!r} (known: {sorted(rates)})")
            rates[key] = float(value)
            if not 0 <= rates[key] <= 1:
                raise ValueError(f"{ENV}: {key} must be a share from 0 to 1")
        self.conflict = rates["conflict"]
        self.throttle = rates["throttle"]
        self.dup = rates["dup"]


class _Injector:
    def __init__(self, rates: FaultRates, log: Path, seed: int | None) -> None:
        self.rates = rates
        self.log = log
        self.seed = seed
        self.pid = os.getpid()
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self._sender: Any = None
        self._session: Any = None
        self._duplicated_in: int | None = None  # the pid that has sent its first duplicate

    def chance(self, share: float) -> bool:
        with self.lock:
            if self.pid != os.getpid():  # a forked pool child: a sequence of its own, not its parent's copy
                self.pid = os.getpid()
                self.rng = random.Random(None if self.seed is None else self.seed + self.pid)
            return share > 0 and self.rng.random() < share

    def record(self, kind: str, operation: str) -> None:
        record_fault(kind, operation, self.log)

    def dynamodb(self, model: Any, params: Any, **_: Any) -> Any:
        """``before-call.dynamodb``: an error response instead of the request, or None to send it."""
        name = model.name
        if name in TRANSACTIONS:
            for reason, share, kind in (
                ("TransactionConflict", self.rates.conflict, "conflict"),
                ("ThrottlingError", self.rates.throttle, "throttle"),
            ):
                if self.chance(share):
                    self.record(kind, name)
                    actions = len(json.loads(params.get("body") or b"{}").get("TransactItems", [])) or 1
                    return _error(
                        "TransactionCanceledException",
                        f"Transaction cancelled, please refer cancellation reasons for specific reasons [{reason}]",
                        CancellationReasons=[{"Code": reason, "Message": "injected"}] * actions,
                    )
            return None
        if self.chance(self.rates.throttle):
            self.record("throttle", name)
            return _error("ThrottlingException", "Rate of requests exceeds the allowed throughput (injected)")
        return None

    def remember_queue(self, params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        """``provide-client-params.sqs.ReceiveMessage``: keep the queue URL for the handler after the call."""
        context["cw_faults_queue_url"] = params.get("QueueUrl")

    def received(self, parsed: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        """``after-call.sqs.ReceiveMessage``: send some of the messages again, at once, with the same body."""
        url = context.get("cw_faults_queue_url")
        if not url:
            return
        for message in parsed.get("Messages", []):
            if self.first_dup() or self.chance(self.rates.dup):
                self.sender().send_message(QueueUrl=url, MessageBody=message["Body"])
                self.record("dup", "ReceiveMessage")

    def first_dup(self) -> bool:
        """True for the first message a process receives while ``dup`` is on: a short run, whose messages a Lambda
        poller may take nearly all of, meets at least one duplicate rather than a chance of one."""
        with self.lock:
            if self.rates.dup <= 0 or self._duplicated_in == os.getpid():
                return False
            self._duplicated_in = os.getpid()
            return True

    def sender(self) -> Any:
        """An SQS client of a session of its own: no handlers of these (one per process: a forked pool child makes
        its own)."""
        with self.lock:
            pid = os.getpid()
            if self._sender is None or self._sender[0] != pid:
                import boto3

                self._sender = (pid, boto3.session.Session().client("sqs"))
            return self._sender[1]


def _error(code: str, message: str, **extra: Any) -> tuple[Any, dict[str, Any]]:
    """What a ``before-call`` handler returns in place of a response: an HTTP 400 and its parsed error."""
    http = SimpleNamespace(status_code=400, headers={}, content=b"", text="")
    parsed = {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": 400}, **extra}
    return http, parsed


def install(rates: FaultRates, log: Path, *, seed: int | None = None) -> None:
    """Register the fault handlers on boto3's default session (clients made after this carry them)."""
    import boto3

    session = boto3._get_default_session()  # the session boto3.client() uses
    injector = _Injector(rates, log, seed)
    session.events.register("before-call.dynamodb", injector.dynamodb, unique_id="cw-faults-dynamodb")
    _register_dups(session.events, injector)


def install_dups(client: Any, spec: str, log: Path) -> None:
    """Only the ``dup`` fault, on one SQS client's receives (the Lambda poller's: SQS delivers twice to an event
    source mapping as it does to a worker)."""
    _register_dups(client.meta.events, _Injector(FaultRates(spec), log, None))


def _register_dups(events: Any, injector: _Injector) -> None:
    events.register("provide-client-params.sqs.ReceiveMessage", injector.remember_queue, unique_id="cw-faults-q")
    events.register("after-call.sqs.ReceiveMessage", injector.received, unique_id="cw-faults-dup")


def install_from_env() -> bool:
    """:func:`install` with ``$CW_AWS_FAULTS`` into ``$CW_CHAOS_DIR/faults.log``; False when it is not set."""
    spec = os.environ.get(ENV)
    if not spec:
        return False
    install(FaultRates(spec), Path(os.environ.get("CW_CHAOS_DIR", "/tmp")) / "faults.log")
    return True


def record_fault(kind: str, operation: str, log: Path | None = None) -> None:
    """One line ``<kind> <operation> <pid>`` in ``log`` (default ``$CW_CHAOS_DIR/faults.log``): one ``write`` of an
    ``O_APPEND`` file, so lines of several processes never interleave."""
    path = log or Path(os.environ.get("CW_CHAOS_DIR", "/tmp")) / "faults.log"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{kind} {operation} {os.getpid()}\n".encode())
    finally:
        os.close(fd)


def count_faults(log: Path) -> dict[str, int]:
    """Injected faults by kind (and Lambda invocations that timed out or crashed), from the log the processes
    wrote."""
    counts = {"conflict": 0, "throttle": 0, "dup": 0, "timeout": 0, "crash": 0}
    if log.exists():
        for line in log.read_text().splitlines():
            kind = line.split(" ", 1)[0]
            counts[kind] = counts.get(kind, 0) + 1
    return counts
