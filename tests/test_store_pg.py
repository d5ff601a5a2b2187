"""The team store on a real PostgreSQL (tests/pg.py): the server the tests start,
what the store does on it that SQLite has no counterpart for (schema versions
across clients, an unreachable database, users), and two Unix users at once."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import pg
from conftest import PAI, ROOT, job_id_from, pai, wait_until
from netns import module_cluster
from paicli.store import SCHEMA_VERSION, Store


def test_the_test_server_is_stopped_and_its_folder_removed_even_when_a_test_fails():
    ok, why = pg.can_run()
    if not ok:
        pytest.skip(why)
    with pytest.raises(RuntimeError):
        with pg.PostgresServer() as server:
            url = server.new_database()
            assert url.startswith("postgresql://pai@127.0.0.1:")
            raise RuntimeError("a failing test")
    assert not server.dir.exists()
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", server.port)) != 0


def test_an_unreachable_database_is_one_line_at_submit_and_nothing_starts(pai_home, tmp_path, monkeypatch):
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    monkeypatch.setenv("PAI_STORE", f"postgresql://pai@127.0.0.1:{pg.free_port()}/pai")
    done = pai("-name", "python", f"-Dscript={script}")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pai: error: PAI_STORE postgresql://pai@127.0.0.1:"), lines
    assert "cannot reach the database (Connection refused)" in lines[0] and "Traceback" not in done.stderr
    assert not list((pai_home / "jobs").iterdir()) if (pai_home / "jobs").exists() else True


def test_a_store_newer_than_the_client_is_refused_and_an_older_one_upgraded_only_on_request(pai_home, postgres,
                                                                                             monkeypatch):
    import psycopg

    url = postgres.new_database()
    monkeypatch.setenv("PAI_STORE", url)
    Store().close()
    with psycopg.connect(url, autocommit=True) as con:
        con.execute("UPDATE schema_version SET version = %s", (SCHEMA_VERSION + 1,))
    for args in (["list"], ["store", "upgrade"]):
        done = pai(*args)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert f"has schema version {SCHEMA_VERSION + 1}, newer than this pai knows ({SCHEMA_VERSION})" in done.stderr
    with psycopg.connect(url, autocommit=True) as con:   # an older store: as this one before jobs had users
        assert con.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION + 1,)]
        con.execute("UPDATE schema_version SET version = %s", (SCHEMA_VERSION - 1,))
        con.execute("ALTER TABLE jobs DROP COLUMN user_name")
    done = pai("list")
    assert done.returncode == 2 and "older than this pai's" in done.stderr and "`pai store upgrade`" in done.stderr
    done = pai("store", "upgrade")
    assert done.returncode == 0 and f"schema version {SCHEMA_VERSION}" in done.stdout, done.stderr
    assert pai("list").returncode == 0


def test_the_queue_and_jobs_tables_leave_room_for_new_row_versions_and_an_upgrade_gives_it_to_a_store(
        pai_home, postgres, monkeypatch):
    """A turn rewrites every waiting job's line: PostgreSQL keeps a row's new version on
    its page (no index entry, pruned as the page is read) only where the page has room."""
    import psycopg

    url = postgres.new_database()
    monkeypatch.setenv("PAI_STORE", url)
    Store().close()

    def fill() -> dict[str, str]:
        with psycopg.connect(url) as con:
            return dict(con.execute("SELECT relname, array_to_string(reloptions, ',') FROM pg_class"
                                    " WHERE relname IN ('queue', 'jobs')").fetchall())

    assert fill() == {"queue": "fillfactor=50", "jobs": "fillfactor=70"}
    with psycopg.connect(url, autocommit=True) as con:   # a store of this version made without it
        con.execute("ALTER TABLE queue RESET (fillfactor)")
        con.execute("ALTER TABLE jobs RESET (fillfactor)")
    assert pai("list").returncode == 0 and fill() == {"queue": None, "jobs": None}   # a version alike: as it is
    done = pai("store", "upgrade")
    assert done.returncode == 0 and f"schema version {SCHEMA_VERSION}" in done.stdout, done.stderr
    assert fill() == {"queue": "fillfactor=50", "jobs": "fillfactor=70"}


@pytest.fixture
def team(postgres):
    """Two Unix users, each with a database role of their name in the role `team`,
    sharing one store (created, and its tables granted to the team, by the owner)."""
    import psycopg

    ok = os.geteuid() == 0 and shutil.which("useradd")
    if not ok:
        pytest.skip("two Unix users need root and useradd")
    url = postgres.new_database()
    base = Path(tempfile.mkdtemp(prefix="pai-team-"))   # pytest's tmp_path: only root may enter it
    base.chmod(0o755)
    users = []
    try:
        with psycopg.connect(url, autocommit=True) as con:
            con.execute("DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'team')"
                        " THEN CREATE ROLE team; END IF; END $$")
        for name in ("pai-alice", "pai-bob"):
            users.append(pg.UnixUser(name, base))
            with psycopg.connect(url, autocommit=True) as con:
                con.execute(f'DROP ROLE IF EXISTS "{name}"')
                con.execute(f'CREATE ROLE "{name}" LOGIN IN ROLE team')
        env = {"PAI_STORE": url}
        subprocess.run([*PAI, "store", "upgrade"], env={**os.environ, **env}, check=True, capture_output=True)
        with psycopg.connect(url, autocommit=True) as con:
            con.execute("GRANT ALL ON ALL TABLES IN SCHEMA public TO team")
            con.execute("GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO team")
        yield url, users, base
    finally:
        for user in users:
            user.close()
        shutil.rmtree(base, ignore_errors=True)


team_cluster = module_cluster(2, "ptm", 230, name="team_cluster")


def test_each_user_lists_their_own_jobs_all_lists_the_teams_and_only_owners_or_admins_act(team):
    url, (alice, bob), base = team
    script = base / "hello.py"
    script.write_text("print('hello')\n")
    script.chmod(0o644)
    ids = {}
    for user, project in ((alice, "vision"), (bob, "speech")):
        done = user.run("-name", "python", f"-Dscript={script}", f"-project={project}",
                        env={"PAI_STORE": url.replace("//pai@", f"//{user.name}@")})
        assert done.returncode == 0, done.stderr
        ids[user.name] = job_id_from(done.stdout)
    as_alice = {"PAI_STORE": url.replace("//pai@", "//pai-alice@")}
    mine = alice.run("list", "--json", env=as_alice)
    assert [job["id"] for job in json.loads(mine.stdout)] == [ids["pai-alice"]]
    everyone = alice.run("list", "--all", env=as_alice)
    assert everyone.returncode == 0, everyone.stderr
    rows = {line.split()[3]: line.split()[:3] for line in everyone.stdout.splitlines()[1:]}
    assert rows == {ids["pai-alice"]: ["pai-alice", "vision", "Succeeded"],
                    ids["pai-bob"]: ["pai-bob", "speech", "Succeeded"]}
    for args in (["kill", ids["pai-bob"]], ["resume", ids["pai-bob"]], ["get", ids["pai-bob"]]):
        done = alice.run(*args, env=as_alice)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert f"{ids['pai-bob']} is pai-bob's job: you may not" in done.stderr
    quota = base / "quota.yaml"
    quota.write_text("admins: [pai-alice]\n")
    quota.chmod(0o644)
    assert alice.run("kill", ids["pai-bob"], env={**as_alice, "PAI_QUOTA": str(quota)}).returncode == 2  # the store's
    assert alice.run("quota", "set", "--file", str(quota), env=as_alice).returncode == 0
    done = alice.run("kill", ids["pai-bob"], env=as_alice)
    assert done.returncode == 0 and "had already ended (Succeeded)" in done.stdout, done.stderr


def test_the_nodes_files_store_selects_the_team_store_and_pai_store_wins(pai_home, postgres, monkeypatch):
    url = postgres.new_database()
    monkeypatch.setenv("PAI_STORE", url)
    Store().create_job("20261203000000000team001", name="shared", framework="python", project="vision",
                       task_name="T", job_dir=pai_home / "jobs" / "x", roles=[])
    monkeypatch.delenv("PAI_STORE")
    nodes = pai_home / "nodes.yaml"
    nodes.write_text(f"store: {url}\nnodes: [{{name: h1, host: 127.0.0.1}}]\n")
    listed = pai("list", "--all", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [job["id"] for job in json.loads(listed.stdout)] == ["20261203000000000team001"]
    assert json.loads(pai("list", "--all", "--json", env={"PAI_STORE": postgres.new_database()}).stdout) == []
    nodes.write_text("store: sqlite:///x.db\nnodes: [{name: h1, host: 127.0.0.1}]\n")
    done = pai("list")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"nodes file {nodes}: key 'store': expected a PostgreSQL URL, got 'sqlite:///x.db'" in done.stderr


def test_a_job_whose_master_runs_on_another_machine_is_never_judged_by_this_ones_process_table(pai_home, postgres,
                                                                                             monkeypatch):
    """Another machine's pid means nothing here: its job is neither recorded lost,
    nor revived, nor stripped of what it holds by this machine's pai."""
    import subprocess as sp

    from paicli.cluster import lifecycle
    from paicli.jobstatus import read_job
    from paicli.states import JobStatus

    monkeypatch.setenv("PAI_STORE", postgres.new_database())
    store = Store()
    gone = sp.Popen(["true"])
    gone.wait()
    for job_id, host in (("20261203000000000there01", "elsewhere"), ("20261203000000000here001", None)):
        store.create_job(job_id, name="j", framework="python", project=None, task_name="T",
                         job_dir=pai_home / "jobs" / job_id, roles=[])
        store.set_job(job_id, JobStatus.RUNNING, master_pid=gone.pid, master_start="1",
                      **({"master_host": host} if host else {}))
    assert lifecycle.sweep_lost(store, report=lambda line: None) == ["20261203000000000here001"]
    assert read_job(store, "20261203000000000there01")["status"] == "Running"


