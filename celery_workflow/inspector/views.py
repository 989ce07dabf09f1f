"""The inspector's blueprint and its pages: the runs list, a run, a stream, the live tail and the dead letters.

Every page reads the World through its protocol only (``list_runs``, ``get_run``, ``list_events``, ``get_step``,
``list_waits``, ``list_hooks``, ``list_streams``, ``read_stream``) and the dead letters through
:func:`~celery_workflow.dead_letters.dead_letter_store`, so it works on every World. Bad query parameters get a 400
page, an unknown run a 404 page, an unreachable World a 503 page; the POST actions are in :mod:`.actions`.

Every page is bounded, whatever a run holds: lists are paged (the timeline by :data:`TIMELINE_PAGE` items, the event
log by :data:`EVENTS_PAGE` events, a stream by :data:`CHUNKS_PAGE` chunks, stream names by :data:`NAMES_PAGE`), the
run page shows the first :data:`RUN_STREAMS` streams with their first :data:`RUN_CHUNKS` chunks and at most
:data:`LIVE_SHOWN` live hooks and sleeps, and a value in a list is cut at :data:`model.MAX_LISTED` bytes with a link
to a page that shows it whole (a step, an event, a run's input or output, a stream chunk with ``limit=1``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from flask import Blueprint, Response, render_template, request, url_for

from celery_workflow import worker_setup
from celery_workflow._backend.children import link_of
from celery_workflow.dead_letters import DeadLetter, dead_letter_store
from celery_workflow.errors import (
    CeleryWorkflowError,
    ConfigurationError,
    DeadLetterNotFound,
    EventConflict,
    NotFound,
    PayloadTooLarge,
    WorldError,
)
from celery_workflow.events import RunStatus, RunView
from celery_workflow.history import History
from celery_workflow.ids import utcnow
from celery_workflow.inspector import guard, model
from celery_workflow.runtime import continuation
from celery_workflow.transport.scheduled import NO_DELAYED, delayed_requests, delayed_store, listed_queues
from celery_workflow.waiting_on import describe, run_waiting_on
from celery_workflow.world import StreamPage, World

if TYPE_CHECKING:
    from celery_workflow.app import Workflows

TEMPLATES = "celery_workflow_inspector"
RUNS_PAGE = 50
MAX_RUNS_PAGE = 200
EVENTS_PAGE = 100
#: Timeline items per page of the run page.
TIMELINE_PAGE = 200
#: Chunks per page of a stream's page.
CHUNKS_PAGE = 100
#: Streams the run page shows with their first chunks, and how many chunks each.
RUN_STREAMS = 10
RUN_CHUNKS = 10
#: Stream names per page (the run page names this many beyond those it shows; the streams page lists them all).
NAMES_PAGE = 200
#: Live hooks and pending sleeps the run page lists (a count says how many more there are).
LIVE_SHOWN = 200
LETTERS_PAGE = 100
#: The runs list reloads itself every ``refresh`` seconds when asked (0: never); the choices the page offers.
MIN_REFRESH, MAX_REFRESH = 2, 3600
REFRESH_CHOICES = (5, 15, 60)
#: The runs list says what a run in progress waits for when its log has at most this many events (else: "see run").
WAITING_MAX_EVENTS = 2000
#: Delayed messages one page of ``/scheduled`` lists (soonest due first).
SCHEDULED_PAGE = 500
MAX_INT64 = 2**63 - 1
#: The longest a live tail answer streams before it ends (the browser's EventSource then reconnects where it was).
TAIL_LIFETIME = 60.0
#: How long one read of the World waits for a new chunk before the tail looks at the run again.
TAIL_POLL = 0.5
#: A comment line is sent when nothing else was for this long (keeps proxies from closing the connection).
HEARTBEAT = 15.0
_DIGITS = re.compile(r"[0-9]{1,19}")


def waiting_column(world: World, runs: list[RunView]) -> dict[str, str]:
    """The runs list's "Waiting on" cell of each run in progress (issue #30, item 5; hook tokens hidden): the first
    thing it waits for and how many more; a run with a log over :data:`WAITING_MAX_EVENTS` events says "see run"."""
    cells: dict[str, str] = {}
    for run in runs:
        if run.status.terminal:
            continue
        if run.event_count > WAITING_MAX_EVENTS:
            cells[run.run_id] = "see run"
            continue
        items = run_waiting_on(world, run.run_id)
        if items:
            cells[run.run_id] = describe(items[0]) + (f" (+{len(items) - 1} more)" if len(items) > 1 else "")
    return cells


TITLES = {400: "Bad request", 401: "Unauthorized", 403: "Forbidden", 404: "Not found", 409: "Conflict"}


class Problem(Exception):
    """A request the inspector answers with an error page (status, one-line title, message)."""

    def __init__(self, status: int, message: str, title: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.title = title or TITLES.get(status, "Error")
        self.extra = extra


def problem_of(exc: CeleryWorkflowError) -> Problem:
    """The error page for a celery_workflow error raised while serving a page or an action."""
    if isinstance(exc, (NotFound, DeadLetterNotFound)):
        return Problem(404, exc.message)
    if isinstance(exc, PayloadTooLarge):
        return Problem(413, exc.message, "Too large")
    if isinstance(exc, EventConflict):
        return Problem(409, exc.message)
    if isinstance(exc, WorldError):
        return Problem(503, exc.message, "The World is unavailable")
    return Problem(400, exc.message)  # bad input: a payload that cannot be encoded, an invalid event, a bad setting


@dataclass(frozen=True, slots=True)
class Settings:
    tail_lifetime: float = TAIL_LIFETIME
    tail_poll: float = TAIL_POLL


class Inspector:
    """What the views share: the Workflows, the guard and the settings."""

    def __init__(self, wf: Workflows, access: guard.Guard, settings: Settings) -> None:
        self.wf = wf
        self.guard = access
        self.settings = settings

    @property
    def world(self) -> World:
        return self.wf.world

    def queue_of(self, step_name: str) -> str | None:
        """The queue the step is routed to (None: its run's), or :data:`model.UNKNOWN` for a step this Workflows
        does not register (an inspector served on a World alone)."""
        sdef = self.wf.registry.steps.get(step_name)
        return model.UNKNOWN if sdef is None else sdef.queue

    def check(self, action: str) -> None:
        denied = self.guard.denial(action)
        if denied is not None:
            raise Problem(*denied)

    def page(self, template: str, status: int = 200, **context: Any) -> Response:
        allowed: dict[str, bool] = {}

        def can(action: str) -> bool:
            if action not in allowed:
                allowed[action] = self.guard.allows(action)
            return allowed[action]

        html = render_template(
            f"{TEMPLATES}/{template}",
            can=can,
            csrf_field=guard.FIELD,
            csrf_token=guard.csrf_token,
            nonce=guard.nonce,
            now=utcnow(),
            show_time=model.show_time,
            show_duration=model.show_duration,
            show_relative=model.show_relative,
            show_json=model.show_json,
            show_chunk=model.show_chunk,
            preview=model.preview,
            chunk_preview=model.chunk_preview,
            max_whole=model.MAX_WHOLE,
            max_listed=model.MAX_LISTED,
            error_text=model.error_text,
            event_data=model.event_data,
            **context,
        )
        return Response(html, status=status, mimetype="text/html")

    def problem(self, exc: Problem) -> Response:
        return self.page(
            "error.html", exc.status, title=exc.title, message=exc.message, status_code=exc.status, **exc.extra
        )


# -- query parameters -------------------------------------------------------------------------------------------------


def text_arg(name: str, max_length: int = 200) -> str | None:
    """A query parameter of at most ``max_length`` printable characters (a lone surrogate is not one)."""
    value = request.args.get(name)
    if value is None or value == "":
        return None
    if len(value) > max_length or not value.isprintable():
        raise Problem(400, f"{name}: at most {max_length} printable characters")
    return value


def whole(text: str) -> int | None:
    """``text`` as a whole number that fits 64 bits (ASCII digits only), else None."""
    if not _DIGITS.fullmatch(text) or int(text) > MAX_INT64:
        return None
    return int(text)


def int_arg(name: str, default: int, low: int, high: int) -> int:
    raw = request.args.get(name)
    if raw is None or raw == "":
        return default
    value = whole(raw)
    if value is None or not low <= value <= high:
        raise Problem(400, f"{name}: a whole number from {low} to {high}, not {raw[:50]!r}")
    return value


def status_arg() -> RunStatus | None:
    value = request.args.get("status")
    if value is None or value == "":
        return None
    try:
        return RunStatus(value)
    except ValueError:
        known = ", ".join(s.value for s in RunStatus)
        raise Problem(400, f"unknown status {value[:50]!r}; one of: {known}") from None


def time_arg(name: str) -> datetime | None:
    """An ISO 8601 time (a browser's ``datetime-local`` value included); one without an offset is UTC."""
    value = text_arg(name, 40)
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise Problem(400, f"{name}: an ISO 8601 time such as 2026-12-05T14:30 (UTC), not {value[:50]!r}") from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed


def links(endpoint: str, **params: Any) -> str:
    return url_for(endpoint, **{k: v for k, v in params.items() if v is not None and v != ""})


# -- streams ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamView:
    name: str
    start: int
    page: StreamPage
    more: bool  # chunks beyond this page
    tail: str | None  # the live tail's URL, when the page shows the stream's end and it may still grow

    @property
    def end(self) -> int:
        return self.page.next_index


def read_stream(world: World, run: RunView, name: str, start: int, limit: int = CHUNKS_PAGE) -> StreamView:
    page = world.read_stream(run.run_id, name, start=start, limit=limit + 1)
    more = len(page.chunks) > limit
    if more:
        chunks = page.chunks[:limit]
        page = StreamPage(chunks, page.closed, chunks[-1].index + 1)
    live = not more and not page.closed and not run.status.terminal
    tail = links(".tail", run_id=run.run_id, name=name, start=page.next_index) if live else None
    return StreamView(name, start, page, more, tail)


def sse(event: str, data: Any, event_id: int | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def chunk_events(page: StreamPage) -> Iterator[str]:
    for chunk in page.chunks:
        yield sse("chunk", {"index": chunk.index, "text": model.show_chunk(chunk.data, model.MAX_LISTED)}, chunk.index)


def tail_events(world: World, run_id: str, name: str, start: int, settings: Settings) -> Iterator[str]:
    """Server-sent events of the chunks from ``start``: ``chunk`` (id = index) as they are written, then ``end``
    when the stream closes or the run has ended with nothing more written (``failure`` if the World fails); the
    answer ends after ``settings.tail_lifetime`` seconds, and the browser's EventSource reconnects where it was."""
    deadline = time.monotonic() + settings.tail_lifetime
    quiet_since = time.monotonic()
    index = start
    yield "retry: 2000\n\n"
    while (left := deadline - time.monotonic()) > 0:
        try:
            page = world.read_stream(run_id, name, start=index, limit=CHUNKS_PAGE, wait=min(settings.tail_poll, left))
            if not page.chunks and not page.closed and world.get_run(run_id).status.terminal:
                page = world.read_stream(run_id, name, start=index, limit=CHUNKS_PAGE)  # written just before the end
                if not page.chunks:
                    yield sse("end", {"reason": "the run has ended"})
                    return
        except CeleryWorkflowError as exc:
            yield sse("failure", {"message": exc.message})
            return
        yield from chunk_events(page)
        index = page.next_index
        if page.chunks:
            quiet_since = time.monotonic()
        elif page.closed:
            yield sse("end", {"reason": "the stream is closed"})
            return
        elif time.monotonic() - quiet_since >= HEARTBEAT:
            quiet_since = time.monotonic()
            yield ": still here\n\n"


# -- the pages --------------------------------------------------------------------------------------------------------


def add_views(bp: Blueprint, ins: Inspector) -> None:
    @bp.get("/")
    def runs() -> Response:
        ins.check(guard.VIEW)
        workflow, status, prefix = text_arg("workflow"), status_arg(), text_arg("run")
        created_from, created_until = time_arg("from"), time_arg("until")
        limit = int_arg("limit", RUNS_PAGE, 1, MAX_RUNS_PAGE)
        refresh = int_arg("refresh", 0, 0, MAX_REFRESH)
        cursor = text_arg("cursor", 400)
        try:
            page = ins.world.list_runs(
                workflow=workflow,
                status=status,
                limit=limit,
                cursor=cursor,
                run_id_prefix=prefix,
                created_from=created_from,
                created_until=created_until,
            )
        except ValueError as exc:
            raise Problem(400, f"cannot list runs: {exc}") from None
        filters = {
            "workflow": workflow,
            "status": status.value if status else None,
            "run": prefix,
            "from": request.args.get("from") or None,
            "until": request.args.get("until") or None,
        }
        kept = {**filters, "refresh": refresh or None}
        return ins.page(
            "runs.html",
            runs=page.items,
            waiting=waiting_column(ins.world, page.items),
            counts=model.status_counts(ins.world, workflow=workflow),
            filters=filters,
            searched=any(v is not None for k, v in filters.items() if k not in {"workflow", "status"}),
            refresh=refresh if refresh >= MIN_REFRESH else 0,
            refresh_choices=REFRESH_CHOICES,
            statuses=[s.value for s in RunStatus],
            paged=cursor is not None,
            first_url=links(".runs", **kept, limit=limit if limit != RUNS_PAGE else None),
            next_url=links(".runs", **kept, limit=limit, cursor=page.cursor) if page.cursor else None,
        )

    @bp.get("/runs/<run_id>/history.json")
    def history(run_id: str) -> Response:
        """The run's whole event log as the JSON ``History.load`` / ``testing.replay_history`` read (hook tokens
        included, so it needs the right to reveal them)."""
        ins.check(guard.VIEW)
        ins.check(guard.REVEAL)
        doc = History.from_world(ins.world, run_id).to_json()
        resp = Response(
            json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n", mimetype="application/json"
        )
        resp.headers["Content-Disposition"] = f'attachment; filename="{run_id}.history.json"'
        return resp

    @bp.get("/runs/<run_id>")
    def run(run_id: str) -> Response:
        ins.check(guard.VIEW)
        after = int_arg("after_slot", 0, 0, MAX_INT64)
        first_item = int_arg("item", 0, 0, model.MAX_TIMELINE_EVENTS)
        reveal = set(request.args.getlist("reveal"))
        if reveal:
            ins.check(guard.REVEAL)
        w = ins.world
        view = w.get_run(run_id)
        events, cut = model.read_events(w, run_id)
        items = model.timeline(view, events, ins.queue_of)
        log = w.list_events(run_id, after_slot=after, limit=EVENTS_PAGE + 1)
        names = sorted(w.list_streams(run_id))
        hooks, waits = w.list_hooks(run_id), w.list_waits(run_id)
        base_url = ins.wf.base_url
        earlier = max(0, after - EVENTS_PAGE) if after > 0 else None
        later = log[EVENTS_PAGE - 1].slot if len(log) > EVENTS_PAGE else None

        def items_url(item: int) -> str:
            return links(".run", run_id=run_id, item=item or None, _anchor="timeline")

        return ins.page(
            "run.html",
            run=view,
            no_consumer=bool(worker_setup.unserved(w, [view])),
            continues=continuation.predecessor_of(events[0].body) if events else None,
            continued_as=continuation.continued_as(w, view),
            parent=link.run_id if (link := link_of(events[:1])) is not None else None,
            children=sum(1 for item in items if item.kind == "child"),
            timeline=items[first_item : first_item + TIMELINE_PAGE],
            timeline_from=first_item,
            timeline_count=len(items),
            timeline_cut=cut,
            earlier_items=items_url(max(0, first_item - TIMELINE_PAGE)) if first_item else None,
            later_items=items_url(first_item + TIMELINE_PAGE) if first_item + TIMELINE_PAGE < len(items) else None,
            waits=waits[:LIVE_SHOWN],
            more_waits=max(0, len(waits) - LIVE_SHOWN),
            hooks=hooks[:LIVE_SHOWN],
            more_hooks=max(0, len(hooks) - LIVE_SHOWN),
            reveal=reveal,
            webhook_base=f"{base_url.rstrip('/')}/webhooks/" if base_url else None,
            events=log[:EVENTS_PAGE],
            events_after=after,
            earlier_url=None if earlier is None else links(".run", run_id=run_id, after_slot=earlier, _anchor="events"),
            later_url=None if later is None else links(".run", run_id=run_id, after_slot=later, _anchor="events"),
            streams=[read_stream(w, view, name, 0, RUN_CHUNKS) for name in names[:RUN_STREAMS]],
            more_streams=names[RUN_STREAMS : RUN_STREAMS + NAMES_PAGE],
            all_streams_url=links(".streams", run_id=run_id) if len(names) > RUN_STREAMS + NAMES_PAGE else None,
        )

    @bp.get("/runs/<run_id>/values/<which>")
    def run_value(run_id: str, which: str) -> Response:
        """A run's input, output or error, whole."""
        ins.check(guard.VIEW)
        if which not in ("input", "output", "error"):
            raise Problem(404, f"a run has no value {which[:50]!r}: input, output or error")
        view = ins.world.get_run(run_id)
        return ins.page(
            "value.html", run=view, title=f"The {which} of run {run_id}", values=[(which, getattr(view, which))]
        )

    @bp.get("/runs/<run_id>/steps/<step_id>")
    def step(run_id: str, step_id: str) -> Response:
        """A step with its input, output and error, whole."""
        ins.check(guard.VIEW)
        view = ins.world.get_run(run_id)
        s = ins.world.get_step(run_id, step_id)
        facts = [
            ("Step", s.step_name),
            ("Status", s.status.value),
            ("Attempts", str(s.attempt)),
            ("Created", model.show_time(s.created_at)),
            ("Started", model.show_time(s.started_at)),
            ("Ended", model.show_time(s.completed_at)),
        ]
        values = [("input", s.input), ("output", s.output), ("error", s.error)]
        return ins.page("value.html", run=view, title=f"Step {step_id}", facts=facts, values=values)

    @bp.get("/runs/<run_id>/events/<slot>")
    def event(run_id: str, slot: str) -> Response:
        """An event with its data whole (hook tokens hidden, as in the event log)."""
        ins.check(guard.VIEW)
        number = whole(slot)
        if number is None or number < 1:
            raise Problem(404, f"run {run_id} has no event {slot[:50]!r}")
        view = ins.world.get_run(run_id)
        found = ins.world.list_events(run_id, after_slot=number - 1, limit=1)
        if not found or found[0].slot != number:
            raise Problem(404, f"run {run_id} has no event {number}")
        ev = found[0]
        facts = [
            ("Event", ev.event_type.value),
            ("Correlation id", ev.correlation_id or ""),
            ("Recorded", model.show_time(ev.created_at)),
        ]
        values = [("data", model.event_data(ev))]
        return ins.page("value.html", run=view, title=f"Event {number} of run {run_id}", facts=facts, values=values)

    @bp.get("/runs/<run_id>/streams")
    def streams(run_id: str) -> Response:
        """The run's stream names, :data:`NAMES_PAGE` at a time, after the name ``after``."""
        ins.check(guard.VIEW)
        after = text_arg("after", 512)
        view = ins.world.get_run(run_id)
        names = sorted(ins.world.list_streams(run_id))
        rest = [n for n in names if after is None or n > after]
        page = rest[:NAMES_PAGE]
        later = links(".streams", run_id=run_id, after=page[-1]) if len(rest) > NAMES_PAGE else None
        return ins.page(
            "streams.html", run=view, names=page, count=len(names), paged=after is not None, later_url=later
        )

    @bp.get("/runs/<run_id>/streams/<path:name>")
    def stream(run_id: str, name: str) -> Response:
        ins.check(guard.VIEW)
        start = int_arg("start", 0, 0, MAX_INT64)
        limit = int_arg("limit", CHUNKS_PAGE, 1, CHUNKS_PAGE)
        view = ins.world.get_run(run_id)
        shown = read_stream(ins.world, view, name, start, limit)
        earlier = links(".stream", run_id=run_id, name=name, start=max(0, start - CHUNKS_PAGE)) if start else None
        later = links(".stream", run_id=run_id, name=name, start=shown.end) if shown.more else None
        return ins.page(
            "stream.html",
            run=view,
            stream=shown,
            whole_chunks=limit == 1,
            earlier_url=earlier,
            later_url=later,
        )

    @bp.get("/runs/<run_id>/streams/<path:name>/tail")
    def tail(run_id: str, name: str) -> Response:
        """``text/event-stream`` of the stream from ``start`` (or after the ``Last-Event-ID`` a reconnecting
        EventSource sends)."""
        ins.check(guard.VIEW)
        start = int_arg("start", 0, 0, MAX_INT64)
        last = whole(request.headers.get("Last-Event-ID", ""))
        if last is not None and last < MAX_INT64:
            start = max(start, last + 1)
        w = ins.world
        w.get_run(run_id)  # 404 before the stream starts
        resp = Response(tail_events(w, run_id, name, start, ins.settings), mimetype="text/event-stream")
        resp.headers["X-Accel-Buffering"] = "no"  # nginx: pass events through as they come
        return resp

    @bp.get("/scheduled")
    def scheduled() -> Response:
        """Countdown/ETA deliveries the World's queue holds until they are due (no worker holds them)."""
        ins.check(guard.VIEW)
        queue = text_arg("queue")
        store = delayed_store(ins.world)
        if store is None:
            unavailable = NO_DELAYED[0].upper() + NO_DELAYED[1:] + "."
            return ins.page("scheduled.html", entries=[], unavailable=unavailable, filters={"queue": queue})
        queues = [queue] if queue else listed_queues(store, worker_setup.known_queues(ins.wf))
        entries = delayed_requests(store, queues, None, SCHEDULED_PAGE)
        for entry in entries:
            entry["due"] = datetime.fromisoformat(entry["eta"])
        return ins.page(
            "scheduled.html",
            entries=entries,
            unavailable=None,
            filters={"queue": queue},
            full=len(entries) == SCHEDULED_PAGE,
        )

    @bp.get("/dead-letters")
    def dead_letters() -> Response:
        ins.check(guard.VIEW)
        queue, run_id = text_arg("queue"), text_arg("run")
        after_raw = text_arg("after", 128) or "0"
        after: int | str = after_raw if (number := whole(after_raw)) is None else number
        if isinstance(after, str) and after_raw.isdigit():
            raise Problem(400, f"after: not a dead letter id: {after_raw[:50]!r}")
        redriven = text_arg("redriven", 128)
        try:
            store = dead_letter_store(ins.world)
        except ConfigurationError as exc:
            return ins.page("dead_letters.html", letters=[], unavailable=exc.message, filters={}, redriven=None)
        try:
            letters: list[DeadLetter] = store.list_dead_letters(
                queue=queue, run_id=run_id, after=after, limit=LETTERS_PAGE
            )
        except DeadLetterNotFound:
            raise Problem(400, f"after: not a dead letter id: {after_raw[:50]!r}") from None
        more = len(letters) == LETTERS_PAGE and isinstance(letters[-1].id, int)
        filters = {"queue": queue, "run": run_id}
        return ins.page(
            "dead_letters.html",
            letters=letters,
            unavailable=None,
            filters=filters,
            redriven=redriven,
            paged=after != 0,
            first_url=links(".dead_letters", **filters),
            next_url=links(".dead_letters", **filters, after=letters[-1].id) if more else None,
        )
