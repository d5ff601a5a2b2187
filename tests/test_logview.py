"""The logview server over real HTTP: the `Log view:` URL of a submit, the pages
and the JSON summary, the token on every URL, escaping, log paths confined to
the job's folder, the idle exit, the fallback to the summary file; `pai plot`."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import BEHAVE, pai, pai_json, run_on_pty, wait_until

URL = re.compile(r"^Log view: (http://127\.0\.0\.1:(\d+)/logview/\?i=([a-z0-9]+)&token=([\w-]+))$", re.M)


@pytest.fixture
def web(pai_home, monkeypatch):
    """The logview server on for this test's home; stopped (and checked gone) after."""
    from paicli.web import launch

    monkeypatch.setenv("PAI_LOGVIEW", "web")
    yield pai_home
    state = launch.read_state(pai_home)
    launch.stop_server(pai_home)
    if state:
        from paicli.cluster.procinfo import is_alive
        assert not is_alive(state["pid"], state["start"])


def get(url: str) -> tuple[int, str, dict]:
    try:
        with urllib.request.urlopen(url, timeout=20) as response:
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), dict(err.headers)


def submit(*args: str, env: dict | None = None) -> tuple[str, str, str]:
    """Run a job to its end; (job ID, base URL, token) from its `Log view:` line."""
    result = pai("-name", "python", *args, env=env)
    assert result.returncode == 0, result.stderr
    match = URL.search(result.stdout)
    assert match, result.stdout
    return match.group(3), f"http://127.0.0.1:{match.group(2)}", match.group(4)


def test_submit_prints_the_page_url_and_the_page_shows_the_job(web):
    job_id, base, token = submit(f"-Dscript={BEHAVE}", '-Dcluster={"ps":{"count":1},"worker":{"count":2}}',
                                 env={"BEHAVE": "print:5", "BEHAVE_PS": "serve"})
    code, page, headers = get(f"{base}/logview/?i={job_id}&token={token}")
    assert code == 200
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    for text in (job_id, "Fatal/Finished/Total", "PythonTask", "0/3/3", ">OK<", "worker:1", "ps:0",
                 "Only tail 10KB", "step=4, global_step=4"):
        assert text in page, text
    summary = json.loads(get(f"{base}/api/jobs/{job_id}.json?token={token}")[1])
    assert summary["status"] == "Succeeded" and summary["owner"]
    assert [p[0] for p in summary["metric_series"]["worker:0"]["loss"]] == [0, 1, 2, 3, 4]
    assert any(e["kind"] == "job" and e["message"] == "Succeeded" for e in summary["events"])
    whole = get(f"{base}/api/jobs/{job_id}/log?instance=worker:1&token={token}")
    assert whole[0] == 200 and whole[2]["Content-Type"].startswith("text/plain") and "step=4" in whole[1]
    listing = get(f"{base}/logview/?token={token}")[1]
    assert job_id in listing and "Succeeded" in listing
    rows = get(f"{base}/api/jobs.html?token={token}")  # what the open list polls for
    assert rows[0] == 200 and f'<tr data-job="{job_id}">' in rows[1] and "Succeeded" in rows[1]
    # pai status and pai logview hand out the same server's URL.
    assert f"{base}/logview/?i={job_id}&token={token}" in pai("status", job_id).stdout
    assert pai("logview", job_id[:12]).stdout.strip() == f"{base}/logview/?i={job_id}&token={token}"
    assert pai("wait", job_id).stdout.startswith(f"Log view: {base}/logview/?i={job_id}&token={token}\n")
    as_json = pai_json("status", job_id)  # the same URL, and the plain file beside it
    assert as_json["log_view"] == f"{base}/logview/?i={job_id}&token={token}"
    assert as_json["summary_file"].endswith("summary.txt") and "Status: Succeeded" in open(as_json["summary_file"]).read()
    # The token and the state are the user's alone.
    folder = web / "logview"
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    for name in ("token", "server.json", "server.log"):
        assert oct((folder / name).stat().st_mode & 0o777) == "0o600", name
    assert json.loads((folder / "token").read_text())["token"] == token


