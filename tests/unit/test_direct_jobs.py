"""The blocking pool's jobs go to the children's pipe from the submitting thread, and only when that cannot block
(``celery_workflow.transport.prefork.DirectJobs``)."""

from __future__ import annotations

import fcntl
import os
import queue
import select
import threading
from typing import Any

import pytest
from billiard import pool as billiard_pool
from billiard.queues import SimpleQueue

from celery_workflow.transport.prefork import DirectJobs


class Pool:
    """What DirectJobs reads of billiard's pool: its state and its job pipe."""

    def __init__(self) -> None:
        self._state = billiard_pool.RUN
        self._inqueue = SimpleQueue(ctx=billiard_pool.get_context())


@pytest.fixture
def pool() -> Any:
    p = Pool()
    yield p
    p._inqueue.close()


def jobs_of(pool: Pool) -> tuple[DirectJobs, queue.Queue[Any]]:
    handler: queue.Queue[Any] = queue.Queue()
    jobs = DirectJobs(pool)  # type: ignore[arg-type]
    jobs._handler_queue = handler
    return jobs, handler


def test_a_small_job_is_in_the_pipe_when_put_returns(pool: Pool) -> None:
    jobs, handler = jobs_of(pool)
    job = ("TASK", (1, None, len, ("abc",), {}))
    jobs.put(([job], None))
    assert handler.empty()
    assert pool._inqueue._reader.poll(0)
    assert pool._inqueue._reader.recv() == job


def test_what_could_block_goes_to_the_handler_thread(pool: Pool) -> None:
    jobs, handler = jobs_of(pool)
    large = ("TASK", (2, None, len, ("x" * select.PIPE_BUF,), {}))
    jobs.put(([large], None))  # would not be written whole at once
    assert handler.get_nowait() == ([large], None)
    assert not pool._inqueue._reader.poll(0)

    # a pipe without PIPE_BUF bytes of room (children busy): the consumer must not wait for them
    fd = pool._inqueue._writer.fileno()
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    try:
        while True:
            os.write(fd, b"\0" * 1024)
    except BlockingIOError:
        pass
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    small = ("TASK", (3, None, len, ("abc",), {}))
    jobs.put(([small], None))  # returns at once
    assert handler.get_nowait() == ([small], None)


def test_a_large_job_is_pickled_once(pool: Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs, handler = jobs_of(pool)
    large = ("TASK", (7, None, len, ("x" * (4 * select.PIPE_BUF),), {}))
    jobs.put(([large], None))
    (queued,), length = handler.get_nowait()
    assert (queued, length) == (large, None) and queued[:2] == large[:2]  # what billiard's handler reads of it

    def pickled_again(obj: Any) -> None:
        raise AssertionError("the job was pickled a second time")

    monkeypatch.setattr(pool._inqueue._writer, "send", pickled_again)
    reader = pool._inqueue._reader
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(reader.recv()))  # the pipe holds less than the job
    thread.start()
    jobs.send(queued)  # the handler thread's write
    thread.join(timeout=10)
    assert got == [large]


def test_sentinels_batches_and_a_closing_pool_go_to_the_handler_thread(pool: Pool) -> None:
    jobs, handler = jobs_of(pool)
    jobs.put(None)
    one, two = ("TASK", (4, 0, len, ("a",), {})), ("TASK", (4, 1, len, ("b",), {}))
    jobs.put(([one, two], 2))
    pool._state = billiard_pool.CLOSE
    late = ("TASK", (5, None, len, ("c",), {}))
    jobs.put(([late], None))
    assert [handler.get_nowait() for _ in range(3)] == [None, ([one, two], 2), ([late], None)]
    assert not pool._inqueue._reader.poll(0)
    assert jobs.qsize() == 0  # the handler thread reads the queue through it


def test_the_handler_threads_writes_share_the_lock(pool: Pool) -> None:
    jobs, _ = jobs_of(pool)
    jobs.send(("TASK", (6, None, len, ("d",), {})))
    assert pool._inqueue._reader.recv() == ("TASK", (6, None, len, ("d",), {}))
