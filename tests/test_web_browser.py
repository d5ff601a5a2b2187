"""The logview page in a real headless Chromium (Debian's chromium and
chromium-driver, installed by .ci/setup): a running job's page shows new log
lines and a growing curve without a reload; a finished job's page shows the
summary and OK; a `<script>` printed by a worker is shown as text.

Screenshots of both pages are saved in the test's folder, and into
$PAI_SCREENSHOT_DIR when it is set (how docs/img/*.png are made):
    PAI_SCREENSHOT_DIR=docs/img .venv/bin/python -m pytest tests/test_web_browser.py
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

from conftest import ROOT, pai, wait_until

CHROMIUM = shutil.which("chromium")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER),
                                reason="needs Debian's chromium and chromium-driver (bash .ci/setup installs them)")


def _chromium_pids(profile: Path) -> list[int]:
    """Processes of the browser we started (its profile folder is on their command line)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if str(profile).encode() in cmdline:
                pids.append(int(entry))
    return pids


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tmp_path / "chromium-profile"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1280,1500"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        for pid in _chromium_pids(profile):  # anything the driver left behind: ours, by its profile
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert wait_until(lambda: not _chromium_pids(profile), timeout=10)


@pytest.fixture
def web(pai_home, monkeypatch):
    from paicli.web import launch

    monkeypatch.setenv("PAI_LOGVIEW", "web")
    yield pai_home
    launch.stop_server(pai_home)


def screenshot(driver, tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    driver.save_screenshot(str(path))
    target = os.environ.get("PAI_SCREENSHOT_DIR")
    if target:
        folder = Path(target) if Path(target).is_absolute() else ROOT / target
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, folder / name)


def text_of(driver, element_id: str) -> str:
    return driver.execute_script(f"return (document.getElementById('{element_id}') || {{}}).textContent || ''")


# A ps/worker job whose workers pause at steps 20 and 150 until the test opens a
# gate: what the test sees while the job runs does not depend on how fast a loaded
# machine gets there (a job of fixed length could end before the page was checked).
GATED_JOB = """\
import os, sys, time
from pathlib import Path

gates = Path(sys.argv[sys.argv.index("--gates") + 1])
if os.environ["PAI_ROLE"] == "ps":
    print("ps serving", flush=True)
    while True:
        time.sleep(1)   # until the launcher stops it once the workers are done


def hold(name):
    deadline = time.monotonic() + 300   # a test that died never leaves this running
    while not (gates / name).exists():
        if time.monotonic() > deadline:
            sys.exit(f"the gate {name} was never opened")
        time.sleep(0.05)


for step in range(160):
    if step in (20, 150):
        hold(f"step{step}")
    print(f"step={step}, global_step={step}, loss={1 / (step + 1):.6f}, duration=0.050000s.", flush=True)
    time.sleep(0.05)
"""


def test_running_job_page_grows_live_then_shows_ok(web, browser, tmp_path):
    script, gates = tmp_path / "gated.py", tmp_path / "gates"
    script.write_text(GATED_JOB)
    gates.mkdir()
    started = pai("--detach", "-name", "python", f"-Dscript={script}",
                  '-Dcluster={"ps":{"count":1},"worker":{"count":2}}', f"-DuserDefinedParameters=--gates {gates}")
    assert started.returncode == 0, started.stderr
    job_id = started.stdout.strip()
    try:
        _watch_the_gated_job(browser, tmp_path, job_id, gates)
    finally:
        for name in ("step20", "step150"):
            (gates / name).touch()
        if pai("wait", job_id, timeout=120).returncode != 0:
            pai("kill", job_id)


