"""Real jobs through the real `pai` command: launching, retrying, failing,
cancelling, re-attaching, and leaving no process behind."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paicli.cluster import spawn
from paicli.cluster.backends import local
from paicli.cluster.backends.base import InstanceRef
from paicli.cluster.backends.local import LocalBackend
from paicli.cluster.procinfo import boot_id, proc_stat
from paicli.store import Store

from conftest import BEHAVE, PAI, ROOT, default_signals, job_id_from, kill_groups, pai, pai_json, processes_in, read_until, run_on_pty, wait_until, watchdog_of

EXAMPLE = ROOT / "examples" / "python" / "ps_worker.py"
# How long a test waits for an event (a file written, processes gone, a status
# recorded) before calling it missing: generous, for a loaded 2-core machine where
# each cold `pai` and interpreter costs seconds. A wait ends at the event, so this
# costs nothing when all is well; what a test asserts about time is measured on the
# store's clock, between recorded events.
EVENT_DEADLINE = 60.0
PS_2W = '{"ps":{"count":1},"worker":{"count":2}}'


def pids_from(pidfile) -> dict[str, tuple[int, int, int]]:
    """role:index -> (pid, pgid, sid) of the last attempt that wrote the file."""
    out = {}
    for line in pidfile.read_text().splitlines():
        name, pid, pgid, sid = line.split()
        out[name] = (int(pid), int(pgid), int(sid))
    return out


def start_attached(*args, env=None) -> subprocess.Popen:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.Popen([*PAI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, start_new_session=True)


def test_ps_and_two_workers_succeed_and_the_ps_is_stopped(pai_home, store_kind):
    result = pai("-name", "python", f"-Dscript=file://{EXAMPLE}", f"-Dcluster={PS_2W}",
                 "-DuserDefinedParameters=--steps 8 --sleep 0.02;")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    job_id = job_id_from(out)
    assert out.splitlines()[-1] == "OK"
    assert out.splitlines()[1].startswith("Log view: ")
    for worker in ("worker:0", "worker:1"):
        assert f"[{worker}] step=7, global_step=" in out
    assert "[ps:0] ps listening on" in out
    assert "PythonTask_job:3/0/3[0%]" in out and "PythonTask_job:0/3/3[100%]" in out
    summary = [line.split() for line in out.splitlines() if line.startswith(("ps ", "worker "))]
    assert ["ps", "0/1/1", "0"] in summary and ["worker", "0/2/2", "0"] in summary
    status = pai_json("status", job_id)
    assert status["status"] == "Succeeded"
    ps = next(i for i in status["instances"] if i["role"] == "ps")
    assert ps["status"] == "Terminated" and ps["exit_code"] == -signal.SIGTERM  # stopped by us, counted finished
    assert [t["fatal"] for t in status["tasks"]] == [0, 0]
    assert processes_in({i["pgid"] for i in status["instances"]}) == []
    # The ps goes as soon as the workers are done: its SIGTERM exit is seen at once,
    # not after the stop timeout (3 s) has run out.
    ends = {(a["role"], a["idx"]): a["ended"] for a in Store().attempts(job_id)}
    assert ends[("ps", 0)] - max(ends[("worker", 0)], ends[("worker", 1)]) < 2
    # Metrics parsed from the worker lines and stored.
    losses = status["metric_series"]["worker:0"]["loss"]
    assert len(losses) == 8 and losses[-1][0] == 7
    assert status["metrics"]["worker:1"]["global_step"] >= 8


def test_worker_killed_by_sigkill_is_retried_and_the_job_succeeds(pai_home, tmp_path):
    pidfile = tmp_path / "pids"
    env = {"BEHAVE_WORKER_1": f"pidfile:{pidfile},print:2,selfkill:SIGKILL,print:2",
           "BEHAVE_WORKER_0": "print:6", "SLEEP": "0.05"}
    result = pai("-name", "python", f"-Dscript={BEHAVE}", '-Dcluster={"worker":{"count":2}}', env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "OK"
    assert "[worker:1] step=1, global_step=1, loss=0.5000, attempt=1" in result.stdout
    assert "restarting it (retry 1 of 3)" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("worker ")]
    assert rows == [["worker", "0/2/2", "1"]]
    status = pai_json("status", job_id_from(result.stdout))
    w1 = next(i for i in status["instances"] if (i["role"], i["index"]) == ("worker", 1))
    assert w1["attempts"] == 2 and w1["exit_code"] == 0
    assert status["tasks"][0]["retries"] == 1


def test_worker_exiting_1_fails_the_job_fast_and_names_it(pai_home, tmp_path):
    pidfile = tmp_path / "pids"
    env = {"BEHAVE_WORKER_1": f"pidfile:{pidfile},print:2,exit:1",
           "BEHAVE_WORKER_0": f"pidfile:{pidfile},print:600", "BEHAVE_PS": f"pidfile:{pidfile},serve",
           "SLEEP": "0.05"}
    result = pai("-name", "python", f"-Dscript={BEHAVE}", f"-Dcluster={PS_2W}", env=env)
    assert result.returncode == 1
    last = result.stdout.splitlines()[-1]
    assert last.startswith("FAILED: worker:1 exited with code 1")
    assert "exiting with 1" in last  # its last log lines
    # On the store's clock, from worker:1's end to the last instance's (not the cold
    # starts a loaded machine slows): worker:0 would print for 30 s more.
    job_id = job_id_from(result.stdout)
    failed_at = max(a["ended"] for a in Store(pai_home).attempts(job_id) if (a["role"], a["idx"]) == ("worker", 1))
    assert _last_instance_end(pai_home, job_id) - failed_at < 20, "the job must not wait for worker:0"
    status = pai_json("status", job_id)
    states = {f"{i['role']}:{i['index']}": i["status"] for i in status["instances"]}
    assert states == {"ps:0": "Killed", "worker:0": "Killed", "worker:1": "Failed"}
    groups = {pgid for _, pgid, _ in pids_from(pidfile).values()}
    assert processes_in(groups) == []


def test_permanent_exit_code_is_not_retried(pai_home):
    result = pai("-name", "python", f"-Dscript={BEHAVE}", env={"BEHAVE": "exit:2"})
    assert result.returncode == 1
    assert "worker:0 exited with code 2" in result.stdout
    status = pai_json("status", job_id_from(result.stdout))
    assert status["instances"][0]["attempts"] == 1


def test_retries_are_bounded_by_max_retries(pai_home):
    result = pai("-name", "python", f"-Dscript={BEHAVE}", "-DmaxRetries=2", env={"BEHAVE": "exit:137"})
    assert result.returncode == 1
    assert "worker:0 exited with code 137 (no retries left of 2)" in result.stdout
    assert pai_json("status", job_id_from(result.stdout))["instances"][0]["attempts"] == 3


def test_sigint_to_attached_pai_cancels_and_leaves_no_process(pai_home, tmp_path):
    pidfile = tmp_path / "pids"
    env = {"BEHAVE_WORKER": f"pidfile:{pidfile},child,print:1,sleep:600",
           "BEHAVE_PS": f"pidfile:{pidfile},child,ignore-term,serve"}
    proc = start_attached("-name", "python", f"-Dscript={BEHAVE}", f"-Dcluster={PS_2W}", env=env)
    # Every instance up before the Ctrl-C: the workers printed, and the ps (started
    # first, but its interpreter may come up after theirs) wrote its pid, started its
    # child and ignores SIGTERM, which its "serving on" line comes after.
    head = ""
    for marker in ("[worker:1] step=0", "[worker:0] step=0", "[ps:0] serving on"):
        if marker not in head:
            head += read_until(proc, marker)
    job_id = job_id_from(head)
    sent = time.time()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert (out.strip().splitlines() or [""])[-1] == "CANCELLED: cancelled (Ctrl-C)"
    pids = pids_from(pidfile)
    assert len(pids) == 3
    groups = {pgid for _, pgid, _ in pids.values()} | {sid for *_, sid in pids.values()}
    assert wait_until(lambda: processes_in(groups) == [], timeout=EVENT_DEADLINE), processes_in(groups)
    status = pai_json("status", job_id)
    assert status["status"] == "Cancelled"
    assert {i["status"] for i in status["instances"]} == {"Killed"}
    # The budget (a 3 s grace for the ps that ignores SIGTERM, then SIGKILL) on the
    # store's own clock: from Ctrl-C to the last instance ended, not the CLI's exit.
    assert _last_instance_end(pai_home, job_id) - sent < 8


def test_kill_9_of_the_cli_leaves_the_job_running_and_wait_reattaches(pai_home):
    env = {"BEHAVE": "print:40", "SLEEP": "0.1"}
    proc = start_attached("-name", "python", f"-Dscript={BEHAVE}", '-Dcluster={"worker":{"count":2}}', env=env)
    job_id = job_id_from(read_until(proc, "step=3"))
    proc.kill()
    proc.wait()
    status = pai_json("status", job_id)
    assert status["status"] == "Running"
    waited = pai("wait", job_id, timeout=60)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert waited.stdout.splitlines()[-1] == "OK"
    assert "step=39" in waited.stdout  # it tails from where the job is, to the end
    assert "step=0," not in waited.stdout
    assert pai_json("status", job_id)["status"] == "Succeeded"


def test_kill_9_of_the_supervisor_leaves_no_orphan(pai_home, tmp_path):
    pidfile = tmp_path / "pids"
    env = {"BEHAVE_WORKER": f"pidfile:{pidfile},child,print:1,sleep:600",
           "BEHAVE_PS": f"pidfile:{pidfile},child,serve"}
    result = pai("-name", "python", f"-Dscript={BEHAVE}", f"-Dcluster={PS_2W}",
                 "--detach", env=env)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip()
    assert wait_until(lambda: pidfile.exists() and len(pidfile.read_text().splitlines()) == 3, timeout=EVENT_DEADLINE)
    status = pai_json("status", job_id)
    groups = {i["pgid"] for i in status["instances"]}
    assert len(processes_in(groups)) >= 6  # each instance and its grandchild
    watchdog_pid(pai_home, job_id)
    os.kill(status["master_pid"], signal.SIGKILL)
    assert wait_until(lambda: processes_in(groups) == [], timeout=EVENT_DEADLINE), processes_in(groups)
    after = pai_json("status", job_id)
    assert after["status"] == "Failed" and after["reason"] == "master lost"
    # The watchdog was told of each instance as it started (cluster/master.py _tell_watchdog).
    log = pai_home / "jobs" / job_id / "watchdog.log"
    assert wait_until(lambda: "lost; stopped" in log.read_text(), timeout=EVENT_DEADLINE)
    assert "(of 3 instance(s) it was told about)" in log.read_text(), log.read_text()


def test_a_master_killed_at_any_moment_of_its_start_is_recorded_lost(pai_home, store_kind):
    """kill -9 of the master as its job is recorded Running, and a little later:
    each time the job is recorded Failed, "master lost", with no other job to sweep
    it (in a team store another user's next job could not: the watchdog must exist
    before the job runs)."""
    store = Store(pai_home)
    try:
        for delay in (0.0, 0.3, 0.8):
            job_id = pai("--detach", "-name", "python", f"-Dscript={BEHAVE}",
                         env={"BEHAVE": "print:1,sleep:600"}).stdout.strip()
            assert wait_until(lambda: store.job(job_id)["status"] == "Running", EVENT_DEADLINE, 0.002)
            time.sleep(delay)
            os.kill(store.job(job_id)["master_pid"], signal.SIGKILL)
            assert wait_until(lambda: store.job(job_id)["ended"], EVENT_DEADLINE, 0.5), (delay, dict(store.job(job_id)))
            assert (store.job(job_id)["status"], store.job(job_id)["reason"]) == ("Failed", "master lost"), delay
    finally:
        store.close()


def test_supervisor_death_is_noticed_by_the_next_look_too(pai_home):
    """With the watchdog gone as well, `pai status` shows the job lost (derived: a
    reader writes nothing, issue 16) and `pai kill` records it and ends its groups."""
    result = pai("-name", "python", f"-Dscript={BEHAVE}", "--detach", env={"BEHAVE": "print:1,sleep:600"})
    job_id = result.stdout.strip()
    status = wait_until(lambda: (s := pai_json("status", job_id))["instances"][0]["pid"] and s,
                        timeout=EVENT_DEADLINE, interval=0.5)
    master = status["master_pid"]
    watchdog = watchdog_pid(pai_home, job_id)
    assert os.getsid(watchdog) != os.getsid(master)  # its own session: a signal to the master's group misses it
    os.kill(watchdog, signal.SIGKILL)
    os.kill(master, signal.SIGKILL)
    after = pai_json("status", job_id)
    assert after["status"] == "Failed" and after["reason"] == "master lost"
    assert pai("kill", job_id).returncode == 0
    assert wait_until(lambda: processes_in({status["instances"][0]["pgid"]}) == [], timeout=EVENT_DEADLINE)


def _last_instance_end(pai_home: Path, job_id: str) -> float:
    """When the job's last instance was recorded as ended (the store's clock)."""
    store = Store(pai_home)
    assert wait_until(lambda: all(i["ended"] for i in store.instances(job_id)), timeout=EVENT_DEADLINE)
    return max(i["ended"] for i in store.instances(job_id))


def watchdog_pid(pai_home: Path, job_id: str) -> int:
    """The job's watchdog, as it names itself at the top of its log."""
    return watchdog_of(pai_home / "jobs" / job_id, job_id, timeout=EVENT_DEADLINE)


