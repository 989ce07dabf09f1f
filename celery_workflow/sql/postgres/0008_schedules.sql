-- Schedules (issue #30, item 3): one row per schedule, changed by compare-and-set on ``version``
-- (celery_workflow.schedules.model).
CREATE TABLE celery_workflow_schedules (
    schedule_id   text             PRIMARY KEY,
    workflow_name text             NOT NULL,
    cron          text             NOT NULL,
    timezone      text             NOT NULL,
    input         bytea            NOT NULL,
    overlap       text             NOT NULL,
    catch_up      double precision NOT NULL,
    paused        boolean          NOT NULL,
    next_tick     timestamptz,
    last_tick     timestamptz,
    last_run_id   text,
    lease_holder  text,
    lease_until   timestamptz,
    version       bigint           NOT NULL,
    created_at    timestamptz,
    updated_at    timestamptz
);
