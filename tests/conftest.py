"""Shared test helpers: an isolated PAI_HOME per test, running the real `pai`
command, and looking for processes a job left behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BEHAVE = ROOT / "tests" / "scripts" / "behave.py"
PAI = [sys.executable, "-m", "paicli"]

# Jobs in tests print the summary file as their `Log view:` instead of starting a
# logview server per test home; tests/test_logview.py turns the server on itself.
os.environ.setdefault("PAI_LOGVIEW", "file")

# A test that runs `pai` or opens the store without the pai_home fixture must not
# write into the ~/.pai (or the PAI_HOME) of whoever runs the suite: this process, and
# every `pai` a test starts, begin on a folder of their own, removed after the session.
SESSION_HOME = Path(tempfile.mkdtemp(prefix="pai-tests-home-"))
os.environ["PAI_HOME"] = str(SESSION_HOME)

# Signals a shell may have set to "ignore" for us (nohup, a background job in a
# script: `trap '' INT HUP`). An ignored signal stays ignored across exec, so
# every `pai` and instance a test starts would inherit it. A Python handler does
# not survive exec: installing a no-op one here keeps this process as deaf as it
# was asked to be, while every child a test starts (subprocess, pty.fork + exec)
# begins with the default disposition, as it would from a fresh terminal.
CHILD_DEFAULT_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT)


def _ignore(signum, frame) -> None:
    pass


for _signum in CHILD_DEFAULT_SIGNALS:
    if signal.getsignal(_signum) == signal.SIG_IGN:
        signal.signal(_signum, _ignore)


def default_signals() -> None:
    """For a forked child before it execs: every signal back to its default."""
    for signum in CHILD_DEFAULT_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


def run_on_pty(argv: list[str], env: dict[str, str]) -> tuple[int, bytes]:
    """Run `argv` with a terminal as its stdout until it ends: (exit code, all it wrote)."""
    import pty

    pid, fd = pty.fork()
    if pid == 0:
        default_signals()
        os.execvpe(argv[0], argv, env)
    chunks = []
    try:
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:   # EIO once the child's side closed
                break
            if not data:
                break
            chunks.append(data)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), b"".join(chunks)


# The longest modules first: `.ci/run` hands whole modules to two workers in this
# order (--dist loadfile --no-loadscope-reorder), so the run does not end waiting on
# one long module that started last. Slowest first, measured with --durations.
LONGEST_MODULES = ("test_ray.py", "test_tensorflow.py", "test_multihost.py", "test_pluto.py", "test_mxnet.py",
                   "test_tune.py", "test_outputs_ssh.py", "test_envs_nodes.py", "test_pluto_costs.py",
                   "test_runtimes.py", "test_fidelity_tf.py", "test_launcher.py", "test_pluto_cluster.py",
                   "test_fidelity_mx_jobs.py", "test_envs.py", "test_queue_jobs.py", "test_store_pg.py",
                   "test_serving_jobs.py", "test_serving_nodes.py", "test_serving_quant.py", "test_serving_router.py")


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: n for n, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_unconfigure(config) -> None:
    """The session's home goes at the end of any run, `--collect-only` included
    (a session fixture's teardown runs only when a test ran)."""
    shutil.rmtree(SESSION_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres():
    """One real PostgreSQL server for the session (of this xdist worker): tests/pg.py."""
    import pg

    ok, why = pg.can_run()
    if not ok:
        pytest.skip(why)
    with pg.PostgresServer() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def store_kind(request, monkeypatch):
    """Run the test on each store: SQLite under PAI_HOME (no PAI_STORE), and a fresh
    database on the session's PostgreSQL server (PAI_STORE, for every `pai` it starts too)."""
    monkeypatch.delenv("PAI_STORE", raising=False)
    if request.param == "postgresql":
        monkeypatch.setenv("PAI_STORE", request.getfixturevalue("postgres").new_database())
    return request.param


@pytest.fixture
def pai_home(tmp_path, monkeypatch):
    home = tmp_path / "pai-home"
    monkeypatch.setenv("PAI_HOME", str(home))
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.delenv("PAI_DEBUG", raising=False)
    return home


def pai(*args: str, env: dict | None = None, timeout: float = 120, input: str | None = None,
        cwd: str | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([*PAI, *args], capture_output=True, text=True, timeout=timeout, env=full_env,
                          input=input, cwd=cwd)


def read_until(proc: subprocess.Popen, marker: str, timeout: float = 60) -> str:
    """What a started `pai` printed (proc.stdout, text) up to the line with `marker`."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if marker in line:
            return "".join(seen)
    raise AssertionError(f"{marker!r} never appeared in:\n{''.join(seen)}")


def pai_json(*args: str, env: dict | None = None) -> dict | list:
    result = pai(*args, "--json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def job_id_from(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("ID = "):
            return line[5:].strip()
    raise AssertionError(f"no 'ID = ' line in:\n{output}")


def processes_in(groups: set[int]) -> list[tuple[int, int, str]]:
    """Live processes (pid, pgid, state) whose process group or session is one of `groups`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        state, pgid, sid = fields[0].decode(), int(fields[2]), int(fields[3])
        if state != "Z" and (pgid in groups or sid in groups):
            found.append((int(entry), pgid, state))
    return found


def kill_groups(groups) -> None:
    """A test's last resort: SIGKILL every group it saw, gone or not (what the code
    under test should have stopped must not outlive a failing test)."""
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def watchdog_says(job_dir, text: str, timeout: float = 60.0) -> str:
    """The job's watchdog.log once it holds `text` (it logs as it goes)."""
    log = Path(job_dir) / "watchdog.log"
    assert wait_until(lambda: log.exists() and text in log.read_text(), timeout=timeout), (job_dir, text)
    return log.read_text()


def watchdog_of(job_dir, job_id: str, timeout: float = 60.0) -> int:
    """The pid of the job's watchdog, as it names itself at the top of its log, once
    it runs. A test that kills a master to see what its watchdog does waits for it first."""
    import re

    text = watchdog_says(job_dir, f"watchdog of {job_id}: pid", timeout)
    pids = [int(pid) for pid in re.findall(rf"watchdog of {job_id}: pid (\d+)", text)]
    assert len(pids) == 1, text
    return pids[0]


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


CHATTY_SCRIPT = """
import sys, threading, time

stop = threading.Event()

def chatter():
    while not stop.is_set():
        sys.stderr.write({chatter!r} + "\\n")
        time.sleep(0)

thread = threading.Thread(target=chatter)
thread.start()
for step in range(1, {steps} + 1):
    print({step_format!r} % step)
stop.set()
thread.join()
"""


def chatty_script(chatter: str, step_format: str, steps: int = 4000) -> str:
    """A script whose thread writes `chatter` lines to stderr without pause while it
    prints `steps` step lines (`step_format % step`): under `python -u` a chatter line
    can land between a print's text and its newline (runners/script_output.py)."""
    return CHATTY_SCRIPT.format(chatter=chatter, step_format=step_format, steps=steps)


def broken_lines(stdout: str, instance: str, chatter: str, step_format: str) -> tuple[list[str], int]:
    """What `chatty_script(chatter, step_format)` run as `instance` left in `stdout`: the
    lines that hold the chatter but are not a whole chatter line (a chatter line is one
    write, so any break leaves it inside another line), and how many whole step lines."""
    prefix = f"[{instance}] "
    step_line = re.compile(re.escape(prefix + step_format).replace("%i", r"\d+"))
    lines = stdout.splitlines()
    broken = [line for line in lines if chatter in line and line != prefix + chatter]
    return broken, sum(1 for line in lines if step_line.fullmatch(line))


def instance_groups(status: dict) -> set[int]:
    return {i["pgid"] for i in status["instances"] if i["pgid"]}