def _holds(pid: str, target: str) -> bool:
    """Whether a process has a descriptor on `target` (a pipe: both ends look alike)."""
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == target for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def test_pai_kill_cancels_within_5_seconds(pai_home, tmp_path, store_kind):
    pidfile = tmp_path / "pids"
    env = {"BEHAVE": f"pidfile:{pidfile},ignore-term,child,print:1,sleep:600"}
    job_id = pai("--detach", "-name", "python", f"-Dscript={BEHAVE}", env=env).stdout.strip()
    assert wait_until(lambda: pidfile.exists(), timeout=EVENT_DEADLINE)
    result = pai("kill", job_id)
    assert result.returncode == 0 and "cancelled" in result.stdout
    groups = {pgid for _, pgid, _ in pids_from(pidfile).values()}
    # A generous deadline for what a loaded machine adds (a cold `pai`); the 5 s
    # budget (a 3 s grace, then SIGKILL) on the store's clock: from the cancel
    # recorded to the instance ended.
    assert wait_until(lambda: processes_in(groups) == [], timeout=EVENT_DEADLINE)
    status = pai_json("status", job_id)
    assert status["status"] == "Cancelled" and status["reason"] == "cancelled by user"
    assert _last_instance_end(pai_home, job_id) - Store(pai_home).job(job_id)["ended"] < 5
    again = pai("kill", job_id)
    assert "already ended (Cancelled)" in again.stdout
    waited = pai("wait", job_id)
    assert waited.returncode == 130


