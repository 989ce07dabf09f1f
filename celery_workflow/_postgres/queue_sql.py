"""The SQL statements of the Postgres queue (:mod:`celery_workflow._postgres.queue`); not part of the public API.

Tables: ``celery_workflow_queue`` (a row per message) and the broker state the transport shares
(``celery_workflow_broker_queues`` / ``_exchanges`` / ``_bindings`` / ``_consumers``), migration ``0002_queue.sql``.
Every statement takes ``%(now)s``: NULL for the database server's clock, or a test clock.
"""

from __future__ import annotations

from functools import lru_cache

from celery_workflow._backend.broker import (
    BROKER_BINDINGS,
    BROKER_CONSUMERS,
    BROKER_EXCHANGES,
    BROKER_QUEUES,
    DEAD_LETTER_COLUMNS,
    DEAD_LETTERS,
    QUEUE,
    queue_tables,
)
from celery_workflow._backend.migrations import Table, columns
from celery_workflow._postgres.listener import ALIVE_LOCK, CHANNEL_QUEUE, notify_sql
from celery_workflow.dead_letters import LEASE_EXPIRED

Q = QUEUE
QUEUES = BROKER_QUEUES
EXCHANGES = BROKER_EXCHANGES
BINDINGS = BROKER_BINDINGS
CONSUMERS = BROKER_CONSUMERS
DEAD = DEAD_LETTERS
DEAD_COLUMNS = ", ".join(DEAD_LETTER_COLUMNS.split())

#: The standing claims of idle consumers (migration ``0006_standing_claims.sql``, :mod:`.standing`).
STANDING = "celery_workflow_standing_claims"

#: The queue's tables as the code expects them (the migration test compares the migrated catalog with this).
TABLES = {
    **queue_tables(
        ttl_columns=("expires", "message_ttl"),
        idempotency_indexes=("celery_workflow_queue_idempotency_run", "celery_workflow_queue_idempotency_queue"),
    ),
    STANDING: Table(columns("token queues lease serial lock_key active assigned_id since"), ("token",)),
}

# "now": the database clock, unless a test clock is set (then every statement gets it as %(now)s).
NOW = "COALESCE(%(now)s::timestamptz, now())"
NOTIFY = notify_sql(CHANNEL_QUEUE, "queue")

# A row is claimable at now when it is due, its lease (if any) has run out and it has not expired.
CLAIMABLE = (
    f"q.not_before <= {NOW} AND (q.lease_until IS NULL OR q.lease_until <= {NOW})"
    f" AND (q.expires_at IS NULL OR q.expires_at > {NOW})"
)

# A message due at once, inserted alone in its transaction, is announced with its row id after the queue's name
# (second line): an idle consumer may claim that row by its key (CLAIM_NOTIFIED) instead of looking through the
# queue. Several inserted together are announced by the queue's name alone (one notification per queue and
# transaction: Postgres folds identical payloads).
NOTIFY_ROW = notify_sql(CHANNEL_QUEUE, "CASE WHEN due THEN queue || E'\\n' || id ELSE queue END")

# An idempotency key deduplicates against a pending row of the same run (a row without a run: of the same queue).
# The duplicate LOCKS the pending row it joins until its own transaction ends (``DO UPDATE … WHERE false`` updates
# nothing and returns nothing, but locks the conflicting row), and claims skip locked rows: the delivery that absorbed
# the duplicate is claimed only once the writes that came with the duplicate (a step's result, a hook's payload) are
# visible to it. With ``DO NOTHING`` a claim could take the row between the duplicate's insert and its commit, and
# that delivery would replay a log without them: the run's wake-up lost for good (a run stuck, seen with three
# parallel steps finishing together while Flower watched). A delivery without a key cannot conflict.
ON_CONFLICT = {
    "none": "ON CONFLICT DO NOTHING",
    "run": "ON CONFLICT (run_id, idempotency_key) WHERE idempotency_key IS NOT NULL AND run_id IS NOT NULL"
    " DO UPDATE SET idempotency_key = EXCLUDED.idempotency_key WHERE false",
    "queue": "ON CONFLICT (queue, idempotency_key) WHERE idempotency_key IS NOT NULL AND run_id IS NULL"
    " DO UPDATE SET idempotency_key = EXCLUDED.idempotency_key WHERE false",
}


