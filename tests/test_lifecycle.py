"""Issue 16: the CLI reads, the lifecycle module writes. Reading a job never
writes the store or signals anything; `pai kill` ends any job; no signal goes to
an identity that cannot be verified."""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from paicli.cluster.backends import write_snapshot
from paicli.cluster import procinfo
from paicli.cluster.procinfo import is_alive, proc_stat, start_time
from paicli.store import Store, new_job_id

from conftest import BEHAVE, PAI, ROOT, kill_groups, pai, pai_json, processes_in, wait_until

QUIET = {"PAI_LOGVIEW": "file"}  # no logview server started by the commands under test


def sleeper() -> subprocess.Popen:
    """A process that is not any job's: it must survive every test here."""
    return subprocess.Popen(["sleep", "600"], start_new_session=True)


def end(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def dead_identity() -> tuple[int, str]:
    """A pid and start time of a process that has ended (a master that died)."""
    proc = sleeper()
    start = start_time(proc.pid)
    end(proc)
    return proc.pid, start


def record_job(home: Path, *, master: tuple[int, str | None] | None, snapshot: dict | None = None,
               refs: list[dict] = (), created: float | None = None) -> str:
    """A job in the store as a master would have left it: Running, its worker
    Running with the given instance identities recorded as attempts."""
    store = Store(home)
    job_id = new_job_id()
    job_dir = store.jobs_dir / job_id
    job_dir.mkdir(parents=True)
    store.create_job(job_id, name="n", framework="python", project=None, task_name="T", job_dir=job_dir,
                     roles=[{"name": "worker", "count": 1, "must_finish": True}])
    write_snapshot(job_dir, snapshot or {"backend": "local"})
    if created is not None:
        store.update_job(job_id, created=created)
    if master is not None:
        from paicli.states import InstanceStatus, JobStatus

        store.update_job(job_id, master_pid=master[0], master_start=master[1])
        store.set_job(job_id, JobStatus.RUNNING)
        store.set_instance(job_id, "worker", 0, InstanceStatus.RUNNING)
        for attempt, ref in enumerate(refs):
            store.record_attempt(job_id, "worker", 0, attempt, pid=ref["pid"], pgid=ref["pgid"],
                                 ref=json.dumps(ref))
    store.close()
    return job_id


def dump(home: Path) -> list[str]:
    """The store's whole content, to see that nothing was written."""
    store = Store(home)
    try:
        return list(store.db.iterdump())
    finally:
        store.close()


# -- identity: no signal without a verified one -------------------------------------------


def test_a_pid_without_a_start_time_is_never_taken_for_alive_nor_signalled():
    proc = sleeper()
    try:
        start = start_time(proc.pid)
        assert is_alive(proc.pid, start)
        assert not is_alive(proc.pid, None)
        with pytest.raises(procinfo.Unverified, match=f"pid {proc.pid} has no recorded start time"):
            procinfo.signal_verified(proc.pid, None, signal.SIGTERM)
        assert not procinfo.signal_verified(proc.pid, str(int(start) - 7), signal.SIGTERM)  # a recycled pid
        time.sleep(0.2)
        assert proc.poll() is None
        assert procinfo.signal_verified(proc.pid, start, signal.SIGTERM)
        assert proc.wait(timeout=10) == -signal.SIGTERM
        assert not procinfo.signal_verified(proc.pid, start, signal.SIGTERM)  # gone: nothing sent, no error
    finally:
        end(proc)


def test_pai_kill_never_signals_a_master_whose_start_time_is_unknown(pai_home):
    """The defect: client.kill took `is_alive(pid, None)` for a live master and sent
    SIGTERM to whatever process has that pid now."""
    stranger = sleeper()
    try:
        job_id = record_job(pai_home, master=(stranger.pid, None))
        result = pai("kill", job_id, env=QUIET)
        assert result.returncode == 0, result.stderr
        assert f"{job_id}: master lost; recorded, and what it left is stopped" in result.stderr
        time.sleep(0.3)
        assert stranger.poll() is None, "pai kill signalled a pid it could not verify"
        status = pai_json("status", job_id, env=QUIET)
        assert (status["status"], status["reason"], status["unrecorded"]) == ("Failed", "master lost", False)
    finally:
        end(stranger)


def test_stop_server_leaves_a_pid_it_cannot_verify_alone_and_says_so(pai_home):
    from paicli.errors import PaiError
    from paicli.web import launch

    stranger = sleeper()
    try:
        folder = launch.state_dir(pai_home)
        (folder / "server.json").write_text(json.dumps({"pid": stranger.pid, "host": "127.0.0.1", "port": 1,
                                                        "token": "t"}))
        with pytest.raises(PaiError) as err:
            launch.stop_server(pai_home)
        assert "no recorded start time" in str(err.value) and "\n" not in str(err.value)
        assert launch.running_server(pai_home) is None  # nor is it taken for our server
        time.sleep(0.2)
        assert stranger.poll() is None
    finally:
        end(stranger)
    # Once that pid names nothing there is nothing to mistake: "not running".
    assert launch.stop_server(pai_home) is False


def test_stop_server_when_the_server_ends_between_the_check_and_the_signal(pai_home, monkeypatch):
    """The defect: os.kill raised ProcessLookupError out of `pai logview --stop`."""
    from paicli.web import launch

    pid, start = dead_identity()
    (launch.state_dir(pai_home) / "server.json").write_text(json.dumps({"pid": pid, "start": start,
                                                                        "host": "127.0.0.1", "port": 1}))
    # The check says alive (as it did a moment before the server exited).
    monkeypatch.setattr(procinfo, "is_alive", lambda pid, start: True)
    assert launch.stop_server(pai_home) is False
    assert not (pai_home / "logview" / "server.json").exists()


def test_a_master_recorded_before_this_boot_is_gone_whatever_its_pid_names_now(pai_home):
    """After a reboot a master's pid, and even its start time (ticks since boot),
    can name a new process: a job recorded before the boot has no live master."""
    stranger = sleeper()
    try:
        job_id = record_job(pai_home, master=(stranger.pid, start_time(stranger.pid)),
                            created=procinfo.boot_time() - 60)
        status = pai_json("status", job_id, env=QUIET)
        assert (status["status"], status["reason"], status["unrecorded"]) == ("Failed", "master lost", True)
        assert pai("kill", job_id, env=QUIET).returncode == 0
        time.sleep(0.2)
        assert stranger.poll() is None
    finally:
        end(stranger)


# -- reading never writes -----------------------------------------------------------------


def test_reading_a_job_whose_master_is_gone_derives_the_end_and_writes_nothing(pai_home):
    stranger = sleeper()
    try:
        ref = {"backend": "local", "node": "local", "host": "127.0.0.1", "pid": stranger.pid,
               "pgid": stranger.pid, "start": start_time(stranger.pid), "boot_id": None}
        job_id = record_job(pai_home, master=dead_identity(), refs=[ref])
        before = dump(pai_home)
        status = pai_json("status", job_id, env=QUIET)
        assert (status["status"], status["reason"], status["unrecorded"]) == ("Failed", "master lost", True)
        assert [i["status"] for i in status["instances"]] == ["Killed"]  # as its record will say
        text = pai("status", job_id, env=QUIET).stdout
        assert f"`pai kill {job_id}` stops what it left and records it" in text
        listed = {j["id"]: j for j in pai_json("list", env=QUIET)}
        assert (listed[job_id]["status"], listed[job_id]["reason"]) == ("Failed", "master lost")
        waited = pai("wait", job_id, env=QUIET, timeout=30)
        assert waited.returncode == 1 and waited.stdout.splitlines()[-1] == "FAILED: master lost"
        assert pai("logs", "-f", job_id, env=QUIET, timeout=30).returncode == 0
        assert dump(pai_home) == before
        assert stranger.poll() is None, "a reader signalled an instance"
    finally:
        end(stranger)


# Every command of `pai`, as a reader (given: the argv lists to run for a job ID, or
# for none) or as a writer. A new command must be placed here: the walk below fails
# until it is, so no read path escapes the test that follows.
READERS = {
    "status": lambda job: [["status", job], ["status", job, "--json"]],
    "logs": lambda job: [["logs", job], ["logs", job, "--json"]],
    "outputs": lambda job: [["outputs", job, "--json"]],
    "plot": lambda job: [["plot", job]],
    "wait": None,   # run below for the jobs shown ended: it follows the others until they end
    "list": [["list"], ["list", "--json"], ["list", "--all"]],
    "quota show": [["quota", "show"], ["quota", "show", "--json"]],
    "queue": [["queue"], ["queue", "--json"]],
    "tune list": [["tune", "list", "--json"]],
    "console": None,  # run below with read statements only
}
# Not readers of jobs: they submit, cancel, copy files out, start the logview
# server (`logview`), ask a master for more or fewer replicas (`serve scale`), or read no job at all.
WRITERS = {"submit", "run", "resume", "kill", "export", "params", "plan", "get", "logview", "nodes trust",
           "runtime install", "runtime list", "runtime remove", "tune start", "tune status", "tune stop",
           "store upgrade", "quota set", "serve start", "serve scale"}


def _leaf_commands() -> set[str]:
    import click

    from paicli.cli import cli

    found = set()

    def walk(command, path):
        if isinstance(command, click.Group):
            for name in command.list_commands(click.Context(command)):
                walk(command.get_command(click.Context(command), name), [*path, name])
        else:
            found.add(" ".join(path))

    walk(cli, [])
    return found


def _queued_job(home: Path, master: tuple[int, str] | None) -> str:
    """A job waiting in the queue as its supervisor left it (its turn not come)."""
    from paicli.cluster import queue_turns
    from paicli.cluster.backends.base import NodeSpec
    from paicli.jobplan import JobPlan, RolePlan

    job_id = record_job(home, master=None)
    store = Store(home)
    try:
        plan = JobPlan("j", "python", "T", [RolePlan("worker", 1, ["true"], cpu=100)])
        store.enqueue(job_id, 0, None, queue_turns.check_and_describe(
            store, plan, [NodeSpec("local", "127.0.0.1", 100, 1000)], 0, None))
        if master is not None:
            store.update_job(job_id, master_pid=master[0], master_start=master[1],
                             reason="waiting: 1st in queue; worker needs cpu 100, local has 0 free")
    finally:
        store.close()
    return job_id


def _processes_of(home: Path, but: set[int]) -> list[int]:
    """Processes started with this PAI_HOME (a master, a watchdog) other than `but`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in but:
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"PAI_HOME={home}".encode() in environ:
                found.append(int(entry))
    return found


def _files(home: Path) -> dict[str, int]:
    """Every file under PAI_HOME but the store's own, with its size (a master
    started even for a moment leaves its master.log)."""
    return {str(p.relative_to(home)): p.stat().st_size for p in home.rglob("*")
            if p.is_file() and not p.name.startswith("pai.db")}


def test_every_read_command_over_every_kind_of_job_writes_nothing_and_starts_nothing(pai_home, monkeypatch):
    """A store holding a job of each kind (queued with its supervisor gone, queued
    and supervised, running with its master gone, running, never started, ended):
    every read command over every job leaves the store row for row as it was, and
    starts no process (a queued job's supervisor is restarted by writers only:
    docs/decisions.md, "the CLI only reads")."""
    from paicli.states import JobStatus

    commands = _leaf_commands()
    assert not set(READERS) & WRITERS
    assert commands == set(READERS) | WRITERS, \
        f"place each command in READERS or WRITERS: {sorted(commands ^ (set(READERS) | WRITERS))}"
    monkeypatch.delenv("PAI_QUOTA", raising=False)
    stranger, alive = sleeper(), sleeper()
    mine = {stranger.pid, alive.pid}
    spawned: list[int] = []
    try:
        ref = {"backend": "local", "node": "local", "host": "127.0.0.1", "pid": stranger.pid,
               "pgid": stranger.pid, "start": start_time(stranger.pid), "boot_id": None}
        live = (alive.pid, start_time(alive.pid))
        jobs = {
            "queued, supervisor gone": _queued_job(pai_home, dead_identity()),
            "queued": _queued_job(pai_home, live),
            "running, master gone": record_job(pai_home, master=dead_identity(), refs=[ref]),
            "running": record_job(pai_home, master=live, refs=[ref]),
            "never started": record_job(pai_home, master=None, created=time.time() - 600),
            "ended": record_job(pai_home, master=dead_identity()),
        }
        store = Store(pai_home)
        store.set_job(jobs["ended"], JobStatus.SUCCEEDED)
        for job in jobs.values():   # what its master would have written
            (pai_home / "jobs" / job / "job.log").write_text(f"{job}: started\n")
            (pai_home / "jobs" / job / "logs").mkdir()
            (pai_home / "jobs" / job / "logs" / "worker-0.0.log").write_text("step=1, loss=0.5\n")
            store.add_metrics([(job, "worker", 0, time.time(), step, "loss", 1 / step) for step in (1, 2)])
        store.close()
        env = {**QUIET, "PAI_QUOTA": ""}
        before, files = dump(pai_home), _files(pai_home)
        runs = [argv for reader in READERS.values() if isinstance(reader, list) for argv in reader]
        runs += [argv for job in jobs.values() for reader in READERS.values() if callable(reader)
                 for argv in reader(job)]
        for argv in runs:
            result = pai(*argv, env=env, timeout=60)
            assert result.returncode in (0, 1), f"pai {' '.join(argv)}: {result.stderr}"
            spawned = _processes_of(pai_home, mine)
            assert not spawned, f"`pai {' '.join(argv)}` started processes {spawned}"
            assert dump(pai_home) == before, f"`pai {' '.join(argv)}` wrote the store"
            assert _files(pai_home) == files, f"`pai {' '.join(argv)}` wrote in PAI_HOME"
        shown = {j["id"]: j["status"] for j in pai_json("list", env=env)}
        for job in jobs.values():
            if JobStatus(shown[job]).is_terminal():
                assert pai("wait", job, env=env, timeout=60).returncode == \
                    (0 if shown[job] == "Succeeded" else 1)
        console = pai("console", env=env, input="show instances;\nshow queue;\n" +
                      "".join(f"status {job};\nlogs {job};\n" for job in jobs.values()))
        assert console.returncode == 0, console.stderr
        # The logview server's pages read through the same functions (paicli/web/data.py).
        from paicli.jobstatus import SUPERVISOR_GONE
        from paicli.web import data

        store = Store(pai_home)
        try:
            pages = {row["id"]: row for row in data.job_list(store)}
            for job in jobs.values():
                data.job_page(store, job), data.summary_json(store, job), data.instance_logs(store, job)
        finally:
            store.close()
        gone = jobs["queued, supervisor gone"]
        assert (pages[gone]["status"], pages[gone]["reason"]) == \
            ("Waiting", f"waiting: 1st in queue; worker needs cpu 100, local has 0 free; {SUPERVISOR_GONE}")
        assert (shown[gone], pages[jobs["running, master gone"]]["status"]) == ("Waiting", "Failed")
        assert dump(pai_home) == before and _files(pai_home) == files
        assert _processes_of(pai_home, mine) == []
        assert stranger.poll() is None and alive.poll() is None, "a reader signalled a process"
    finally:
        for pid in spawned or _processes_of(pai_home, mine):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        end(stranger)
        end(alive)


def tarpit() -> socket.socket:
    """An address where a TCP connect succeeds and then nothing ever answers (an
    SSH node behind a dead link): any SSH round trip there waits for its timeout."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(200)
    return sock


