-- Queue and broker state of the Postgres World and the Postgres Kombu transport (celery_workflow.pg_queue).
-- Tables go to the connection's search_path. Times are timestamptz; "now" is the database server's clock.

-- One row per pending or claimed delivery. ``payload`` is the UTF-8 JSON of a Kombu virtual-transport message
-- (body, content-encoding, content-type, headers, properties), whoever inserted it (the World or Celery via _put).
-- A bigserial id is never reused, so a receipt "<id>.<attempts>" names exactly one claim forever.
CREATE TABLE celery_workflow_queue (
    id              bigserial   PRIMARY KEY,
    queue           text        NOT NULL,
    payload         bytea       NOT NULL,
    run_id          text,
    not_before      timestamptz NOT NULL,
    attempts        integer     NOT NULL DEFAULT 0,
    lease_until     timestamptz,
    idempotency_key text,
    expires_at      timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- Claims: due rows of one queue, oldest due first (a claim walks this index per queue with FOR UPDATE SKIP LOCKED).
CREATE INDEX celery_workflow_queue_due ON celery_workflow_queue (queue, not_before, id);

-- Leases in flight (few rows): when does the next lease of a queue run out.
CREATE INDEX celery_workflow_queue_leased ON celery_workflow_queue (queue, lease_until) WHERE lease_until IS NOT NULL;

CREATE INDEX celery_workflow_queue_run ON celery_workflow_queue (run_id) WHERE run_id IS NOT NULL;

CREATE INDEX celery_workflow_queue_expiry ON celery_workflow_queue (expires_at) WHERE expires_at IS NOT NULL;

-- An idempotency key deduplicates against a pending row (claiming sets the key to NULL) of the same run, or of the
-- same queue for rows without a run. Inserts use ON CONFLICT DO NOTHING (no target: either index).
CREATE UNIQUE INDEX celery_workflow_queue_idempotency_run
    ON celery_workflow_queue (run_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL AND run_id IS NOT NULL;

CREATE UNIQUE INDEX celery_workflow_queue_idempotency_queue
    ON celery_workflow_queue (queue, idempotency_key)
    WHERE idempotency_key IS NOT NULL AND run_id IS NULL;

-- Queue declarations (AMQP-style arguments kept by the transport). ``last_used`` is refreshed by declarations
-- and by consumers; a queue with ``expires`` unused for that long is collected with its bindings and rows.
CREATE TABLE celery_workflow_broker_queues (
    name        text        PRIMARY KEY,
    durable     boolean     NOT NULL DEFAULT true,
    exclusive   boolean     NOT NULL DEFAULT false,
    auto_delete boolean     NOT NULL DEFAULT false,
    expires     interval,
    message_ttl interval,
    last_used   timestamptz NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE celery_workflow_broker_exchanges (
    name        text        PRIMARY KEY,
    type        text        NOT NULL,
    durable     boolean     NOT NULL DEFAULT true,
    auto_delete boolean     NOT NULL DEFAULT false,
    arguments   jsonb       NOT NULL DEFAULT '{}',
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- Bindings shared by every process (fanout, topic and direct routing, pidbox replies, event queues).
-- ``pattern`` is the regular expression of a topic binding, NULL otherwise.
CREATE TABLE celery_workflow_broker_bindings (
    exchange    text        NOT NULL,
    routing_key text        NOT NULL,
    queue       text        NOT NULL,
    pattern     text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (exchange, routing_key, queue)
);

CREATE INDEX celery_workflow_broker_bindings_queue ON celery_workflow_broker_bindings (queue);

-- Live consumers, refreshed periodically; an auto_delete queue is deleted when its last consumer goes away
-- (cancelled, or its heartbeat went stale because the process died).
CREATE TABLE celery_workflow_broker_consumers (
    queue    text        NOT NULL,
    consumer text        NOT NULL,
    seen_at  timestamptz NOT NULL,
    PRIMARY KEY (queue, consumer)
);
