"""The one loop every World's blocking reads share (``wait_for_terminal``, ``read_stream(wait=…)``).

A waiter takes a *mark* of the World's change signal before it reads, reads, and if the answer is not final waits
for a change after that mark, at most ``poll_interval`` seconds, then reads again. A change between the read and the
wait ends the wait at once (it is after the mark), and a lost signal costs one poll interval, never a missed result.
Each World brings its own signal: a condition variable (memory), ``PRAGMA data_version`` (SQLite), LISTEN/NOTIFY
(Postgres), or nothing but the poll interval.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["wait_until"]

T = TypeVar("T")
M = TypeVar("M")


def wait_until(
    read: Callable[[], T],
    done: Callable[[T], bool],
    *,
    timeout: float | None,
    poll_interval: float,
    mark: Callable[[], M],
    wait: Callable[[M, float], object],
) -> T:
    """``read()`` until ``done`` says its answer is final or ``timeout`` seconds pass (None: no limit); return the
    last answer. ``mark()`` is taken before each read; ``wait(mark, seconds)`` returns early on a later change. A
    ``timeout`` of 0 or less reads once, taking no mark (so a World starts no listener for it)."""
    if timeout is not None and timeout <= 0:
        return read()
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        token = mark()
        value = read()
        left = poll_interval if deadline is None else min(poll_interval, deadline - time.monotonic())
        if done(value) or left <= 0:
            return value
        wait(token, left)
