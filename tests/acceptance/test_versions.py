"""Issue #30 item 2, checked from outside: a run recorded by the old code on a real worker is carried on by a worker
running the changed code, guarded by ``patched``, on the SQLite and Postgres Worlds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_workflow.events import EventType

from .workers import Worker, imported_app, postgres_schema, wait_for

pytestmark = pytest.mark.acceptance


@pytest.fixture(params=["sqlite", "postgres"])
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    if request.param == "sqlite":
        yield {"CELERY_WORKFLOW_URL": f"sqlite:///{tmp_path / 'world.sqlite3'}"}
        return
    with postgres_schema() as url:
        yield {"CELERY_WORKFLOW_URL": url}


def deploy(env: dict[str, str], version: int, log: Path) -> Worker:
    worker = Worker("versionsapp", {**env, "CW_CODE_VERSION": str(version)}, log, ["-c", "1", "-n", f"v{version}@%h"])
    worker.wait_ready()
    return worker


def test_an_old_run_replays_on_changed_code_guarded_by_patched(env: dict[str, str], tmp_path: Path) -> None:
    with imported_app("versionsapp", {**env, "CW_CODE_VERSION": "1"}) as app:
        world = app.wf.world
        old_code = deploy(env, 1, tmp_path / "v1.log")
        try:
            old = app.order.start("o-old")
            wait_for(lambda: world.list_hooks(old.id), 30, lambda: (tmp_path / "v1.log").read_text()[-3000:])
        finally:
            old_code.stop()
        new_code = deploy(env, 2, tmp_path / "v2.log")
        try:
            app.wf.resume_hook("go:o-old", "approved")
            assert old.result(timeout=30) == ["approved", "shipped o-old"]  # its recorded path: no audit
            new = app.order.start("o-new")
            app.wf.resume_hook("go:o-new", "approved", wait=30)
            assert new.result(timeout=30) == ["audited o-new", "approved", "shipped o-new"]
        finally:
            new_code.stop()
        assert EventType.PATCH_APPLIED not in [e.event_type for e in old.events()]
        markers = [e for e in new.events() if e.event_type is EventType.PATCH_APPLIED]
        assert [m.correlation_id for m in markers] == ["patch:audit-first"]