def test_timeout_cancels_with_reason_timeout(pai_home):
    result = pai("-name", "python", f"-Dscript={BEHAVE}", "-Dtimeout=1.5s", env={"BEHAVE": "sleep:60"})
    assert result.returncode == 130
    assert result.stdout.splitlines()[-1] == "CANCELLED: timeout after 1.5s"


def test_grandchildren_of_a_finished_instance_are_not_left_behind(pai_home, tmp_path):
    pidfile = tmp_path / "pids"
    result = pai("-name", "python", f"-Dscript={BEHAVE}", env={"BEHAVE": f"pidfile:{pidfile},child,print:1"})
    assert result.returncode == 0
    groups = {pgid for _, pgid, _ in pids_from(pidfile).values()}
    assert wait_until(lambda: processes_in(groups) == [], timeout=EVENT_DEADLINE)


def test_logs_status_list_and_instance_log(pai_home):
    result = pai("-name", "python", f"-Dscript={BEHAVE}", '-Dcluster={"worker":{"count":2}}',
                 "-DjobName=logs-test", env={"BEHAVE": "print:5"})
    job_id = job_id_from(result.stdout)
    one = pai("logs", job_id, "--instance", "worker:1")
    assert one.returncode == 0
    assert one.stdout.splitlines()[0] == "step=0, global_step=0, loss=1.0000, attempt=0"
    assert len(one.stdout.splitlines()) == 5
    tail = pai("logs", job_id, "--tail", "2")
    assert tail.stdout.splitlines()[-1].startswith("[pai] job Succeeded")
    assert len(tail.stdout.splitlines()) == 2
    everything = pai("logs", job_id)
    assert everything.stdout.count("[worker:0] step=") == 5 and everything.stdout.count("[worker:1] step=") == 5
    as_json = [json.loads(line) for line in pai("logs", job_id, "--json").stdout.splitlines()]
    assert {"instance": "worker:1", "line": "step=4, global_step=4, loss=0.2000, attempt=0"} in as_json
    assert as_json[-1]["instance"] == "pai" and as_json[-1]["line"].startswith("job Succeeded")
    one_json = [json.loads(line) for line in pai("logs", job_id, "-i", "worker:0", "--json", "-n", "1").stdout.splitlines()]
    assert one_json == [{"instance": "worker:0", "line": "step=4, global_step=4, loss=0.2000, attempt=0"}]
    bad = pai("logs", job_id, "--instance", "../../etc/passwd:0")
    assert bad.returncode == 2 and "expected role:index" in bad.stderr
    missing = pai("logs", job_id, "--instance", "ps:0")
    assert missing.returncode == 2 and "has no such instance" in missing.stderr
    listed = pai_json("list")
    assert listed[0]["id"] == job_id and listed[0]["name"] == "logs-test" and listed[0]["status"] == "Succeeded"
    plain = pai("list")
    assert job_id in plain.stdout and "Succeeded" in plain.stdout
    human = pai("status", job_id[:12])
    assert human.returncode == 0 and "worker:1" in human.stdout and "Succeeded" in human.stdout
    view = open(json.loads(pai("status", job_id, "--json").stdout)["log_view"]).read()
    assert "Status: Succeeded" in view and "worker:1" in view


def test_logs_follow_runs_until_the_job_ends(pai_home):
    job_id = pai("-name", "python", f"-Dscript={BEHAVE}", "--detach",
                 env={"BEHAVE": "print:20", "SLEEP": "0.05"}).stdout.strip()
    followed = pai("logs", job_id, "--follow", "--instance", "worker:0", timeout=60)
    assert followed.returncode == 0
    assert followed.stdout.splitlines()[-1].startswith("step=19,")


def test_job_from_a_yaml_file_with_overrides(pai_home, tmp_path):
    job = tmp_path / "job.yaml"
    local = tmp_path / "scripts"
    local.mkdir()
    (local / "w.py").write_text("import os; print('role', os.environ['PAI_ROLE'], os.environ['PAI_INDEX'])\n")
    job.write_text("name: python\nscript: scripts/w.py\ncluster: {worker: {count: 2}}\njob_name: from-yaml\n")
    result = pai("run", str(job), '-Dcluster={"worker":{"count":3}}')
    assert result.returncode == 0, result.stderr
    assert "[worker:2] role worker 2" in result.stdout
    assert pai_json("list")[0]["name"] == "from-yaml"


def test_closing_the_terminal_does_not_stop_the_job(pai_home):
    """SIGHUP (a closed terminal, a laptop lid) ends the CLI, never the job."""
    proc = start_attached("-name", "python", f"-Dscript={BEHAVE}", env={"BEHAVE": "print:30", "SLEEP": "0.1"})
    job_id = job_id_from(read_until(proc, "step=2"))
    proc.send_signal(signal.SIGHUP)
    proc.wait(timeout=10)
    assert pai_json("status", job_id)["status"] == "Running"
    assert pai("wait", job_id, timeout=60).returncode == 0