def test_pai_list_with_50_live_jobs_on_unreachable_ssh_nodes_answers_without_touching_a_node(pai_home, tmp_path):
    """Listing reads the store and this machine's process table only: no connection
    reaches the node, so no SSH round trip (CONNECT_TIMEOUT each) is waited for."""
    from paicli.cluster.nodes import load_config
    from paicli.cluster.ssh_transport import CONNECT_TIMEOUT

    pit = tarpit()
    alive = sleeper()
    try:
        nodes = tmp_path / "nodes.json"
        nodes.write_text(json.dumps({"known_hosts": str(tmp_path / "known_hosts"), "nodes": [
            {"name": "far", "host": "127.0.0.1", "port": pit.getsockname()[1], "cpu": 100, "memory": 1000,
             "gpu": 0}]}))
        snapshot = load_config(nodes)
        ref = {"backend": "ssh", "node": "far", "host": "127.0.0.1", "pid": 4242, "pgid": 4242,
               "start": "1234", "boot_id": "b"}
        for n in range(50):
            master = dead_identity() if n % 2 else (alive.pid, start_time(alive.pid))
            record_job(pai_home, master=master, snapshot=snapshot, refs=[ref])
        before = dump(pai_home)
        times = []
        for _ in range(3):
            started = time.monotonic()
            result = subprocess.run([*PAI, "list", "--json"], capture_output=True, text=True, timeout=120,
                                    env={**os.environ, **QUIET})
            times.append(time.monotonic() - started)
            assert result.returncode == 0, result.stderr
        jobs = json.loads(result.stdout)
        assert len(jobs) == 50
        assert sorted({(j["status"], j["reason"]) for j in jobs}, key=str) == \
            sorted({("Failed", "master lost"), ("Running", None)}, key=str)
        print(f"pai list, 50 live jobs on an unreachable SSH node: {', '.join(f'{t:.3f}' for t in times)} s")
        assert max(times) < CONNECT_TIMEOUT / 2, times   # not one round trip to the node waited for
        pit.setblocking(False)
        with pytest.raises(BlockingIOError):
            pit.accept()   # nothing ever connected to the node
        assert dump(pai_home) == before
    finally:
        end(alive)
        pit.close()


