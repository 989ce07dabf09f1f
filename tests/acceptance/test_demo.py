"""The README's first command: `celery-workflow demo` in an empty folder finishes a run on a real worker."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.acceptance


def test_demo_in_an_empty_folder(tmp_path: Path) -> None:
    exe = shutil.which("celery-workflow")
    cmd = [exe, "demo"] if exe else [sys.executable, "-m", "celery_workflow.cli", "demo"]
    env = {k: v for k, v in os.environ.items() if k != "CELERY_WORKFLOW_URL"}
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "completed" in out.stdout
    assert "'status': 'shipped'" in out.stdout
    assert "packed teapot" in out.stdout  # progress came from the stream
    assert (tmp_path / "celery_workflow.sqlite3").exists()
