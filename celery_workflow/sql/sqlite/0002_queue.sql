-- Queue and broker state of the SQLite World and the SQLite Kombu transport (celery_workflow.sqlite_queue).
-- Times are integer microseconds since the Unix epoch, written by Python (never by SQLite's clock).

-- One row per pending or claimed delivery. ``payload`` is the UTF-8 JSON of a Kombu virtual-transport message
-- (body, content-encoding, content-type, headers, properties), whoever inserted it (the World or Celery via _put).
-- AUTOINCREMENT: ids are never reused, so a receipt "<id>.<attempts>" names exactly one claim forever.
CREATE TABLE celery_workflow_queue (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    queue           TEXT    NOT NULL,
    payload         BLOB    NOT NULL,
    run_id          TEXT,
    not_before      INTEGER NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    lease_until     INTEGER,
    idempotency_key TEXT,
    expires_at      INTEGER,
    created_at      INTEGER NOT NULL
);

-- Claims: due rows of a queue, oldest due first.
CREATE INDEX celery_workflow_queue_due ON celery_workflow_queue (queue, not_before, id);

-- Leases in flight (few rows): when does the next lease run out.
CREATE INDEX celery_workflow_queue_leased ON celery_workflow_queue (queue, lease_until) WHERE lease_until IS NOT NULL;

CREATE INDEX celery_workflow_queue_run ON celery_workflow_queue (run_id) WHERE run_id IS NOT NULL;

CREATE INDEX celery_workflow_queue_expiry ON celery_workflow_queue (expires_at) WHERE expires_at IS NOT NULL;

-- An idempotency key deduplicates against a pending row (claiming sets the key to NULL) of the same run, or of the
-- same queue for rows without a run. Inserts use ON CONFLICT DO NOTHING against this index.
CREATE UNIQUE INDEX celery_workflow_queue_idempotency
    ON celery_workflow_queue (run_id IS NULL, COALESCE(run_id, queue), idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- Queue declarations (AMQP-style arguments kept by the transport). ``last_used`` is refreshed by declarations
-- and by consumers; a queue with ``expires_ms`` unused for that long is collected with its bindings and rows.
CREATE TABLE celery_workflow_broker_queues (
    name           TEXT    PRIMARY KEY,
    durable        INTEGER NOT NULL DEFAULT 1,
    exclusive      INTEGER NOT NULL DEFAULT 0,
    auto_delete    INTEGER NOT NULL DEFAULT 0,
    expires_ms     INTEGER,
    message_ttl_ms INTEGER,
    last_used      INTEGER NOT NULL,
    created_at     INTEGER NOT NULL
);

CREATE TABLE celery_workflow_broker_exchanges (
    name        TEXT    PRIMARY KEY,
    type        TEXT    NOT NULL,
    durable     INTEGER NOT NULL DEFAULT 1,
    auto_delete INTEGER NOT NULL DEFAULT 0,
    arguments   TEXT    NOT NULL DEFAULT '{}',
    created_at  INTEGER NOT NULL
);

-- Bindings shared by every process (fanout, topic and direct routing, pidbox replies, event queues).
-- ``pattern`` is the regular expression of a topic binding, NULL otherwise.
CREATE TABLE celery_workflow_broker_bindings (
    exchange    TEXT    NOT NULL,
    routing_key TEXT    NOT NULL,
    queue       TEXT    NOT NULL,
    pattern     TEXT,
    created_at  INTEGER NOT NULL,
    PRIMARY KEY (exchange, routing_key, queue)
);

CREATE INDEX celery_workflow_broker_bindings_queue ON celery_workflow_broker_bindings (queue);

-- Live consumers, refreshed periodically; an auto_delete queue is deleted when its last consumer goes away
-- (cancelled, or its heartbeat went stale because the process died).
CREATE TABLE celery_workflow_broker_consumers (
    queue    TEXT    NOT NULL,
    consumer TEXT    NOT NULL,
    seen_at  INTEGER NOT NULL,
    PRIMARY KEY (queue, consumer)
);