def test_the_server_stands_by_holding_nothing_else_of_the_caller(web):
    """ensure_server records a live process at once (stoppable, its pid and start
    time in server.json), which stands by on the socket until the first visit."""
    from paicli.cluster.procinfo import is_alive
    from paicli.web import launch

    state = launch.ensure_server(web)
    assert is_alive(state["pid"], state["start"])
    assert os.getsid(state["pid"]) != os.getsid(0)   # a session of its own
    log = launch.state_dir(web) / "server.log"
    assert wait_until(lambda: "standing by" in log.read_text(), timeout=30)
    # stdin, the log twice, the socket: nothing else of the caller's (numbers a fork
    # brought along point at /dev/null: procinfo.let_go_inherited)
    held = {fd: os.readlink(f"/proc/{state['pid']}/fd/{fd}") for fd in os.listdir(f"/proc/{state['pid']}/fd")}
    assert len({fd: t for fd, t in held.items() if t != "/dev/null"}) <= 3, held
    assert get(f"http://127.0.0.1:{state['port']}/logview/?token={state['token']}")[0] == 200


def test_a_retried_instance_shows_its_events_attempts_and_both_logs(web):
    job_id, base, token = submit(f"-Dscript={BEHAVE}", '-Dcluster={"worker":{"count":1}}',
                                 env={"BEHAVE": "print:2,selfkill:SIGKILL,print:3"})
    page = get(f"{base}/logview/?i={job_id}&token={token}")[1]
    events = page[page.index('id="events"'):]
    for text in ("submitted", "Running: attempt 0", "Waiting: killed by SIGKILL, restarting",
                 "Running: attempt 1", "Terminated: exit 0", ">Succeeded<"):
        assert text in events, text
    instances = page[page.index('id="instances"'):page.index('id="events"')]
    assert "<td>worker:0</td><td>local</td>" in instances and "<td>2</td><td>0</td>" in instances  # attempts, exit
    assert "<td>PythonTask</td><td>0/1/1</td><td>1</td>" in page                                 # one retry
    assert "whole log of worker:0 (attempt 1)" in page
    first = get(f"{base}/api/jobs/{job_id}/log?instance=worker:0&attempt=0&token={token}")[1]
    second = get(f"{base}/api/jobs/{job_id}/log?instance=worker:0&attempt=1&token={token}")[1]
    assert "killing myself with SIGKILL" in first and "attempt=0" in first and "attempt=0" not in second
    assert "step=2, global_step=2, loss=0.3333, attempt=1" in second


def test_the_feed_ends_when_a_master_died_without_recording_the_end(web):
    import sqlite3

    job_id, base, token = submit(f"-Dscript={BEHAVE}", env={"BEHAVE": "print:3"})
    with urllib.request.urlopen(f"{base}/api/jobs/{job_id}/stream?token={token}", timeout=20) as response:
        assert response.read().decode().rstrip().split("\n")[-2] == "event: end"   # a finished job: at once
    # As if master and watchdog had died mid-run: Running in the store, nobody alive.
    db = sqlite3.connect(web / "pai.db")
    with db:
        db.execute("UPDATE jobs SET status = 'Running', ended = NULL WHERE id = ?", (job_id,))
    db.close()
    with urllib.request.urlopen(f"{base}/api/jobs/{job_id}/stream?token={token}", timeout=20) as response:
        feed = response.read().decode()                # returns only because the feed ends
    end = json.loads(feed.rstrip().split("\n")[-1][len("data: "):])
    # The loss is derived for display, as `pai status` derives it (issue 16: readers write nothing).
    assert end["status"] == "Failed" and end["verdict"] == "FAILED: master lost"
    assert "step=2" in feed
    shown = json.loads(get(f"{base}/api/jobs/{job_id}.json?token={token}")[1])
    assert (shown["status"], shown["unrecorded"]) == ("Failed", True)
    listed = {job["id"]: job for job in json.loads(get(f"{base}/api/jobs.json?token={token}")[1])}
    assert listed[job_id]["status"] == "Failed"      # the page's job list derives it too
    assert pai_json("status", job_id)["status"] == "Failed"
    # Neither the server nor pai status changed the store.
    db = sqlite3.connect(web / "pai.db")
    assert db.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()[0] == "Running"
    db.close()