def test_colour_per_instance_on_a_real_terminal(pai_home):
    env = dict(os.environ, BEHAVE="print:2")
    env.pop("NO_COLOR", None)
    env.pop("FORCE_COLOR", None)
    code, raw = run_on_pty([*PAI, "-name", "python", f"-Dscript={BEHAVE}", '-Dcluster={"worker":{"count":2}}'], env)
    out = raw.decode()
    assert code == 0
    colours = {line.split("[worker:")[0] for line in out.splitlines() if "[worker:" in line}
    assert len(colours) == 2 and all(c.startswith("\x1b[") for c in colours), colours


def test_master_started_as_a_fresh_interpreter_works_the_same(pai_home):
    """The path a threaded caller of the library takes (no fork)."""
    result = pai("-name", "python", f"-Dscript={BEHAVE}", '-Dcluster={"worker":{"count":2}}',
                 env={"BEHAVE": "print:2", "PAI_MASTER_EXEC": "1"})
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "OK"
    job_id = job_id_from(result.stdout)
    assert "started as a new interpreter" in (pai_home / "jobs" / job_id / "master.log").read_text()
    forked = pai("-name", "python", f"-Dscript={BEHAVE}", env={"BEHAVE": "print:1"})
    assert "started by fork" in (pai_home / "jobs" / job_id_from(forked.stdout) / "master.log").read_text()


def test_job_restart_after_a_finished_worker_keeps_memory_and_store_in_step(pai_home, tmp_path):
    """restart=job (TensorFlow without a chief): worker:0 exits 0, then worker:1 is
    SIGKILLed. The whole job runs again; worker:0's second run must be what the
    store shows (Running with its new pid, then Terminated at attempt 2), not its
    first run's Terminated row while a new process runs unseen."""
    pidfile = tmp_path / "pids"
    env = {"BEHAVE_WORKER_0": f"pidfile:{pidfile},print:2,sleep:0.6",
           "BEHAVE_WORKER_1": f"pidfile:{pidfile},print:1,sleep:1.2,selfkill:SIGKILL,sleep:0.6",
           "BEHAVE_PS": f"pidfile:{pidfile},serve", "SLEEP": "0.05"}
    result = pai("-name", "tensorflow", f"-Dscript={BEHAVE}", f"-Dcluster={PS_2W}", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "restarting the whole job (retry 1 of 3)" in result.stdout
    status = pai_json("status", job_id_from(result.stdout))
    w0 = next(i for i in status["instances"] if (i["role"], i["index"]) == ("worker", 0))
    assert w0["attempts"] == 2 and w0["status"] == "Terminated" and w0["exit_code"] == 0
    pids = [line.split() for line in pidfile.read_text().splitlines()]
    second_w0 = [int(p[1]) for p in pids if p[0] == "worker:0"]
    assert len(second_w0) == 2
    assert w0["pid"] == second_w0[-1], "the store must show worker:0's second run"
    groups = {int(p[2]) for p in pids}
    assert processes_in(groups) == []


# -- one identity, one stop path -------------------------------------------------------------


def _sleeper(*extra: str) -> subprocess.Popen:
    """A real process in a session of its own (as an instance is), with default signals."""
    return subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(600)", *extra],
                            start_new_session=True, restore_signals=True,
                            preexec_fn=default_signals)


def _ref_of(pid: int, **changes) -> InstanceRef:
    fields = dict(backend="local", node="local", host="127.0.0.1", pid=pid, pgid=pid,
                  start=proc_stat(pid).start, boot_id=boot_id())
    fields.update(changes)
    return InstanceRef(**fields)


def test_identity_checked_stop_refuses_a_recycled_pid_and_another_boot():
    backend = LocalBackend()
    proc = _sleeper()
    try:
        # Same pid, another start time: the number was handed to another process.
        recycled = _ref_of(proc.pid, start=str(int(proc_stat(proc.pid).start) - 1))
        assert backend.stop(recycled, timeout=0.5) is False
        assert proc.poll() is None
        assert backend.stop(_ref_of(proc.pid, boot_id="0" * 32), timeout=0.5) is False
        assert proc.poll() is None
        ref = InstanceRef.from_dict(json.loads(json.dumps(_ref_of(proc.pid).to_dict())))  # stored and read back
        assert backend.alive(ref)
        assert backend.stop(ref, timeout=2) is True
        assert proc.wait(timeout=5) == -signal.SIGTERM
        assert not backend.alive(ref)
    finally:
        proc.kill()
        proc.wait()


def test_a_ref_without_a_start_time_is_refused_and_reported(capfd):
    """Issue 16: a ref whose start time is unknown used to be stopped by its bare pid;
    the pid may belong to another process of ours by now. Nothing is signalled, and
    the refusal is said."""
    backend = LocalBackend()
    proc = _sleeper()
    try:
        unknown = _ref_of(proc.pid, start=None)
        assert backend.stop(unknown, timeout=0.5) is False
        assert backend.stop_all([unknown], timeout=0) == []
        time.sleep(0.2)
        assert proc.poll() is None, "a process was signalled by a pid whose identity was not verified"
        err = capfd.readouterr().err
        assert f"not stopping local:{proc.pid}: no start time was recorded for it" in err, err
    finally:
        proc.kill()
        proc.wait()


def test_stop_ends_what_is_left_of_a_group_whose_leader_is_gone(tmp_path):
    """The leader exited; its child (same group) is still ours: Linux does not reuse
    the number while the group lives."""
    pidfile = tmp_path / "child"
    leader = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
                               "'import time; time.sleep(600)']); open(sys.argv[1], 'w').write(str(p.pid))",
                               str(pidfile)], start_new_session=True)
    ref = _ref_of(leader.pid)
    leader.wait(timeout=10)
    child = int(pidfile.read_text())
    try:
        assert processes_in({ref.pgid}) != []
        assert LocalBackend().stop(ref, timeout=2) is True
        assert wait_until(lambda: processes_in({ref.pgid}) == [], timeout=EVENT_DEADLINE)
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _plant_stale_ref(home, job_id: str, victim: subprocess.Popen) -> None:
    """An old attempt whose recorded process is gone and whose pid now belongs to
    another process (`victim`): its stored pid/pgid point at a stranger."""
    store = Store(home)
    stale = _ref_of(victim.pid, start=str(int(proc_stat(victim.pid).start) - 7))
    store.record_attempt(job_id, "worker", 0, 99, pid=victim.pid, pgid=victim.pid, ref=json.dumps(stale.to_dict()))
    store.close()