def dedup_scope(run_id: str | None, key: str | None) -> str:
    """Which unique index a delivery may conflict on (the key of :data:`ON_CONFLICT`)."""
    return "none" if key is None else "queue" if run_id is None else "run"


# When a message expires: its queue's ``x-message-ttl`` after it is due, or its own TTL (``%(ttl)s``: Kombu's
# ``expiration``, NULL for none) after it was put, whichever comes first (LEAST ignores NULLs).
EXPIRES_AT = f"LEAST(t.due + (SELECT message_ttl FROM {QUEUES} WHERE name = %(queue)s), t.now + %(ttl)s::interval)"

INSERT_WHEN = f"""
WITH ins AS (
    INSERT INTO {Q} (queue, payload, run_id, not_before, idempotency_key, expires_at, created_at)
    SELECT %(queue)s, %(payload)s, %(run_id)s, t.due, %(key)s, {EXPIRES_AT}, t.now
    FROM (SELECT COALESCE(%(due)s::timestamptz, {NOW}) AS due, {NOW} AS now) AS t
    WHERE {{when}}
    {{conflict}}
    RETURNING queue, id, not_before <= created_at AS due
)
SELECT {NOTIFY} FROM ins
"""
INSERT_WHEN_ALONE = INSERT_WHEN.replace(f"SELECT {NOTIFY} FROM ins", f"SELECT {NOTIFY_ROW} FROM ins")


# What a handed-over message's notification says (keyed by the claim's token: the claim's serial and the row id,
# which the consumer fetches with FETCH_HANDED) and a plain one's (NOTIFY_ROW). Notifications carry ids and tokens,
# never a message: any role that can connect to the database may LISTEN on the channel.
NOTIFY_HANDED = notify_sql(CHANNEL_QUEUE, "w.token || E'\\n' || w.serial || E'\\n' || ins.id")
NOTIFY_INSERTED = notify_sql(CHANNEL_QUEUE, "CASE WHEN ins.due THEN ins.queue || E'\\n' || ins.id ELSE ins.queue END")

# The insert of one message that may be handed to an idle consumer's standing claim (see
# celery_workflow._postgres.standing), when ``%(handoff)s`` (the message is free to skip deduplication: it has no
# idempotency key, or it is the first of a new run) and it is due now. ``w`` takes the oldest standing
# claim of the queue that is unassigned and whose consumer is alive (it holds its advisory lock: a shared lock on it
# cannot be taken), locked so no other producer takes it too. The message is then inserted leased to that consumer
# (its lease, attempts 1, no idempotency key: as a claim leaves it), the claim records the row, and the notification
# is keyed by the claim's token and names the claim's serial and the row, which the consumer then fetches by its key
# (FETCH_HANDED). Without a claim it is the plain insert, announced as INSERT_WHEN_ALONE does.
INSERT_HANDOFF = f"""
WITH t AS (
    SELECT COALESCE(%(due)s::timestamptz, {NOW}) AS due, {NOW} AS now
), w AS (
    SELECT s.token, s.serial, s.lease FROM {STANDING} AS s, t
    WHERE %(handoff)s AND t.due <= t.now AND {{when}}
      AND CASE WHEN s.active AND s.assigned_id IS NULL AND %(queue)s = ANY(s.queues)
               THEN NOT pg_try_advisory_xact_lock_shared({ALIVE_LOCK}, s.lock_key) ELSE false END
    ORDER BY s.since LIMIT 1
    FOR UPDATE OF s SKIP LOCKED
), ins AS (
    INSERT INTO {Q} (queue, payload, run_id, not_before, idempotency_key, expires_at, created_at, lease_until,
                     attempts)
    SELECT %(queue)s, %(payload)s, %(run_id)s, t.due, CASE WHEN w.token IS NULL THEN %(key)s END,
           {EXPIRES_AT}, t.now, t.now + w.lease,
           CASE WHEN w.token IS NULL THEN 0 ELSE 1 END
    FROM t LEFT JOIN w ON true
    WHERE {{when}}
    {{conflict}}
    RETURNING queue, id, not_before <= created_at AS due, lease_until IS NOT NULL AS handed
), a AS (
    UPDATE {STANDING} AS s SET assigned_id = ins.id FROM ins, w WHERE s.token = w.token AND ins.handed
)
SELECT CASE WHEN ins.handed THEN {NOTIFY_HANDED} ELSE {NOTIFY_INSERTED} END
FROM ins LEFT JOIN w ON true
"""