def test_every_url_is_403_without_the_token(web):
    job_id, base, token = submit(f"-Dscript={BEHAVE}", env={"BEHAVE": "print:1"})
    paths = ["/", "/logview/", f"/logview/?i={job_id}", "/api/jobs.json", "/api/jobs.html", f"/api/jobs/{job_id}.json",
             f"/api/jobs/{job_id}/log", f"/api/jobs/{job_id}/stream", "/static/logview.js",
             "/static/logview.css", "/nothing/here"]
    wrong = token[:-1] + ("y" if token[-1] != "y" else "z")   # token[:-1] + "x" IS the token 1 time in 64
    for path in paths:
        sep = "&" if "?" in path else "?"
        for suffix in ("", f"{sep}token=", f"{sep}token={wrong}"):
            code, body, _ = get(base + path + suffix)
            assert code == 403, (path, suffix, code)
            assert job_id not in body
    assert get(f"{base}/static/logview.js?token={token}")[0] == 200


def test_script_tags_in_logs_and_names_are_text(web, tmp_path):
    script = tmp_path / "evil<b>name.py"
    script.write_text('print("<script>alert(1)</script> step=1, loss=0.5", flush=True)\n')
    job_id, base, token = submit(f"-Dscript={script}")
    page = get(f"{base}/logview/?i={job_id}&token={token}")[1]
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "evil&lt;b&gt;name" in page
    assert "<script>alert" not in page and "<b>name" not in page
    other, _, _ = submit(f"-Dscript={script}", "-DjobName=<img src=x onerror=alert(2)>")
    for url in (f"{base}/logview/?token={token}", f"{base}/logview/?i={other}&token={token}"):
        html = get(url)[1]
        assert "<img src=x" not in html and "&lt;img src=x onerror=alert(2)&gt;" in html


def test_a_log_path_cannot_leave_its_job_folder(web, tmp_path):
    job_id, base, token = submit(f"-Dscript={BEHAVE}", env={"BEHAVE": "print:1"})
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    logs = web / "jobs" / job_id / "logs"
    (logs / "worker-0.7.log").symlink_to(secret)        # a link planted in the logs folder
    for query in ("instance=worker:0&attempt=7", "instance=../../../etc/passwd", "instance=..:0",
                  "instance=worker:0/../../x:0", "attempt=abc&instance=worker:0"):
        code, body, _ = get(f"{base}/api/jobs/{job_id}/log?{query}&token={token}")
        assert code in (400, 404), (query, code)
        assert "top secret" not in body and "root:" not in body
    assert get(f"{base}/api/jobs/..%2F..%2Fetc/log?token={token}")[0] == 404
    assert get(f"{base}/static/..%2Fserver.py?token={token}")[0] == 404
    assert get(f"{base}/logview/?i=nosuchjob&token={token}")[0] == 404


def test_the_server_goes_away_when_idle(pai_home, monkeypatch):
    from paicli.cluster.procinfo import is_alive
    from paicli.web import launch

    monkeypatch.setenv("PAI_LOGVIEW_IDLE", "1")
    state = launch.ensure_server(pai_home)
    try:
        assert get(launch.url_for(state))[0] == 200
        assert wait_until(lambda: not is_alive(state["pid"], state["start"]), timeout=20)
        assert not (pai_home / "logview" / "server.json").exists()
        # The next command that needs one starts a new one, with the same token.
        again = launch.ensure_server(pai_home)
        assert again["pid"] != state["pid"] and again["token"] == state["token"]
        # ... on the same port when it is free: the URL printed before works again.
        assert launch.url_for(again) == launch.url_for(state)
        assert get(launch.url_for(state))[0] == 200
    finally:
        launch.stop_server(pai_home)


def loaded(pid: int, name: str) -> bool:
    """Whether a process has mapped a shared object whose path contains `name`."""
    return name in Path(f"/proc/{pid}/maps").read_text()


def test_the_server_imports_no_web_library_until_its_page_is_opened(pai_home, monkeypatch):
    """A submit starts a standby that holds the socket; aiohttp (its compiled
    parser) is loaded only when a page is asked for, in the same process."""
    from paicli.cluster.procinfo import is_alive
    from paicli.web import launch

    state = launch.ensure_server(pai_home)
    try:
        log = pai_home / "logview" / "server.log"
        assert wait_until(lambda: "standing by" in log.read_text(), timeout=20)
        assert not loaded(state["pid"], "aiohttp")
        assert get(launch.url_for(state))[0] == 200  # queued on the socket until the server is up
        assert loaded(state["pid"], "aiohttp") and is_alive(state["pid"], state["start"])
        assert "logview serving" in log.read_text()
    finally:
        launch.stop_server(pai_home)