# -- the writers: pai kill, the watchdog, and the next watchdog's sweep ---------------------


def test_pai_kill_records_a_job_whose_master_and_watchdog_died_and_stops_what_it_left(pai_home):
    from test_launcher import watchdog_pid

    result = pai("-name", "python", f"-Dscript={BEHAVE}", "--detach", env={"BEHAVE": "child,print:1,sleep:600"})
    job_id = result.stdout.strip()
    status = wait_until(lambda: (s := pai_json("status", job_id))["instances"][0]["pid"] and s, timeout=20)
    groups = {status["instances"][0]["pgid"]}
    try:
        os.kill(watchdog_pid(pai_home, job_id), signal.SIGKILL)
        os.kill(status["master_pid"], signal.SIGKILL)
        assert wait_until(lambda: pai_json("status", job_id, env=QUIET)["unrecorded"], timeout=10)
        after = pai_json("status", job_id, env=QUIET)
        assert (after["status"], after["reason"]) == ("Failed", "master lost")
        result = pai("kill", job_id, env=QUIET, timeout=30)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"{job_id} recorded Failed: master lost"   # not "cancelled"
        assert wait_until(lambda: processes_in(groups) == [], timeout=10), processes_in(groups)
        recorded = pai_json("status", job_id, env=QUIET)
        assert (recorded["status"], recorded["reason"], recorded["unrecorded"]) == ("Failed", "master lost", False)
        assert [i["status"] for i in recorded["instances"]] == ["Killed"]
    finally:
        kill_groups(groups)


