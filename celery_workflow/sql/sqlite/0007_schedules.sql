-- Schedules (issue #30, item 3): one row per schedule, changed by compare-and-set on ``version``
-- (celery_workflow.schedules.model). Times are integer microseconds since the epoch (UTC), the input a codec-tagged
-- BLOB, ``paused`` 0 or 1.
CREATE TABLE celery_workflow_schedules (
    schedule_id   TEXT    NOT NULL PRIMARY KEY,
    workflow_name TEXT    NOT NULL,
    cron          TEXT    NOT NULL,
    timezone      TEXT    NOT NULL,
    input         BLOB    NOT NULL,
    overlap       TEXT    NOT NULL,
    catch_up      REAL    NOT NULL,
    paused        INTEGER NOT NULL,
    next_tick     INTEGER,
    last_tick     INTEGER,
    last_run_id   TEXT,
    lease_holder  TEXT,
    lease_until   INTEGER,
    version       INTEGER NOT NULL,
    created_at    INTEGER,
    updated_at    INTEGER
) WITHOUT ROWID;