def test_an_unvisited_standby_goes_away_when_idle(pai_home, monkeypatch):
    from paicli.cluster.procinfo import is_alive
    from paicli.web import launch

    monkeypatch.setenv("PAI_LOGVIEW_IDLE", "1")
    state = launch.ensure_server(pai_home)
    try:
        assert wait_until(lambda: not is_alive(state["pid"], state["start"]), timeout=20)
        assert not (pai_home / "logview" / "server.json").exists()
        assert "before any visit: exiting" in (pai_home / "logview" / "server.log").read_text()
        assert not loaded_ever(pai_home)
    finally:
        launch.stop_server(pai_home)


def loaded_ever(home: Path) -> bool:
    return "logview serving" in (home / "logview" / "server.log").read_text()


def test_pai_logview_stop_and_the_file_fallback(web, monkeypatch):
    from paicli.web import launch

    url = pai("logview").stdout.strip()
    assert url.startswith("http://127.0.0.1:") and get(url)[0] == 200
    assert pai("logview", "--stop").stdout.strip() == "logview server stopped"
    assert pai("logview", "--stop").stdout.strip() == "no logview server was running"
    # An address this machine does not have: the summary file, and a note why.
    result = pai("-name", "python", f"-Dscript={BEHAVE}", env={"BEHAVE": "print:1", "PAI_LOGVIEW_HOST": "192.0.2.1"})
    assert result.returncode == 0
    line = [ln for ln in result.stdout.splitlines() if ln.startswith("Log view: ")][0]
    assert line.endswith("summary.txt") and Path(line[10:]).is_file()
    assert "note: no logview page (cannot listen on 192.0.2.1" in result.stderr
    job_id = pai_json("list")[0]["id"]
    noted = pai("status", job_id, "--json", env={"PAI_LOGVIEW_HOST": "192.0.2.1"})
    assert json.loads(noted.stdout)["log_view"] == line[10:] and "note: no logview page" in noted.stderr
    # PAI_LOGVIEW=file: the file, no server started, no note.
    plain = pai("status", job_id, "--json", env={"PAI_LOGVIEW": "file"})
    assert json.loads(plain.stdout)["log_view"] == line[10:] and plain.stderr == ""
    assert launch.running_server(web) is None


def test_plot_in_a_pipe_is_plain_text(pai_home):
    result = pai("-name", "python", f"-Dscript={BEHAVE}", '-Dcluster={"worker":{"count":2}}',
                 env={"BEHAVE": "print:8"})
    job_id = pai_json("list")[0]["id"]
    assert result.returncode == 0
    out = pai("plot", job_id, "--width", "60", "--height", "12")
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout
    assert "loss of " + job_id in out.stdout and "worker:0" in out.stdout and "worker:1" in out.stdout
    assert "step" in out.stdout and "1.0" in out.stdout            # loss starts at 1.0
    assert len(out.stdout.splitlines()) >= 10
    one = pai("plot", job_id, "--instance", "worker:1", "--metric", "loss").stdout
    assert "worker:1" in one and "worker:0" not in one
    bad = pai("plot", job_id, "--metric", "accuracy")
    assert bad.returncode == 2 and bad.stderr.startswith("pai: error: --metric accuracy: job ") \
        and "it has loss" in bad.stderr
    assert os.environ.get("PAI_LOGVIEW") == "file"  # other tests start no server
    # On a terminal: colour, braille curves.
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    _, screen = run_on_pty([sys.executable, "-m", "paicli", "plot", job_id, "--width", "60"], env)
    text = screen.decode("utf-8", "replace")
    assert "\x1b[" in text and any("\u2800" <= ch <= "\u28ff" for ch in text), text[:500]


def test_pluto_plan_and_forecast_on_the_page(web):
    job_id, base, token = submit(f"-Dscript={BEHAVE}", '-Dcluster={"worker":{"count":2}}', env={"BEHAVE": "print:6"})
    plan_file = web / "jobs" / job_id / "plan.json"
    plan = json.loads(plan_file.read_text())
    plan["pluto"] = {"label": "2 ps, variables spread by size", "forecast_step_s": 0.05,
                     "reasons": ["<ps> is the bottleneck: spread the weights"]}
    plan_file.write_text(json.dumps(plan))
    page = get(f"{base}/logview/?i={job_id}&token={token}")[1]
    assert "Pluto plan: 2 ps, variables spread by size" in page
    assert "Pluto: forecast 0.0500 s/step, measured" in page
    assert "&lt;ps&gt; is the bottleneck" in page
    assert json.loads(get(f"{base}/api/jobs/{job_id}.json?token={token}")[1])["plan"]["pluto"][0].startswith("Pluto plan")


