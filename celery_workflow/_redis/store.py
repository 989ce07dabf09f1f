"""A :class:`~celery_workflow._backend.queue_contract.ControlStore` in Redis: the control channel of the SQS transport.

SQS has no fanout, so Celery's events and remote control (``celery inspect``, Flower) cannot travel on it. With
``AWSConfig(control_url="redis://…")`` the SQS transport keeps that traffic (pidbox, event and reply queues, their
exchanges and bindings) in Redis through this store, with the same semantics as our SQL stores, so the Kombu layer
(:mod:`celery_workflow.transport.base`) is the same code on every broker:

* a message is a hash ``<prefix>m:<id>`` (ids from ``INCR``, never reused); a queue's unleased messages are a sorted
  set by due time (``<prefix>due:<queue>``) and its leased ones another by lease end (``<prefix>held:<queue>``);
* every operation is one Lua script, so it is atomic: a claim takes due messages oldest first across the queues
  asked for, counts the attempt, releases the idempotency key and leases them (or deletes them, for ``no_ack``
  queues); ack, release, retry and extend act only while the receipt's attempt is the message's current one;
* queue declarations (``x-expires``, ``x-message-ttl``, auto_delete), exchanges, bindings and live consumers are
  hashes and sorted sets, shared by every process; :meth:`RedisStore.gc` collects what nobody uses;
* a message keeps its failure history (first and last failed delivery, last error: a lease that ran out, a retry
  with an error); past its delivery limit, or rejected, it moves to the dead letters (``<prefix>d:<id>`` hashes
  indexed by ``<prefix>dead``), the :class:`~celery_workflow.dead_letters.DeadLetterStore` of the SQL stores;
* every insert and release publishes the queue's name on ``<prefix>changes``; one subscriber thread per process turns
  that into the change token waiters wait on.

Times are integer microseconds from :attr:`RedisStore.clock` (Python's ``time.time`` unless a test sets one),
passed into the scripts: Redis's own clock is never read. Redis errors are raised as
:class:`~celery_workflow.errors.WorldError` (``WorldUnavailable`` when Redis is unreachable).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from celery_workflow import dead_letters
from celery_workflow._backend.broker import Binding, QueuedMessage, claimed, parse_receipt
from celery_workflow._redis import scripts as lua
from celery_workflow.dead_letters import DeadLetter
from celery_workflow.errors import ConfigurationError, DeadLetterNotFound, WorldError, WorldUnavailable
from celery_workflow.world import ClaimedDelivery, Delivery

try:  # the optional driver: pip install 'celery-workflow[redis]'
    import redis
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ConfigurationError("the control channel needs redis: pip install 'celery-workflow[redis]'") from exc

__all__ = ["RedisStore"]

log = logging.getLogger(__name__)


def _us(seconds: float) -> int:
    return round(seconds * 1_000_000)


def _when(raw: bytes | None) -> datetime | None:
    return None if not raw else datetime.fromtimestamp(int(raw) / 1_000_000, UTC)


def _letter(letter_id: int, row: Mapping[bytes, bytes]) -> DeadLetter:
    enqueued, died = _when(row[b"enq"]), _when(row[b"dead"])
    assert enqueued is not None and died is not None
    return DeadLetter(
        letter_id, int(row[b"mid"]), row[b"queue"].decode(), row[b"run"].decode() or None, int(row[b"attempts"]),
        row[b"reason"].decode(), row[b"err"].decode() or None, _when(row.get(b"ff")), _when(row.get(b"lf")),
        enqueued, died, bytes(row[b"payload"]),
    )  # fmt: skip


class RedisStore:
    """Messages and routing state in Redis under ``prefix`` (thread- and fork-safe; redis-py reconnects after a
    fork)."""

    #: Called (from the subscriber thread) after each change, e.g. to wake a composite store's waiters.
    on_change: Callable[[], None] | None

    def __init__(self, url: str, *, prefix: str = "celery_workflow:") -> None:
        self.url = url
        self.prefix = prefix
        #: Wall clock in seconds since the epoch; tests may replace it.
        self.clock: Callable[[], float] = time.time
        try:
            self.redis = redis.Redis.from_url(
                url, socket_timeout=10, socket_connect_timeout=5, health_check_interval=30
            )
        except ValueError as exc:
            raise ConfigurationError(f"invalid Redis URL for the control channel: {exc}") from exc
        self._scripts = {
            name: self.redis.register_script(body)
            for name, body in {
                "put": lua.PUT,
                "claim": lua.CLAIM,
                "settle": lua.SETTLE,
                "waiting": lua.WAITING,
                "due": lua.DUE,
                "drop": lua.DROP_QUEUES,
                "expire": lua.EXPIRE,
                "dead_letter": lua.DEAD_LETTER,
                "list_letters": lua.LIST_LETTERS,
                "move_letters": lua.MOVE_LETTERS,
            }.items()
        }
        self._cond = threading.Condition()
        self._version = 0
        self.on_change = None
        self._listener: threading.Thread | None = None
        self._listener_pid = 0
        self._stop = threading.Event()

    # -- plumbing ----------------------------------------------------------------------------------------------------

    def _now(self) -> int:
        return _us(self.clock())

    def _key(self, *parts: str) -> str:
        return self.prefix + "".join(parts)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise WorldUnavailable(f"Redis {what}: {exc}") from exc
        except redis.RedisError as exc:
            raise WorldError(f"Redis {what}: {exc}") from exc

    def _script(self, name: str, *args: Any) -> Any:
        return self._call(name, self._scripts[name], keys=[], args=[self.prefix, self._now(), *args])

    # -- messages ----------------------------------------------------------------------------------------------------

    def put(
        self,
        queue: str,
        payload: bytes,
        *,
        not_before: float | None = None,
        run_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> bool:
        """Store one message (due at ``not_before``, epoch seconds, or now); ``False`` when deduplicated."""
        now = self._now()
        due = now if not_before is None else _us(not_before)
        found = self._script("put", queue, bytes(payload), run_id or "", due, idempotency_key or "")
        return bool(found)

    def enqueue(self, deliveries: Sequence[Delivery]) -> list[bool]:
        return [
            self.put(
                d.queue,
                d.payload,
                not_before=None if d.not_before is None else d.not_before.timestamp(),
                run_id=d.run_id,
                idempotency_key=d.idempotency_key,
            )
            for d in deliveries
        ]

    def put_fanout(self, exchange: str, payload: bytes, *, not_before: float | None = None) -> int:
        """A copy of the message on every queue bound to ``exchange``; the number of copies."""
        queues = sorted({b.queue for b in self.bindings(exchange)})
        for queue in queues:
            self.put(queue, payload, not_before=not_before)
        return len(queues)

    def receive(
        self, queues: Sequence[str], *, no_ack: Collection[str] = (), limit: int = 1, lease: float = 60.0
    ) -> list[ClaimedDelivery]:
        """Claim up to ``limit`` due messages of ``queues``, oldest due first (``no_ack`` queues: deleted)."""
        names = list(dict.fromkeys(queues))
        if not names or limit <= 0:
            return []
        rows = self._script(
            "claim",
            self._now() + _us(lease),
            limit,
            len(names),
            *names,
            *("1" if q in no_ack else "0" for q in names),
            dead_letters.LEASE_EXPIRED,
        )
        return [
            claimed(int(i), q.decode(), bytes(payload), int(a), run.decode() or None)
            for i, q, payload, a, run, _nb in rows
        ]

    def claim(self, queues: Sequence[str], *, limit: int = 1, lease: float = 60.0) -> list[ClaimedDelivery]:
        return self.receive(queues, limit=limit, lease=lease)

    def poll(
        self, queues: Sequence[str], *, no_ack: Collection[str] = (), limit: int = 1, lease: float = 60.0
    ) -> tuple[list[ClaimedDelivery], dict[str, float]]:
        return self.receive(queues, no_ack=no_ack, limit=limit, lease=lease), self.due_times(queues)

    def due_times(self, queues: Sequence[str]) -> dict[str, float]:
        """For each of ``queues`` holding a message: epoch seconds at which its next one becomes claimable."""
        names = list(dict.fromkeys(queues))
        if not names:
            return {}
        flat = self._script("due", *names)
        return {flat[i].decode(): int(flat[i + 1]) / 1e6 for i in range(0, len(flat), 2)}

    def next_due(self, queues: Sequence[str]) -> float | None:
        return min(self.due_times(queues).values(), default=None)

    def _settle(self, op: str, value: int, receipts: Sequence[str], error: str | None = None) -> None:
        args: list[Any] = []
        for receipt in receipts:
            row_id, attempts = parse_receipt(receipt)
            args += [row_id, attempts]
        if args:
            self._script("settle", op, value, dead_letters.cut_error(error) or "", *args)

    def ack(self, receipt: str) -> None:
        self._settle("ack", 0, [receipt])

    def release(self, receipt: str) -> None:
        self._settle("release", 0, [receipt])

    def retry_later(self, receipt: str, delay: float, *, error: str | None = None) -> None:
        """Due again in ``delay`` seconds, recording a failed delivery (and ``error``, when given, as its last
        error). No-op when the receipt is stale."""
        self._settle("later", self._now() + _us(max(delay, 0.0)), [receipt], error)

    def extend(self, receipts: Sequence[str], lease: float) -> None:
        self._settle("extend", self._now() + _us(lease), receipts)

    def size(self, queue: str) -> int:
        return int(self._script("waiting", "count", queue))

    def purge(self, queue: str) -> int:
        return int(self._script("waiting", "purge", queue))

    def peek(self, queues: Sequence[str] | None = None) -> list[QueuedMessage]:
        """Every stored message of ``queues`` (all declared or used queues when None), in claim order."""
        names = list(dict.fromkeys(queues)) if queues is not None else self._used_queues()
        out: list[QueuedMessage] = []
        for queue in names:
            ids = [*self._call("peek", self.redis.zrange, self._key("due:", queue), 0, -1)]
            ids += self._call("peek", self.redis.zrange, self._key("held:", queue), 0, -1)
            for raw in ids:
                m = self._call("peek", self.redis.hgetall, self._key("m:", raw.decode()))
                if not m:
                    continue
                lease, exp, key = m[b"lease"].decode(), m[b"exp"].decode(), m[b"key"].decode()
                out.append(
                    QueuedMessage(
                        int(raw),
                        queue,
                        m[b"run"].decode() or None,
                        int(m[b"attempts"]),
                        int(m[b"nb"]) / 1e6,
                        int(lease) / 1e6 if lease else None,
                        key or None,
                        int(exp) / 1e6 if exp else None,
                        bytes(m[b"payload"]),
                    )
                )
        return sorted(out, key=lambda m: (m.due, m.id))

    def _used_queues(self) -> list[str]:
        """The queues holding messages (their sorted sets exist)."""
        keys = [*self._call("peek", self.redis.keys, self._key("due:*"))]
        keys += self._call("peek", self.redis.keys, self._key("held:*"))
        return sorted({k.decode()[len(self.prefix) :].split(":", 1)[1] for k in keys})

    # -- dead letters (celery_workflow.dead_letters.DeadLetterStore) -------------------------------------------------

    def dead_letter(self, receipt: str, *, reason: str, error: str | None = None) -> DeadLetter | None:
        """Move the claimed message to the dead letters with its history (``error`` becomes its last error when
        given); None when the receipt is stale."""
        row_id, attempts = parse_receipt(receipt)
        letter = int(self._script("dead_letter", row_id, attempts, reason, dead_letters.cut_error(error) or ""))
        return self.get_dead_letter(letter) if letter else None

    def _letters(self, ids: Sequence[bytes | int | str]) -> list[DeadLetter]:
        pipe = self.redis.pipeline(transaction=False)
        for letter in ids:
            pipe.hgetall(self._key("d:", str(int(letter))))
        rows = self._call("dead letters", pipe.execute) if ids else []
        return [_letter(int(i), row) for i, row in zip(ids, rows, strict=True) if row]

    def list_dead_letters(
        self, *, queue: str | None = None, run_id: str | None = None, after: int | str = 0, limit: int = 100
    ) -> list[DeadLetter]:
        """Dead letters with ids above ``after``, oldest first (of ``queue`` / ``run_id`` when given)."""
        after_id = dead_letters.letter_id(after)
        if limit <= 0:
            return []
        ids = self._script("list_letters", after_id, limit, queue or "", run_id or "", "0")
        return self._letters(ids)

    def get_dead_letter(self, letter_id: int | str) -> DeadLetter:
        letters = self._letters([dead_letters.letter_id(letter_id)])
        if not letters:
            raise DeadLetterNotFound(f"no dead letter {letter_id}")
        return letters[0]

    def unsettled_dead_letters(self, *, limit: int = 100) -> list[DeadLetter]:
        """Dead letters whose run has not been failed because of them yet, oldest first."""
        return self._letters(self._script("list_letters", 0, max(limit, 0), "", "", "1")) if limit > 0 else []

    def settle_dead_letters(self, ids: Sequence[int | str]) -> None:
        """Record that the runs of these dead letters have been dealt with."""
        if ids:
            self._move_letters("settle", ids, None)

    def _move_letters(self, mode: str, ids: Sequence[int | str] | None, queue: str | None) -> int:
        if ids is not None and not ids:
            return 0
        picked = [] if ids is None else [dead_letters.letter_id(i) for i in ids]
        return int(self._script("move_letters", mode, queue or "", "1" if ids is None else "0", *picked))

    def redrive_dead_letters(self, ids: Sequence[int | str] | None = None, *, queue: str | None = None) -> int:
        """Put the selected dead letters back on their queues, due now with attempts reset, and delete them."""
        return self._move_letters("redrive", ids, queue)

    def purge_dead_letters(self, ids: Sequence[int | str] | None = None, *, queue: str | None = None) -> int:
        return self._move_letters("purge", ids, queue)

    # -- queues ------------------------------------------------------------------------------------------------------

    def declare_queue(
        self,
        name: str,
        *,
        durable: bool = True,
        exclusive: bool = False,
        auto_delete: bool = False,
        expires: float | None = None,
        message_ttl: float | None = None,
    ) -> None:
        declaration = {
            "durable": durable,
            "exclusive": exclusive,
            "auto_delete": auto_delete,
            "expires": expires,
            "message_ttl": message_ttl,
            "last_used": self._now(),
        }
        self._call("declare queue", self.redis.hset, self._key("queues"), name, json.dumps(declaration))

    def queue_info(self, name: str) -> dict[str, Any] | None:
        raw = self._call("queue info", self.redis.hget, self._key("queues"), name)
        if raw is None:
            return None
        info: dict[str, Any] = json.loads(raw)
        info["last_used"] = info["last_used"] / 1e6
        return info

    def has_queue(self, name: str) -> bool:
        """Declared, or holding messages."""
        if self._call("has queue", self.redis.hexists, self._key("queues"), name):
            return True
        return bool(self._call("has queue", self.redis.exists, self._key("due:", name), self._key("held:", name)))

    def queues(self) -> list[str]:
        return sorted(k.decode() for k in self._call("queues", self.redis.hkeys, self._key("queues")))

    def delete_queue(self, name: str) -> int:
        return int(self._script("drop", name))

    # -- exchanges and bindings --------------------------------------------------------------------------------------

    def declare_exchange(
        self,
        name: str,
        type: str,
        *,
        durable: bool = True,
        auto_delete: bool = False,
        arguments: Mapping[str, Any] | None = None,
    ) -> None:
        value = json.dumps({"type": type, "durable": durable, "auto_delete": auto_delete,
                            "arguments": dict(arguments or {})}, default=str)  # fmt: skip
        self._call("declare exchange", self.redis.hset, self._key("exchanges"), name, value)

    def exchange_type(self, name: str) -> str | None:
        raw = self._call("exchange type", self.redis.hget, self._key("exchanges"), name)
        return None if raw is None else str(json.loads(raw)["type"])

    def exchanges(self) -> list[str]:
        return sorted(k.decode() for k in self._call("exchanges", self.redis.hkeys, self._key("exchanges")))

    def delete_exchange(self, name: str) -> None:
        for binding in self.bindings(name):
            self.unbind(name, binding.routing_key, binding.queue)
        self._call("delete exchange", self.redis.hdel, self._key("exchanges"), name)

    def bind(self, exchange: str, routing_key: str, pattern: str | None, queue: str) -> None:
        field = f"{routing_key or ''}\0{queue}"
        pipe = self.redis.pipeline()
        pipe.hset(self._key("bind:", exchange), field, json.dumps([routing_key or "", pattern, queue, self._now()]))
        pipe.sadd(self._key("bound:", queue), exchange)
        pipe.sadd(self._key("exchanges_bound"), exchange)
        self._call("bind", pipe.execute)

    def unbind(self, exchange: str, routing_key: str, queue: str) -> None:
        self._call("unbind", self.redis.hdel, self._key("bind:", exchange), f"{routing_key or ''}\0{queue}")

    def bindings(self, exchange: str | None = None) -> list[Binding]:
        """Bindings of one exchange, or all of them (in creation order)."""
        names = [exchange] if exchange is not None else sorted(
            k.decode() for k in self._call("bindings", self.redis.smembers, self._key("exchanges_bound"))
        )  # fmt: skip
        rows = []
        for name in names:
            for raw in self._call("bindings", self.redis.hvals, self._key("bind:", name)):
                key, pattern, queue, created = json.loads(raw)
                rows.append((created, name, key, pattern, queue))
        return [Binding(e, k, p, q) for _, e, k, p, q in sorted(rows)]

    # -- liveness and collection -------------------------------------------------------------------------------------

    def touch(self, consumer: str, queues: Sequence[str]) -> list[str]:
        """Record that ``consumer`` is alive on ``queues`` and mark them used; return those not declared."""
        names = list(dict.fromkeys(queues))
        if not names:
            return []
        now = self._now()
        missing = []
        for name in names:
            self._call("touch", self.redis.zadd, self._key("consumers:", name), {consumer: now})
            self._call("touch", self.redis.sadd, self._key("consumed"), name)
            raw = self._call("touch", self.redis.hget, self._key("queues"), name)
            if raw is None:
                missing.append(name)
                continue
            declaration = json.loads(raw)
            declaration["last_used"] = now
            self._call("touch", self.redis.hset, self._key("queues"), name, json.dumps(declaration))
        return missing

    def consumers(self) -> dict[str, int]:
        names = [k.decode() for k in self._call("consumers", self.redis.smembers, self._key("consumed"))]
        counts = {n: int(self._call("consumers", self.redis.zcard, self._key("consumers:", n))) for n in names}
        return {n: c for n, c in sorted(counts.items()) if c}

    def drop_consumer(self, consumer: str, queues: Sequence[str]) -> list[str]:
        """Forget ``consumer`` on ``queues``; delete the auto_delete ones left without consumers (returned)."""
        names = list(dict.fromkeys(queues))
        for name in names:
            self._call("drop consumer", self.redis.zrem, self._key("consumers:", name), consumer)
        doomed = self._orphaned_auto_delete(names)
        if doomed:
            self._script("drop", *doomed)
        return doomed

    def _orphaned_auto_delete(self, names: Sequence[str]) -> list[str]:
        doomed = []
        for name in names:
            info = self.queue_info(name)
            if info and info["auto_delete"] and not self._call("gc", self.redis.zcard, self._key("consumers:", name)):
                doomed.append(name)
        return doomed

    def gc(self, *, consumer_timeout: float = 60.0) -> dict[str, int]:
        """Collect unused queues, dead consumers (and their auto_delete queues) and expired messages."""
        now = self._now()
        expired = [
            name
            for name in self.queues()
            if (info := self.queue_info(name))
            and info["expires"]
            and _us(info["last_used"]) + _us(info["expires"]) <= now
        ]
        stale = 0
        touched = []
        for name in [k.decode() for k in self._call("gc", self.redis.smembers, self._key("consumed"))]:
            removed = int(self._call("gc", self.redis.zremrangebyscore, self._key("consumers:", name), "-inf",
                                     now - _us(consumer_timeout)))  # fmt: skip
            if removed:
                stale += removed
                touched.append(name)
        doomed = list(dict.fromkeys(expired + self._orphaned_auto_delete(touched)))
        dropped = int(self._script("drop", *doomed)) if doomed else 0
        # only a declared queue's messages have a time to live (``PUT`` reads it from the declaration)
        ttl = int(self._script("expire", *self.queues()))
        return {"queues": len(doomed), "consumers": stale, "messages": dropped + ttl}

    # -- change notification -----------------------------------------------------------------------------------------

    def _listen(self) -> None:
        """The subscriber thread: every published change bumps the version waiters compare."""
        delay = 0.1
        while not self._stop.is_set():
            pubsub: Any = None
            try:
                pubsub = self.redis.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call,unused-ignore]
                pubsub.subscribe(self._key("changes"))
                self._bump()  # (re)connected: something may have been missed
                delay = 0.1
                while not self._stop.is_set():
                    if pubsub.get_message(timeout=1.0) is not None:
                        self._bump()
            except Exception as exc:  # a lost connection, or the store closed under the thread
                if self._stop.is_set():
                    return
                log.warning("control channel lost Redis (%s); reconnecting in %.1f s", exc, delay)
                self._bump()
                self._stop.wait(delay)
                delay = min(delay * 2, 5.0)
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:  # pragma: no cover - closing a broken connection
                        pass

    def _bump(self) -> None:
        with self._cond:
            self._version += 1
            self._cond.notify_all()
        if self.on_change is not None:
            self.on_change()

    def _ensure_listener(self) -> None:
        if self._listener is not None and self._listener_pid == os.getpid() and self._listener.is_alive():
            return
        self._listener_pid = os.getpid()
        self._listener = threading.Thread(target=self._listen, name="celery_workflow-redis", daemon=True)
        self._listener.start()

    def change_token(self) -> int:
        self._ensure_listener()
        with self._cond:
            return self._version

    def wait_for_change(self, token: Any, timeout: float) -> bool:
        self._ensure_listener()
        with self._cond:
            return bool(self._cond.wait_for(lambda: self._version != token, max(timeout, 0.0)))

    def close(self) -> None:
        """Stop the subscriber (within a second) and close this process's connections."""
        self._stop.set()
        listener = self._listener
        if listener is not None and listener.is_alive() and listener is not threading.current_thread():
            listener.join(2.0)
        self.redis.close()