def test_the_next_jobs_watchdog_records_a_job_lost_with_its_watchdog(pai_home):
    """Decision: nobody reading a job writes it, so a job whose master and watchdog
    both died (a reboot) is recorded by the next job's watchdog."""
    stranger = sleeper()
    try:
        ref = {"backend": "local", "node": "local", "host": "127.0.0.1", "pid": stranger.pid,
               "pgid": stranger.pid, "start": str(int(start_time(stranger.pid)) - 7), "boot_id": None}
        lost = record_job(pai_home, master=dead_identity(), refs=[ref])
        never = record_job(pai_home, master=None, created=time.time() - 600)
        result = pai("-name", "python", f"-Dscript={BEHAVE}", env={"BEHAVE": "print:1,sleep:1"})
        assert result.returncode == 0, result.stdout + result.stderr

        def recorded(job_id: str):
            store = Store(pai_home)
            try:
                job = store.job(job_id)
                return (job["status"], job["reason"]) if job["ended"] else None
            finally:
                store.close()

        assert wait_until(lambda: recorded(lost), timeout=20) == ("Failed", "master lost")
        assert wait_until(lambda: recorded(never), timeout=20) == \
            ("Failed", "its master never started (none within 30s)")
        time.sleep(0.2)
        assert stranger.poll() is None, "the sweep signalled a recycled pid"
    finally:
        end(stranger)