def test_tails_start_at_a_whole_line_and_long_series_are_thinned(tmp_path):
    from paicli.web.data import tail_text, thin

    log = tmp_path / "x.log"
    log.write_bytes(b"".join(b"line %05d\n" % i for i in range(5000)))
    text, end = tail_text(log, size=1000)
    assert end == log.stat().st_size and text.startswith("line ") and text.endswith("line 04999\n")
    assert len(text) <= 1000
    points = [["worker:0", "loss", step, 1.0 / (step + 1)] for step in range(10_000)]
    points += [["worker:1", "loss", 0, 1.0]]
    kept = thin(points, cap=100)
    assert len([p for p in kept if p[0] == "worker:0"]) == 100 and kept[99][2] == 9999
    assert ["worker:1", "loss", 0, 1.0] in kept


def test_the_server_listens_where_it_is_told(pai_home, monkeypatch):
    from paicli.web import launch

    monkeypatch.setenv("PAI_LOGVIEW_HOST", "127.0.0.2")
    state = launch.ensure_server(pai_home)
    try:
        url = launch.url_for(state, None)
        assert url.startswith("http://127.0.0.2:")
        assert get(url)[0] == 200
        with pytest.raises(OSError):  # nothing on 127.0.0.1 at that port
            socket.create_connection(("127.0.0.1", state["port"]), timeout=2).close()
    finally:
        launch.stop_server(pai_home)


def test_the_feed_sends_whole_lines_and_restarts_a_rotated_log(tmp_path):
    from paicli.web.server import LogFollower

    log = tmp_path / "worker-0.0.log"
    log.write_bytes(b"old line\n")
    follower = LogFollower()
    assert follower.read(log, final=False) == ("old line\n", True)
    assert follower.read(log, final=False) is None
    with open(log, "ab") as f:
        f.write(b"step=1\nstep=2, lo")          # the writer is in the middle of a line
    assert follower.read(log, final=False) == ("step=1\n", False)
    with open(log, "ab") as f:
        f.write(b"ss=0.5\n")
    assert follower.read(log, final=False) == ("step=2, loss=0.5\n", False)
    log.rename(tmp_path / "worker-0.0.log.1")    # rotated: a new file, longer than the old offset
    log.write_bytes(b"x" * 100 + b"\nnew\n")
    assert follower.read(log, final=False) == ("x" * 100 + "\nnew\n", True)


def test_a_token_file_left_readable_is_tightened_when_used(tmp_path):
    """The token is stored 0600: one written looser (by hand, an old version) is
    tightened the next time it is read, and kept while valid (old URLs keep working)."""
    import time

    from paicli.web import launch

    folder = launch.state_dir(tmp_path)
    (folder / "token").write_text(json.dumps({"token": "abc", "port": 4321, "minted": time.time()}))
    os.chmod(folder / "token", 0o644)
    assert launch.user_token(tmp_path, 4321)["token"] == "abc"
    assert oct((folder / "token").stat().st_mode & 0o777) == "0o600"


def test_a_token_serves_only_its_own_port_and_only_for_its_days():
    from paicli.web.launch import TOKEN_SECONDS, token_valid

    record = {"token": "abc", "port": 4321, "minted": 1000.0}
    assert token_valid(record, 4321, 1000.0) and token_valid(record, 4321, 1000.0 + TOKEN_SECONDS - 1)
    assert not token_valid(record, 4322, 1000.0)                     # another port: whoever holds the old one
    assert not token_valid(record, 4321, 1000.0 + TOKEN_SECONDS)     # expired
    assert not token_valid(record, 4321, 999.0)                      # minted in the future: a clock gone back
    assert not token_valid(None, 4321, 1000.0) and not token_valid({**record, "token": ""}, 4321, 1000.0)
    assert not token_valid({**record, "minted": "x"}, 4321, 1000.0)


