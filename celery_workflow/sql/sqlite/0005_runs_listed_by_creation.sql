-- list_runs lists newest first by creation time, ties by run id (run ids are caller-chosen: only generated ones sort
-- by time), paged by the keyset (created_at, run_id) < (the cursor's). One index per way of listing serves the
-- order and the cursor as one backward range scan: no filter, by workflow, by status (replacing the two indexes
-- that ordered by run id).
DROP INDEX celery_workflow_runs_workflow;
DROP INDEX celery_workflow_runs_status;
CREATE INDEX celery_workflow_runs_created ON celery_workflow_runs (created_at, run_id);
CREATE INDEX celery_workflow_runs_workflow ON celery_workflow_runs (workflow_name, created_at, run_id);
CREATE INDEX celery_workflow_runs_status ON celery_workflow_runs (status, created_at, run_id);
