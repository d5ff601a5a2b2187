"""The queue with real jobs, real masters, a real sshd: two jobs needing the same
GPU run one after the other, priorities reorder, a queued job survives the
CLI's death, `pai kill` takes a waiting job out; quotas, the timeout of a wait
and a supervisor restarted after it was lost (as after a reboot). Tiny python
jobs that wait for a file (tests/scripts/gate.py), so the order is the test's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PAI, ROOT, job_id_from, pai, pai_json, wait_until, watchdog_says
from paicli.jobstatus import SUPERVISOR_GONE
from netns import SSHD

GATE = ROOT / "tests" / "scripts" / "gate.py"


def submit(gate: Path, *extra: str) -> str:
    result = pai("--detach", "-name", "python", f"-Dscript={GATE}", f"-DuserDefinedParameters={gate}", *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.split()[0]   # --detach: the ID alone


def status(job_id: str) -> dict:
    return pai_json("status", job_id)


def state_is(job_id: str, wanted: str, timeout: float = 30) -> dict:
    info = wait_until(lambda: (lambda s: s if s["status"] == wanted else None)(status(job_id)), timeout, 0.2)
    assert info, f"{job_id} is {status(job_id)['status']}, not {wanted}"
    return info


def master_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads: line for {pid}")


@pytest.fixture
def gates(tmp_path):
    """Gate files; every one opened at the end, and every unfinished job killed."""
    made: list[Path] = []

    def gate(name: str) -> Path:
        made.append(tmp_path / f"gate-{name}")
        return made[-1]

    yield gate
    for path in made:
        path.touch()
    listed = pai("list", "--json", "-n", "50")
    for job in json.loads(listed.stdout) if listed.returncode == 0 else []:
        if job["status"] in ("Waiting", "Running"):
            pai("kill", job["id"], timeout=60)


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(SSHD), reason="needs root and sshd (a loopback node)")
def test_one_gpu_two_jobs_priorities_cli_death_and_kill_of_a_waiting_job(tmp_path, monkeypatch, pai_home, gates, store_kind):
    from netns import LoopbackHost

    with LoopbackHost(Path("/var/tmp") / f"paicli-qlo-{os.getpid()}") as lo:
        nodes = tmp_path / "nodes.yaml"
        nodes.write_text(json.dumps({"known_hosts": str(lo.known_hosts), "nodes": [
            lo.node(cpu=400, memory=4000, gpu=1, work_dir=str(tmp_path / "work"))]}))
        monkeypatch.setenv("PAI_NODES", str(nodes))
        gpu = "-DgpuRequired=100"
        a = submit(gates("a"), gpu)
        state_is(a, "Running")
        # b in the foreground: its Waiting List line, then its CLI dies (kill -9)
        b_cli = subprocess.Popen([*PAI, "-name", "python", f"-Dscript={GATE}",
                                  f"-DuserDefinedParameters={gates('b')}", gpu],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen = []
        for line in b_cli.stdout:
            seen.append(line)
            if "waiting:" in line:
                break
        b = job_id_from("".join(seen))
        assert seen[-1].strip() == f"[pai] waiting: 1st in queue; worker needs gpu 100, lo has 0 free (held by {a})"
        os.kill(b_cli.pid, signal.SIGKILL)
        b_cli.wait()
        b_cli.stdout.close()
        c = submit(gates("c"), gpu, "-Dpriority=5")
        d = submit(gates("d"), gpu)
        queued = wait_until(lambda: [q["id"] for q in pai_json("queue")] == [c, b, d] and pai_json("queue"), 15)
        assert queued, pai_json("queue")
        assert [(q["position"], q["priority"]) for q in queued] == [(1, 5), (2, 0), (3, 0)]
        # A waiting job keeps no connection to its node: the probe's (made by its master
        # as the submit began) are let go, and the master is one thread again, so the
        # wake-up signal its turn comes with cannot go to another thread (on a team
        # store, one more: the listener for its turn, which blocks the signals).
        alone = 1 if store_kind == "sqlite" else 2
        for job in (b, c, d):
            pid = status(job)["master_pid"]
            assert wait_until(lambda: threads(pid) == alone, 15), f"{job}'s master has {threads(pid)} threads"
        assert status(b)["status"] == "Waiting" and status(b)["reason"].startswith("waiting: 2nd in queue; ")
        listed = pai("list").stdout
        assert re.search(rf"Waiting +{b} .*waiting: 2nd in queue", listed), listed
        # pai kill of a waiting job: out of the queue, its supervisor gone, nothing started
        d_master = status(d)["master_pid"]
        killed = pai("kill", d)
        assert killed.returncode == 0 and f"{d} cancelled" in killed.stdout, killed.stdout + killed.stderr
        assert wait_until(lambda: not master_alive(d_master), 5), "the waiting job's master is still there"
        d_info = status(d)
        assert d_info["status"] == "Cancelled" and not any(i["pid"] for i in d_info["instances"])
        assert [q["id"] for q in pai_json("queue")] == [c, b]
        # a ends: c (priority 5) starts before b, though b was submitted first
        gates("a").touch()
        state_is(c, "Running")
        assert status(b)["status"] == "Waiting"
        gates("c").touch()
        gates("b").touch()
        b_info = state_is(b, "Succeeded", 60)
        a_info, c_info = status(a), state_is(c, "Succeeded")
        assert a_info["ended"] <= c_info["started"] + 0.5 and c_info["ended"] <= b_info["started"] + 0.5
        assert all(i["node"] == "lo" for i in b_info["instances"])
        assert "started" in pai("logs", b).stdout
        assert pai_json("queue") == []


SMALL = '-Dcluster={"worker":{"count":1,"cpu":10}}'


def project_p_full(tmp_path: Path, monkeypatch, gates) -> str:
    """A quota of cpu 10 for project p, and a job of p holding all of it (open
    gate "a" to end it): the next jobs of p wait. Returns its ID."""
    quota = tmp_path / "quota.yaml"
    quota.write_text("p: {cpu: 10}\n")
    monkeypatch.setenv("PAI_QUOTA", str(quota))
    a = submit(gates("a"), SMALL, "-project", "p")
    state_is(a, "Running")
    return a


def swept(pai_home: Path, job_id: str) -> None:
    """Wait for the running job's watchdog to have made its one sweep of the home's
    lost jobs (cluster/watchdog.py, SWEEP_AFTER after it starts)."""
    watchdog_says(pai_home / "jobs" / job_id, "swept the home's lost jobs", 30)


def test_quota_timeout_and_a_lost_supervisor_restarted(tmp_path, monkeypatch, pai_home, gates):
    a = project_p_full(tmp_path, monkeypatch, gates)
    b = submit(gates("b"), SMALL, "-project", "p")
    other = submit(gates("q"), SMALL, "-project", "q")   # another project is not held up
    state_is(other, "Running")
    info = wait_until(lambda: (lambda s: s if s["reason"] else None)(status(b)), 10)
    assert info["status"] == "Waiting"
    assert info["reason"] == "waiting: 1st in queue; project p over its quota: holds cpu 10 of 10, needs 10 more"
    shown = pai("console", input="show queue;\n").stdout   # the console's verb for `pai queue`
    assert re.search(rf"^1 +{b} +gate +0 +p .* cpu 10 +project p over its quota", shown, re.M), shown
    # bigger than its quota: never, exit 2, one line
    too_big = pai("-name", "python", f"-Dscript={GATE}", '-Dcluster={"worker":{"count":2,"cpu":10}}', "-project", "p")
    assert too_big.returncode == 2
    assert too_big.stderr.startswith(
        "pai: error: the job needs cpu 20, more than the quota of -project p (cpu 10); "), too_big.stderr
    assert len(too_big.stderr.splitlines()) == 1
    # -Dtimeout covers the wait
    t = submit(gates("t"), SMALL, "-project", "p", "-Dtimeout=2")
    timed_out = state_is(t, "Cancelled", 20)
    assert timed_out["reason"].startswith("timeout while waiting in the queue")
    # The running jobs' watchdogs have made their sweep of lost jobs (once each, a
    # little after they start): none comes between b's supervisor's death and the reader.
    for running in (a, other):
        swept(pai_home, running)
    # b's supervisor dies (as in a reboot): a reader shows it so and starts nothing (issue 16) ...
    old = status(b)["master_pid"]
    os.kill(old, signal.SIGKILL)
    assert wait_until(lambda: not master_alive(old), 5)
    new = pai_json("list")
    assert [(j["status"], j["reason"]) for j in new if j["id"] == b] == \
        [("Waiting", f"waiting: 1st in queue; project p over its quota: holds cpu 10 of 10, needs 10 more;"
                     f" {SUPERVISOR_GONE}")]
    assert status(b)["master_pid"] == old
    # ... and the queue's next move, a's end, starts another, which takes b's turn
    gates("a").touch()
    pid = wait_until(lambda: (lambda p: p if p not in (None, old) else None)(status(b)["master_pid"]), 60, 0.2)
    assert pid and pid != old and wait_until(lambda: master_alive(pid), 5)
    events = subprocess.run([sys.executable, "-c", "import sys; from paicli.store import Store;"
                             " print([e['message'] for e in Store().events(sys.argv[1])])", b],
                            capture_output=True, text=True).stdout
    assert "a new one takes its place in the queue" in events
    state_is(b, "Running")
    gates("b").touch()
    gates("q").touch()
    state_is(b, "Succeeded")


def test_a_queued_job_whose_supervisor_is_gone_is_revived_by_a_writer_never_by_a_reader(tmp_path, monkeypatch,
                                                                                        pai_home, gates):
    """Issue 16: `pai queue`, `list` and `status` only show that a waiting job's
    supervisor is gone; `pai queue --revive` (what to run after a reboot) gives it
    a new one; `pai kill` of such a job cancels it (nothing of it ran), not "master lost"."""
    a = project_p_full(tmp_path, monkeypatch, gates)
    b = submit(gates("b"), SMALL, "-project", "p")
    c = submit(gates("c"), SMALL, "-project", "p")
    assert wait_until(lambda: [q["id"] for q in pai_json("queue")] == [b, c] and status(c)["reason"], 20)
    swept(pai_home, a)   # a's watchdog's one sweep is not what gives b and c their new supervisors
    old = {job: status(job)["master_pid"] for job in (b, c)}
    for pid in old.values():
        os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not any(master_alive(pid) for pid in old.values()), 5)
    shown = pai_json("queue")
    assert [(q["id"], q["waiting_for"].endswith(f"; {SUPERVISOR_GONE}")) for q in shown] == [(b, True), (c, True)]
    assert pai("queue").stdout.count("its supervisor is gone") == 2
    assert status(c)["reason"].endswith(f"; {SUPERVISOR_GONE}")
    assert {job: status(job)["master_pid"] for job in (b, c)} == old     # nothing started by reading
    revived = pai("queue", "--revive")
    assert revived.returncode == 0, revived.stderr
    assert sorted(revived.stderr.splitlines()) == sorted(f"{job}: a new supervisor takes its place in the queue"
                                                         for job in (b, c))
    new = {job: status(job)["master_pid"] for job in (b, c)}
    assert all(new[job] not in (None, old[job]) and wait_until(lambda: master_alive(new[job]), 5) for job in new)
    assert not any(SUPERVISOR_GONE in q["waiting_for"] for q in pai_json("queue"))
    # c's new supervisor dies too: `pai kill c` takes it out of the queue, Cancelled
    os.kill(new[c], signal.SIGKILL)
    assert wait_until(lambda: not master_alive(new[c]), 5)
    killed = pai("kill", c)
    assert killed.returncode == 0 and f"{c} cancelled" in killed.stdout, killed.stdout + killed.stderr
    c_info = status(c)
    assert (c_info["status"], c_info["reason"], c_info["unrecorded"]) == ("Cancelled", "cancelled by user", False)
    assert [q["id"] for q in pai_json("queue")] == [b]
    gates("a").touch()
    state_is(b, "Running")
    gates("b").touch()
    state_is(b, "Succeeded")