def test_a_new_port_or_a_spent_token_mints_a_new_token_and_old_urls_get_403(pai_home):
    """Another local user who binds the port of an old URL must not receive a token
    that still opens the logs: a server on another port has a new token; a token past
    its days is replaced (the server with it); an old URL gets a 403 that says why."""
    from paicli.web import launch

    first = launch.ensure_server(pai_home)
    launch.stop_server(pai_home)
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taken.bind(("127.0.0.1", first["port"]))
    taken.listen(1)
    try:
        moved = launch.ensure_server(pai_home)
        assert moved["port"] != first["port"] and moved["token"] != first["token"]
        old = launch.url_for({**first, "port": moved["port"]})
        code, body, _ = get(old)
        assert code == 403 and "pai logview" in body and "expired" in body
        assert get(launch.url_for(moved))[0] == 200
        # its days are over (as if minted long ago): the next command replaces the server and the token
        path = pai_home / "logview" / "token"
        record = json.loads(path.read_text())
        path.write_text(json.dumps({**record, "minted": record["minted"] - launch.TOKEN_SECONDS}))
        fresh = launch.ensure_server(pai_home)
        assert fresh["token"] != moved["token"] and fresh["pid"] != moved["pid"]
        assert get(launch.url_for({**moved, "port": fresh["port"]}))[0] == 403
        assert get(launch.url_for(fresh))[0] == 200
    finally:
        taken.close()
        launch.stop_server(pai_home)


def test_a_running_server_refuses_its_token_once_spent(tmp_path):
    """A server that outlives its token's days (an open page keeps it up) answers 403."""
    import asyncio
    import threading
    import time

    pytest.importorskip("aiohttp")
    from aiohttp import web

    from paicli.web import server

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(server.make_app(tmp_path, "tok", expires=time.time() - 1))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    port = runner.addresses[0][1]
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        code, body, _ = get(f"http://127.0.0.1:{port}/logview/?token=tok")
        assert code == 403 and "expired" in body
    finally:
        loop.call_soon_threadsafe(loop.stop)


def test_a_slow_store_read_does_not_hold_up_another_request(tmp_path, monkeypatch, store_kind):
    """The handlers read SQLite off the event loop: while one request's read is
    stuck, a second request (another read of the store) is answered."""
    import asyncio
    import threading

    from aiohttp import web

    from paicli.store import Store
    from paicli.web import data, server

    Store(tmp_path).create_job("j1", name="n", framework="python", project=None, task_name="T", job_dir=tmp_path,
                               roles=[{"name": "worker", "count": 1, "must_finish": True}])
    release, entered = threading.Event(), threading.Event()
    real = data.job_list

    def job_list(store, *args):
        if not entered.is_set():      # the first read hangs until the second request is answered
            entered.set()
            release.wait(60)
        return real(store, *args)

    monkeypatch.setattr(data, "job_list", job_list)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(server.make_app(tmp_path, "tok"))
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    slow: list = []
    first = threading.Thread(target=lambda: slow.append(get(f"http://127.0.0.1:{port}/api/jobs.json?token=tok")))
    try:
        first.start()
        assert entered.wait(30), "the first request never reached the store"
        # The loop is free: a second read is answered while the first one hangs.
        code, body, _ = get(f"http://127.0.0.1:{port}/api/jobs/j1.json?token=tok")
        assert code == 200 and json.loads(body)["id"] == "j1"
        code, body, _ = get(f"http://127.0.0.1:{port}/api/jobs.json?token=tok")
        assert code == 200 and [job["id"] for job in json.loads(body)] == ["j1"]
        assert not slow   # still hanging: the answers above did not wait for it
    finally:
        release.set()
        first.join(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.run_until_complete(runner.cleanup())
        loop.run_until_complete(loop.shutdown_default_executor())   # its thread gone before the next test
        loop.close()
    assert slow and slow[0][0] == 200


def test_the_first_submit_of_a_home_starts_its_server_and_prints_its_url(pai_home, monkeypatch):
    """The token in the URL is 32 URL-safe characters, the one kept in the home."""
    import subprocess

    from paicli.web import launch

    monkeypatch.delenv("PAI_LOGVIEW", raising=False)   # the page, not the summary file
    script = Path(__file__).resolve().parent.parent / "examples" / "python" / "ps_worker.py"
    try:
        result = subprocess.run([sys.executable, "-m", "paicli", "-name", "python",
                                 f"-Dscript={script}", '-Dcluster={"ps":{"count":1},"worker":{"count":1}}',
                                 "-DuserDefinedParameters=--steps=1 --sleep=0"],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr[-2000:]
        assert "Log view: http://127.0.0.1:" in result.stdout   # the submit started the server
        token = json.loads((pai_home / "logview" / "token").read_text())["token"]
        assert re.fullmatch(r"[A-Za-z0-9_-]{32}", token), token
        assert f"token={token}" in result.stdout
    finally:
        launch.stop_server(pai_home)
