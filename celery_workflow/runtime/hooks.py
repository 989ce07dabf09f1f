"""Hooks under a replay: creating (or meeting in the log) a hook, the takeover of a forced claim, the next payload
a ``wait()`` gets, and disposal. :class:`~.replay.Replay` delegates its hook calls here; the bookkeeping they read
and append to (the log by correlation id, the pending creations) is the replay's own.
"""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from celery_workflow import codec
from celery_workflow.errors import EventInvalid, HookConflict
from celery_workflow.event_data import HookConflictData, HookCreatedData, HookDisposedData, HookReceivedData
from celery_workflow.events import EventType, NewEvent
from celery_workflow.runtime.control import Diverged, Suspend, guarded

if TYPE_CHECKING:
    from celery_workflow.runtime.replay import Replay

#: How often a forced hook claim takes its token over before it gives up (each time another run claimed it first).
MAX_TAKEOVERS = 3


def claim(
    replay: Replay,
    token: str | None,
    metadata: Any,
    *,
    is_webhook: bool,
    respond_with: Any,
    options: tuple[bool, bool] | None = None,
    force: bool = False,
    retention: timedelta | datetime | None = None,
) -> tuple[str, str, HookCreatedData | None]:
    """Create (or meet in the log) a hook: its correlation id, its token and its creation data (None: its
    creation met an owner, ``hook_conflict``). ``options``: a webhook's ``(many, keep_credentials)``."""
    if token is not None and not (isinstance(token, str) and token):
        # raised where the workflow asks, so its cause is plain (the World would refuse the creation later)
        got = "an empty string" if isinstance(token, str) else type(token).__name__
        raise EventInvalid(f"a hook token must be a non-empty string, not {got}")
    cid = replay._next_id("hook")
    ev = replay._match(cid)

    def creation(tok: str) -> HookCreatedData:
        until = None
        if retention is not None:  # an end in time, fixed when the hook is first created (see rules)
            until = replay.effects.wall_now() + retention if isinstance(retention, timedelta) else retention
        many, keep_credentials = options if options is not None else (None, None)
        return HookCreatedData(
            token=tok,
            metadata=codec.to_json(metadata),
            is_webhook=is_webhook,
            respond_with=codec.to_json(respond_with) if respond_with is not None else None,
            many=many,
            keep_credentials=keep_credentials,
            force=force,
            token_retention_until=until,
        )

    if ev is None:
        tok = token if token is not None else secrets.token_urlsafe(18)
        data = creation(tok)
        replay.pending.append(NewEvent.of(data, cid))
        if force:
            replay.forced[cid] = data
        return cid, tok, data
    body = ev.body
    if not isinstance(body, HookCreatedData | HookConflictData):
        raise Diverged(f"slot {ev.slot} holds {ev.event_type} {cid!r}, not a hook")
    tok = body.token
    if token is not None and token != tok:
        raise Diverged(f"hook {cid!r} was created with token {tok!r}, the code now asks for {token!r}")
    if force:
        replay.forced[cid] = creation(tok)
    return cid, tok, body if isinstance(body, HookCreatedData) else None


def current(replay: Replay, cid: str, *, take: bool) -> str:
    """The hook that stands for ``cid`` now. A forced claim whose creation met an owner (``hook_conflict``) takes
    the token from it and claims it again as ``<cid>~1`` (``~2`` … when yet another run took it meanwhile, up to
    :data:`MAX_TAKEOVERS` times; past that the hook stays in conflict). Successors are found by id: their
    creations come after whatever the code did in between. ``take``: take the token over when no successor
    exists yet (a wait), or not (a dispose)."""
    data = replay.forced.get(cid)
    if data is None or not replay._of(cid, EventType.HOOK_CONFLICT):
        return cid
    current = cid
    for k in range(1, MAX_TAKEOVERS + 1):
        successor = f"{cid}~{k}"
        if replay._of(successor, EventType.HOOK_CREATED):
            return successor
        if not replay._of(successor, EventType.HOOK_CONFLICT):
            pending = any(ev.correlation_id == successor for ev in replay.pending)
            if take and not pending:
                guarded(partial(replay.effects.take_token, data.token))
                replay.pending.append(NewEvent.of(data, successor))
            return successor if take or pending else current
        current = successor
    return current


def next_payload(replay: Replay, cid: str, consumed: int) -> tuple[Any, int]:
    cid = current(replay, cid, take=True)
    conflict = replay._of(cid, EventType.HOOK_CONFLICT)
    if conflict:
        data = conflict[0].data_as(HookConflictData)
        raise HookConflict(token=data.token, conflicting_run_id=data.conflicting_run_id)
    received = replay._of(cid, EventType.HOOK_RECEIVED)
    if consumed < len(received):
        ev = received[consumed]
        replay._advance(ev)
        return ev.data_as(HookReceivedData).payload, consumed + 1
    for ev in replay._of(cid, EventType.HOOK_DISPOSED):
        taken_by = ev.data_as(HookDisposedData).taken_by
        if taken_by:  # another run's forced claim took the token (see Effects.take_token)
            replay._advance(ev)
            created = replay._of(cid, EventType.HOOK_CREATED)
            token = created[0].data_as(HookCreatedData).token if created else ""
            # the message names no token: it is recorded as the run's error where it fails the run
            raise HookConflict(
                f"the token of hook {cid} was taken over by run {taken_by}",
                token=token,
                conflicting_run_id=taken_by,
            )
    raise Suspend()


def dispose(replay: Replay, cid: str) -> None:
    cid = current(replay, cid, take=False)
    if replay._of(cid, EventType.HOOK_DISPOSED) or replay._of(cid, EventType.HOOK_CONFLICT):
        return
    for i, ev in enumerate(replay.pending):
        if ev.correlation_id == cid and ev.event_type is EventType.HOOK_CREATED:
            del replay.pending[i]  # never written: nothing to release
            return
    if any(ev.correlation_id == cid for ev in replay.pending):
        return
    replay.pending.append(NewEvent.of(HookDisposedData(), cid))