def _watch_the_gated_job(browser, tmp_path, job_id: str, gates) -> None:
    url = pai("logview", job_id).stdout.strip()
    browser.get(url)
    browser.execute_script("window.__sameDocument = 'yes';")   # a reload would forget this

    def points() -> int:
        return int(browser.find_element("id", "plot").get_attribute("data-points") or 0)

    def worker_log() -> str:
        return browser.execute_script(
            "return document.querySelector('#tails .tail[data-instance=\"worker:0\"] pre').textContent")

    # Held at step 20: the first points and lines are on the page.
    assert wait_until(lambda: points() >= 10, timeout=90), text_of(browser, "live")
    first_points, first_log = points(), worker_log()
    assert "step=" in first_log
    (gates / "step20").touch()
    # Running to step 150 and held there: the page grows without a reload.
    assert wait_until(lambda: points() > first_points + 10, timeout=90)
    assert wait_until(lambda: len(worker_log()) > len(first_log), timeout=90)
    new_lines = worker_log()[len(first_log.rstrip("\n")):]
    assert "step=" in new_lines
    # One curve per worker, against step; the metric picked is loss.
    curves = browser.find_elements("css selector", "#plot polyline.curve")
    assert sorted(c.get_attribute("data-instance") for c in curves) == ["worker:0", "worker:1"]
    assert browser.find_element("id", "plot").get_attribute("data-metric") == "loss"
    assert "Running" in text_of(browser, "job-status")   # the workers wait at step 150
    screenshot(browser, tmp_path, "logview-running.png")

    (gates / "step150").touch()
    assert pai("wait", job_id, timeout=120).returncode == 0
    assert wait_until(lambda: "the job is over: OK" in text_of(browser, "live"), timeout=60)
    assert text_of(browser, "verdict") == "OK"
    assert browser.execute_script("return window.__sameDocument") == "yes"
    summary = text_of(browser, "summary")
    assert "PythonTask" in summary and "0/3/3" in summary
    assert "Succeeded" in text_of(browser, "job-status")
    assert points() >= 2 * 150   # every step of both workers
    assert "step=159" in worker_log()
    screenshot(browser, tmp_path, "logview-finished.png")


def test_finished_job_page_shows_summary_ok_and_script_as_text(web, browser, tmp_path):
    script = tmp_path / "noisy.py"
    script.write_text(
        'import time\n'
        'for i in range(5):\n'
        '    print(f"step={i}, loss={1/(i+1):.3f}", flush=True)\n'
        'print("<script>window.__pwned = 1</script><b>not bold</b>", flush=True)\n')
    result = pai("-name", "python", f"-Dscript={script}", '-Dcluster={"worker":{"count":1}}')
    assert result.returncode == 0, result.stderr
    url = [line[10:] for line in result.stdout.splitlines() if line.startswith("Log view: ")][0]
    browser.get(url)
    # The feed's last event (not the server-rendered page) says the job is over.
    assert wait_until(lambda: "the job is over: OK" in text_of(browser, "live"), timeout=20)
    assert text_of(browser, "verdict") == "OK"
    assert "0/1/1" in text_of(browser, "summary")
    log = browser.execute_script("return document.querySelector('#tails .tail.on pre').textContent")
    assert "<script>window.__pwned = 1</script><b>not bold</b>" in log
    assert browser.execute_script("return window.__pwned === undefined")
    assert not browser.find_elements("css selector", "#tails pre b, #tails pre script")
    assert int(browser.find_element("id", "plot").get_attribute("data-points")) == 5, browser.get_log("browser")
    # The job list links to the page.
    browser.get(url.split("?")[0] + "?token=" + url.split("token=")[1])
    assert wait_until(lambda: browser.find_elements("css selector", "#jobs a"), timeout=10)


def test_job_list_updates_itself_while_jobs_run(web, browser):
    url = pai("logview").stdout.strip()            # the job list, before any job
    browser.get(url)
    browser.execute_script("window.__sameDocument = 'yes';")
    assert "no jobs yet" in text_of(browser, "job-rows")
    example = ROOT / "examples" / "python" / "ps_worker.py"
    started = pai("--detach", "-name", "python", f"-Dscript={example}",
                  '-Dcluster={"ps":{"count":1},"worker":{"count":1}}', "-DjobName=<i>listed</i>", "-DuserDefinedParameters=--steps 60 --sleep 0.1")
    assert started.returncode == 0, started.stderr
    job_id = started.stdout.strip()

    def row() -> str:
        return browser.execute_script(
            "const r = document.querySelector('#job-rows tr[data-job=\"' + arguments[0] + '\"]');"
            " return r ? r.textContent : '';", job_id)

    # The new job appears, running, then finished: all without a reload.
    assert wait_until(lambda: "Running" in row(), timeout=20), text_of(browser, "job-rows")
    assert "<i>listed</i>" in row() and not browser.find_elements("css selector", "#job-rows i")
    assert pai("wait", job_id, timeout=120).returncode == 0
    assert wait_until(lambda: "Succeeded" in row(), timeout=10), row()
    assert browser.execute_script("return window.__sameDocument") == "yes"
    assert int(browser.find_element("id", "live").get_attribute("data-updates")) >= 3
    # Its link leads to the job's page.
    browser.find_element("css selector", f'#job-rows tr[data-job="{job_id}"] a').click()
    assert wait_until(lambda: text_of(browser, "verdict") == "OK", timeout=20)
