"""What keeps a submit's overhead low, pinned without timing (speed itself lives
in bench/bench_hardening.py overhead): the node agent's start-up imports, the
master's, and local instances started together rather than one round trip after
another."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from paicli.cluster.backends.base import Placement
from paicli.cluster.backends.local import AGENT, LocalBackend

from conftest import ROOT, wait_until

# Everything `python -I -S node_agent.py run LABEL` imports before it has its spec
# (an SSH node and a threaded master start it so): stdlib modules, the few that
# starting and watching one process needs. A new import here is paid by every
# instance on every node: add it only with a reason.
AGENT_ALLOWED = {
    "__future__", "_abc", "_codecs", "_collections", "_collections_abc", "_frozen_importlib_external",
    "_functools", "_io", "_json", "_locale", "_operator", "_posixsubprocess", "_signal", "_socket", "_sre",
    "_stat", "_struct", "_weakrefset", "abc", "array", "codecs", "collections", "collections.abc",
    "contextlib", "copyreg", "encodings", "encodings.aliases", "encodings.utf_8", "enum", "errno", "fcntl",
    "functools", "genericpath", "io", "itertools", "json", "json.decoder", "json.encoder", "json.scanner",
    "keyword", "locale", "marshal", "math", "msvcrt", "operator", "os", "posix", "posixpath", "re",
    "re._casefix", "re._compiler", "re._constants", "re._parser", "reprlib", "select", "selectors", "signal",
    "socket", "stat", "struct", "subprocess", "threading", "time", "types", "warnings", "zipimport", "zlib",
    # other Python versions' spellings of the same imports
    "_typing", "typing", "_thread", "sre_compile", "sre_parse", "sre_constants", "_weakref", "weakref",
    "_tokenize", "_string", "_warnings", "_locale", "_opcode", "_contextvars", "_strptime",
}

# Never on the master's start-up path: web, SSH, Ray, YAML, plotting, the CLI's
# own command tree, the framework adapters (the plan is read from plan.json).
MASTER_HEAVY = ("yaml", "aiohttp", "jinja2", "ray", "paramiko", "numpy", "optuna", "click", "rich",
                "prompt_toolkit", "plotext", "paicli.web", "paicli.cli", "paicli.console", "paicli.adapters",
                "paicli.tune", "paicli.pluto", "paicli.cluster.backends.ssh", "paicli.cluster.backends.ray")


def imported_by(argv: list[str], stdin: bytes = b"") -> set[str]:
    """The modules a Python command imports (-X importtime lists each one)."""
    out = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], input=stdin, capture_output=True,
                         check=True, cwd=ROOT, timeout=60).stderr.decode()
    return {line.split("|")[-1].strip() for line in out.splitlines()
            if line.startswith("import time:") and "[us]" not in line}


def test_the_node_agent_starts_on_an_allow_list_of_stdlib_modules():
    mods = imported_by([sys.executable, "-I", "-S", AGENT, "run", "probe"])
    assert "subprocess" in mods and "json" in mods   # the probe saw the agent's own imports
    assert not {m for m in mods if m.split(".")[0] == "paicli"}
    assert mods <= AGENT_ALLOWED, f"the node agent now imports {sorted(mods - AGENT_ALLOWED)} at start-up"


def test_the_venvs_interpreters_start_without_setuptools_editable_hook():
    """.ci/source_finder.py: an interpreter of this checkout's venv (every instance of a
    `-name python` job) imports none of what setuptools' editable hook imported at start-up
    (~38 ms of a core, and more to finalize at its exit), and still finds paicli's
    packages in this checkout's folders."""
    mods = imported_by([sys.executable, "-c", "pass"])
    assert "_paicli_source" in mods, "the venv's .pth does not use .ci/source_finder.py's hook"
    assert not mods & {"pathlib", "fnmatch", "re", "importlib.util", "contextlib"}, sorted(mods)
    code = ("import paicli.cluster.backends.local as a, paicli.runners.node_agent as b, "
            "paicli.adapters.python as c; print(a.__file__, b.__file__, c.__file__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd="/", timeout=60).stdout.split()
    assert out == [str(ROOT / "cluster/backends/local.py"), str(ROOT / "runners/node_agent.py"),
                   str(ROOT / "adapters/python.py")]


def test_logging_in_to_nodes_does_not_import_invoke():
    """paramiko.config imports invoke when it can, only for ssh_config's `Match exec`,
    which paicli never reads: ~70 ms of every process that logs in to a node (the
    submit's probe, the master). Kept out while paramiko imports, and only then."""
    code = ("import sys; from paicli.cluster import ssh_transport as t; p = t._paramiko(); "
            "print('invoke' in sys.modules, 'paramiko.config' in sys.modules, p.SSHClient.__name__); "
            "import invoke; print(invoke.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT, timeout=60).stdout.split()
    assert out == ["False", "True", "SSHClient", "invoke"]


def test_the_master_imports_nothing_heavy():
    code = "import sys, paicli.cluster.master; print('\\n'.join(sorted(sys.modules)))"
    mods = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              cwd=ROOT, timeout=60).stdout.split())
    assert "paicli.cluster.master" in mods
    heavy = sorted(m for m in mods if any(m == h or m.startswith(h + ".") for h in MASTER_HEAVY))
    assert heavy == [], f"the master's start-up imports {heavy}"