def test_two_users_twenty_jobs_each_against_four_cards_never_hold_more_than_four(team, monkeypatch):
    """Each user's process queues 20 one-card jobs at once and plays their masters;
    the claims and turns of both, in one serialised transaction each, never give
    a card twice: no two spans on one card overlap, at most 4 at any instant."""
    url, users, base = team
    script = base / "team_jobs.py"
    shutil.copy(ROOT / "tests" / "scripts" / "team_jobs.py", script)
    script.chmod(0o644)
    procs = [subprocess.Popen(user.argv(str(script), "20", env={"PAI_STORE": url.replace("//pai@", f"//{user.name}@")}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for user in users]
    outs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err for _, err in outs]
    spans = [(user.name, *span) for user, (out, _) in zip(users, outs) for span in json.loads(out)]
    assert len(spans) == 40
    cards = [(who, job, (node, card), start, end) for who, job, node, gpus, start, end in spans for card in gpus]
    for i, a in enumerate(cards):
        for b in cards[i + 1:]:
            assert not (a[2] == b[2] and a[3] < b[4] and b[3] < a[4]), f"{a} and {b} held one card at once"
    most = max(sum(1 for c in cards if c[3] <= t < c[4]) for t in (c[3] for c in cards))
    assert most <= 4
    # The two users' jobs did run side by side: the claims were contended across them.
    assert any(a[0] != b[0] and a[3] < b[4] and b[3] < a[4] for a in cards for b in cards)
    monkeypatch.setenv("PAI_STORE", url)
    store = Store(base / "root-home")
    assert [job["status"] for job in store.jobs(100)] == ["Succeeded"] * 40
    store.close()


def test_quotas_live_in_the_team_store_set_by_its_admins_and_hold_every_users_jobs(team, monkeypatch):
    url, (alice, bob), base = team
    as_ = {user.name: {"PAI_STORE": url.replace("//pai@", f"//{user.name}@")} for user in (alice, bob)}
    quota = base / "quota.yaml"
    quota.write_text("admins: [pai-alice]\nvision: {gpu: 100}\n")
    quota.chmod(0o644)
    done = alice.run("quota", "set", "--file", str(quota), env=as_["pai-alice"])   # no admins yet: anyone may
    assert done.returncode == 0 and done.stdout.strip() == "quotas set: vision; admins: pai-alice", done.stderr
    done = bob.run("quota", "set", "vision", "gpu=300", env=as_["pai-bob"])
    assert done.returncode == 2 and done.stderr.strip() == \
        "pai: error: only an admin may set quotas (pai-alice); ask one of them, or `pai quota show`"
    done = alice.run("quota", "set", "speech", "cpu=800", "gpu=x", env=as_["pai-alice"])
    assert done.returncode == 2 and "'gpu=x': expected KEY=NUMBER" in done.stderr
    assert alice.run("quota", "set", "speech", "cpu=800", env=as_["pai-alice"]).returncode == 0
    shown = json.loads(bob.run("quota", "show", "--json", env=as_["pai-bob"]).stdout)
    assert shown == {"quotas": {"speech": {"cpu": 800}, "vision": {"gpu": 100}}, "admins": ["pai-alice"]}
    # Whoever's jobs they are, the project's: the second one-card vision job waits, naming it.
    from test_queue import nodes, record

    from paicli.cluster import queue_turns

    monkeypatch.setenv("PAI_STORE", url)
    monkeypatch.delenv("PAI_QUOTA", raising=False)
    store = Store(base / "root-home")
    two_cards = nodes((400, 8000, 0), (400, 8000, 2))
    record(store, "2026a", two_cards, project="vision", worker=(1, 100, 0, 100))
    record(store, "2026b", two_cards, project="vision", worker=(1, 100, 0, 0))
    queue_turns.dispatch(store)
    assert store.take_turn("2026a") and store.take_turn("2026b")   # b needs no card
    record(store, "2026c", two_cards, project="vision", worker=(1, 100, 0, 100))
    queue_turns.dispatch(store)
    assert store.take_turn("2026c") is None
    assert "project vision over its quota: holds gpu 100 of 100" in store.job("2026c")["reason"]
    store.close()


def test_a_grant_by_another_users_dispatch_wakes_the_waiter_through_listen_notify(team, monkeypatch):
    """No signal crosses users (or machines): the waiter of bob's job listens on the
    store, and alice's dispatch that grants it notifies it."""
    import threading

    from test_queue import TWO, record

    url, (alice, bob), base = team
    monkeypatch.delenv("PAI_QUOTA", raising=False)
    monkeypatch.setenv("PAI_STORE", url)
    store = Store(base / "root-home")
    record(store, "2026bob", TWO, worker=(1, 100, 0, 100))
    woken = threading.Event()
    stop = store.listen_turns("2026bob", woken.set)
    try:
        script = base / "dispatch.py"
        script.write_text("from paicli.cluster import queue_turns\nfrom paicli.store import Store\n"
                          "queue_turns.dispatch(Store())\n")
        script.chmod(0o644)
        done = subprocess.run(alice.argv(str(script), env={"PAI_STORE": url.replace("//pai@", "//pai-alice@")}),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert woken.wait(30)
        assert store.queue_entry("2026bob")["state"] == "granted"
    finally:
        stop()
    store.close()


def test_what_another_machines_job_holds_is_freed_once_its_master_stops_renewing_its_lease(pai_home, postgres,
                                                                                          monkeypatch):
    """kill -9 of a master on another machine: nothing here can see its pid; its
    lease lapses, and the card it held goes to the next job."""
    import subprocess as sp

    from test_queue import TWO, record

    from paicli.cluster import queue_turns
    from paicli.states import JobStatus
    from paicli.store import LEASE

    monkeypatch.delenv("PAI_QUOTA", raising=False)
    monkeypatch.setenv("PAI_STORE", postgres.new_database())
    store = Store()
    record(store, "2026there", TWO, worker=(1, 100, 0, 100))
    queue_turns.dispatch(store)
    assert store.take_turn("2026there")
    gone = sp.Popen(["true"])
    gone.wait()
    store.set_job("2026there", JobStatus.RUNNING, master_pid=gone.pid, master_start="1", master_host="elsewhere")
    store.renew_lease("2026there")
    record(store, "2026next", TWO, worker=(1, 100, 0, 100))
    queue_turns.dispatch(store)
    assert store.take_turn("2026next") is None   # its lease holds: alive, whatever this machine's pid says
    store.update_job("2026there", lease=time.time() - LEASE - 1)
    queue_turns.dispatch(store)
    assert json.loads(store.take_turn("2026next"))[0]["gpus"] == ["0"]
    store.close()


def test_jobs_run_on_through_an_outage_of_the_store_and_it_catches_up_after(pai_home, tmp_path, monkeypatch):
    """PostgreSQL stopped for 30 s while 5 jobs run (they end meanwhile): they all
    succeed, their masters' writes reach the store once it is back."""

    ok, why = pg.can_run()
    if not ok:
        pytest.skip(why)
    script = tmp_path / "steps.py"
    script.write_text("import time\nfor i in range(8):\n    print('step', i, flush=True)\n    time.sleep(1)\n")
    with pg.PostgresServer() as server:
        monkeypatch.setenv("PAI_STORE", server.new_database())
        ids = []
        for _ in range(5):
            done = pai("--detach", "-name", "python", f"-Dscript={script}",
                       '-Dcluster={"worker":{"count":1,"cpu":10}}')
            assert done.returncode == 0, done.stderr
            ids.append(done.stdout.split()[0])
        assert wait_until(lambda: {j["status"] for j in json.loads(pai("list", "--json").stdout)} == {"Running"}, 60)
        server.stop()
        time.sleep(30)
        server.start()
        ended = wait_until(lambda: (lambda jobs: jobs if all(j["status"] not in ("Waiting", "Running") for j in jobs)
                                    else None)(json.loads(pai("list", "--all", "--json").stdout)), 120, 1.0)
        assert ended and sorted(j["id"] for j in ended) == sorted(ids)
        assert {j["status"] for j in ended} == {"Succeeded"}, [(j["id"], j["status"], j["reason"]) for j in ended]


def test_a_store_lost_for_longer_than_the_jobs_timeout_ends_the_job_and_the_end_is_recorded_after(pai_home,
                                                                                                    tmp_path,
                                                                                                    monkeypatch):
    """A job's master waits for a lost store as long as the job's -Dtimeout (else
    STORE_WAIT, docs/team.md): past it, it stops the job's instances through the one
    stop path while the store is still away, says so in job.log naming the store,
    and records the job Failed for that reason once the store is back."""
    import signal

    from conftest import kill_groups, processes_in

    ok, why = pg.can_run()
    if not ok:
        pytest.skip(why)
    script = tmp_path / "long.py"
    script.write_text("import time\nfor i in range(600):\n    print('step', i, flush=True)\n    time.sleep(1)\n")
    master, groups, passed = None, set(), False
    with pg.PostgresServer() as server:
        url = server.new_database()
        monkeypatch.setenv("PAI_STORE", url)
        try:
            done = pai("--detach", "-name", "python", f"-Dscript={script}", "-Dtimeout=20")
            assert done.returncode == 0, done.stderr
            job_id = done.stdout.split()[0]
            store = Store()
            assert wait_until(lambda: store.instances(job_id)[0]["status"] == "Running", 60)
            master, groups = store.job(job_id)["master_pid"], {store.instances(job_id)[0]["pgid"]}
            store.close()
            server.stop()
            lost = f"the job store {url} could not be reached for 20s"
            log = pai_home / "jobs" / job_id / "job.log"
            assert wait_until(lambda: f"{lost}: the job ends" in log.read_text(), 120, 0.5), log.read_text()
            assert wait_until(lambda: processes_in(groups) == [], 30), processes_in(groups)
            server.start()
            store = Store()
            assert wait_until(lambda: store.job(job_id)["ended"], 60, 0.5), dict(store.job(job_id))
            assert (store.job(job_id)["status"], store.job(job_id)["reason"]) == ("Failed", lost)
            store.close()
            passed = True
        finally:
            if master and not passed:   # a master that waits on for the store would keep its job for an hour
                with contextlib.suppress(ProcessLookupError):
                    os.kill(master, signal.SIGKILL)
                kill_groups(groups)


def submit_gated(team, ids: dict) -> dict:
    """Each team user's job asking for every core of this machine, ending once its gate
    file `open-USER` is in the team's folder; their IDs go into `ids` as they are
    submitted (a failing test still opens each gate). Each user's environment."""
    from paicli.cluster.scheduler import machine_cpu

    url, users, base = team
    gate = base / "gate.py"
    shutil.copy(ROOT / "tests" / "scripts" / "gate.py", gate)
    gate.chmod(0o644)
    whole = '-Dcluster={"worker":{"count":1,"cpu":%d}}' % machine_cpu()
    env = {user.name: {"PAI_STORE": url.replace("//pai@", f"//{user.name}@")} for user in users}
    for user in users:
        done = user.run("--detach", "-name", "python", f"-Dscript={gate}",
                        f"-DuserDefinedParameters={base / ('open-' + user.name)}", whole, env=env[user.name])
        assert done.returncode == 0, done.stderr
        ids[user.name] = done.stdout.split()[0]
    return env


def test_two_users_real_jobs_wait_in_one_queue_and_the_next_starts_when_the_others_ends(team):
    """Real masters of two Unix users on this machine: bob's job waits for the cores
    alice's holds, saying so, and starts once hers ends (no signal of hers may reach
    his master: his turn comes by the store's notification, or his own look)."""
    _url, (alice, bob), base = team
    ids = {}

    def state(user, job_id):
        return json.loads(user.run("status", job_id, "--json", env=env[user.name]).stdout)

    try:
        env = submit_gated(team, ids)
        assert wait_until(lambda: state(alice, ids["pai-alice"])["status"] == "Running", 60)
        waiting = wait_until(lambda: (lambda s: s if "held by" in (s["reason"] or "") else None)(
            state(bob, ids["pai-bob"])), 60)
        assert waiting and waiting["status"] == "Waiting" and ids["pai-alice"] in waiting["reason"], waiting
        queued = json.loads(bob.run("queue", "--json", env=env["pai-bob"]).stdout)
        assert [q["id"] for q in queued] == [ids["pai-bob"]]
        (base / "open-pai-alice").touch()
        assert wait_until(lambda: state(bob, ids["pai-bob"])["status"] == "Running", 60)
        (base / "open-pai-bob").touch()
        assert wait_until(lambda: state(bob, ids["pai-bob"])["status"] == "Succeeded", 60)
        assert state(alice, ids["pai-alice"])["status"] == "Succeeded"
    finally:
        for name in ids:
            (base / f"open-{name}").touch()


def test_a_waiting_job_holds_one_connection_to_the_team_store(pai_home, tmp_path, postgres, monkeypatch):
    """Its master listens for its turn on the connection it reads the store with:
    N waiting jobs hold N connections (max_connections bounds the queue by that)."""
    import psycopg

    from paicli.cluster.scheduler import machine_cpu

    url = postgres.new_database()
    monkeypatch.setenv("PAI_STORE", url)
    monkeypatch.delenv("PAI_QUOTA", raising=False)
    gate = tmp_path / "gate.py"
    shutil.copy(ROOT / "tests" / "scripts" / "gate.py", gate)
    whole = '-Dcluster={"worker":{"count":1,"cpu":%d}}' % machine_cpu()

    def submit(env=None):
        done = pai("--detach", "-name", "python", f"-Dscript={gate}", f"-DuserDefinedParameters={tmp_path / 'open'}",
                   whole, env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()[0]

    def jobs():
        return {j["id"]: j for j in json.loads(pai("list", "--json").stdout)}

    def connections(con):   # of the waiting jobs' processes: libpq names them by PGAPPNAME
        return con.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database()"
                           " AND application_name = 'pai-waiting'").fetchone()[0]

    ids = []
    with psycopg.connect(url, autocommit=True) as con:
        try:
            ids.append(submit())
            assert wait_until(lambda: jobs()[ids[0]]["status"] == "Running", 60)
            ids += [submit({"PGAPPNAME": "pai-waiting"}) for _ in range(5)]
            # Each has said why it waits: it listens for its turn since before that.
            assert wait_until(lambda: all(jobs()[i]["status"] == "Waiting" and jobs()[i]["reason"] for i in ids[1:]),
                              60)
            assert wait_until(lambda: connections(con) == 5, 30), connections(con)
        except BaseException:
            for job_id in ids:   # no job outlives a failed test (they would wait for a store that goes)
                pai("kill", job_id)
            raise
        finally:
            (tmp_path / "open").touch()
        assert wait_until(lambda: {j["status"] for j in jobs().values()} == {"Succeeded"}, 120), jobs()


def test_three_users_real_jobs_on_ssh_hosts_share_four_cards_by_priority_and_quota(team, team_cluster):
    """Real masters of three Unix users, one-card jobs on two SSH hosts of two
    declared cards each. While 4 gate jobs hold the cards, alice and bob queue 6
    jobs each (priorities rising as they submit) and carol one job of project
    vision, whose quota is one card and whose gate job holds it. Then the gates
    open: never more than 4 cards claimed, every job ends, a higher-priority job
    never starts after a lower one ended, carol's waits naming its project until
    her gate job ends."""
    import psycopg

    from paicli.runners.runtimes import runtime_root

    url, (alice, bob), base = team
    gates = Path(tempfile.mkdtemp(prefix="pai-team-gates-", dir="/var/tmp"))   # the hosts' /tmp is their own
    gates.chmod(0o755)
    carol = None
    try:
        carol = pg.UnixUser("pai-carol", base)
        with psycopg.connect(url, autocommit=True) as con:
            con.execute('DROP ROLE IF EXISTS "pai-carol"')
            con.execute('CREATE ROLE "pai-carol" LOGIN IN ROLE team')
        users = {u.name: u for u in (alice, bob, carol)}
        env, folder = {}, {}
        for name, user in users.items():
            folder[name] = user.home / "proj"
            folder[name].mkdir()
            shutil.copy(ROOT / "tests" / "scripts" / "gate.py", folder[name] / "gate.py")
            (folder[name] / "short.py").write_text("import time\ntime.sleep(1)\n")
            for key in ("client_key", "known_hosts"):   # the cluster's key, each user's own copy
                shutil.copy(getattr(team_cluster, key), user.home / key)
            nodes = {"known_hosts": str(user.home / "known_hosts"),
                     "nodes": [{**n, "key": str(user.home / "client_key"), "cpu": 400, "gpu": 2,
                                "runtime_dir": str(runtime_root())} for n in team_cluster.nodes()]}
            (user.home / "nodes.yaml").write_text(json.dumps(nodes))
            subprocess.run(["chown", "-R", name, str(user.home)], check=True)
            env[name] = {"PAI_STORE": url.replace("//pai@", f"//{name}@"), "PAI_NODES": str(user.home / "nodes.yaml")}

        def submit(name, *args):
            done = subprocess.run(users[name].argv("-m", "paicli", "--detach", "-name", "python", *args,
                                                   '-Dcluster={"worker":{"count":1,"gpu":100}}', env=env[name]),
                                  capture_output=True, text=True, timeout=120, cwd=folder[name])
            assert done.returncode == 0, done.stdout + done.stderr
            return done.stdout.split()[0]

        done = alice.run("quota", "set", "vision", "gpu=100", env=env["pai-alice"])
        assert done.returncode == 0, done.stderr
        gate_ids = {submit(name, "-Dscript=gate.py", f"-DuserDefinedParameters={gates / name}",
                           *(["-project=vision"] if name == "pai-carol" else []))
                    for name in ("pai-alice", "pai-alice", "pai-bob", "pai-carol")}
        store = psycopg.connect(url, autocommit=True)

        def statuses():
            return dict(store.execute("SELECT id, status FROM jobs").fetchall())

        def cards_held():
            return store.execute("SELECT COUNT(*) FROM claims c JOIN jobs j ON j.id = c.job_id"
                                 " WHERE c.kind = 'gpu' AND j.status IN ('Waiting', 'Running')").fetchone()[0]

        assert wait_until(lambda: all(statuses().get(i) == "Running" for i in gate_ids), 120), statuses()
        priority = {}
        for n in range(6):
            for name, p in (("pai-alice", 2 * n + 1), ("pai-bob", 2 * n + 2)):
                priority[submit(name, "-Dscript=short.py", f"-Dpriority={p}")] = p
        over = submit("pai-carol", "-Dscript=short.py", "-project=vision", "-Dpriority=99")
        line = lambda: store.execute("SELECT reason FROM jobs WHERE id = %s", (over,)).fetchone()[0] or ""
        assert wait_until(lambda: "project vision over its quota" in line(), 60), line()
        for name in ("pai-alice", "pai-bob"):
            (gates / name).touch()
        most, deadline = 0, time.monotonic() + 300
        while not all(statuses()[i] in ("Succeeded", "Failed", "Cancelled") for i in priority):
            most = max(most, cards_held())
            assert statuses()[over] == "Waiting" and time.monotonic() < deadline, statuses()
            time.sleep(0.1)
        assert 0 < most <= 4 and statuses()[over] == "Waiting" and "project vision over its quota" in line()
        (gates / "pai-carol").touch()
        assert wait_until(lambda: set(statuses().values()) == {"Succeeded"}, 120), statuses()
        times = {i: store.execute("SELECT started, ended FROM jobs WHERE id = %s", (i,)).fetchone() for i in priority}
        for a in priority:
            for b in priority:
                assert not (priority[a] > priority[b] and times[a][0] > times[b][1]), \
                    f"priority {priority[a]} started after priority {priority[b]} ended"
        store.close()
    finally:
        if carol is not None:
            carol.close()
        for name in ("pai-alice", "pai-bob", "pai-carol"):
            (gates / name).touch()
        shutil.rmtree(gates, ignore_errors=True)


def test_kill_9_of_a_real_master_frees_what_it_held_and_the_next_users_job_starts(team):
    """alice's job holds every core; bob's waits for them. SIGKILL of alice's master
    (its pid from the store) as soon as her job runs: what it held is freed (its pid is
    gone, and its lease lapses after LEASE), bob's master, at the head, runs the policy
    again and starts, and alice's job is recorded Failed by its watchdog (bob's
    job's sweep of lost jobs is of bob's alone)."""
    import signal

    import psycopg

    from paicli.store import LEASE

    url, (alice, bob), base = team
    ids = {}
    store = psycopg.connect(url, autocommit=True)

    def job(job_id):
        return store.execute("SELECT status, master_pid, reason FROM jobs WHERE id = %s", (job_id,)).fetchone()

    try:
        submit_gated(team, ids)
        assert wait_until(lambda: job(ids["pai-alice"])[0] == "Running", 60)
        reason = lambda: store.execute("SELECT reason FROM jobs WHERE id = %s", (ids["pai-bob"],)).fetchone()[0] or ""
        assert wait_until(lambda: f"held by {ids['pai-alice']}" in reason(), 60), reason()
        assert job(ids["pai-bob"])[0] == "Waiting"
        os.kill(job(ids["pai-alice"])[1], signal.SIGKILL)
        assert wait_until(lambda: job(ids["pai-alice"])[0] != "Running", 30, 0.5), job(ids["pai-alice"])
        assert job(ids["pai-alice"])[::2] == ("Failed", "master lost")
        assert wait_until(lambda: job(ids["pai-bob"])[0] == "Running", LEASE + 60, 0.5), job(ids["pai-bob"])
        (base / "open-pai-bob").touch()
        assert wait_until(lambda: job(ids["pai-bob"])[0] == "Succeeded", 60)
    finally:
        for name in ("pai-alice", "pai-bob"):
            (base / f"open-{name}").touch()
        store.close()
