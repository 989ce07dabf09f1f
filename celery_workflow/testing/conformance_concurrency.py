"""World conformance: streams, blocking waits and concurrent writers (threads)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from celery_workflow import codec, ids
from celery_workflow.errors import EntityTerminal, EventConflict, EventInvalid, RunNotFound, StaleLog
from celery_workflow.events import EventType, RunStatus
from celery_workflow.testing._conformance import (
    DEADLINE,
    Conformance,
    create,
    ev,
    hook_created,
    step_created,
    unique,
)
from celery_workflow.world import AppendResult, World


def _in_thread(target: Callable[[], object], *, delay: float = 0.0) -> threading.Thread:
    def body() -> None:
        if delay:
            time.sleep(delay)
        target()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def _run_together(n: int, body: Callable[[int], object]) -> list[object]:
    """Run ``body(i)`` in ``n`` threads released together; return each result or the exception it raised."""
    barrier = threading.Barrier(n)
    results: list[object] = [None] * n

    def worker(i: int) -> None:
        barrier.wait(timeout=DEADLINE)
        try:
            results[i] = body(i)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE * 3)
        assert not t.is_alive(), "a writer thread hung"
    return results


class StreamConformance(Conformance):
    """Streams: ordered indexes, reads from an index, an explicit close, waits that wake on writes."""

    def test_write_and_read_in_order(self, world: World) -> None:
        run = create(world, started=True)
        chunks = [codec.dumps_chunk({"n": i}) for i in range(5)]
        assert world.write_stream(run.run_id, "default", chunks[:3]) == 3
        assert world.write_stream(run.run_id, "default", chunks[3:]) == 5
        page = world.read_stream(run.run_id, "default")
        assert [(c.index, c.data) for c in page.chunks] == list(enumerate(chunks))
        assert page.next_index == 5 and not page.closed
        tail = world.read_stream(run.run_id, "default", start=3)
        assert [c.index for c in tail.chunks] == [3, 4] and tail.next_index == 5
        assert [codec.loads(c.data) for c in tail.chunks] == [{"n": 3}, {"n": 4}]
        some = world.read_stream(run.run_id, "default", start=1, limit=2)
        assert [c.index for c in some.chunks] == [1, 2] and some.next_index == 3
        empty = world.read_stream(run.run_id, "default", start=5)
        assert empty.chunks == [] and empty.next_index == 5
        unknown = world.read_stream(run.run_id, "other")
        assert unknown.chunks == [] and not unknown.closed and unknown.next_index == 0

    def test_close_is_idempotent_and_final(self, world: World) -> None:
        run = create(world, started=True)
        world.write_stream(run.run_id, "s", [codec.dumps_chunk(b"raw")])
        world.close_stream(run.run_id, "s")
        world.close_stream(run.run_id, "s")
        with pytest.raises(EventConflict):
            world.write_stream(run.run_id, "s", [codec.dumps_chunk(1)])
        page = world.read_stream(run.run_id, "s", wait=DEADLINE)
        assert page.closed and [codec.loads(c.data) for c in page.chunks] == [b"raw"]
        started = time.monotonic()
        assert world.read_stream(run.run_id, "s", start=1, wait=DEADLINE).closed
        assert time.monotonic() - started < DEADLINE / 2
        world.close_stream(run.run_id, "never-written")
        assert world.read_stream(run.run_id, "never-written").closed

    def test_streams_are_per_run_and_listed(self, world: World) -> None:
        run = create(world, started=True)
        other = create(world, started=True)
        world.write_stream(run.run_id, "b", [codec.dumps_chunk(1)])
        world.write_stream(run.run_id, "a", [codec.dumps_chunk(2)])
        world.write_stream(other.run_id, "a", [codec.dumps_chunk(3)])
        assert world.list_streams(run.run_id) == ["a", "b"]
        assert [codec.loads(c.data) for c in world.read_stream(other.run_id, "a").chunks] == [3]
        assert world.list_streams(create(world).run_id) == []

    def test_streams_of_unknown_runs_and_bad_chunks_are_rejected(self, world: World) -> None:
        with pytest.raises(RunNotFound):
            world.write_stream(ids.new_run_id(), "s", [codec.dumps_chunk(1)])
        run = create(world, started=True)
        with pytest.raises(EventInvalid):
            world.write_stream(run.run_id, "s", [codec.dumps_chunk(1), b"x" * (codec.MAX_PAYLOAD_BYTES + 100)])
        assert world.read_stream(run.run_id, "s").chunks == []

    def test_stream_outlives_the_run_end(self, world: World) -> None:
        run = create(world, started=True)
        world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=None)])
        assert world.write_stream(run.run_id, "late", [codec.dumps_chunk("after")]) == 1

    def test_read_wait_returns_when_a_chunk_arrives(self, world: World) -> None:
        run = create(world, started=True)
        writer = _in_thread(lambda: world.write_stream(run.run_id, "live", [codec.dumps_chunk("hi")]), delay=0.2)
        started = time.monotonic()
        page = world.read_stream(run.run_id, "live", wait=DEADLINE)
        assert [codec.loads(c.data) for c in page.chunks] == ["hi"]
        assert time.monotonic() - started < DEADLINE / 2
        writer.join(DEADLINE)

    def test_read_wait_returns_when_the_stream_closes(self, world: World) -> None:
        run = create(world, started=True)
        closer = _in_thread(lambda: world.close_stream(run.run_id, "live"), delay=0.2)
        page = world.read_stream(run.run_id, "live", wait=DEADLINE)
        assert page.closed and page.chunks == []
        closer.join(DEADLINE)

    def test_read_wait_times_out_empty(self, world: World) -> None:
        run = create(world, started=True)
        started = time.monotonic()
        page = world.read_stream(run.run_id, "quiet", wait=0.2)
        assert page.chunks == [] and not page.closed
        assert 0.15 <= time.monotonic() - started < DEADLINE / 2


class WaitForTerminalConformance(Conformance):
    """``wait_for_terminal`` wakes when another thread ends the run and gives up at its timeout."""

    def test_returns_when_another_thread_ends_the_run(self, world: World) -> None:
        run = create(world, started=True)
        ender = _in_thread(lambda: world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=42)]), delay=0.2)
        started = time.monotonic()
        done = world.wait_for_terminal(run.run_id, DEADLINE)
        assert done.status is RunStatus.COMPLETED and done.output == 42
        assert time.monotonic() - started < DEADLINE / 2
        ender.join(DEADLINE)

    def test_returns_the_unfinished_run_at_timeout(self, world: World) -> None:
        run = create(world, started=True)
        started = time.monotonic()
        view = world.wait_for_terminal(run.run_id, 0.2)
        assert view.status is RunStatus.RUNNING and 0.15 <= time.monotonic() - started < DEADLINE / 2

    def test_returns_at_once_for_an_ended_run_and_rejects_unknown_runs(self, world: World) -> None:
        run = create(world)
        world.append(run.run_id, [ev(EventType.RUN_CANCELLED)])
        assert world.wait_for_terminal(run.run_id, None).status is RunStatus.CANCELLED
        with pytest.raises(RunNotFound):
            world.wait_for_terminal(ids.new_run_id(), 0.1)


class ConcurrencyConformance(Conformance):
    """Concurrent writers to one run: contiguous slots, nothing lost, exactly one winner per terminal event."""

    threads = 8
    appends_per_thread = 5

    def test_concurrent_appends_leave_contiguous_slots(self, world: World) -> None:
        run = create(world, started=True)

        def body(i: int) -> None:
            for j in range(self.appends_per_thread):
                world.append(run.run_id, [step_created(f"s{i}-{j}")])

        results = _run_together(self.threads, body)
        assert all(r is None for r in results), results
        total = self.threads * self.appends_per_thread
        log = world.list_events(run.run_id)
        assert [e.slot for e in log] == list(range(1, total + 3))
        assert sorted(e.correlation_id or "" for e in log[2:]) == sorted(
            f"s{i}-{j}" for i in range(self.threads) for j in range(self.appends_per_thread)
        )
        assert world.get_run(run.run_id).event_count == total + 2
        assert len(world.list_steps(run.run_id)) == total

    def test_optimistic_appends_retry_on_stale_log(self, world: World) -> None:
        run = create(world, started=True)

        def body(i: int) -> int:
            stale = 0
            while True:
                count = world.get_run(run.run_id).event_count
                try:
                    world.append(run.run_id, [step_created(f"s{i}")], expected_count=count)
                    return stale
                except StaleLog:
                    stale += 1

        results = _run_together(self.threads, body)
        assert all(isinstance(r, int) for r in results), results
        assert [e.slot for e in world.list_events(run.run_id)] == list(range(1, self.threads + 3))

    def test_racing_step_completions_have_one_winner(self, world: World) -> None:
        run = create(world, started=True)
        for round_ in range(3):
            sid = f"s{round_}"
            world.append(run.run_id, [step_created(sid), ev(EventType.STEP_STARTED, sid)])

            def complete(i: int, sid: str = sid) -> AppendResult:
                return world.append(run.run_id, [ev(EventType.STEP_COMPLETED, sid, result=i)])

            results = _run_together(2, complete)
            losers = [r for r in results if isinstance(r, Exception)]
            assert len(losers) == 1 and isinstance(losers[0], EntityTerminal), results
            terminal = [e for e in world.list_events(run.run_id) if e.correlation_id == sid]
            assert [e.event_type for e in terminal].count(EventType.STEP_COMPLETED) == 1
        log = world.list_events(run.run_id)
        assert [e.slot for e in log] == list(range(1, len(log) + 1))

    def test_racing_hook_tokens_have_one_owner(self, world: World) -> None:
        runs = [create(world, started=True) for _ in range(4)]
        token = unique("tok")
        results = _run_together(len(runs), lambda i: world.append(runs[i].run_id, [hook_created("h", token)]))
        assert all(isinstance(r, AppendResult) for r in results), results
        kinds = sorted(r.events[0].event_type for r in results if isinstance(r, AppendResult))
        assert kinds == [EventType.HOOK_CONFLICT] * 3 + [EventType.HOOK_CREATED]
        owner = world.get_hook_by_token(token)
        assert sum(len(world.list_hooks(r.run_id)) for r in runs) == 1
        assert world.list_hooks(owner.run_id)[0].token == token