def _sleepers(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


def test_local_agents_start_their_instances_before_any_identity_is_read():
    """The master sends every instance's spec before it waits for any identity
    (LocalBackend.begin_start): all three instances run while no identity has been
    read yet, and a program that cannot start is still reported as such."""
    backend = LocalBackend()
    marker = f"pai-overhead-{uuid.uuid4().hex}"
    argv = [sys.executable, "-c", "import time; time.sleep(60)", marker]
    env = {"PATH": os.environ.get("PATH", "")}
    finishes, handles, missing = [], [], None
    try:
        for idx in range(3):
            finishes.append(backend.begin_start(Placement("worker", idx, "local", "127.0.0.1"), argv, env, None))
        missing = backend.begin_start(Placement("worker", 3, "local", "127.0.0.1"),
                                      ["/nonexistent/pai-overhead"], env, None)
        assert wait_until(lambda: len(_sleepers(marker)) == 3, timeout=30), _sleepers(marker)
        assert not backend._links   # running, and no identity read yet (base.Backend.start would have)
        handles = [finish() for finish in finishes]
        assert sorted(h.ref.pid for h in handles) == sorted(_sleepers(marker))
        with pytest.raises(FileNotFoundError):
            missing()
        missing = None
        assert all(backend.poll(h) is None for h in handles)
    finally:
        for finish in finishes[len(handles):]:
            handles.append(finish())
        if missing is not None:
            with pytest.raises(OSError):
                missing()
        backend.stop_all([h.ref for h in handles], 0)
        for h in handles:
            backend.wait(h, 10)
        backend.cleanup("")
    assert all(backend.poll(h) < 0 for h in handles)   # stopped by signal, not left running
    assert wait_until(lambda: not _sleepers(marker), timeout=30)


def test_the_services_agents_start_first_and_the_rest_while_the_services_start(tmp_path):
    """LocalBackend.prepare forks only the services' agents (each fork of the master
    is ~3 ms of a loaded core on the way to the ps); the master begins the ps, then
    has the workers' agents forked (start_ahead) and the workers made ready (their
    records, logs, environments: ~3 ms) before it waits for the ps's identity; the
    workers' specs go as soon as that identity is in, before the ps is recorded
    (~2 ms of store writes), and the workers find their agents warm. Every started
    instance is known before a refusal is acted on, whichever group it is in."""
    from types import SimpleNamespace

    from paicli.cluster.master import JobMaster

    roles = [SimpleNamespace(name="ps", must_finish=False), SimpleNamespace(name="worker", must_finish=True)]
    placements = [Placement("ps", 0, "local", "127.0.0.1"), Placement("worker", 0, "local", "127.0.0.1"),
                  Placement("worker", 1, "local", "127.0.0.1")]
    backend = LocalBackend()
    try:
        backend.prepare(str(tmp_path / "job1"), SimpleNamespace(roles=roles), placements)
        assert list(backend._warm) == [("ps", 0)]
        backend.start_ahead()
        assert list(backend._warm) == [("ps", 0), ("worker", 0), ("worker", 1)]
        backend.start_ahead()   # once: nothing more
        assert len(backend._warm) == 3
    finally:
        backend.cleanup(str(tmp_path / "job1"))
    assert backend._warm == {}

    order = []
    insts = [SimpleNamespace(role=role, name=f"{role.name}:{idx}") for role, idx in
             ((roles[0], 0), (roles[1], 0), (roles[1], 1))]

    def ask(inst, ready):
        order.append(f"ask {inst.name}")

        def finish():
            order.append(f"identity {inst.name}")
            if inst.name == "worker:1":
                raise PermissionError(13, "refused")
            return inst
        return finish

    fake = SimpleNamespace(backend=SimpleNamespace(start_ahead=lambda: order.append("start_ahead")),
                           _ready=lambda inst: order.append(f"ready {inst.name}"), _ask=ask,
                           _identities=JobMaster._identities,
                           _started=lambda inst, handle: order.append(f"started {inst.name}"),
                           _refused=lambda inst, err: order.append(f"refused {inst.name}"))
    JobMaster._launch_all(fake, insts)
    assert order == ["ready ps:0", "ask ps:0", "start_ahead", "ready worker:0", "ready worker:1",
                     "identity ps:0", "ask worker:0", "ask worker:1", "started ps:0", "identity worker:0",
                     "identity worker:1", "started worker:0", "refused worker:1"]

    # No service to wait for (the 64-instance tail job), or more workers than fit in a
    # ps's start: each of the rest is made ready and asked for at once, as before.
    from paicli.cluster.master import READY_EARLY

    order.clear()
    JobMaster._launch_all(fake, insts[1:])
    assert order == ["start_ahead", "ready worker:0", "ask worker:0", "ready worker:1", "ask worker:1",
                     "identity worker:0", "identity worker:1", "started worker:0", "refused worker:1"]
    many = [SimpleNamespace(role=roles[1], name=f"w:{idx}") for idx in range(READY_EARLY + 2)]
    order.clear()
    JobMaster._launch_all(fake, insts[:1] + many)
    early = [f"w:{idx}" for idx in range(READY_EARLY)]
    assert order[:3 + READY_EARLY] == ["ready ps:0", "ask ps:0", "start_ahead", *(f"ready {n}" for n in early)]
    assert order[3 + READY_EARLY:3 + 2 * READY_EARLY + 5] == [
        "identity ps:0", *(f"ask {n}" for n in early), f"ready w:{READY_EARLY}", f"ask w:{READY_EARLY}",
        f"ready w:{READY_EARLY + 1}", f"ask w:{READY_EARLY + 1}"]


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


def test_an_agent_forked_ahead_that_died_is_passed_over_and_the_unused_ones_leave():
    """local.fork_agents_ahead: agents_ahead.take gives the first that still waits (one
    killed meanwhile is reaped, never handed a spec); discard_agents_ahead sends the
    rest EOF, and they exit by themselves."""
    import signal

    from paicli.cluster import agents_ahead
    from paicli.cluster.backends.local import fork_agents_ahead
    from paicli.cluster.procinfo import reap_children

    fork_agents_ahead(3)
    try:
        first, second, third = agents_ahead._AHEAD
        assert all(a.ahead for a in (first, second, third))
        os.kill(first.pid, signal.SIGKILL)
        assert wait_until(lambda: _state(first.pid) in ("Z", None), timeout=30)
        taken = agents_ahead.take()
        assert taken is second and agents_ahead._AHEAD == [third]
        assert _state(first.pid) is None   # reaped, not a zombie
        agents_ahead.discard_agents_ahead()
        assert agents_ahead._AHEAD == []
        taken.discard()
        reap_children(30)
        assert second.exit_code == 0 and third.exit_code == 0   # EOF: "never used"
    finally:
        agents_ahead.discard_agents_ahead()
        reap_children(5)


def test_a_backend_other_than_local_lets_the_agents_forked_ahead_go_as_it_prepares(tmp_path):
    """Backend.prepare: the pool a spare's waiting master forked is for the local
    backend's instances; an SSH or Ray job's nodes run its agents, so any other backend
    sends the pool EOF as it prepares, and the local backend keeps it."""
    from paicli.cluster import agents_ahead
    from paicli.cluster.backends.base import Backend
    from paicli.cluster.backends.local import LocalBackend, fork_agents_ahead
    from paicli.cluster.procinfo import reap_children

    class Remote(Backend):
        name = "remote"

        def _prepare(self, job_dir, plan, placements):
            pass

    fork_agents_ahead(2)
    try:
        kept = list(agents_ahead._AHEAD)
        assert LocalBackend.takes_agents_ahead and not Remote.takes_agents_ahead
        Remote().prepare(str(tmp_path), None, [])
        assert agents_ahead._AHEAD == []
        reap_children(30)
        assert [a.exit_code for a in kept] == [0, 0]   # EOF: "never used"
    finally:
        agents_ahead.discard_agents_ahead()
        reap_children(5)


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

    from conftest import job_id_from, pai
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



def test_the_watchdog_is_forked_once_the_instances_have_started_up(pai_home):
    """Not at the launch, where its fork and start took a core from the instances'
    interpreters: WATCHDOG_DELAY later (a master dead before then is covered by its
    agents, test_launcher's test_a_dead_master_takes_its_instances_with_it_even_without_a_watchdog)."""
    import time

    from conftest import BEHAVE, pai, wait_until
    from paicli.cluster.master import WATCHDOG_DELAY
    from paicli.store import Store

    result = pai("--detach", "-name", "python", f"-Dscript={BEHAVE}", env={"BEHAVE": "print:1,sleep:30"})
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip()
    log = pai_home / "jobs" / job_id / "watchdog.log"
    try:
        assert wait_until(log.exists, timeout=60, interval=0.01)
        seen = time.time()   # no sooner than its creation
        store = Store(pai_home)
        started = store.instances(job_id)[0]["started"]
        store.close()
        assert seen - started >= WATCHDOG_DELAY > 0.2, (seen - started, WATCHDOG_DELAY)
    finally:
        assert pai("kill", job_id).returncode == 0


# -- the master forked as a submit begins (cluster/spawn.py WaitingMaster) --------------

WAITING_PROBE = r"""
import os, sys, time
from paicli.cluster.spawn import fork_waiting_master
waiting = fork_waiting_master()
print("forked" if waiting else "none", flush=True)
sys.stdin.readline()          # the test has looked for the waiting master
waiting.close()
"""


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


def test_a_waiting_master_waits_in_a_session_of_its_own_and_leaves_at_eof():
    marker = f"waiting-{uuid.uuid4().hex}"
    probe = subprocess.Popen([sys.executable, "-c", WAITING_PROBE, marker], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert probe.stdout.readline().strip() == "forked"
        def waiting_master() -> list[int]:   # not the probe, nor the intermediate child it forked
            return [p for p in _processes_with(marker) if p != probe.pid and _ppid(p) not in (probe.pid, None)]

        found = wait_until(waiting_master, timeout=30)
        assert len(found) == 1, f"no waiting master was forked: {found}"
        pid = found[0]
        assert os.getsid(pid) != os.getsid(probe.pid)   # a session of its own: a Ctrl-C at the CLI misses it
        probe.stdin.write("\n")
        probe.stdin.flush()
        assert probe.wait(timeout=30) == 0
        assert wait_until(lambda: not _processes_with(marker), timeout=30), "the waiting master stayed after EOF"
    finally:
        _end_all(probe, marker)


STORE_PROBE = r"""
import sys
from pathlib import Path
from paicli.cluster.spawn import fork_waiting_master
from paicli.store import Store
waiting = fork_waiting_master()
store = Store(Path(sys.argv[2]))     # the CLI opens the store after the fork, as pai does
waiting.store_open(store.home)
print("told", flush=True)
sys.stdin.readline()
waiting.close()
"""


def test_a_waiting_master_opens_its_own_store_connection_once_the_cli_has_the_store(tmp_path):
    """As soon as the CLI has the store open, the waiting master opens its own
    connection (the open and the first statements of a cold connection, ~2-3 ms,
    were on the way from the handover to the instances); it keeps it over the
    stdio it takes at the handover, and leaves at EOF as before."""
    marker = f"waiting-{uuid.uuid4().hex}"
    home = tmp_path / "home"
    probe = subprocess.Popen([sys.executable, "-c", STORE_PROBE, marker, str(home)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert probe.stdout.readline().strip() == "told"

        def store_held() -> list[int]:
            held = []
            for pid in _processes_with(marker):
                if pid == probe.pid:
                    continue
                try:
                    links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
                except OSError:
                    continue
                if str(home / "pai.db") in links:
                    held.append(pid)
            return held

        assert wait_until(store_held, timeout=30), "the waiting master did not open the store"
        probe.stdin.write("\n")
        probe.stdin.flush()
        assert probe.wait(timeout=30) == 0
        assert wait_until(lambda: not _processes_with(marker), timeout=30), "the waiting master stayed after EOF"
    finally:
        _end_all(probe, marker)


def test_no_waiting_master_while_a_store_is_open(tmp_path):
    """A fork would carry the open SQLite connection: the submit takes spawn_master's path."""
    from paicli.cluster.spawn import fork_waiting_master
    from paicli.store import Store

    store = Store(tmp_path)
    try:
        assert fork_waiting_master() is None
    finally:
        store.close()


def test_a_submit_hands_its_job_to_the_master_it_forked_first(pai_home):
    from conftest import job_id_from, pai

    result = pai("-name", "python", f"-Dscript={ROOT / 'tests' / 'scripts' / 'behave.py'}", env={"BEHAVE": "print:1"})
    assert result.returncode == 0, result.stderr
    log = (pai_home / "jobs" / job_id_from(result.stdout) / "master.log").read_text()
    assert "started by fork as the submit began" in log


def test_a_submit_refused_leaves_no_waiting_master(pai_home):
    from conftest import pai

    marker = f"refused-{uuid.uuid4().hex}"
    result = pai("-name", "python", f"-Dscript=/nonexistent/{marker}.py")
    assert result.returncode == 2 and "does not exist" in result.stderr
    assert wait_until(lambda: not _processes_with(marker), timeout=30), "a waiting master outlived the refused submit"


def test_a_submit_with_stdin_closed_hands_its_job_to_the_waiting_master(pai_home):
    """A pipe of the waiting master's that landed on fd 0 (a pai started with <&-, as
    cron or a daemon may) must survive its taking of the standard descriptors."""
    script = ROOT / "tests" / "scripts" / "behave.py"
    result = subprocess.run(["bash", "-c", 'exec "$0" "$@" <&-', sys.executable, "-m", "paicli", "-name", "python",
                             f"-Dscript={script}"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "BEHAVE": "print:1"})
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "OK", result.stdout + result.stderr
    from conftest import job_id_from

    log = (pai_home / "jobs" / job_id_from(result.stdout) / "master.log").read_text()
    assert "started by fork as the submit began" in log


def test_a_forked_master_imports_nothing_once_it_has_the_job(pai_home):
    """Everything a run imports lazily is imported while the CLI stages the job
    (cluster.master.RUN_MODULES): an import after the handover delays the
    instances' start by its time. -X importtime lists, in master.log (the master's
    stderr from the handover on), every module imported after it."""
    script = ROOT / "examples" / "python" / "ps_worker.py"
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "paicli", "-name", "python", f"-Dscript={script}",
                             '-Dcluster={"ps":{"count":1},"worker":{"count":2}}',
                             "-DuserDefinedParameters=--steps=3 --sleep=0.01"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "NO_COLOR": "1"})
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "OK", result.stdout + result.stderr[-2000:]
    assert "import time:" in result.stderr   # the CLI's own imports are listed: the probe works
    from conftest import job_id_from

    log = (pai_home / "jobs" / job_id_from(result.stdout) / "master.log").read_text()
    assert "started by fork as the submit began" in log
    late = [line.split("|")[-1].strip() for line in log.splitlines() if line.startswith("import time:")]
    assert late == [], f"the master imported {late} after the handover: add them to cluster.master.RUN_MODULES"


def test_pai_forks_the_waiting_master_before_it_imports_the_rest_of_itself():
    """The master imports its modules on the other core while the CLI imports the
    statement's: forked after paicli.commands (json, the error boundary) it started
    ~6 ms later and was what the job's handover waited for."""
    code = ("import sys\n"
            "import paicli.cluster.spawn as spawn\n"
            "def probe():\n"
            "    print(sorted(m for m in ('paicli.commands', 'paicli.statement', 'paicli.store', 'json',\n"
            "                             'dataclasses', 'typing') if m in sys.modules), flush=True)\n"
            "spawn.fork_waiting_master = probe\n"
            "from paicli.pai import main\n"
            "main(['-name', 'python', '-Dscript=/nonexistent/script.py'])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 2 and "does not exist" in result.stderr, result.stdout + result.stderr
    assert result.stdout.splitlines()[0] == "[]", result.stdout


# Each is milliseconds of every interpreter that imports it, on both sides of the
# handover: typing ~3 ms (annotations name it under TYPE_CHECKING only); dataclasses
# ~7 ms with inspect, and ~0.6 ms for each class it builds (paicli.records instead);
# string 0.5 ms for two constants (the store's job IDs).
HEAVY_ON_BOTH_SIDES = ("typing", "dataclasses", "inspect", "string")


def test_neither_the_submit_nor_a_waiting_master_imports_typing_or_dataclasses(pai_home):
    code = ("import sys\n"
            "import paicli.cli_tokens, paicli.cluster.spawn as spawn\n"
            "before = set(sys.modules)\n"
            "spawn.import_run_modules()\n"
            "new = set(sys.modules) - before\n"
            "print('paicli.cluster.master' in new, 'paicli.runners.node_agent' in new,\n"
            f"      *[m for m in {HEAVY_ON_BOTH_SIDES!r} if m in sys.modules])\n")
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert probe.stdout.split() == ["True", "True"], probe.stdout + probe.stderr
    script = ROOT / "examples" / "python" / "ps_worker.py"
    cli = imported_by([sys.executable, "-m", "paicli", "--detach", "-name", "python", f"-Dscript={script}",
                       '-Dcluster={"ps":{"count":1},"worker":{"count":1}}', "-DuserDefinedParameters=--steps=1 --sleep=0"])
    assert "paicli.client" in cli and "sqlite3" in cli   # the probe saw a whole submit
    assert [m for m in HEAVY_ON_BOTH_SIDES if m in cli] == []


def test_the_cli_says_its_first_lines_between_the_handover_and_the_masters_pid(tmp_path):
    """WaitingMaster.start: the job's line written, `meanwhile` run (the CLI prints the
    ID and the log view while the master may still import), then the pid read: a
    line, taken as soon as it is there, while the pipe stays open (the master closes
    it once the job's record is complete: take_recorded)."""
    import select
    import threading
    import time

    from paicli.cluster.spawn import WaitingMaster

    command_r, command_w = os.pipe()
    pid_r, pid_w = os.pipe()
    seen = []
    held = threading.Timer(20, os.close, (pid_w,))

    def meanwhile():
        seen.append(os.read(command_r, 4096))
        os.write(pid_w, b"4242\n")
        held.start()

    waiting = WaitingMaster(command_w, pid_r, 0)
    try:
        began = time.monotonic()
        assert waiting.start(tmp_path, "job1", tmp_path / "master.log", meanwhile) == 4242
        assert time.monotonic() - began < 10, "the pid was read only when the pipe closed"
        assert seen and seen[0].endswith(b"\n") and b'"job1"' in seen[0]
        recorded = waiting.take_recorded()
        assert recorded == pid_r and not select.select([recorded], [], [], 0)[0]   # open: the record goes on
        waiting.close()
        os.fstat(recorded)   # not closed by close(): the follower's now
    finally:
        os.close(command_r)
        os.close(pid_r)
        held.cancel()
        try:
            os.close(pid_w)
        except OSError:
            pass


def test_a_follower_ends_once_the_record_is_complete_not_when_the_master_exits(tmp_path):
    """The master closes the pipe it wrote its pid to once the job's record is
    complete (its verdict, its summary file), then waits for its agents' exits and
    exits itself: a follower given that pipe (WaitingMaster.take_recorded) shows the
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
    from conftest import BEHAVE, job_id_from, pai

    result = pai("-name", "python", f"-Dscript={BEHAVE}", "-Dcluster={\"worker\":{\"count\":2}}",
                 env={"BEHAVE": "print:2", "PAI_LOGVIEW": "file"})
    assert result.returncode == 0, result.stdout + result.stderr
    job_dir = pai_home / "jobs" / job_id_from(result.stdout)
    assert "Status: Succeeded" in (job_dir / "summary.txt").read_text()
    assert '"status": "Succeeded"' in (job_dir / "status.json").read_text()


def test_an_error_in_the_first_lines_is_raised_once_the_master_is_recorded(tmp_path):
    """A closed stdout while the ID is printed: the job is handed over already, so its
    master's pid is recorded (the job is not called unstarted) before the error goes up."""
    from paicli.client import start_master
    from paicli.store import Store

    store = Store(tmp_path)
    try:
        store.create_job("job1", name="n", framework="python", project=None, task_name="PythonTask",
                         job_dir=tmp_path / "jobs" / "job1", roles=[{"name": "worker", "count": 1, "must_finish": True}])
        order = []

        class Waiting:
            def start(self, home, job_id, log_path, meanwhile=None):
                order.append("handed over")
                meanwhile()
                order.append("pid read")
                return os.getpid()

        def first_lines(job_id):
            order.append(f"ID = {job_id}")
            raise BrokenPipeError("stdout closed")

        with pytest.raises(BrokenPipeError):
            start_master(store, "job1", tmp_path / "jobs" / "job1", Waiting(), first_lines)
        assert order == ["handed over", "ID = job1", "pid read"]
        job = store.job("job1")
        assert job["master_pid"] == os.getpid() and job["status"] == "Waiting"
    finally:
        store.close()



def test_the_cli_leaves_the_masters_pid_to_a_master_that_recorded_itself(tmp_path, monkeypatch):
    """A forked master records its pid and start first thing; the CLI writes them
    only for a master that has not yet (a new interpreter still importing): its
    second write waited for the lock the starting master held, or held it up."""
    from paicli.client import start_master
    from paicli.cluster.procinfo import start_time
    from paicli.store import Store

    store = Store(tmp_path)
    try:
        store.create_job("job1", name="n", framework="python", project=None, task_name="PythonTask",
                         job_dir=tmp_path / "jobs" / "job1", roles=[{"name": "worker", "count": 1, "must_finish": True}])
        writes = []
        update_job = store.update_job
        monkeypatch.setattr(store, "update_job", lambda job_id, **fields: writes.append(fields) or
                            update_job(job_id, **fields))

        class Waiting:
            def __init__(self, records_itself):
                self.records_itself = records_itself

            def start(self, home, job_id, log_path, meanwhile=None):
                if self.records_itself:
                    update_job(job_id, master_pid=os.getpid(), master_start=start_time(os.getpid()))
                return os.getpid()

        start_master(store, "job1", tmp_path / "jobs" / "job1", Waiting(records_itself=True))
        assert writes == [] and store.job("job1")["master_pid"] == os.getpid()
        store.update_job("job1", master_pid=None, master_start=None)
        writes.clear()
        start_master(store, "job1", tmp_path / "jobs" / "job1", Waiting(records_itself=False))
        assert [w["master_pid"] for w in writes] == [os.getpid()]
        assert store.job("job1")["master_start"] == start_time(os.getpid())
    finally:
        store.close()

# -- the bench's own processes ------------------------------------------------------------------

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
    waiting master 101 -> master 102, agents 103-105, ps 106 and workers 107-108),
    a by-hand run (ps 201, workers 202-203) forked by the bench (50), and a served
    pai run (client 300, the submit server's child 401 and what it forked)."""
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
    # a served pai (paicli/submit_server.py): client 300 exec at 3000, the server (400)
    # forks its child 401 at 3002, which forks the master 402; ps 406, workers 407-408
    fork(3000, 50, 300)
    exec_(3000, 300, "/v/bin/pai")
    run(3001, 300, 1.0)
    fork(3002, 400, 401)
    run(3010, 401, 9.0)
    fork(3012, 401, 402)
    for agent in (403, 404, 405):
        fork(3030, 402, agent, "pai-node-agent")
    for agent, child, t in ((403, 406, 3040), (404, 407, 3045), (405, 408, 3046)):
        fork(t, agent, child)
    instance(3040, 406, True, 3080, 3905)
    instance(3045, 407, False, 3100, 3890)
    instance(3046, 408, False, 3110, 3900)
    lines.append(_perf_line("pai", 300, 3915, "sched:sched_process_exit", "comm=pai pid=300 prio=120"))
    found = bench_windows.runs(bench_windows.Trace("\n".join(lines)))
    assert [r["kind"] for r in found] == ["pai", "hand", "pai"]
    pai, hand, served = found
    assert served["windows"]["submit"]["ms"] == 40.0 and served["windows"]["submit"]["cli"] == 10.0
    assert served["windows"]["end"]["ms"] == 15.0 and served["refused_connects"] == 2
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


def test_prefault_takes_a_forked_childs_copy_on_write_faults_ahead():
    """procinfo.prefault: a forked process's writes to the memory it shares with its
    parent fault one page at a time (~5 us each here); after prefault they do not,
    unless it was told to stop at once."""
    import resource

    from paicli.cluster.procinfo import prefault

    shared = bytearray(8 << 20)   # 2048 pages, written before the fork: the child shares them

    def faults_writing(first) -> int:
        first()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for offset in range(0, len(shared), 4096):
            shared[offset] = 1
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    results = []
    for first in (lambda: None, prefault, lambda: prefault(until=lambda: True)):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.write(write_fd, str(faults_writing(first)).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as pipe:
            results.append(int(pipe.read() or b"-1"))
        os.waitpid(pid, 0)
    plain, prefaulted, stopped = results
    assert plain >= 1500 and 0 <= prefaulted < 100, results
    assert stopped >= 1500, results   # work came at once (`until`): nothing was taken ahead
