"""A job followed to its end: the master's loop (coalesced reads, exits acted on at
once, agents reaped later), the attached view's follower (inotify, the master's
pidfd, the pipe closed once the job's record is complete), the master's own
process (started before the job is recorded, leaving at EOF without one), and the
bench's own processes."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from conftest import BEHAVE, ROOT, job_id_from, pai, wait_until

def test_a_released_watch_stops_watching_at_once_and_closes_without_a_thread(tmp_path):
    """At a verdict the attached view removes its inotify watch (the kernel reaps
    it in the background) and closes the descriptor only as it leaves: closed at
    once, or left to the process's exit, the descriptor waited 0-24 ms for that
    reaping. No thread: `pai` leaves by the fast exit (exit_now takes the slow one
    while a thread lives)."""
    import threading

    from paicli.logtail import DirectoryWatch

    watch = DirectoryWatch(tmp_path)
    fd = watch.fd
    assert fd >= 0
    with open(f"/proc/self/fdinfo/{fd}") as info:
        assert "inotify wd:" in info.read()   # the probe sees a live watch
    threads = threading.active_count()
    watch.release()
    assert watch.fd == -1 and threading.active_count() == threads
    with open(f"/proc/self/fdinfo/{fd}") as info:
        assert "inotify wd:" not in info.read()   # removed now, the descriptor still open
    (tmp_path / "job.log").write_text("x\n")
    watch.wait(0.01)   # no descriptor watched: a short sleep, not a select on the released one
    watch.close()
    with pytest.raises(OSError):
        os.fstat(fd)   # closed for real
    watch.close()      # twice: nothing left to close


def test_a_watch_with_nothing_to_watch_takes_an_overdue_wait_as_none(tmp_path):
    """After the verdict the follower has released its watch; where no pidfd and no
    wake-up pipe are at hand either, a look already due asks for a negative wait.
    It must return, not raise (time.sleep refused it: `pai` ended an attached job
    that had succeeded with "internal error: ValueError", seen in the overhead bench)."""
    from paicli.logtail import DirectoryWatch

    watch = DirectoryWatch(tmp_path)
    watch.release()
    assert watch.wait(-0.003) is False
    watch.close()


def test_a_follower_waits_on_the_master_exit_through_its_pidfd(tmp_path):
    """After a verdict the attached view sleeps until the master exits (its pidfd),
    not in 5 ms polls; the pidfd is of the recorded master only."""
    import time

    from paicli import jobstatus
    from paicli.cluster.procinfo import start_time
    from paicli.logtail import DirectoryWatch

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    try:
        job = {"master_pid": proc.pid, "master_start": start_time(proc.pid), "created": time.time(),
               "supervised": None}
        fd = jobstatus.master_exit_fd(job)
        assert fd >= 0
        assert jobstatus.master_exit_fd({**job, "master_start": "1"}) == -1   # another process's pid: none
        watch = DirectoryWatch(tmp_path)
        watch.release()
        t0 = time.monotonic()
        assert watch.wait(30, exited=fd)   # woken by the exit, long before the timeout
        assert time.monotonic() - t0 < 20
        os.close(fd)
        watch.close()
    finally:
        proc.kill()
        proc.wait()


def test_the_master_reads_what_a_step_printed_in_one_round_and_an_exit_at_once():
    """A worker's line wakes the master; the other worker's line of the same step,
    printed within the window, is read in the same round (one wake-up per step, not
    one per line, taken from the workers' cores). A child's exit waits for nothing."""
    import selectors

    from paicli.cluster.master import COALESCE_S, ready_together

    selector = selectors.DefaultSelector()
    pipes = [os.pipe() for _ in range(3)]
    try:
        for (read_fd, _w), data in zip(pipes, ("worker:0", "worker:1", None)):
            selector.register(read_fd, selectors.EVENT_READ, data)
        slept = []

        def meanwhile(seconds):   # the window passes; worker:1 prints during it
            slept.append(seconds)
            os.write(pipes[1][1], b"step=1\n")

        import threading

        later = threading.Timer(0.05, os.write, (pipes[0][1], b"step=1\n"))   # while the master waits
        later.start()
        ready = ready_together(selector, 30.0, sleep=meanwhile)
        later.join()
        assert sorted(key.data for key, _ in ready) == ["worker:0", "worker:1"] and slept == [COALESCE_S]
        assert 0 < COALESCE_S <= 0.01   # well inside the tail's latency goal (p99 <= 100 ms)
        # Output already waiting (a flood, a backlog) is read at once.
        slept.clear()
        assert len(ready_together(selector, 30.0, sleep=meanwhile)) == 2 and slept == []
        for read_fd, _w in pipes[:2]:
            os.read(read_fd, 100)
        later = threading.Timer(0.05, os.write, (pipes[2][1], b"x"))   # SIGCHLD's wake-up byte
        later.start()
        ready = ready_together(selector, 30.0, sleep=meanwhile)
        later.join()
        assert [key.data for key, _ in ready] == [None] and slept == []
    finally:
        selector.close()
        for read_fd, write_fd in pipes:
            os.close(read_fd)
            os.close(write_fd)


def test_output_that_came_sooner_than_the_window_is_read_at_once():
    """In a flood the master reads every pipe, then waits for the next line a few
    microseconds: sleeping the window then left 64 writers blocked on full pipes
    and both cores idle. Only a wait of the window or longer (a step's first line
    after a quiet stretch) is followed by the window."""
    import selectors

    from paicli.cluster.master import COALESCE_S, ready_together

    selector = selectors.DefaultSelector()
    read_fd, write_fd = os.pipe()
    try:
        selector.register(read_fd, selectors.EVENT_READ, "worker:0")
        for waited, windows in ((COALESCE_S / 10, []), (COALESCE_S, [COALESCE_S])):
            slept = []
            times = iter((100.0, 100.0 + waited))
            os.write(write_fd, b"x\n")
            # Nothing is ready at the first look (select(0)), the line is at the second.
            looks = iter(([], [(selector.get_key(read_fd), 1)], [(selector.get_key(read_fd), 1)]))
            selector.select = lambda timeout: next(looks)
            ready = ready_together(selector, 30.0, sleep=slept.append, clock=lambda: next(times))
            assert [key.data for key, _ in ready] == ["worker:0"] and slept == windows, waited
            os.read(read_fd, 10)
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_a_round_of_the_pump_writes_the_combined_log_once(tmp_path):
    """One round of the master's loop reads each instance that has output once; the
    round's lines go to job.log in one write, in the order they were read, instead
    of one write per read: each write woke the attached `pai` (inotify) to read a
    few KB, ~7000 times a million lines (bench_core.py logtail)."""
    import selectors
    from types import SimpleNamespace

    from paicli.cluster.logsink import InstanceLog, JobLog, MetricParser

    jm = pumping_master(None, selectors.DefaultSelector())
    jm.job_id = "j"
    jm.joblog = JobLog(tmp_path / "job.log", MetricParser([]), cap=1 << 30)
    writes = []
    write = jm.joblog.file.write
    jm.joblog.file.write = lambda data: writes.append(data) or write(data)
    pipes = [os.pipe() for _ in range(3)]
    try:
        for idx, (read_fd, write_fd) in enumerate(pipes):
            log = InstanceLog(tmp_path / f"w{idx}.log", f"[worker:{idx}] ", cap=1 << 30)
            jm.selector.register(read_fd, selectors.EVENT_READ,
                                 SimpleNamespace(role=SimpleNamespace(name="worker"), idx=idx, log=log))
            os.write(write_fd, b"".join(b"line %d\n" % n for n in range(100)))
        jm._pump(1.0)
        assert len(writes) == 1
        shown = (tmp_path / "job.log").read_bytes().splitlines()
        assert len(shown) == 300 and {line.split(b"]")[0] for line in shown} == {b"[worker:0", b"[worker:1", b"[worker:2"}
        assert [line for line in shown if line.startswith(b"[worker:1]")][-1] == b"[worker:1] line 99"
    finally:
        jm.selector.close()
        for fd in (fd for pair in pipes for fd in pair):
            os.close(fd)


def test_the_coalescing_window_ends_when_a_child_exits():
    """An instance's last output is followed by its agent's exit: with the SIGCHLD
    self-pipe given, the window ends at that exit instead of running out (the job's
    verdict waits on it), and what came meanwhile is read in the same round."""
    import selectors
    import threading
    import time

    from paicli.cluster.master import ready_together

    selector = selectors.DefaultSelector()
    output, wake = os.pipe(), os.pipe()
    timers = []
    try:
        selector.register(output[0], selectors.EVENT_READ, "worker:0")
        selector.register(wake[0], selectors.EVENT_READ, None)
        timers = [threading.Timer(0.05, os.write, (output[1], b"last line\n")),
                  threading.Timer(0.3, os.write, (wake[1], b"x"))]   # the agent exits during the window
        for timer in timers:
            timer.start()
        began = time.monotonic()
        waited = iter((0.0, 60.0))   # the line came after a quiet minute: the window applies
        ready = ready_together(selector, 30.0, window=60.0, wake_fd=wake[0], clock=lambda: next(waited))
        assert time.monotonic() - began < 30.0   # not the 60 s window: the exit ended it
        assert sorted(str(key.data) for key, _ in ready) == ["None", "worker:0"]
    finally:
        for timer in timers:
            timer.cancel()
            timer.join()
        selector.close()
        for fd in (*output, *wake):
            os.close(fd)


def pumping_master(backend, selector=None):
    """A JobMaster with only what its pump (_pump, _stop) needs: `backend`, `selector`,
    and a job log and outputs that take nothing."""
    from paicli.cluster import master as master_mod

    jm = object.__new__(master_mod.JobMaster)
    jm.selector, jm.wake_fd, jm.backend, jm.stop_timeout = selector, None, backend, 1.0
    jm.joblog = type("Log", (), {"refresh_live": lambda self, now: None, "take_metrics": lambda self: [],
                                 "hold": lambda self: None, "release": lambda self: None})()
    jm.outputs = type("Outputs", (), {"flush": lambda self: None})()
    jm.metrics_due = float("inf")
    return jm


def test_the_master_stops_instances_without_a_coalescing_window(monkeypatch):
    """While instances are being stopped the master waits for their exits, not for
    a step's lines: its pump then reads what wakes it at once."""
    from paicli.cluster import master as master_mod

    windows = []
    monkeypatch.setattr(master_mod, "ready_together",
                        lambda selector, timeout, window, wake_fd=None: windows.append(window) or [])

    class Backend:
        def stop_all(self, refs, timeout, waiting):
            waiting()
            return []

        def poll(self, handle):
            return None

    jm = pumping_master(Backend())
    jm._stop([], master_mod.InstanceStatus.TERMINATED)
    jm._pump(0.1)
    assert windows == [0, master_mod.COALESCE_S]


def test_the_master_acts_on_an_exit_status_before_the_agent_has_exited():
    """A local agent sends its instance's exit status, then exits (a forked
    process's teardown, ~2-3 ms): the status wakes the master's loop (AgentFrames)
    while the agent still runs, the link reads it, and the frames stop being
    watched; the agent's link is closed without waiting for it to exit."""
    import selectors

    from paicli.cluster import agent_link
    from paicli.cluster import master as master_mod
    from paicli.cluster.backends.base import Handle, InstanceRef

    class Agent:   # the transport of a local agent that has sent X and has not exited
        def __init__(self):
            self.frames, self.write_end = os.pipe()
            self.closed = False

        def fileno(self):
            return self.frames

        def send(self, data):
            pass

        def close(self):
            self.closed = True
            os.close(self.frames)

    agent = Agent()
    link = agent_link.Link(agent, "local")
    ref = InstanceRef(backend="local", node="local", host="127.0.0.1", pid=1, pgid=1, start=None, boot_id=None)
    handle = Handle(ref=ref, output_fd=-1, native=link)
    jm = pumping_master(type("Backend", (), {"poll": lambda self, h: h.native.poll()})(),
                        selectors.DefaultSelector())
    inst = master_mod.Instance(role=None, idx=0, placed=None, handle=handle)
    try:
        jm._watch_frames(inst, handle)
        assert inst.frames_fd >= 0
        os.write(agent.write_end, agent_link.HEAD.pack(b"X", 12) + b'{"status":3}')
        ready = master_mod.ready_together(jm.selector, 30.0, window=60.0)
        assert [type(key.data) for key, _ in ready] == [master_mod.AgentFrames]   # no window for it
        jm._pump(30.0)
        assert inst.frames_fd == -1 and agent.closed and link.poll() == 3
    finally:
        jm.selector.close()
        os.close(agent.write_end)


def test_a_closed_local_agent_is_reaped_later_not_waited_for():
    """LocalBackend's agents: close() returns at once, however long the agent takes
    to exit; the agent is reaped once it has (procinfo.reap_children), and a job's
    cleanup waits for it, SIGKILLing one that never exits."""
    import signal
    import time

    from paicli.cluster.backends.local import AgentProcess
    from paicli.cluster.procinfo import reap_children

    agent = AgentProcess("job/worker:0")
    os.kill(agent.pid, signal.SIGSTOP)   # it cannot read its EOF
    began = time.monotonic()
    agent.close()
    assert agent.exit_code is None and time.monotonic() - began < 5   # the old close waited 10 s, then SIGKILLed
    reap_children()
    assert agent.exit_code is None
    os.kill(agent.pid, signal.SIGCONT)   # it reads EOF and exits
    reap_children(30)
    assert agent.exit_code == 0
    stuck = AgentProcess("job/worker:1")
    os.kill(stuck.pid, signal.SIGSTOP)
    stuck.close()
    reap_children(0.2)
    assert stuck.exit_code == -signal.SIGKILL


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return None


def test_an_attached_job_ends_with_the_status_its_master_wrote(pai_home):
    """The master writes the ended job's status beside summary.txt (0600); the CLI
    that followed the job prints it rather than building it again, but only while
    the store still agrees with it."""
    import json

    from paicli import jobstatus
    from paicli.store import Store

    result = pai("-name", "python", f"-Dscript={ROOT / 'tests' / 'scripts' / 'behave.py'}", env={"BEHAVE": "print:1"})
    assert result.returncode == 0, result.stderr
    job_id = job_id_from(result.stdout)
    kept = pai_home / "jobs" / job_id / jobstatus.FINAL_STATUS
    assert oct(kept.stat().st_mode & 0o777) == "0o600"
    store = Store(pai_home)
    try:
        built = jobstatus.build_status(store, job_id)
        assert json.loads(kept.read_text()) == built and built["status"] == "Succeeded"
        # What the file says is what the CLI gets ...
        kept.write_text(json.dumps(dict(built, name="from the master's file")))
        assert jobstatus.final_status(store, job_id)["name"] == "from the master's file"
        # ... unless the store says otherwise (a later writer, another attempt).
        kept.write_text(json.dumps(dict(built, name="stale", job_attempt=built["job_attempt"] + 1)))
        assert jobstatus.final_status(store, job_id)["name"] == built["name"]
        kept.write_text("{not json")
        assert jobstatus.final_status(store, job_id) == built
        kept.unlink()
        assert jobstatus.final_status(store, job_id) == built
    finally:
        store.close()


def test_a_follower_ends_once_the_record_is_complete_not_when_the_master_exits(tmp_path, store_kind):
    """The master closes the pipe it wrote its pid to once the job's record is
    complete (its verdict, its summary file), then waits for its agents' exits and
    exits itself: a follower given that pipe (client.hand_over) shows the
    verdict then, not after the master's own exit."""
    import io
    import time

    from paicli import logtail
    from paicli.cluster.procinfo import start_time
    from paicli.states import JobStatus
    from paicli.store import Store

    store = Store(tmp_path)
    master = subprocess.Popen(["sleep", "120"])   # a master still at its cleanup
    recorded_r, recorded_w = os.pipe()
    try:
        job_dir = tmp_path / "jobs" / "job1"
        job_dir.mkdir(parents=True)
        (job_dir / "job.log").write_text("[worker:0] step=0\n[pai] job Succeeded\n")
        store.create_job("job1", name="n", framework="python", project=None, task_name="PythonTask",
                         job_dir=job_dir, roles=[{"name": "worker", "count": 1, "must_finish": True}])
        store.update_job("job1", master_pid=master.pid, master_start=start_time(master.pid))
        assert store.set_job("job1", JobStatus.RUNNING) and store.set_job("job1", JobStatus.SUCCEEDED)
        os.close(recorded_w)
        out = io.BytesIO()
        began = time.monotonic()
        status = logtail.follow_job(store, "job1", out, progress=False, recorded_fd=recorded_r)
        assert time.monotonic() - began < 30, "the follower waited for the master's exit"
        assert status["status"] == "Succeeded" and b"[pai] job Succeeded" in out.getvalue()
        assert master.poll() is None
    finally:
        master.kill()
        master.wait()
        store.close()


def test_an_attached_pai_returns_once_the_summary_file_has_the_verdict(pai_home):
    """The follower ends when the master says the record is complete, before the
    master's own exit: by then the summary file (the log view without a server) and
    the final status it keeps are written."""

    result = pai("-name", "python", f"-Dscript={BEHAVE}", "-Dcluster={\"worker\":{\"count\":2}}",
                 env={"BEHAVE": "print:2", "PAI_LOGVIEW": "file"})
    assert result.returncode == 0, result.stdout + result.stderr
    job_dir = pai_home / "jobs" / job_id_from(result.stdout)
    assert "Status: Succeeded" in (job_dir / "summary.txt").read_text()
    assert '"status": "Succeeded"' in (job_dir / "status.json").read_text()


def _processes_with(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(name))
            except OSError:
                pass   # gone meanwhile
    return found


def _end_all(proc: subprocess.Popen, marker: str) -> None:
    """A test's teardown: its process, and every process whose command line has `marker`."""
    proc.kill()
    proc.wait()
    for pid in _processes_with(marker):
        os.kill(pid, 9)


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


BY_HAND_PROBE = r"""
import argparse, sys
sys.path.insert(0, sys.argv[1])
import bench_core
bench_core.exit_on_signals()
print("started", flush=True)
bench_core.run_plain_job(argparse.Namespace(steps=100000, sleep=float(sys.argv[2])))
"""


def test_the_by_hand_baseline_goes_with_a_bench_that_is_stopped():
    """bench/bench_core.py's by-hand job (a ps and two workers the bench starts
    itself) must not outlive the bench when it is sent SIGTERM mid-run."""
    sleep = 0.01 + (uuid.uuid4().int % 10**6 + 1) / 10**9
    marker = f"--sleep={sleep}"   # as the bench writes it into the workers' argv (a float's repr)
    bench = subprocess.Popen([sys.executable, "-c", BY_HAND_PROBE, str(ROOT / "bench"), repr(sleep)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert bench.stdout.readline().strip() == "started"
        assert wait_until(lambda: len(_processes_with(marker)) == 3, timeout=60), _processes_with(marker)
        bench.terminate()
        assert bench.wait(timeout=30) == 128 + 15
        assert wait_until(lambda: not _processes_with(marker), timeout=30), "the by-hand processes stayed"
    finally:
        _end_all(bench, marker)


def _perf_line(comm: str, pid: int, t_ms: float, event: str, rest: str) -> str:
    return f"{comm:>16} {pid:6d} [000] {1000 + t_ms / 1000:.6f}: {event}: {rest}"


def test_bench_windows_cuts_each_run_into_windows_and_charges_cpu_to_its_processes():
    """bench/bench_windows.py reads `perf script` text: a pai run (CLI 100, its
    master 101 -> 102 (a double fork), agents 103-105, ps 106 and workers 107-108)
    and a by-hand run (ps 201, workers 202-203) forked by the bench (50)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_windows
    finally:
        sys.path.remove(str(ROOT / "bench"))
    lines = []

    def fork(t, parent, child, comm="python"):
        lines.append(_perf_line(comm, parent, t, "sched:sched_process_fork",
                                f"comm={comm} pid={parent} child_comm={comm} child_pid={child}"))

    def exec_(t, pid, path):
        lines.append(_perf_line("python", pid, t, "sched:sched_process_exec", f"filename={path} pid={pid} old_pid={pid}"))

    def run(t, pid, ms):
        lines.append(_perf_line("python", pid, t, "sched:sched_stat_runtime", f"comm=python pid={pid} runtime={int(ms * 1e6)} [ns]"))

    def instance(t_exec, pid, ps: bool, t_ready, t_exit):
        exec_(t_exec, pid, "/v/bin/python")
        if ps:
            lines.append(_perf_line("python", pid, t_ready, "syscalls:sys_enter_listen", "fd: 0x3, backlog: 0x5"))
        else:
            lines.append(_perf_line("python", pid, t_ready - 5, "syscalls:sys_exit_connect", "0xffffffffffffff91"))
            lines.append(_perf_line("python", pid, t_ready, "syscalls:sys_exit_connect", "0x0"))
        lines.append(_perf_line("python", pid, t_exit, "sched:sched_process_exit", f"comm=python pid={pid} prio=120"))

    # pai: exec at 0, ps exec at 60, workers connected by 130, their exits by 1000, CLI gone at 1015
    fork(0, 50, 100)
    exec_(0, 100, "/v/bin/pai")
    run(10, 100, 20.0)
    fork(20, 100, 101)
    fork(21, 101, 102)
    run(40, 102, 15.0)
    for agent in (103, 104, 105):
        fork(50, 102, agent, "pai-node-agent")
    fork(59, 103, 106)
    fork(65, 104, 107)
    fork(66, 105, 108)
    instance(60, 106, True, 100, 1005)
    instance(66, 107, False, 120, 990)
    instance(67, 108, False, 130, 1000)
    run(80, 106, 30.0)
    run(1008, 102, 4.0)
    run(1009, 999, 2.5)   # someone else's process
    lines.append(_perf_line("pai", 100, 1015, "sched:sched_process_exit", "comm=pai pid=100 prio=120"))
    # by hand, from the bench: ps forked at 2000, exec 2001; workers connected by 2070; ends 2900 / 2902
    for child, t in ((201, 2000), (202, 2000.5), (203, 2001)):
        fork(t, 50, child)
    instance(2001, 201, True, 2050, 2902)
    instance(2002, 202, False, 2060, 2890)
    instance(2002, 203, False, 2070, 2900)
    found = bench_windows.runs(bench_windows.Trace("\n".join(lines)))
    assert [r["kind"] for r in found] == ["pai", "hand"]
    pai, hand = found
    w = pai["windows"]
    assert list(w) == ["submit", "start", "middle", "end"]
    assert w["submit"]["ms"] == 60.0 and w["start"]["ms"] == 70.0 and w["middle"]["ms"] == 870.0 and w["end"]["ms"] == 15.0
    assert w["submit"]["cli"] == 20.0 and w["submit"]["master"] == 15.0 and w["submit"]["instances"] == 0
    assert w["start"]["instances"] == 30.0 and w["end"]["master"] == 4.0 and w["end"]["other"] == 2.5
    assert pai["total_ms"] == 1015.0 and pai["refused_connects"] == 2
    assert hand["total_ms"] == 902.0 and list(hand["windows"]) == ["submit", "start", "middle", "end"]
    assert hand["windows"]["start"]["ms"] == 69.0 and hand["windows"]["end"]["ms"] == 2.0
    medians = bench_windows.report(found)
    assert medians["pai"]["end"]["ms"] == 15.0 and medians["hand"]["start"]["ms"] == 69.0


MASTER_PROBE = r"""
import sys
from pathlib import Path
from paicli.cluster.spawn import start_master
job_dir = Path(sys.argv[2])
master = start_master(job_dir.parent, job_dir)
print("started", flush=True)
sys.stdin.readline()          # the test has looked for the master
master.close()
"""


def test_a_master_without_a_job_waits_in_a_session_of_its_own_and_leaves_at_eof(tmp_path):
    marker = f"master-{uuid.uuid4().hex}"
    job_dir = tmp_path / "jobs" / "job1"
    job_dir.mkdir(parents=True)
    probe = subprocess.Popen([sys.executable, "-c", MASTER_PROBE, marker, str(job_dir)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert probe.stdout.readline().strip() == "started"

        def master() -> list[int]:   # not the probe, nor the intermediate child it forked
            return [p for p in _processes_with(marker) if p != probe.pid and _ppid(p) not in (probe.pid, None)]

        found = wait_until(master, timeout=30)
        assert len(found) == 1, f"no master was started: {found}"
        assert os.getsid(found[0]) != os.getsid(probe.pid)   # a session of its own: a Ctrl-C at the CLI misses it
        probe.stdin.write("\n")
        probe.stdin.flush()
        assert probe.wait(timeout=30) == 0
        assert wait_until(lambda: not _processes_with(marker), timeout=30), "the master stayed after EOF"
    finally:
        _end_all(probe, marker)


def test_a_refused_submit_leaves_no_process(pai_home):
    """A job too big for this machine is refused once its master has answered with
    the nodes: the master leaves with it, and the job folder is gone."""
    marker = f"refused-{uuid.uuid4().hex}"
    result = pai("-name", "python", f"-Dscript={BEHAVE}", '-Dcluster={"worker":{"count":1,"cpu":10000000}}',
                 f"-DuserDefinedParameters={marker}")
    assert result.returncode == 2, result.stdout + result.stderr
    assert wait_until(lambda: not _processes_with(marker), timeout=30), "a master outlived the refused submit"
    assert not any((pai_home / "jobs").iterdir())


def test_a_submit_with_stdin_closed_hands_its_job_to_its_master(pai_home):
    """A pai started with stdin closed (cron, a daemon) runs its job as any other."""
    result = subprocess.run(["bash", "-c", 'exec "$0" "$@" <&-', sys.executable, "-m", "paicli", "-name", "python",
                             f"-Dscript={BEHAVE}"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "BEHAVE": "print:1"})
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "OK", result.stdout + result.stderr


class FakeMaster:
    """client.hand_over's side of a MasterProcess."""

    def __init__(self, order: list, records_itself: bool = False, store=None):
        self.order, self.records_itself, self.store = order, records_itself, store

    def start(self, job_id: str) -> int:
        from paicli.cluster.procinfo import start_time

        self.order.append("handed over")
        if self.records_itself:
            self.store.update_job(job_id, master_pid=os.getpid(), master_start=start_time(os.getpid()))
        return os.getpid()

    def take_recorded(self) -> int:
        return os.open(os.devnull, os.O_RDONLY)


def test_an_error_in_the_first_lines_is_raised_once_the_master_is_recorded(tmp_path, store_kind):
    """A closed stdout while the ID is printed: the job is handed over already, so its
    master's pid is recorded (the job is not called unstarted) before the error goes up."""
    from paicli.client import hand_over
    from paicli.store import Store

    store = Store(tmp_path)
    try:
        store.create_job("job1", name="n", framework="python", project=None, task_name="PythonTask",
                         job_dir=tmp_path / "jobs" / "job1", roles=[{"name": "worker", "count": 1, "must_finish": True}])
        order: list = []

        def first_lines(job_id, recorded_fd):
            os.close(recorded_fd)
            order.append(f"ID = {job_id}")
            raise BrokenPipeError("stdout closed")

        with pytest.raises(BrokenPipeError):
            hand_over(store, "job1", FakeMaster(order), first_lines)
        assert order == ["handed over", "ID = job1"]
        job = store.job("job1")
        assert job["master_pid"] == os.getpid() and job["status"] == "Waiting"
    finally:
        store.close()


def test_the_cli_leaves_the_masters_pid_to_a_master_that_recorded_itself(tmp_path, monkeypatch, store_kind):
    """The master records its pid and start first thing; the CLI writes them only
    for a master that has not yet."""
    from paicli.client import hand_over
    from paicli.cluster.procinfo import start_time
    from paicli.store import Store

    store = Store(tmp_path)
    try:
        store.create_job("job1", name="n", framework="python", project=None, task_name="PythonTask",
                         job_dir=tmp_path / "jobs" / "job1", roles=[{"name": "worker", "count": 1, "must_finish": True}])
        writes = []
        update_job = store.update_job
        master = FakeMaster([], records_itself=True, store=store)
        monkeypatch.setattr(store, "update_job", lambda job_id, **fields: writes.append(fields) or
                            update_job(job_id, **fields))
        master.store = type("S", (), {"update_job": staticmethod(update_job)})()
        hand_over(store, "job1", master)
        assert writes == [] and store.job("job1")["master_pid"] == os.getpid()
        store.update_job("job1", master_pid=None, master_start=None)
        writes.clear()
        hand_over(store, "job1", FakeMaster([]))
        assert [w["master_pid"] for w in writes] == [os.getpid()]
        assert store.job("job1")["master_start"] == start_time(os.getpid())
    finally:
        store.close()
