"""The run inspector in headless Chromium (selenium), served by a real werkzeug server on a SQLite World with real
runs: one whose step failed once and was retried, one asleep, one writing a stream. Screenshots of each page go to
``$INSPECTOR_SCREENSHOTS`` (default: ``test-artifacts/inspector/`` in the repository).

Needs Debian's ``chromium`` and ``chromium-driver`` (``.ci/run`` installs them when it can); without them every test
here is skipped, saying so. Selenium is pointed at ``/usr/bin/chromedriver`` and never downloads anything.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_workflow import Workflows, create_hook, get_writable, sleep
from celery_workflow.inspector.model import show_time
from celery_workflow.inspector.server import LOOPBACK_NAMES, make_app
from celery_workflow.testing import LocalWorker

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip(
        "headless Chromium is not installed (apt-get install chromium chromium-driver): browser tests skipped",
        allow_module_level=True,
    )
pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[test]')")

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions as ec  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402
from werkzeug.serving import make_server  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WAIT = 10.0


@dataclass
class Site:
    base: str
    wf: Workflows
    worker: LocalWorker
    runs: dict[str, str]
    shots: Path


def screenshots() -> Path:
    path = Path(os.environ.get("INSPECTOR_SCREENSHOTS") or REPO / "test-artifacts" / "inspector")
    path.mkdir(parents=True, exist_ok=True)
    return path


def register(wf: Workflows) -> None:
    failures: list[int] = []

    @wf.step(max_retries=3, retry_backoff=0.01)
    def charge(cents: int) -> str:
        failures.append(cents)
        if len(failures) == 1:
            raise RuntimeError("the card network timed out")
        return "rcpt_1"

    @wf.workflow
    def retried(cents: int) -> str:
        return charge(cents)

    @wf.workflow
    def napping() -> str:
        sleep(3600)
        return "rested"

    @wf.step
    def emit(text: str) -> None:
        get_writable("progress").write({"stage": text})

    @wf.workflow
    def streaming() -> str:
        emit("first chunk")
        create_hook(token="tail-go").wait()
        emit("second chunk")
        return "streamed"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    path = tmp_path_factory.mktemp("browser") / "inspector.sqlite3"
    wf = Workflows(Celery("inspector-browser"), world=f"sqlite:///{path}", broker="app")
    register(wf)
    worker = LocalWorker(wf)
    runs = {name: wf.start(name, *args).id for name, args in (("retried", (1200,)), ("napping", ()))}
    runs["streaming"] = wf.start("streaming").id
    worker.run_until(lambda: wf.world.get_run(runs["retried"]).status.terminal, timeout=20)
    worker.run_until(lambda: bool(wf.world.list_waits(runs["napping"])), timeout=20)
    worker.run_until(lambda: bool(wf.world.list_hooks(runs["streaming"])), timeout=20)
    server = make_server("127.0.0.1", 0, make_app(wf, trusted_hosts=LOOPBACK_NAMES), threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="inspector-server", daemon=True)
    thread.start()
    try:
        yield Site(f"http://127.0.0.1:{server.server_port}", wf, worker, runs, screenshots())
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=WAIT)
        wf.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,1800",
    ):
        options.add_argument(flag)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SE_OFFLINE", "true")  # Selenium Manager, should anything call it, must not download anything
        driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
        try:
            yield driver
        finally:
            driver.get("about:blank")  # closes a live tail before the server goes
            driver.quit()


def wait(driver: Any) -> WebDriverWait[Any]:
    return WebDriverWait(driver, WAIT)


def row_ids(driver: Any) -> list[str]:
    return [row.get_attribute("data-run-id") for row in driver.find_elements(By.CSS_SELECTOR, "tr.run")]


def test_the_runs_list_filters_by_submitting_the_form(site: Site, browser: Any) -> None:
    browser.get(f"{site.base}/")
    wait(browser).until(ec.presence_of_element_located((By.CSS_SELECTOR, "tr.run")))
    assert sorted(row_ids(browser)) == sorted(site.runs.values())
    browser.save_screenshot(str(site.shots / "runs.png"))

    Select(browser.find_element(By.NAME, "status")).select_by_value("completed")
    browser.find_element(By.CSS_SELECTOR, "form.filters button[type=submit]").click()
    wait(browser).until(ec.url_contains("status=completed"))
    completed = [r for r in site.runs.values() if site.wf.world.get_run(r).status == "completed"]
    assert site.runs["retried"] in completed and site.runs["napping"] not in completed
    newest_first = sorted(completed, key=lambda r: (site.wf.world.get_run(r).created_at, r), reverse=True)
    assert row_ids(browser) == newest_first  # by creation time, whatever the ids

    Select(browser.find_element(By.NAME, "status")).select_by_value("")
    field = browser.find_element(By.NAME, "workflow")
    field.clear()
    field.send_keys("napping")
    browser.find_element(By.CSS_SELECTOR, "form.filters button[type=submit]").click()
    wait(browser).until(ec.url_contains("workflow=napping"))
    assert row_ids(browser) == [site.runs["napping"]]
    browser.save_screenshot(str(site.shots / "runs-filtered.png"))


def test_the_run_page_shows_the_retried_step_with_its_attempts(site: Site, browser: Any) -> None:
    browser.get(f"{site.base}/runs/{site.runs['retried']}")
    step = wait(browser).until(ec.presence_of_element_located((By.CSS_SELECTOR, 'li[data-id="step:charge:1"]')))
    attempts = step.find_elements(By.CSS_SELECTOR, "li.attempt")
    assert [a.get_attribute("class") for a in attempts] == ["attempt o-retrying", "attempt o-completed"]
    assert "attempt 1" in attempts[0].text and "RuntimeError: the card network timed out" in attempts[0].text
    assert "attempt 2" in attempts[1].text and "completed" in attempts[1].text
    assert "2 attempts" in step.text
    assert "rcpt_1" in browser.find_element(By.CSS_SELECTOR, "section.values").text
    browser.save_screenshot(str(site.shots / "run-retried.png"))


def test_the_sleeping_run_shows_its_due_time(site: Site, browser: Any) -> None:
    (nap,) = site.wf.world.list_waits(site.runs["napping"])
    browser.get(f"{site.base}/runs/{site.runs['napping']}")
    row = wait(browser).until(ec.presence_of_element_located((By.CSS_SELECTOR, 'tr.wait[data-id="wait:1"]')))
    assert row.find_element(By.CSS_SELECTOR, "td.due").text == show_time(nap.resume_at)
    assert row.find_element(By.CSS_SELECTOR, "td.rel").text.startswith("in 59 min")
    timeline = browser.find_element(By.CSS_SELECTOR, 'ol.timeline li[data-id="wait:1"]').text
    assert "due " + show_time(nap.resume_at) in timeline
    browser.save_screenshot(str(site.shots / "run-sleeping.png"))


def test_the_stream_shows_its_chunks_and_tails_new_ones(site: Site, browser: Any) -> None:
    run_id = site.runs["streaming"]
    browser.get(f"{site.base}/runs/{run_id}")
    chunks = wait(browser).until(ec.presence_of_element_located((By.CSS_SELECTOR, "ol.chunks[data-tail]")))
    assert "first chunk" in chunks.find_element(By.CSS_SELECTOR, 'li[data-index="0"]').text
    assert "hidden" in browser.find_element(By.CSS_SELECTOR, 'tr.hook[data-id="hook:1"] td.token').text
    assert "tail-go" not in browser.page_source

    site.wf.resume_hook("tail-go", {"go": True})  # the run goes on after the page opened: its next step writes
    site.worker.run_until(lambda: site.wf.world.get_run(run_id).status.terminal, timeout=WAIT)
    fresh = wait(browser).until(ec.presence_of_element_located((By.CSS_SELECTOR, 'ol.chunks li.fresh[data-index="1"]')))
    assert "second chunk" in fresh.text
    state = browser.find_element(By.CSS_SELECTOR, ".stream .tail-state")
    wait(browser).until(lambda _: state.text in ("the run has ended", "the stream is closed"))
    browser.save_screenshot(str(site.shots / "run-stream.png"))

    browser.get(f"{site.base}/runs/{run_id}/streams/progress")
    wait(browser).until(ec.presence_of_element_located((By.CSS_SELECTOR, 'ol.chunks li[data-index="1"]')))
    browser.save_screenshot(str(site.shots / "stream.png"))


def test_the_dead_letters_page_renders(site: Site, browser: Any) -> None:
    browser.get(f"{site.base}/dead-letters")
    wait(browser).until(ec.presence_of_element_located((By.CSS_SELECTOR, "table.letters")))
    assert "no dead letters" in browser.find_element(By.CSS_SELECTOR, "table.letters").text
    browser.save_screenshot(str(site.shots / "dead-letters.png"))