@lru_cache(maxsize=64)
def insert(scope: str, *, alone: bool, when: str = "true", handoff: bool = False) -> str:
    """The insert of one delivery (see INSERT_WHEN): announced with its row id when ``alone``, stored only under the
    SQL condition ``when``, deduplicated in ``scope`` (see :func:`dedup_scope`); built once per combination.
    ``handoff`` (one delivery alone): :data:`INSERT_HANDOFF`, which takes ``%(handoff)s`` too."""
    template = INSERT_HANDOFF if handoff and alone else INSERT_WHEN_ALONE if alone else INSERT_WHEN
    return template.replace("{when}", when).replace("{conflict}", ON_CONFLICT[scope])


FANOUT = f"""
WITH ins AS (
    INSERT INTO {Q} (queue, payload, not_before, expires_at, created_at)
    SELECT b.queue, %(payload)s, t.due, LEAST(t.due + d.message_ttl, t.now + %(ttl)s::interval), t.now
    FROM (SELECT DISTINCT queue FROM {BINDINGS} WHERE exchange = %(exchange)s) AS b
    CROSS JOIN (SELECT COALESCE(%(due)s::timestamptz, {NOW}) AS due, {NOW} AS now) AS t
    LEFT JOIN {QUEUES} AS d ON d.name = b.queue
    RETURNING queue
)
SELECT {NOTIFY} FROM ins
"""

# A lease still set when a row is claimed again has run out: the delivery it covered failed.
LEASE_EXPIRED_SQL = "'" + LEASE_EXPIRED.replace("'", "''") + "'"

# What a claim sets on a row it leases (a lease still set has run out: the delivery it covered failed).
LEASE = f"""lease_until = {NOW} + %(lease)s, attempts = q.attempts + 1, idempotency_key = NULL,
        first_failed_at = COALESCE(q.first_failed_at, q.lease_until),
        last_failed_at = COALESCE(q.lease_until, q.last_failed_at),
        last_error = CASE WHEN q.lease_until IS NULL THEN q.last_error ELSE {LEASE_EXPIRED_SQL} END"""

# The claim of one row by its key, as announced by NOTIFY_ROW (skipped, like RECEIVE, when another claim has it).
CLAIM_NOTIFIED = f"""
UPDATE {Q} AS q SET {LEASE}
WHERE q.id = (SELECT q.id FROM {Q} AS q WHERE q.id = %(id)s AND q.queue = %(queue)s AND {CLAIMABLE}
              FOR UPDATE SKIP LOCKED)
RETURNING q.id, q.queue, q.payload, q.attempts, q.run_id
"""

# The claim. The rows picked are then updated (or deleted) by id through ``id = ANY(ARRAY(…))``, an index lookup on
# the primary key in every plan: joined to ``picked`` instead, the generic plan our sessions use
# (``plan_cache_mode``) scanned the whole table once per claim, 100,000 sleeping rows costing 45 ms a claim.
RECEIVE = f"""
WITH picked AS (
    SELECT c.id, c.queue FROM unnest(%(queues)s::text[]) AS n(name)
    CROSS JOIN LATERAL (
        SELECT q.id, q.queue, q.not_before FROM {Q} AS q
        WHERE q.queue = n.name AND {CLAIMABLE}
        ORDER BY q.not_before, q.id LIMIT %(limit)s
        FOR UPDATE OF q SKIP LOCKED
    ) AS c
    ORDER BY c.not_before, c.id LIMIT %(limit)s
), leased AS (
    UPDATE {Q} AS q SET {LEASE}
    WHERE q.id = ANY(ARRAY(SELECT id FROM picked WHERE queue <> ALL(%(no_ack)s::text[])))
    RETURNING q.id, q.queue, q.payload, q.attempts, q.run_id, q.not_before
), taken AS (
    DELETE FROM {Q} AS q WHERE q.id = ANY(ARRAY(SELECT id FROM picked WHERE queue = ANY(%(no_ack)s::text[])))
    RETURNING q.id, q.queue, q.payload, q.attempts + 1, q.run_id, q.not_before
)
SELECT * FROM leased UNION ALL SELECT * FROM taken ORDER BY not_before, id
"""