@contextlib.contextmanager
def _job_with_a_stale_ref(home, pidfile):
    """A detached job (one instance with a child) whose store entry also holds an old
    attempt pointing at a live stranger; yields (job id, stranger), kills both after."""
    job_id = pai("--detach", "-name", "python", f"-Dscript={BEHAVE}",
                 env={"BEHAVE": f"pidfile:{pidfile},child,print:1,sleep:600"}).stdout.strip()
    assert wait_until(lambda: pidfile.exists(), timeout=EVENT_DEADLINE)
    stranger = _sleeper()
    try:
        _plant_stale_ref(home, job_id, stranger)
        yield job_id, stranger
    finally:
        stranger.kill()
        stranger.wait()
        pai("kill", job_id)  # a failed assertion must not leave the job running


def test_pai_kill_stops_through_the_identity_checked_path(pai_home, tmp_path):
    pidfile = tmp_path / "pids"
    with _job_with_a_stale_ref(pai_home, pidfile) as (job_id, stranger):
        result = pai("kill", job_id)
        assert result.returncode == 0, result.stderr
        groups = {pgid for _, pgid, _ in pids_from(pidfile).values()}
        assert wait_until(lambda: processes_in(groups) == [], timeout=EVENT_DEADLINE)
        time.sleep(0.3)
        assert stranger.poll() is None, "pai kill signalled a process group that was not the job's"


def test_master_lost_with_its_backend_out_of_reach_still_ends_the_instances_in_the_store(pai_home, tmp_path):
    """The watchdog cannot build the job's backend (here: a Ray address nobody
    answers at, as when a Ray head went down with the master): one line in its log,
    and the instances are still recorded as ended, not left Running."""
    pidfile = tmp_path / "pids"
    job_id = pai("--detach", "-name", "python", f"-Dscript={BEHAVE}",
                 env={"BEHAVE": f"pidfile:{pidfile},print:1,sleep:600"}).stdout.strip()
    groups: set[int] = set()
    try:
        assert wait_until(lambda: pidfile.exists(), timeout=EVENT_DEADLINE)
        groups = {pgid for _, pgid, _ in pids_from(pidfile).values()}
        job_dir = pai_home / "jobs" / job_id
        (job_dir / "nodes.json").write_text(json.dumps({"backend": "ray", "address": "127.0.0.1:1"}))
        watchdog_pid(pai_home, job_id)
        os.kill(pai_json("status", job_id)["master_pid"], signal.SIGKILL)
        assert wait_until(lambda: all(i["status"] == "Killed" for i in pai_json("status", job_id)["instances"]),
                          timeout=EVENT_DEADLINE, interval=0.5), pai_json("status", job_id)
        assert pai_json("status", job_id)["reason"] == "master lost"
        log = (job_dir / "watchdog.log").read_text()
        assert "cannot reach the job's backend to stop its instances: " in log and "Traceback" not in log, log
    finally:
        kill_groups(groups)   # the pretend Ray backend could not stop them: this machine's processes


def test_master_lost_clean_up_stops_through_the_identity_checked_path(pai_home, tmp_path):
    pidfile = tmp_path / "pids"
    with _job_with_a_stale_ref(pai_home, pidfile) as (job_id, stranger):
        status = pai_json("status", job_id)
        inst = status["instances"][0]
        assert (inst["node"], inst["host"]) == ("local", "127.0.0.1")
        text = pai("status", job_id).stdout.splitlines()
        header = next(line for line in text if line.startswith("Instance"))
        row = next(line for line in text if line.startswith("worker:0"))
        node_at, host_at = header.index("Node"), header.index("Host")
        assert (row[node_at:host_at].strip(), row[host_at:].split()[0]) == ("local", "127.0.0.1")
        watchdog_pid(pai_home, job_id)
        os.kill(status["master_pid"], signal.SIGKILL)  # the watchdog cleans up
        groups = {pgid for _, pgid, _ in pids_from(pidfile).values()}
        assert wait_until(lambda: processes_in(groups) == [], timeout=EVENT_DEADLINE)
        assert wait_until(lambda: pai_json("status", job_id)["reason"] == "master lost", timeout=EVENT_DEADLINE,
                          interval=0.5)
        time.sleep(0.3)
        assert stranger.poll() is None, "the watchdog signalled a process group that was not the job's"
        # its log names what it stopped: the instance or nothing (the instance's node
        # agent saw the master's end of its pipe close and stopped the group itself,
        # maybe first), never the stranger
        log = (pai_home / "jobs" / job_id / "watchdog.log").read_text()
        assert (f"stopped ['local:{inst['pid']}'] (of 1 instance(s)" in log
                or "stopped [] (of 1 instance(s)" in log), log
        assert str(stranger.pid) not in log


# -- issue 12: the launcher's defects ----------------------------------------------------------


def test_a_job_whose_master_never_started_does_not_stay_waiting(pai_home, tmp_path):
    """Defect 2: recorded, but no master ever ran (the CLI died in between, or the
    start failed): after the start deadline it is Failed, and wait/logs -f end."""
    store = Store(pai_home)
    job_dir = store.jobs_dir / "20200101000000000abcdefg"
    job_dir.mkdir()
    store.create_job("20200101000000000abcdefg", name="n", framework="python", project=None, task_name="T",
                     job_dir=job_dir, roles=[{"name": "worker", "count": 1, "must_finish": True}])
    store.update_job("20200101000000000abcdefg", created=time.time() - 600)
    store.close()
    started = time.monotonic()
    waited = pai("wait", "20200101000000000abcdefg", timeout=30)
    assert time.monotonic() - started < 10
    assert waited.returncode == 1
    assert waited.stdout.splitlines()[-1] == "FAILED: its master never started (none within 30s)"
    followed = pai("logs", "-f", "20200101000000000abcdefg", timeout=30)
    assert followed.returncode == 0
    assert pai_json("status", "20200101000000000abcdefg")["instances"][0]["status"] == "Killed"


def test_a_fresh_job_without_a_master_yet_is_still_waiting(pai_home):
    store = Store(pai_home)
    job_dir = store.jobs_dir / "20200101000000000hijklmn"
    job_dir.mkdir()
    store.create_job("20200101000000000hijklmn", name="n", framework="python", project=None, task_name="T",
                     job_dir=job_dir, roles=[{"name": "worker", "count": 1, "must_finish": True}])
    store.close()
    assert pai_json("status", "20200101000000000hijklmn")["status"] == "Waiting"


