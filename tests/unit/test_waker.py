"""The hub's wake-up pipe (transport/eventloop.Waker): a wake after the close never writes into whatever reused its
descriptor numbers, whichever thread wakes it."""

from __future__ import annotations

import os
import threading

from celery_workflow.transport.eventloop import Waker


def _readable(fd: int) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 16)
    except BlockingIOError:
        return b""


def test_a_wake_after_the_close_leaves_the_reused_descriptor_alone() -> None:
    waker = Waker()
    waker.wake()
    waker.drain()
    waker.close()
    r, w = os.pipe()  # the lowest free numbers: the waker's own, just closed
    try:
        waker.wake()
        waker.drain()
        assert _readable(r) == b""
        os.write(w, b"x")
        waker.drain()  # not the waker's any more: the byte stays for its new owner
        assert _readable(r) == b"x"
    finally:
        os.close(r)
        os.close(w)


def test_wakes_from_threads_racing_the_close_never_fail_or_leak() -> None:
    for _ in range(50):
        waker = Waker()
        go = threading.Event()

        def wake_many(target: Waker = waker, start: threading.Event = go) -> None:
            start.wait()
            for _ in range(200):
                target.wake()

        threads = [threading.Thread(target=wake_many) for _ in range(3)]
        for t in threads:
            t.start()
        go.set()
        waker.close()
        r, w = os.pipe()
        for t in threads:
            t.join(timeout=10)
        try:
            assert _readable(r) == b""
        finally:
            os.close(r)
            os.close(w)