# Per queue name n.name: d.not_before, the due time of its next claimable row (``extra`` narrows those rows), and
# l.lease_until, the earliest lease held on it; queues with neither are left out.
def due_from(extra: str = "") -> str:
    return f"""FROM unnest(%(queues)s::text[]) AS n(name)
LEFT JOIN LATERAL (
    SELECT q.not_before FROM {Q} AS q
    WHERE q.queue = n.name AND (q.lease_until IS NULL OR q.lease_until <= {NOW})
      AND (q.expires_at IS NULL OR q.expires_at > {NOW}){extra}
    ORDER BY q.not_before, q.id LIMIT 1
) AS d ON true
LEFT JOIN LATERAL (
    SELECT q.lease_until FROM {Q} AS q WHERE q.queue = n.name AND q.lease_until > {NOW}
    ORDER BY q.lease_until LIMIT 1
) AS l ON true
WHERE d.not_before IS NOT NULL OR l.lease_until IS NOT NULL"""


DUE_IN = f"EXTRACT(EPOCH FROM LEAST(d.not_before, l.lease_until) - {NOW})::float8"

# Per queue: seconds from now until its next row is claimable (due, or its lease runs out).
DUE_TIMES = f"SELECT n.name, {DUE_IN}\n{due_from()}"

# A claim as in RECEIVE, then (same statement) each queue's next due time among the rows it did not claim (rows
# claimed by this statement are left out: their new lease is not visible to it).
POLL = RECEIVE.replace(
    "SELECT * FROM leased UNION ALL SELECT * FROM taken ORDER BY not_before, id",
    f"""claimed AS (SELECT * FROM leased UNION ALL SELECT * FROM taken)
SELECT c.id, c.queue, c.payload, c.attempts, c.run_id, c.not_before, NULL::float8 AS due_in FROM claimed AS c
UNION ALL
SELECT NULL::bigint, n.name, NULL::bytea, NULL::integer, NULL::text, NULL::timestamptz, {DUE_IN}
{due_from(" AND q.id NOT IN (SELECT id FROM picked)")}""",
).replace(
    "    RETURNING q.id, q.queue, q.payload, q.attempts + 1, q.run_id, q.not_before\n)\n",
    "    RETURNING q.id, q.queue, q.payload, q.attempts + 1, q.run_id, q.not_before\n),\n",
)

DROP_QUEUES = f"""
WITH gone AS (DELETE FROM {Q} WHERE queue = ANY(%(names)s::text[]) RETURNING 1),
     b AS (DELETE FROM {BINDINGS} WHERE queue = ANY(%(names)s::text[])),
     c AS (DELETE FROM {CONSUMERS} WHERE queue = ANY(%(names)s::text[])),
     d AS (DELETE FROM {QUEUES} WHERE name = ANY(%(names)s::text[]))
SELECT count(*) FROM gone
"""

ORPHANED_AUTO_DELETE = f"""
SELECT name FROM {QUEUES} AS d
WHERE name = ANY(%(names)s::text[]) AND auto_delete
  AND NOT EXISTS (SELECT 1 FROM {CONSUMERS} AS c WHERE c.queue = d.name)
ORDER BY name
"""

# Move one claimed row (matched by its receipt) to the dead letters, with its history.
DEAD_LETTER = f"""
WITH gone AS (
    DELETE FROM {Q} WHERE id = %(id)s AND attempts = %(attempts)s AND lease_until IS NOT NULL
    RETURNING id, queue, payload, run_id, attempts, first_failed_at, last_failed_at, last_error, created_at
)
INSERT INTO {DEAD} (message_id, queue, payload, run_id, attempts, reason, last_error, first_failed_at,
                    last_failed_at, enqueued_at, dead_at, run_settled_at)
SELECT id, queue, payload, run_id, attempts, %(reason)s, COALESCE(%(error)s, last_error), first_failed_at,
       last_failed_at, created_at, {NOW}, CASE WHEN run_id IS NULL THEN {NOW} END
FROM gone
RETURNING {DEAD_COLUMNS}
"""

# The dead letters picked by ``%(ids)s`` (NULL: any) and ``%(queue)s`` (NULL: any).
DEAD_SELECTION = (
    "(%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[])) AND (%(queue)s::text IS NULL OR queue = %(queue)s)"
)