def test_pai_kill_ends_a_master_that_cannot_answer_within_10_seconds(pai_home, tmp_path):
    """A master blocked for good (here: stopped, as in a Ray call that never
    returns) is killed after its grace; its instances are stopped all the same."""
    pidfile = tmp_path / "pids"
    job_id = pai("--detach", "-name", "python", f"-Dscript={BEHAVE}",
                 env={"BEHAVE": f"pidfile:{pidfile},child,print:1,sleep:600"}).stdout.strip()
    assert wait_until(lambda: pidfile.exists(), timeout=20)
    status = pai_json("status", job_id, env=QUIET)
    master, groups = status["master_pid"], {i["pgid"] for i in status["instances"]}
    try:
        os.kill(master, signal.SIGSTOP)
        started = time.monotonic()
        result = pai("kill", job_id, env=QUIET, timeout=30)
        assert result.returncode == 0 and "cancelled" in result.stdout, result.stderr
        assert wait_until(lambda: processes_in(groups) == [] and proc_stat(master) is None, timeout=10)
        assert time.monotonic() - started < 10
        assert "did not end within its grace: killed" in result.stderr
        after = pai_json("status", job_id, env=QUIET)
        assert (after["status"], after["reason"]) == ("Cancelled", "cancelled by user")
        assert {i["status"] for i in after["instances"]} == {"Killed"}
    finally:
        for pid in [master, *groups]:
            try:
                os.kill(pid, signal.SIGKILL) if pid == master else os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- layering: status data apart from its rendering ------------------------------------------


def _imported(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_the_master_imports_status_data_not_its_rendering():
    assert "paicli.jobview" not in _imported(ROOT / "cluster" / "master.py")
    assert "paicli.jobstatus" in _imported(ROOT / "cluster" / "master.py")
    data = _imported(ROOT / "paicli" / "jobstatus.py")
    assert not {m for m in data if m.startswith(("paicli.jobview", "click", "paicli.cli"))}, data


def test_the_cli_side_has_no_writer_left():
    """Only cluster/lifecycle.py (and the master) write a job's state after its
    submit: the reading modules name no writer."""
    for name in ("client.py", "jobview.py", "jobstatus.py"):
        text = (ROOT / "paicli" / name).read_text()
        for writer in ("set_job(", "set_instance(", "os.kill(", "stop_all(", "mark_master_lost", "mark_revived(",
                       "queue_turns.revive", "revive_queue("):
            if name == "client.py" and writer == "set_job(":
                continue  # submit records a master that did not start (its own job)
            assert writer not in text, f"{name} calls {writer}"
