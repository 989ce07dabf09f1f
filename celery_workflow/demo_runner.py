"""``celery-workflow demo``: start a real Celery worker on the embedded World, drive one run, show it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, TextIO

from celery_workflow.errors import CeleryWorkflowError, HookNotFound
from celery_workflow.world import open_world


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = min(width, width * done // max(1, total))
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def _absolute(url: str) -> str:
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        return "sqlite:///" + os.path.abspath(url[len("sqlite:///") :])
    return url


def run_demo(url: str, *, out: TextIO, timeout: float = 120.0) -> int:
    url = _absolute(url)
    os.environ["CELERY_WORKFLOW_URL"] = url
    open_world(url).close()  # create and migrate before the worker starts
    from celery_workflow import demo

    log_file = tempfile.NamedTemporaryFile("w+", prefix="celery-workflow-demo-", suffix=".log", delete=False)  # noqa: SIM115
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "celery_workflow.demo",
            "worker",
            "-c",
            "2",
            "-n",
            "demo@%h",
            "--loglevel=INFO",
        ],
        env={**os.environ, "CELERY_WORKFLOW_URL": url},
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    print(f"world:  {url}", file=out)
    print(f"worker: celery -A celery_workflow.demo worker (pid {worker.pid}, log {log_file.name})", file=out)
    try:
        return _drive(demo, out, timeout)
    except CeleryWorkflowError as exc:
        print(f"demo failed: {exc}", file=out)
        log_file.seek(0)
        print("--- worker log (tail) ---\n" + "".join(log_file.readlines()[-40:]), file=out)
        return 1
    finally:
        _stop(worker)
        log_file.close()


def _drive(demo: Any, out: TextIO, timeout: float) -> int:
    wf = demo.wf
    order_id = f"o-{int(time.time() * 1000) % 10**8}"
    run = demo.process_order.start(order_id)
    print(f"run:    {run.id} (workflow process_order, order {order_id})\n", file=out)

    def show_progress() -> None:
        for done, value in enumerate(run.stream("progress", timeout=timeout), start=1):
            print(f"  {_bar(done, demo.STAGES)}  {value['stage']}", file=out, flush=True)

    reader = threading.Thread(target=show_progress, daemon=True)
    reader.start()
    token = f"approve:{order_id}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            wf.world.get_hook_by_token(token)
            break
        except HookNotFound:
            if time.monotonic() > deadline or run.status.terminal:
                raise
            time.sleep(0.05)
    print(f"  the run waits on hook {token!r}; approving it from outside", file=out, flush=True)
    time.sleep(0.05)
    wf.resume_hook(token, {"ok": True, "by": "celery-workflow demo"})
    result = run.result(timeout=timeout)
    reader.join(timeout=5)
    print(f"\nresult: {result}", file=out)
    print(f"status: {run.status.value}\n\nevents:", file=out)
    for ev in run.events():
        print(f"  {ev.slot:3} {ev.event_type.value:15} {ev.correlation_id or ''}", file=out)
    print(f"\nrun {run.id} completed. Inspect it with: celery-workflow runs show {run.id}", file=out)
    return 0


def _stop(worker: subprocess.Popen[bytes]) -> None:
    if worker.poll() is not None:
        return
    try:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=15)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(worker.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        worker.wait(timeout=5)