def test_a_port_conflict_respects_max_retries(pai_home):
    """Defect 3: an exit 1 whose last lines say the address is in use used to restart
    the whole job 5 times even with maxRetries=0."""
    env = {"BEHAVE_WORKER_1": "print:1,say:bind failed: address already in use,exit:1", "BEHAVE_PS": "serve",
           "BEHAVE_WORKER_0": "sleep:30"}
    script = BEHAVE
    result = pai("-name", "python", f"-Dscript={script}", f"-Dcluster={PS_2W}", "-DmaxRetries=0", env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stdout.splitlines()[-1]
    assert last.startswith("FAILED: worker:1 exited with code 1 (its port was taken) (no retries left of 0)"), last
    status = pai_json("status", job_id_from(result.stdout))
    assert status["job_attempt"] == 0
    assert all(i["attempts"] == 1 for i in status["instances"])
    # With a retry to spend, the job is restarted once on fresh ports, then fails.
    again = pai("-name", "python", f"-Dscript={script}", f"-Dcluster={PS_2W}", "-DmaxRetries=1", env=env)
    assert "its port was taken); restarting the job on fresh ports (retry 1 of 1)" in again.stdout
    assert again.stdout.splitlines()[-1].startswith("FAILED: worker:1 exited with code 1 (its port was taken) "
                                                    "(no retries left of 1)")
    assert pai_json("status", job_id_from(again.stdout))["job_attempt"] == 1


def test_a_bad_stop_timeout_is_refused_at_submit(pai_home):
    result = pai("-name", "python", f"-Dscript={BEHAVE}", env={"PAI_STOP_TIMEOUT": "abc"})
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "pai: error: PAI_STOP_TIMEOUT='abc': expected seconds between 0 and 3600; "
        "e.g. PAI_STOP_TIMEOUT=3, or unset it for the default (3)"]
    assert not (pai_home / "jobs").exists() or list((pai_home / "jobs").iterdir()) == []


def test_the_forked_master_keeps_nothing_of_the_cli(pai_home, tmp_path):
    """Defect 6: no inherited descriptor (a pipe the caller waits on sees EOF once
    `pai` is gone), not the CLI's working directory; its logs are 0600."""
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen([*PAI, "--detach", "-name", "python", f"-Dscript={BEHAVE}"],
                            env={**os.environ, "BEHAVE": "sleep:5"}, stdout=subprocess.PIPE, text=True,
                            pass_fds=(write_fd,), cwd=tmp_path)
    os.close(write_fd)
    job_id = proc.communicate(timeout=30)[0].strip()
    try:
        os.set_blocking(read_fd, False)
        assert wait_until(lambda: _eof(read_fd), timeout=EVENT_DEADLINE), "the master holds the CLI's descriptor"
        master = pai_json("status", job_id)["master_pid"]
        job_dir = pai_home / "jobs" / job_id
        assert os.readlink(f"/proc/{master}/cwd") == str(job_dir)
        for name in ("master.log", "watchdog.log"):
            assert wait_until(lambda: (job_dir / name).exists(), timeout=EVENT_DEADLINE)
            assert (job_dir / name).stat().st_mode & 0o777 == 0o600, name
        # The watchdog running (forked before the launch): the master opens its log
        # just before the fork and closes it once the watchdog's pid is back, which can
        # come a moment after the watchdog's first line; a leak keeps it open for good.
        watchdog = watchdog_pid(pai_home, job_id)

        def master_holds_log() -> bool:
            fds = [os.readlink(f"/proc/{master}/fd/{fd}") for fd in os.listdir(f"/proc/{master}/fd")]
            return any("watchdog.log" in target for target in fds)

        assert wait_until(lambda: not master_holds_log(), timeout=10), "watchdog.log left open in the master"
        # The watchdog (forked from the master) holds its pipe and its log (stdout, stderr):
        # not the store, not the write end of its own pipe (EOF must mean "master gone").
        # (Numbers above 2 the fork brought along point at /dev/null: procinfo.let_go_inherited.)
        held = {int(fd): os.readlink(f"/proc/{watchdog}/fd/{fd}") for fd in os.listdir(f"/proc/{watchdog}/fd")}
        assert {0, 1, 2} <= set(held) and all(held[fd] == "/dev/null" for fd in held if fd > 2), held
        assert held[0].startswith("pipe:") and held[1].endswith("watchdog.log") and held[2].endswith("watchdog.log"), held
        holders = {int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _holds(pid, held[0])}
        assert holders == {master, watchdog}, holders  # no instance keeps the master's end open
    finally:
        os.close(read_fd)
        pai("kill", job_id)


@pytest.mark.parametrize("child", ["master", "agent"])
def test_a_forked_child_keeps_its_descriptors_whatever_its_parent_left_to_collect(child, tmp_path):
    """The master, its watchdog and a local agent are forked from a process full of
    objects that own descriptors (the CLI's, a test runner's). Such an object,
    collected in the child after it let go of the parent's descriptors, closed
    whatever number the child had opened since: a CI run saw a local agent's pipe
    read EOF and a log write fail with EBADF."""
    dropped = [open(tmp_path / "dropped", "wb")]        # collected when the child drops it
    cycle: list = [open(tmp_path / "cycle", "wb")]      # collected by the cycle collector only
    cycle.append(cycle)
    numbers = (dropped[0].fileno(), cycle[0].fileno())
    gc.disable()   # (the parent must not collect the cycle before the fork)
    del cycle
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                if child == "master":
                    spawn.enter_process(((os.open(os.devnull, os.O_RDONLY), 0), (os.open(os.devnull, os.O_WRONLY), 1)), ())
                else:
                    spawn.enter_process((), keep=(local.AGENT_OUTPUT_FD,))
                # New pipes, until they reach the numbers the parent's objects own: they
                # take those very numbers if the child closed them (the lowest free first).
                pipes = [os.pipe()]
                while max(pipes[-1]) < max(numbers):
                    pipes.append(os.pipe())
                dropped.clear()
                gc.enable()
                gc.collect()
                for r, w in pipes:
                    os.write(w, b"x")   # EBADF (an exception: exit 1) once a number was closed
                    assert os.read(r, 1) == b"x"
                code = 0
            finally:
                os._exit(code)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, \
            "the child's own pipes were closed under it by its parent's objects"
    finally:
        gc.enable()
        dropped[0].close()


def _eof(fd: int) -> bool:
    try:
        return os.read(fd, 1) == b""
    except BlockingIOError:
        return False


