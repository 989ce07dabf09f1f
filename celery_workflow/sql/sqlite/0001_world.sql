-- Storage of the SQLite World (celery_workflow.world_sqlite): runs, the event log, step/hook/wait views, hook tokens
-- and streams. Times are INTEGER microseconds since the Unix epoch (UTC), written by Python. JSON values are BLOBs in
-- the codec's tagged format (codec.dumps); a NULL payload column means the value was never set (or is JSON null).
-- Every row of a run references it with ON DELETE CASCADE, so deleting a run (retention) removes all of it.
-- Tables holding payloads keep their rowid (WITHOUT ROWID suits small rows only); the primary keys are unique indexes.

-- The run view plus its event count: the next slot is event_count + 1. Appends lock the database (BEGIN IMMEDIATE),
-- read this row, and write the events, views and this row in the same transaction.
CREATE TABLE celery_workflow_runs (
    run_id        TEXT    NOT NULL PRIMARY KEY,
    workflow_name TEXT    NOT NULL,
    status        TEXT    NOT NULL CHECK (status IN ('pending', 'running', 'completed', 'failed', 'cancelled')),
    queue         TEXT,
    input         BLOB    NOT NULL,
    output        BLOB,
    error         BLOB,
    event_count   INTEGER NOT NULL CHECK (event_count >= 1),
    created_at    INTEGER NOT NULL,
    updated_at    INTEGER NOT NULL,
    started_at    INTEGER,
    completed_at  INTEGER
);

-- list_runs: newest first (run id descending), optionally by workflow and/or status.
CREATE INDEX celery_workflow_runs_workflow ON celery_workflow_runs (workflow_name, run_id);
CREATE INDEX celery_workflow_runs_status ON celery_workflow_runs (status, run_id);

-- The event log: slots 1, 2, 3 … per run, contiguous, in commit order.
CREATE TABLE celery_workflow_events (
    run_id         TEXT    NOT NULL REFERENCES celery_workflow_runs (run_id) ON DELETE CASCADE,
    slot           INTEGER NOT NULL CHECK (slot >= 1),
    event_type     TEXT    NOT NULL,
    correlation_id TEXT,
    data           BLOB    NOT NULL,
    created_at     INTEGER NOT NULL,
    PRIMARY KEY (run_id, slot)
);

-- Creation checks and lookups by correlation id within a run (hook ids are created once per run).
CREATE INDEX celery_workflow_events_correlation ON celery_workflow_events (run_id, correlation_id)
    WHERE correlation_id IS NOT NULL;

-- Step view. ``created_slot`` (the slot of its step_created event) gives the creation order of list_steps.
CREATE TABLE celery_workflow_steps (
    run_id       TEXT    NOT NULL REFERENCES celery_workflow_runs (run_id) ON DELETE CASCADE,
    step_id      TEXT    NOT NULL,
    step_name    TEXT    NOT NULL,
    status       TEXT    NOT NULL CHECK (status IN ('pending', 'running', 'completed', 'failed')),
    input        BLOB    NOT NULL,
    output       BLOB,
    error        BLOB,
    attempt      INTEGER NOT NULL DEFAULT 0,
    owner        TEXT,
    queue        TEXT,
    created_slot INTEGER NOT NULL,
    created_at   INTEGER NOT NULL,
    updated_at   INTEGER NOT NULL,
    started_at   INTEGER,
    completed_at INTEGER,
    retry_after  INTEGER,
    PRIMARY KEY (run_id, step_id)
);

-- Live hooks: a row exists while the hook is live; hook_disposed and the run's end delete it.
CREATE TABLE celery_workflow_hooks (
    run_id       TEXT    NOT NULL REFERENCES celery_workflow_runs (run_id) ON DELETE CASCADE,
    hook_id      TEXT    NOT NULL,
    token        TEXT    NOT NULL,
    metadata     BLOB,
    is_webhook   INTEGER NOT NULL DEFAULT 0,
    respond_with BLOB,
    created_slot INTEGER NOT NULL,
    created_at   INTEGER NOT NULL,
    PRIMARY KEY (run_id, hook_id)
);

-- Token ownership: the primary key makes a token single-owner across all runs. Deleting the owning hook releases it.
CREATE TABLE celery_workflow_hook_tokens (
    token      TEXT    NOT NULL PRIMARY KEY,
    run_id     TEXT    NOT NULL,
    hook_id    TEXT    NOT NULL,
    created_at INTEGER NOT NULL,
    FOREIGN KEY (run_id, hook_id) REFERENCES celery_workflow_hooks (run_id, hook_id) ON DELETE CASCADE
) WITHOUT ROWID;

CREATE INDEX celery_workflow_hook_tokens_hook ON celery_workflow_hook_tokens (run_id, hook_id);

-- Wait view; deleted when the run ends.
CREATE TABLE celery_workflow_waits (
    run_id       TEXT    NOT NULL REFERENCES celery_workflow_runs (run_id) ON DELETE CASCADE,
    wait_id      TEXT    NOT NULL,
    status       TEXT    NOT NULL CHECK (status IN ('waiting', 'completed')),
    resume_at    INTEGER NOT NULL,
    created_slot INTEGER NOT NULL,
    created_at   INTEGER NOT NULL,
    completed_at INTEGER,
    PRIMARY KEY (run_id, wait_id)
);

-- Stream state: the next index is chunk_count; a closed stream takes no more chunks.
CREATE TABLE celery_workflow_streams (
    run_id      TEXT    NOT NULL REFERENCES celery_workflow_runs (run_id) ON DELETE CASCADE,
    name        TEXT    NOT NULL,
    closed      INTEGER NOT NULL DEFAULT 0,
    chunk_count INTEGER NOT NULL DEFAULT 0,
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL,
    PRIMARY KEY (run_id, name)
);

-- Stream chunks, codec-tagged bytes, keyed by their index (0, 1, 2 …).
CREATE TABLE celery_workflow_stream_chunks (
    run_id     TEXT    NOT NULL,
    name       TEXT    NOT NULL,
    idx        INTEGER NOT NULL CHECK (idx >= 0),
    data       BLOB    NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (run_id, name, idx),
    FOREIGN KEY (run_id, name) REFERENCES celery_workflow_streams (run_id, name) ON DELETE CASCADE
);
