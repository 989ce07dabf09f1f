-- Storage of the Postgres World (celery_workflow.world_pg): runs, the event log, step/hook/wait views, hook tokens and
-- streams. Tables go to the connection's search_path. Payloads (event data, inputs, outputs, errors, hook metadata,
-- stream chunks) are bytea in the codec's tagged format (codec.dumps); times are timestamptz (microseconds) written by
-- Python in UTC. Identifiers use COLLATE "C" so listings order bytewise on every server, like the other Worlds.
-- Every row of a run references it with ON DELETE CASCADE: deleting a run (retention) removes all of it.

-- The run view plus its event count: the next slot is event_count + 1. An append locks this row
-- (SELECT ... FOR NO KEY UPDATE), and writes the events, the views and this row in the same transaction.
CREATE TABLE celery_workflow_runs (
    run_id        text COLLATE "C" NOT NULL PRIMARY KEY,
    workflow_name text COLLATE "C" NOT NULL,
    status        text        NOT NULL CHECK (status IN ('pending', 'running', 'completed', 'failed', 'cancelled')),
    queue         text,
    input         bytea       NOT NULL,
    output        bytea,
    error         bytea,
    event_count   integer     NOT NULL CHECK (event_count >= 1),
    created_at    timestamptz NOT NULL,
    updated_at    timestamptz NOT NULL,
    started_at    timestamptz,
    completed_at  timestamptz
);

-- list_runs: newest first (run id descending), optionally by workflow and/or status.
CREATE INDEX celery_workflow_runs_workflow ON celery_workflow_runs (workflow_name, run_id);
CREATE INDEX celery_workflow_runs_status ON celery_workflow_runs (status, run_id);
-- Retention: ended runs, oldest end first (completed_at is set by the terminal event only).
CREATE INDEX celery_workflow_runs_completed ON celery_workflow_runs (completed_at) WHERE completed_at IS NOT NULL;

-- The event log: slots 1, 2, 3 ... per run, contiguous, in commit order. ``write_id`` names the World call that wrote
-- the event (one per create_run/append call, kept across its retries): a retry after a connection lost during COMMIT
-- finds its own events instead of applying the batch twice.
CREATE TABLE celery_workflow_events (
    run_id         text COLLATE "C" NOT NULL REFERENCES celery_workflow_runs (run_id) ON DELETE CASCADE,
    slot           integer          NOT NULL CHECK (slot >= 1),
    event_type     text             NOT NULL,
    correlation_id text COLLATE "C",
    data           bytea            NOT NULL,
    created_at     timestamptz      NOT NULL,
    write_id       text             NOT NULL,
    PRIMARY KEY (run_id, slot)
);

-- Entity creation is unique per (run, correlation id, type): a safety net under the rules of events.py.
CREATE UNIQUE INDEX celery_workflow_events_created ON celery_workflow_events (run_id, event_type, correlation_id)
    WHERE event_type IN ('step_created', 'wait_created');
-- A hook id is created once per run, as hook_created or as hook_conflict; appends read this index to build
-- Snapshot.created_hooks.
CREATE UNIQUE INDEX celery_workflow_events_hook_created ON celery_workflow_events (run_id, correlation_id)
    WHERE event_type IN ('hook_created', 'hook_conflict');

-- Step view. created_slot (the slot of its step_created event) gives the creation order of list_steps.
CREATE TABLE celery_workflow_steps (
    run_id       text COLLATE "C" NOT NULL REFERENCES celery_workflow_runs (run_id) ON DELETE CASCADE,
    step_id      text COLLATE "C" NOT NULL,
    step_name    text        NOT NULL,
    status       text        NOT NULL CHECK (status IN ('pending', 'running', 'completed', 'failed')),
    input        bytea       NOT NULL,
    output       bytea,
    error        bytea,
    attempt      integer     NOT NULL DEFAULT 0,
    owner        text,
    queue        text,
    created_slot integer     NOT NULL,
    created_at   timestamptz NOT NULL,
    updated_at   timestamptz NOT NULL,
    started_at   timestamptz,
    completed_at timestamptz,
    retry_after  timestamptz,
    PRIMARY KEY (run_id, step_id)
);

-- Live hooks: a row exists while the hook is live; hook_disposed and the run's end delete it.
CREATE TABLE celery_workflow_hooks (
    run_id       text COLLATE "C" NOT NULL REFERENCES celery_workflow_runs (run_id) ON DELETE CASCADE,
    hook_id      text COLLATE "C" NOT NULL,
    token        text COLLATE "C" NOT NULL,
    metadata     bytea,
    is_webhook   boolean     NOT NULL DEFAULT false,
    respond_with bytea,
    created_slot integer     NOT NULL,
    created_at   timestamptz NOT NULL,
    PRIMARY KEY (run_id, hook_id)
);

-- Token ownership: the primary key makes a token single-owner across all runs. Deleting the owning hook releases it.
CREATE TABLE celery_workflow_hook_tokens (
    token      text COLLATE "C" NOT NULL PRIMARY KEY,
    run_id     text COLLATE "C" NOT NULL,
    hook_id    text COLLATE "C" NOT NULL,
    created_at timestamptz      NOT NULL,
    FOREIGN KEY (run_id, hook_id) REFERENCES celery_workflow_hooks (run_id, hook_id) ON DELETE CASCADE
);

-- The tokens of a run (released in token order when its hooks go) and the cascade from hooks.
CREATE INDEX celery_workflow_hook_tokens_hook ON celery_workflow_hook_tokens (run_id, hook_id);

-- Wait view; deleted when the run ends.
CREATE TABLE celery_workflow_waits (
    run_id       text COLLATE "C" NOT NULL REFERENCES celery_workflow_runs (run_id) ON DELETE CASCADE,
    wait_id      text COLLATE "C" NOT NULL,
    status       text        NOT NULL CHECK (status IN ('waiting', 'completed')),
    resume_at    timestamptz NOT NULL,
    created_slot integer     NOT NULL,
    created_at   timestamptz NOT NULL,
    completed_at timestamptz,
    PRIMARY KEY (run_id, wait_id)
);

-- Stream state: the next index is chunk_count; a closed stream takes no more chunks. Writers lock this row.
CREATE TABLE celery_workflow_streams (
    run_id      text COLLATE "C" NOT NULL REFERENCES celery_workflow_runs (run_id) ON DELETE CASCADE,
    name        text COLLATE "C" NOT NULL,
    closed      boolean     NOT NULL DEFAULT false,
    chunk_count integer     NOT NULL DEFAULT 0,
    created_at  timestamptz NOT NULL,
    updated_at  timestamptz NOT NULL,
    PRIMARY KEY (run_id, name)
);

-- Stream chunks, codec-tagged bytes, keyed by their index (0, 1, 2 ...). ``write_id`` names the write_stream call, as
-- in the events table (a retry after a lost COMMIT answer does not write the chunks twice).
CREATE TABLE celery_workflow_stream_chunks (
    run_id     text COLLATE "C" NOT NULL,
    name       text COLLATE "C" NOT NULL,
    idx        integer     NOT NULL CHECK (idx >= 0),
    data       bytea       NOT NULL,
    created_at timestamptz NOT NULL,
    write_id   text        NOT NULL,
    PRIMARY KEY (run_id, name, idx),
    FOREIGN KEY (run_id, name) REFERENCES celery_workflow_streams (run_id, name) ON DELETE CASCADE
);