def test_instances_get_default_signal_dispositions_even_from_nohup(pai_home, tmp_path):
    """`pai` started with SIGINT/SIGHUP/SIGTERM/SIGQUIT/SIGPIPE ignored (nohup, a
    script's background job): its instances still start with the defaults."""
    probe = tmp_path / "sigign.py"
    probe.write_text("import os\n"
                     "line = [l for l in open('/proc/self/status') if l.startswith('SigIgn:')][0]\n"
                     "print('ignored mask', int(line.split()[1], 16), flush=True)\n")
    ignoring = ("import os, signal, sys\n"
                "for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT, signal.SIGPIPE):\n"
                "    signal.signal(s, signal.SIG_IGN)\n"
                "os.execv(sys.executable, [sys.executable, '-m', 'paicli', *sys.argv[1:]])\n")
    result = subprocess.run([sys.executable, "-c", ignoring, "-name", "python", f"-Dscript={probe}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    mask = int(result.stdout.split("ignored mask ")[1].split()[0])
    # Not SIGPIPE: every Python interpreter ignores it at start-up by itself, so a
    # Python instance shows it ignored whatever it inherited (Popen restores it at exec).
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT):
        assert not mask & (1 << (signum - 1)), f"{signal.Signals(signum).name} ignored in the instance"


def test_the_backend_registry_names_the_valid_backends_and_rebuilds_a_jobs_backend(tmp_path, monkeypatch):
    from paicli.cluster import backends
    from paicli.errors import UsageError

    try:
        backends.get_backend({"backend": "nope"})
    except UsageError as err:
        assert err.message == "unknown backend 'nope'" and err.hint == "valid backends: local, ray, ssh"
    else:
        raise AssertionError("an unknown backend must be refused")
    monkeypatch.delenv("PAI_NODES", raising=False)
    monkeypatch.delenv("PAI_RAY_ADDRESS", raising=False)
    assert backends.submit_config(tmp_path) == {"backend": "local"}  # no nodes file: this machine alone
    backends.write_snapshot(tmp_path, {"backend": "local"})
    assert (tmp_path / "nodes.json").stat().st_mode & 0o777 == 0o600
    rebuilt = backends.backend_for_job(tmp_path)
    assert rebuilt.name == "local" and [n.name for n in rebuilt.nodes()] == ["local"]
    monkeypatch.setenv("PAI_RAY_ADDRESS", "10.0.0.1:6379")
    assert backends.submit_config(tmp_path) == {"backend": "ray", "address": "10.0.0.1:6379"}


# -- the one instance engine (cluster/agent_link.py, runners/node_agent.py) -----------------------


def test_agent_frames_decode_the_same_however_the_stream_is_cut():
    import struct

    from paicli.cluster.agent_link import Link, _Gone

    def frame(kind: bytes, payload: bytes = b"") -> bytes:
        return kind + struct.pack(">I", len(payload)) + payload

    stream = (frame(b"I", b'{"pid": 1, "pgid": 1, "start": "5", "boot": ""}') + frame(b"O", b"abc") + frame(b"H")
              + frame(b"O", b"de\n") + frame(b"X", b'{"status": -15}'))
    for cut in range(len(stream) + 1):
        for second in range(cut, len(stream) + 1):
            link = Link(_Gone(), "n")
            out = link.feed(stream[:cut]) + link.feed(stream[cut:second]) + link.feed(stream[second:])
            assert (out, link.status, link.first[0]) == (b"abcde\n", -15, b"I"), (cut, second)


class _SocketTransport:
    """The transport of a remote agent (one byte stream both ways, no fd the master
    reads itself), over a socketpair to a real agent process."""

    def __init__(self, sock):
        self.sock = sock

    def send(self, data):
        self.sock.sendall(data)

    def recv(self, max_bytes, timeout):
        self.sock.settimeout(timeout)
        return self.sock.recv(max_bytes)

    def close(self):
        self.sock.close()


def _remote_style_agent():
    import socket

    from paicli.cluster.backends.local import AGENT

    ours, theirs = socket.socketpair()
    agent = subprocess.Popen([sys.executable, "-I", "-S", AGENT, "run", "job/worker:0"], stdin=theirs,
                             stdout=theirs, start_new_session=True)
    theirs.close()
    return agent, _SocketTransport(ours)


def _read_all(handle, timeout=30) -> bytes:
    import select

    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        select.select([handle.output_fd], [], [], 0.5)
        try:
            data = os.read(handle.output_fd, 65536)
        except BlockingIOError:
            continue
        if not data:
            return out
        out += data
    raise AssertionError(f"no end of output within {timeout}s: {out!r}")


def test_a_remote_style_link_streams_output_reports_the_exit_and_stops_by_its_bytes():
    """The pump mode of agent_link (what SSH and Ray use), against a real agent."""
    from paicli.cluster import agent_link

    agent, transport = _remote_style_agent()
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(5)"
    handle = agent_link.start_instance(transport, {"argv": [sys.executable, "-c", code], "env": {}, "heartbeat": 6},
                                       backend="ssh", node="n1", host="h", start_timeout=30)
    try:
        assert handle.ref.start and handle.ref.pid > 0
        assert sorted(_read_all(handle).splitlines()) == [b"err", b"out"]
        assert handle.native.wait(30) == 5
        assert agent.wait(timeout=10) == 0
    finally:
        os.close(handle.output_fd)
    agent, transport = _remote_style_agent()
    handle = agent_link.start_instance(transport, {"argv": ["sleep", "600"], "env": {}, "heartbeat": 6},
                                       backend="ssh", node="n1", host="h", start_timeout=30)
    try:
        assert handle.native.signal(signal.SIGTERM)
        assert handle.native.wait(30) == -signal.SIGTERM
        assert processes_in({handle.ref.pgid}) == []
    finally:
        os.close(handle.output_fd)
        agent.wait(timeout=10)
    # Its links ended, the heartbeat thread goes: a thread left in this process
    # would make every later master forked from it start as a fresh interpreter.
    assert wait_until(lambda: "agent-heartbeat" not in _thread_names(), timeout=EVENT_DEADLINE), _thread_names()


def _thread_names() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate()]


def test_a_silent_agent_is_a_lost_node_and_a_silent_master_stops_the_instance():
    """Heartbeats both ways: a frozen agent (no H frame for `heartbeat` s) makes the
    master's side report NODE_LOST; the agent, thawed, hears nothing from the
    master within `heartbeat` s either (its link was closed) and stops the group."""
    from paicli.cluster import agent_link
    from paicli.cluster.backends.base import NODE_LOST

    agent, transport = _remote_style_agent()
    handle = agent_link.start_instance(transport, {"argv": ["sleep", "600"], "env": {}, "heartbeat": 2},
                                       backend="ssh", node="n1", host="h", start_timeout=30)
    try:
        os.kill(agent.pid, signal.SIGSTOP)
        assert handle.native.wait(30) == NODE_LOST
        assert processes_in({handle.ref.pgid}) != []
        os.kill(agent.pid, signal.SIGCONT)
        assert agent.wait(timeout=30) == 1
        assert wait_until(lambda: processes_in({handle.ref.pgid}) == [], timeout=EVENT_DEADLINE)
    finally:
        os.close(handle.output_fd)
        for kill, target, signum in ((os.kill, agent.pid, signal.SIGCONT), (os.killpg, handle.ref.pgid, signal.SIGKILL)):
            try:
                kill(target, signum)
            except ProcessLookupError:
                pass
        agent.wait(timeout=10)


