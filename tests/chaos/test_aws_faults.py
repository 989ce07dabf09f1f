"""The fault injector of the AWS chaos run (:mod:`bench.aws_faults`): the ``dup`` fault duplicates the first message
each process receives for certain, so a short run cannot pass without meeting a duplicate."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bench.aws_faults import FaultRates, _Injector, count_faults


class _Sender:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send_message(self, **kwargs: Any) -> None:
        self.sent.append(kwargs)


def test_the_first_message_received_is_duplicated(tmp_path: Path) -> None:
    log = tmp_path / "faults.log"
    injector = _Injector(FaultRates("dup=0.000001"), log, seed=1)
    sender = _Sender()
    injector._sender = (os.getpid(), sender)
    messages = {"Messages": [{"Body": f"m{i}"} for i in range(5)]}
    injector.received(messages, {"cw_faults_queue_url": "http://q"})
    injector.received(messages, {"cw_faults_queue_url": "http://q"})
    assert [m["MessageBody"] for m in sender.sent] == ["m0"]
    assert count_faults(log)["dup"] == 1


def test_no_duplicate_without_the_fault(tmp_path: Path) -> None:
    log = tmp_path / "faults.log"
    injector = _Injector(FaultRates("conflict=0.5"), log, seed=1)
    sender = _Sender()
    injector._sender = (os.getpid(), sender)
    injector.received({"Messages": [{"Body": "m"}]}, {"cw_faults_queue_url": "http://q"})
    assert sender.sent == []