# Put dead letters back on their queues (due now, attempts reset) and delete them, in one statement; notify.
REDRIVE = f"""
WITH gone AS (
    DELETE FROM {DEAD} WHERE {DEAD_SELECTION}
    RETURNING id, queue, payload, run_id
), ins AS (
    INSERT INTO {Q} (queue, payload, run_id, not_before, expires_at, created_at)
    SELECT g.queue, g.payload, g.run_id, {NOW}, {NOW} + d.message_ttl, {NOW}
    FROM gone AS g LEFT JOIN {QUEUES} AS d ON d.name = g.queue
    ORDER BY g.id
    RETURNING queue
)
SELECT {NOTIFY} FROM ins
"""


# -- standing claims (celery_workflow._postgres.standing) ------------------------------------------------------------

# The registration of a consumer's standing claim on its queues (one row per consumer, updated in place). The poll
# that finds nothing to claim makes it in the same statement (REGISTER, in POLL_REGISTER), so it is visible exactly
# from the poll's commit on: a message inserted before that was seen by the poll or is announced on its queue, which
# the consumer hears; one inserted after it finds the claim. An ack makes it alone (REGISTER_ALONE) when the consumer
# heard nothing on its queues since it last looked and that look left nothing due (celery_workflow.transport.postgres). A registration retried
# after its commit's answer was lost changes nothing (same serial): a message handed to it meanwhile stays recorded.
_REGISTER = f"""INSERT INTO {STANDING} (token, queues, lease, serial, lock_key, active, assigned_id, since)
    SELECT %(token)s, %(standing)s::text[], %(lease)s, %(serial)s, %(lock_key)s, true, NULL, {NOW}
    {{where}}
    ON CONFLICT (token) DO UPDATE SET queues = EXCLUDED.queues, lease = EXCLUDED.lease, serial = EXCLUDED.serial,
        lock_key = EXCLUDED.lock_key, active = true, assigned_id = NULL, since = EXCLUDED.since
    WHERE {STANDING}.serial <> EXCLUDED.serial"""
REGISTER_ALONE = _REGISTER.replace("{where}", "")
REGISTER = "registered AS (" + _REGISTER.replace("{where}", "WHERE NOT EXISTS (SELECT 1 FROM picked)") + "\n), "
POLL_REGISTER = POLL.replace("), leased AS (", "), " + REGISTER + "leased AS (", 1)

# The end of a standing claim, before its consumer claims otherwise: the claim is no longer offered (this waits for a
# producer handing a message to it at that moment), then the message handed to it, if any, is released as if never
# claimed (a separate statement: its snapshot sees that producer's insert). The consumer withdraws a claim only when
# the notification of a hand-off has not reached it, so the message it releases is one it never delivered.
WITHDRAW = f"UPDATE {STANDING} SET active = false WHERE token = %(token)s AND active"
RELEASE_HANDED = f"""
WITH r AS (
    UPDATE {Q} AS q SET lease_until = NULL, attempts = 0
    FROM {STANDING} AS s
    WHERE s.token = %(token)s AND q.id = s.assigned_id AND q.attempts = 1 AND q.lease_until IS NOT NULL
    RETURNING q.queue
)
SELECT {NOTIFY} FROM r
"""
#: What withdraws a claim before (or instead of) its consumer's next claim, in one round trip.
WITHDRAWAL = (WITHDRAW, RELEASE_HANDED)
FORGET_STANDING = f"DELETE FROM {STANDING} WHERE token = %(token)s"
# The message handed to a standing claim, which its notification named (the claim's serial and the row id): read by
# its key, only while it is the claim's and still leased as the hand-off left it (attempts 1; a withdrawal releases it
# to attempts 0, a claim after its lease ran out makes it 2).
FETCH_HANDED = f"""
SELECT q.id, q.queue, q.payload, q.attempts, q.run_id FROM {Q} AS q JOIN {STANDING} AS s ON s.assigned_id = q.id
WHERE s.token = %(token)s AND s.serial = %(serial)s AND q.id = %(id)s AND q.attempts = 1 AND q.lease_until IS NOT NULL
"""
# Standing claims of processes that are gone (nobody holds their lock).
DEAD_STANDING = f"DELETE FROM {STANDING} WHERE pg_try_advisory_xact_lock_shared({ALIVE_LOCK}, lock_key)"