def test_a_local_agent_that_ends_before_it_answers_says_how_it_ended():
    """A local agent that dies before it gives the instance's identity: the
    instance's line says how the agent ended (one CI run saw a bare "ended before
    it started the instance"), and the handle reports the node lost."""
    from paicli.cluster import agent_link
    from paicli.cluster.backends.base import NODE_LOST
    from paicli.cluster.backends.local import AgentProcess

    agent = AgentProcess("job/worker:0")
    os.kill(agent.pid, signal.SIGSTOP)   # the spec waits in its pipe, unread
    starting = agent_link.send_spec(agent, {"argv": ["true"], "env": {}, "heartbeat": 0})
    os.kill(agent.pid, signal.SIGKILL)
    handle = starting.started(backend="local", node="local", host="127.0.0.1", start_timeout=30)
    try:
        assert handle.native.poll() == NODE_LOST
        line = _read_all(handle).decode()
        assert "the node agent ended before it started the instance" in line, line
        assert f"(its agent (pid {agent.pid}): killed by SIGKILL)" in line, line
    finally:
        os.close(handle.output_fd)   # (the agent's own output pipe went with the start given up)


def test_an_agent_signalled_as_it_starts_the_instance_still_stops_it(tmp_path):
    """A SIGTERM that reaches the agent just after it started the instance (before
    the identity is out) used to end it at the default disposition, leaving the
    instance running with nobody to stop it. The agent catches it from before
    the start: the identity goes out, and the instance's group is stopped."""
    pidfile = tmp_path / "instance.pid"
    agent_code = ("import os, signal, subprocess, sys\n"
                  "from paicli.runners import node_agent\n"
                  "real = subprocess.Popen\n"
                  "def popen(*args, **kwargs):\n"
                  "    proc = real(*args, **kwargs)\n"
                  f"    open({str(pidfile)!r}, 'w').write(str(proc.pid))\n"
                  "    os.kill(os.getpid(), signal.SIGTERM)\n"
                  "    return proc\n"
                  "node_agent.subprocess.Popen = popen\n"
                  "sys.exit(node_agent.cmd_run('job/worker:0'))\n")
    agent = subprocess.Popen([sys.executable, "-c", agent_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             start_new_session=True, restore_signals=True, preexec_fn=default_signals)
    spec = {"argv": [sys.executable, "-c", "import time; time.sleep(600)"], "env": {}, "heartbeat": 0}
    instance = 0
    try:
        frames, _ = agent.communicate(json.dumps(spec).encode() + b"\n", timeout=EVENT_DEADLINE)
        instance = int(pidfile.read_text())
        assert frames[:1] == b"I", frames          # the identity went out
        assert json.loads(frames[5:5 + int.from_bytes(frames[1:5], "big")])["pid"] == instance
        assert agent.returncode == 1               # it stopped the instance and left
        assert wait_until(lambda: processes_in({instance}) == [], timeout=EVENT_DEADLINE), processes_in({instance})
    finally:
        agent.kill()
        agent.wait()
        if instance:
            kill_groups({instance})


def test_a_stop_on_a_node_that_does_not_answer_is_tried_again_then_reported(capfd):
    """The retry of a transport call lives once, in base.Backend: a backend's
    `_stop_refs` that fails once is called again; one that keeps failing is
    given up with one line naming the node."""
    class Flaky(LocalBackend):
        failures = 1

        def _stop_refs(self, node, refs, timeout):
            if self.failures:
                self.failures -= 1
                raise OSError("connection reset")
            return super()._stop_refs(node, refs, timeout)

    proc = _sleeper()
    try:
        ref = _ref_of(proc.pid)
        assert Flaky().stop_all([ref], 2) == [ref]
        assert proc.wait(timeout=10) == -signal.SIGTERM
        down = Flaky()
        down.failures = 2
        assert down.stop_all([ref], 2) == []
        assert "could not stop 1 instance(s) on node local: OSError: connection reset" in capfd.readouterr().err
    finally:
        proc.kill()
        proc.wait()


def test_a_dead_master_takes_its_instances_with_it_even_without_a_watchdog(pai_home, tmp_path):
    """The node agent holds the master's end of a pipe: when the master dies (here
    with its watchdog, so that nothing else is left to clean up), the agent reads
    EOF and stops its instance's whole group, with no `pai` command looking."""
    pidfile = tmp_path / "pids"
    job_id = pai("--detach", "-name", "python", f"-Dscript={BEHAVE}",
                 env={"BEHAVE": f"pidfile:{pidfile},child,print:1,sleep:600"}).stdout.strip()
    groups: set[int] = set()
    try:
        assert wait_until(lambda: pidfile.exists(), timeout=EVENT_DEADLINE)
        groups = {pgid for _, pgid, _ in pids_from(pidfile).values()}
        assert len(processes_in(groups)) >= 2   # the instance and its child
        os.kill(watchdog_pid(pai_home, job_id), signal.SIGKILL)
        os.kill(Store(pai_home).job(job_id)["master_pid"], signal.SIGKILL)
        assert wait_until(lambda: processes_in(groups) == [], timeout=EVENT_DEADLINE), processes_in(groups)
    finally:
        kill_groups(groups)


def test_a_start_the_backend_refuses_at_once_hands_its_error_to_the_master():
    """The backend may refuse an instance as it is asked for (an agent that cannot be
    forked): the call the master waits on raises that error, which the master turns
    into the instance's exit 126/127, not a NameError of its own."""
    from types import SimpleNamespace

    from paicli.cluster.master import JobMaster

    refusal = PermissionError(13, "Permission denied")

    class Refusing:
        def begin_start(self, *args, **kwargs):
            raise refusal

    master = object.__new__(JobMaster)
    master.backend = Refusing()
    inst = SimpleNamespace(placed=None, role=SimpleNamespace(argv=["/bin/x"], cwd=None))
    finish = master._ask(inst, ({}, SimpleNamespace(watch=None, sink=None)))
    with pytest.raises(PermissionError) as raised:
        finish()
    assert raised.value is refusal
