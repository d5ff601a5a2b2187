"""The resident submit server (paicli/submit_server.py) and its client
(paicli/submit_client.py): a served submit behaves as a cold one (output, exit
codes, Ctrl-C, Ctrl-Z), it is declined where the client's process differs, the
child never outlives its client, the client hears the end even when the server is
killed, and no server is left behind. Each test has a server folder of its own;
the rest of the suite runs with the server off (conftest)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PAI, ROOT, job_id_from, pai, pai_json, read_until, wait_until

from paicli import submit_client

DEADLINE = 60.0
# The server is keyed by the environment, so a test varies a job through its
# parameters, never through variables.
WORK = """import argparse, os, sys, time
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=3)
p.add_argument("--sleep", type=float, default=0.05)
p.add_argument("--exit", type=int, default=0)
p.add_argument("--show", action="store_true")
p.add_argument("--pad", default="")
a = p.parse_args()
if a.show:
    import signal
    blocked = ",".join(str(int(s)) for s in sorted(signal.pthread_sigmask(signal.SIG_BLOCK, ())))
    with open(f"/proc/{os.getppid()}/stat", "rb") as f:   # its agent's start time
        agent_start = f.read().rsplit(b")", 1)[1].split()[19].decode()
    print("seen", os.environ.get("PAI_HOME"), oct(os.umask(0)), os.environ.get("SHLVL"), f"blocked={blocked}",
          f"cwd={os.getcwd()}", f"agent={os.getppid()}@{agent_start}", flush=True)
for i in range(a.steps):
    print(f"step={i}, global_step={i}, loss={1 / (i + 1):.4f}", flush=True)
    time.sleep(a.sleep)
sys.exit(a.exit)
"""


@pytest.fixture
def served(pai_home, tmp_path):
    """An environment with the server on, in a 0700 folder of this test's; afterwards
    every server started there is stopped, and the test fails if one would not go."""
    directory = tmp_path / "server"
    directory.mkdir(mode=0o700)
    (tmp_path / "work.py").write_text(WORK)
    env = {"PAI_SUBMIT_SERVER": "1", "PAI_SUBMIT_SERVER_DIR": str(directory), "PAI_SUBMIT_SERVER_IDLE": "120"}
    yield Served(directory, env)
    left = []
    for pid in Served(directory, env).server_pids():
        left.append(pid)
        os.kill(pid, signal.SIGTERM)
    for pid in left:
        assert wait_until(lambda: not _alive(pid), timeout=DEADLINE), f"server {pid} did not stop on SIGTERM"


class Served:
    def __init__(self, directory: Path, env: dict[str, str]):
        self.directory, self.env = directory, env
        self.script = directory.parent / "work.py"

    def statement(self, params: str = "") -> list[str]:
        return ["-name", "python", f"-Dscript={self.script}", f"-DuserDefinedParameters={params}"]

    def full_env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, **self.env, **extra}

    def server_pids(self) -> list[int]:
        pids = []
        for lock in self.directory.glob("*.lock"):
            text = lock.read_text().split()
            if text and _alive(int(text[0])) and b"paicli.submit_server" in _cmdline(int(text[0])):
                pids.append(int(text[0]))
        return pids

    def log(self) -> str:
        return "".join(p.read_text() for p in self.directory.glob("*.log"))

    def start_server(self) -> int:
        """A cold submit starts the server as it leaves; its pid once it listens."""
        first = pai(*self.statement(), env=self.env)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "served pid" not in self.log()
        assert wait_until(lambda: any(self.directory.glob("*.sock")) and "serving" in self.log(),
                          timeout=DEADLINE), self.log()
        pids = self.server_pids()
        assert len(pids) == 1, pids
        return pids[0]

    def child_of(self, client_pid: int) -> int:
        found = wait_until(lambda: re.search(rf"served pid {client_pid} as (\d+)", self.log()), timeout=DEADLINE)
        assert found, f"pid {client_pid} was not served:\n{self.log()}"
        return int(found.group(1))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0].decode()


def _start(served: Served, params: str = "", client: list[str] = PAI, **where) -> subprocess.Popen:
    where = where or {"start_new_session": True}
    return subprocess.Popen([*client, *served.statement(params)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=served.full_env(), **where)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    """The compiled client (paicli/submit_client.c), built as .ci/setup builds `pai`."""
    launcher = tmp_path_factory.mktemp("client") / "pai"
    if submit_client.write_launcher(str(launcher)) != "compiled":
        pytest.skip("no C compiler here: .ci/setup leaves `pai` the Python launcher")
    return launcher


@pytest.fixture(params=["python", "compiled"])
def client(request) -> list[str]:
    """Each client of the server: the Python one (`python -m paicli`, the launcher
    without a compiler) and the compiled one (.ci/setup's `pai`)."""
    return PAI if request.param == "python" else [str(request.getfixturevalue("compiled"))]


def test_a_served_submit_prints_and_exits_as_a_cold_one(served, client):
    server = served.start_server()
    for params, code in (("--steps 3", 0), ("--steps 2 --exit 3", 1)):
        cold = pai(*served.statement(params))
        proc = _start(served, params, client)
        out, err = proc.communicate(timeout=120)
        assert served.child_of(proc.pid) > 0
        assert proc.returncode == cold.returncode == code, out + err
        drop_ids = lambda text: [line for line in text.splitlines()   # noqa: E731
                                 if not line.startswith(("ID = ", "Log view: ", "train: "))]
        assert drop_ids(out) == drop_ids(cold.stdout)
        assert sorted(drop_ids(err)) == sorted(drop_ids(cold.stderr))
    # Bad input: one line and exit 2 from the served child too, nothing recorded.
    bad = subprocess.run([*client, "-name", "nosuchframework", f"-Dscript={served.script}"], capture_output=True,
                         text=True, env=served.full_env(), timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "nosuchframework" in bad.stderr
    assert served.server_pids() == [server]


def test_the_compiled_client_sends_a_request_of_any_length(served, compiled):
    """Sixteen request lengths in a row, so that one ends on every byte of malloc's
    16-byte step: a write one byte past the request (the last stpcpy's NUL, a real
    bug) corrupted the heap and aborted the client only at some lengths."""
    served.start_server()
    for pad in range(16):
        proc = subprocess.run([str(compiled), *served.statement(f"--steps 1 --pad={'x' * pad}")],
                              capture_output=True, text=True, env=served.full_env(), timeout=120)
        assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "OK", (pad, proc.stdout + proc.stderr)
    assert served.log().count("served pid") == 16, served.log()


def test_the_served_child_takes_the_clients_folder_home_and_umask(served, client, tmp_path):
    served.start_server()
    work = tmp_path / "work"
    work.mkdir()
    # A relative script path is read from the client's folder (the server's is /).
    proc = subprocess.Popen(["sh", "-c", 'umask 027 && exec "$@"', "sh", *client, "-name", "python",
                             "-Dscript=../work.py", "-DuserDefinedParameters=--show"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=served.full_env(), cwd=work)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    assert f"seen {os.environ['PAI_HOME']} 0o27" in out
    assert served.child_of(proc.pid) > 0


def _ours(directory: Path) -> list[int]:
    """Every process started with this test's server folder in its environment."""
    mark = f"PAI_SUBMIT_SERVER_DIR={directory}".encode()
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and mark in Path(f"/proc/{name}/environ").read_bytes().split(b"\0") and _alive(int(name)):
                found.append(int(name))
        except OSError:
            pass
    return found


def _agents(directory: Path) -> list[int]:
    """The node agents among _ours: forked ahead by a spare's waiting master."""
    found = []
    for pid in _ours(directory):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "pai-node-agent":
                found.append(pid)
        except OSError:
            pass
    return found


def test_a_spare_child_and_master_forked_ahead_take_the_next_statement_as_the_client_gave_it(served, tmp_path):
    """After a job the server forks a spare child, and the spare forks its job's
    waiting master, which forks the first node agents (all pre-faulted or waiting):
    the next statement costs no fork on its path. The job still gets the client's
    folder, umask, blocked signals and environment (a variable the server's key
    leaves out, SHLVL, included); its master and its instance's agent were there
    before it, and the agents no instance took leave with the job."""
    served.start_server()
    assert wait_until(lambda: "spare pid" in served.log(), timeout=DEADLINE), served.log()
    assert wait_until(lambda: len(_agents(served.directory)) == 3, timeout=DEADLINE), _agents(served.directory)
    ahead = _agents(served.directory)
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.Popen(["sh", "-c", 'umask 027 && exec "$@"', "sh", *PAI, "-name", "python",
                             "-Dscript=../work.py", "-DuserDefinedParameters=--show"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=served.full_env(SHLVL="7"), cwd=work,
                            preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2}))
    with open(f"/proc/{proc.pid}/stat", "rb") as f:
        client_start = int(f.read().rsplit(b")", 1)[1].split()[19])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    assert f"seen {os.environ['PAI_HOME']} 0o27 7 blocked={int(signal.SIGUSR2)} cwd={work} " in out
    agent, agent_start = re.search(r"agent=(\d+)@(\d+)", out).groups()
    assert int(agent) in ahead and int(agent_start) < client_start   # forked ahead, not by this submit
    assert re.search(rf"served pid {proc.pid} as \d+ \(a spare\)", served.log()), served.log()
    import sqlite3

    with sqlite3.connect(Path(os.environ["PAI_HOME"]) / "pai.db") as db:
        master_start = int(db.execute("SELECT master_start FROM jobs WHERE id = ?", (job_id_from(out),)).fetchone()[0])
    assert master_start < client_start
    # One instance took one agent; the two it left read EOF and are gone with the job.
    assert wait_until(lambda: not set(ahead) & set(_ours(served.directory)), timeout=DEADLINE), \
        set(ahead) & set(_ours(served.directory))


def test_a_spare_and_its_waiting_master_leave_with_the_server(served):
    server = served.start_server()
    assert wait_until(lambda: "spare pid" in served.log(), timeout=DEADLINE), served.log()
    spare = int(re.search(r"spare pid (\d+) waits", served.log()).group(1))
    assert wait_until(lambda: len(_ours(served.directory)) >= 3, timeout=DEADLINE)   # server, spare, its master
    assert spare in _ours(served.directory)
    os.kill(server, signal.SIGKILL)
    assert wait_until(lambda: not _ours(served.directory), timeout=DEADLINE), _ours(served.directory)


def test_a_spare_that_died_is_dropped_and_the_statement_gets_a_fork(served):
    server = served.start_server()
    assert wait_until(lambda: "spare pid" in served.log(), timeout=DEADLINE), served.log()
    spare = int(re.search(r"spare pid (\d+) waits", served.log()).group(1))
    os.kill(spare, signal.SIGKILL)
    assert wait_until(lambda: not _alive(spare), timeout=DEADLINE)
    proc = _start(served)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    assert served.child_of(proc.pid) != spare
    assert f"served pid {proc.pid} as " in served.log() and "(a spare)" not in served.log(), served.log()
    assert served.server_pids() == [server]


def test_a_different_process_is_declined_and_submits_cold(served, client):
    served.start_server()
    proc = subprocess.Popen(["nice", "-n", "3", *client, *served.statement()],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=served.full_env())
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    assert out.splitlines()[-1] == "OK"
    # The client itself is `nice`'s exec: its pid is the one declined, and never served.
    assert f"declined pid {proc.pid}: another nice" in served.log()
    assert f"served pid {proc.pid} " not in served.log()
    batch = subprocess.Popen(["chrt", "--batch", "0", *client, *served.statement()], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=served.full_env())
    out, err = batch.communicate(timeout=120)
    assert batch.returncode == 0 and out.splitlines()[-1] == "OK", out + err
    assert f"declined pid {batch.pid}: another scheduler" in served.log()


def test_changed_code_is_declined_and_the_server_makes_way_for_a_new_one(served):
    old = served.start_server()
    module = ROOT / "cluster" / "pluto" / "view.py"
    st = module.stat()
    try:
        os.utime(module, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        result = pai(*served.statement(), env=served.env)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "code changed" in served.log()
        # The old server leaves; the cold submit started a new one for the next.
        assert wait_until(lambda: not _alive(old), timeout=DEADLINE)
        assert wait_until(lambda: len(served.server_pids()) == 1 and served.server_pids()[0] != old,
                          timeout=DEADLINE), served.log()
    finally:
        os.utime(module, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_ctrl_c_reaches_the_served_child_and_cancels_as_a_cold_pai_does(served, client):
    served.start_server()
    proc = _start(served, "--steps 1 --sleep 600", client)
    job_id = None
    try:
        job_id = job_id_from(read_until(proc, "step=0"))
        child = served.child_of(proc.pid)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, out + err
        assert out.strip().splitlines()[-1] == "CANCELLED: cancelled (Ctrl-C)"
        assert pai_json("status", job_id)["status"] == "Cancelled"
        assert wait_until(lambda: not _alive(child), timeout=DEADLINE)
    finally:   # a failing test leaves no 600 s job behind
        proc.kill()
        proc.wait()
        if job_id:
            pai("kill", job_id)


def test_ctrl_z_stops_the_served_child_with_its_client(served, client):
    served.start_server()
    # A group of its own in this session, as a shell's job: not orphaned, so that
    # SIGTSTP stops it (the kernel drops it for an orphaned group, cold pai or not).
    proc = _start(served, "--steps 400 --sleep 0.05", client, process_group=0)
    job_id = job_id_from(read_until(proc, "step=1"))
    child = served.child_of(proc.pid)
    try:
        proc.send_signal(signal.SIGTSTP)
        assert wait_until(lambda: _state(proc.pid) == "T" and _state(child) == "T", timeout=DEADLINE)
        proc.send_signal(signal.SIGCONT)
        assert wait_until(lambda: _state(child) != "T", timeout=DEADLINE)
        assert "step=" in proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGCONT)   # a stopped client would never end
        pai("kill", job_id)
        proc.communicate(timeout=120)


def test_the_served_child_ends_with_its_client_and_the_job_goes_on(served, client):
    served.start_server()
    proc = _start(served, "--steps 400 --sleep 0.05", client)
    job_id = job_id_from(read_until(proc, "step=1"))
    child = served.child_of(proc.pid)
    try:
        proc.kill()   # as `kill -9` of a cold pai: its job runs on, detached
        proc.wait()
        assert wait_until(lambda: not _alive(child), timeout=DEADLINE), "the child outlived its client"
        assert pai_json("status", job_id)["status"] == "Running"
    finally:
        assert pai("kill", job_id).returncode == 0


def test_the_client_hears_the_end_when_the_server_is_killed(served, client):
    server = served.start_server()
    proc = _start(served, "--steps 30 --sleep 0.05", client)
    read_until(proc, "step=1")
    served.child_of(proc.pid)
    os.kill(server, signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    assert out.splitlines()[-1] == "OK"
    # And the next submit is cold and starts a new server in its place.
    again = pai(*served.statement(), env=served.env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert wait_until(lambda: served.server_pids() not in ([], [server]), timeout=DEADLINE)


def test_an_idle_server_leaves_and_a_client_then_submits_cold(served):
    served.env["PAI_SUBMIT_SERVER_IDLE"] = "1"
    server = served.start_server()
    assert wait_until(lambda: not _alive(server), timeout=DEADLINE), "the idle server stayed"
    assert not any(served.directory.glob("*.sock"))
    result = pai(*served.statement(), env=served.env)
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "OK", result.stdout + result.stderr


def test_the_launcher_is_served_and_runs_every_other_command_cold(served, tmp_path):
    launcher = tmp_path / "pai"
    written = subprocess.run([sys.executable, "-m", "paicli.submit_client", "--write-launcher", str(launcher)],
                             capture_output=True, text=True, check=True)
    python = Path(f"{launcher}-py")   # what the compiled client runs when it does not serve a statement
    assert python.read_text().startswith(f"#!{sys.executable} -S\n")
    compiled = launcher.read_bytes().startswith(b"\x7fELF")
    assert ("(compiled)" in written.stdout) == compiled, written.stdout
    if shutil.which(os.environ.get("CC") or "cc"):
        assert compiled, "a C compiler is here and `pai` is not the compiled client"
    else:
        assert launcher.read_bytes() == python.read_bytes()
    assert launcher.stat().st_mode & 0o777 == python.stat().st_mode & 0o777 == 0o755
    served.start_server()
    proc = subprocess.Popen([str(launcher), *served.statement()], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=served.full_env())
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.splitlines()[-1] == "OK", out + err
    assert served.child_of(proc.pid) > 0
    listed = subprocess.run([str(launcher), "list", "--json"], capture_output=True, text=True,
                            env=served.full_env(), timeout=60)
    assert listed.returncode == 0 and len(__import__("json").loads(listed.stdout)) == 2, listed.stderr
    off = subprocess.run([str(launcher), *served.statement()], capture_output=True, text=True,
                         env=served.full_env(PAI_SUBMIT_SERVER="0"), timeout=120)
    assert off.returncode == 0 and off.stdout.splitlines()[-1] == "OK", off.stdout + off.stderr
    assert len(served.server_pids()) == 1 and served.log().count("served pid") == 1, served.log()


def test_with_the_server_off_no_server_is_started(pai_home, tmp_path):
    directory = tmp_path / "server"
    script = tmp_path / "work.py"
    script.write_text(WORK)
    result = pai("-name", "python", f"-Dscript={script}",
                 env={"PAI_SUBMIT_SERVER": "0", "PAI_SUBMIT_SERVER_DIR": str(directory)})
    assert result.returncode == 0, result.stdout + result.stderr
    time.sleep(0.5)
    assert not directory.exists()


def test_the_socket_folder_must_be_private_and_ours(tmp_path, monkeypatch):
    monkeypatch.setenv("PAI_SUBMIT_SERVER", "1")
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    monkeypatch.setenv("PAI_SUBMIT_SERVER_DIR", str(loose))
    assert submit_client.server_dir() is None
    assert submit_client.submit(["-name", "python"]) == "absent"
    link = tmp_path / "link"
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    link.symlink_to(private)
    monkeypatch.setenv("PAI_SUBMIT_SERVER_DIR", str(link))
    assert submit_client.server_dir() is None
    monkeypatch.setenv("PAI_SUBMIT_SERVER_DIR", str(private))
    assert submit_client.server_dir() == str(private)
    made = tmp_path / "made"
    monkeypatch.setenv("PAI_SUBMIT_SERVER_DIR", str(made))
    assert submit_client.server_dir(create=True) == str(made)
    assert made.stat().st_mode & 0o777 == 0o700


def test_the_key_ignores_the_shells_volatile_variables_only():
    base = {"PATH": "/bin", "PAI_HOME": "/a", "PWD": "/x", "SHLVL": "1"}
    assert submit_client.key(base) == submit_client.key({**base, "PAI_HOME": "/b", "PWD": "/y", "SHLVL": "2"})
    assert submit_client.key(base) != submit_client.key({**base, "PATH": "/usr/bin"})
    assert submit_client.key(base) != submit_client.key({**base, "NO_COLOR": "1"})


def test_the_client_imports_nothing_but_builtins(tmp_path):
    code = ("import sys; before = set(sys.modules); from paicli import submit_client; "
            "submit_client.submit(['-name', 'python']); "
            "print(sorted(m for m in set(sys.modules) - before if m not in sys.builtin_module_names))")
    env = {**os.environ, "PAI_SUBMIT_SERVER": "1", "PAI_SUBMIT_SERVER_DIR": str(tmp_path)}
    os.chmod(tmp_path, 0o700)
    out = subprocess.run([sys.executable, "-I", "-S", "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); {code}"],
                         capture_output=True, text=True, env=env, check=True).stdout
    # What an interpreter without site has not imported yet, and no more: os (site's),
    # the socket and crc32 extension modules, paicli's package and the client.
    assert eval(out) == ["_collections_abc", "_socket", "binascii", "genericpath", "os", "os.path", "paicli",
                         "paicli.submit_client", "posixpath", "stat"], out


def _after_warm_up(code: str) -> str:
    """What `code` prints in a new interpreter once the server's warm-up has run there."""
    return subprocess.run([sys.executable, "-c", "from paicli import submit_server\nsubmit_server.warm_up()\n" + code],
                          capture_output=True, text=True, cwd=ROOT, check=True, timeout=DEADLINE).stdout


def test_the_warm_up_compiles_every_frameworks_metric_patterns_for_the_masters_it_forks(pai_home):
    """A job's master compiles its framework's metric patterns (logsink.MetricParser)
    before it starts an instance: 0.5-5 ms of every served submit, unless the server's
    warm-up compiled them once for the masters forked from it."""
    out = _after_warm_up("from paicli.adapters import adapter_names, get_adapter\n"
                         "from paicli.cluster import logsink\n"
                         "before = logsink.compiled_pattern.cache_info()\n"
                         "for name in adapter_names():\n"
                         "    logsink.MetricParser(list(get_adapter(name).metric_patterns))\n"
                         "after = logsink.compiled_pattern.cache_info()\n"
                         "print(after.misses - before.misses, after.hits - before.hits, len(adapter_names()))\n")
    misses, hits, frameworks = map(int, out.split())
    assert frameworks >= 4 and hits >= frameworks and misses == 0, out


def test_the_warm_up_loads_what_an_attached_submits_follower_needs(tmp_path):
    """An attached submit follows its job through an inotify watch (ctypes, libc): the
    server's warm-up loads them once, and a served child sets its watch without
    importing anything while its job starts."""
    code = ("import sys\n"
            "from pathlib import Path\n"
            "from paicli import submit_server\n"
            "submit_server.import_submit_modules()\n"
            "submit_server.warm_up()\n"
            "before = set(sys.modules)\n"
            "from paicli.logtail import DirectoryWatch\n"
            f"watch = DirectoryWatch(Path({str(tmp_path)!r}))\n"
            "print(watch.fd >= 0, sorted(set(sys.modules) - before))\n"
            "watch.close()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                         timeout=DEADLINE).stdout
    assert out.split(None, 1) == ["True", "[]\n"], out

def test_the_warm_up_compiles_the_patterns_a_usual_statement_is_checked_with(pai_home, tmp_path):
    """A served child checks its statement (a script path, roles, parameters) with
    patterns the server compiled in its warm-up: none is compiled in the child
    (each was ~0.5-1.7 ms of a submit before its job was recorded)."""
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    out = _after_warm_up("import re._compiler as compiler\n"
                         "from paicli.client import prepare\n"
                         "from paicli.statement import parse_statement\n"
                         "compiled = []\n"
                         "original = compiler.compile\n"
                         "compiler.compile = lambda p, flags=0: compiled.append(p) or original(p, flags)\n"
                         f"prepare(parse_statement(['-name', 'python', '-Dscript={script}', "
                         "'-Dcluster={\"ps\":{\"count\":1},\"worker\":{\"count\":2}}', "
                         "'-DuserDefinedParameters=--steps=5 --sleep=0.05']))\n"
                         "print(compiled)\n")
    assert out.strip() == "[]", out


def test_the_warm_up_looks_up_the_logview_libraries_for_the_children_it_forks(pai_home):
    """A first submit in a new PAI_HOME starts its logview server, which needs aiohttp
    and jinja2: looked up once in the server (~1.5 ms), not in every served child."""
    out = _after_warm_up("from paicli.web import launch\n"
                         "before = launch.web_libraries_present.cache_info()\n"
                         "launch.web_libraries_present()\n"
                         "after = launch.web_libraries_present.cache_info()\n"
                         "print(after.misses - before.misses, after.hits - before.hits)\n")
    assert out.split() == ["0", "1"], out


def test_the_server_keeps_none_of_the_descriptors_its_first_client_inherited(served):
    """The cold submit that starts the server may have inherited descriptors (a lock
    `flock` holds for a script, a pipe someone waits to see closed): the server, which
    lives on for minutes, lets them go, so the pipe ends when that `pai` does."""
    import select

    read_fd, write_fd = os.pipe()
    try:
        first = subprocess.run([*PAI, *served.statement()], capture_output=True, text=True, pass_fds=(write_fd,),
                               env=served.full_env(), timeout=120)
        os.close(write_fd)
        write_fd = -1
        assert first.returncode == 0, first.stdout + first.stderr
        assert wait_until(lambda: "serving" in served.log(), timeout=DEADLINE), served.log()
        assert select.select([read_fd], [], [], DEADLINE)[0], "the pipe stayed open: the server holds its write end"
        assert os.read(read_fd, 1) == b""
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)


def test_a_bench_stops_the_server_its_first_submit_started(served):
    """bench_core gives the timed `pai` runs a server folder of the bench's own; at its
    end the server there is stopped and the folder removed (no server outlives a bench)."""
    server = served.start_server()
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_core
    finally:
        sys.path.remove(str(ROOT / "bench"))
    bench_core.stop_submit_servers(str(served.directory))
    assert not _alive(server)
    assert not served.directory.exists()


def _standby_ahead(served, skip: int = 0) -> int:
    """The pid of the logview standby the server's spare forked ahead (the first
    `skip` spares' passed over), once one is ready."""
    found = wait_until(lambda: (re.findall(r"waits \(standby ahead (\d+)\)", served.log()) + [None] * (skip + 1))[skip],
                       timeout=DEADLINE)
    assert found, served.log()
    return int(found)


def test_a_served_submits_logview_standby_runs_in_place_and_serves_the_page(served, tmp_path):
    """A served submit's logview standby is a process of the served child's (here the
    one its spare forked ahead, before the statement came) that runs the standby
    without starting an interpreter; the page it serves is the job's. A spare's
    standby that no statement takes (the home has its server) leaves with the job."""
    import json
    import urllib.request

    served.env["PAI_LOGVIEW"] = "web"
    homes = [tmp_path / "cold-home", tmp_path / "served-home"]
    try:
        first = pai(*served.statement(), env={**served.env, "PAI_HOME": str(homes[0])})
        assert first.returncode == 0, first.stdout + first.stderr
        assert wait_until(lambda: "serving" in served.log(), timeout=DEADLINE), served.log()
        ahead = _standby_ahead(served)
        proc = subprocess.Popen([*PAI, *served.statement()], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=served.full_env(PAI_HOME=str(homes[1])))
        with open(f"/proc/{proc.pid}/stat", "rb") as f:
            client_start = int(f.read().rsplit(b")", 1)[1].split()[19])
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, out + err
        assert served.child_of(proc.pid) > 0
        url = next(line[len("Log view: "):] for line in out.splitlines() if line.startswith("Log view: http"))
        state = json.loads((homes[1] / "logview" / "server.json").read_text())
        assert state["pid"] == ahead and int(state["start"]) < client_start   # forked before the statement
        assert b"paicli.submit_server" in _cmdline(state["pid"]), _cmdline(state["pid"])
        with urllib.request.urlopen(url, timeout=60) as page:
            assert page.status == 200
            assert job_id_from(out) in page.read().decode()
        unused = _standby_ahead(served, skip=1)
        again = pai(*served.statement(), env={**served.env, "PAI_HOME": str(homes[1])})
        assert again.returncode == 0, again.stdout + again.stderr
        assert wait_until(lambda: not _alive(unused), timeout=DEADLINE), f"standby ahead {unused} stayed"
    finally:
        for home in homes:
            pai("logview", "--stop", env={**served.env, "PAI_HOME": str(home)})
    assert not _alive(state["pid"])


def test_a_standby_ahead_that_died_is_passed_over_and_the_statement_forks_one(served, tmp_path):
    import json

    served.env["PAI_LOGVIEW"] = "web"
    home = tmp_path / "new-home"
    try:
        served.start_server()
        ahead = _standby_ahead(served)
        os.kill(ahead, signal.SIGKILL)
        out = pai(*served.statement(), env={**served.env, "PAI_HOME": str(home)})
        assert out.returncode == 0, out.stdout + out.stderr
        assert "(a spare)" in served.log() and "Log view: http" in out.stdout, served.log() + out.stdout
        state = json.loads((home / "logview" / "server.json").read_text())
        assert state["pid"] != ahead and _alive(state["pid"])   # forked by the statement instead
    finally:
        for stop in (os.environ["PAI_HOME"], home):   # the cold submit's home has its server too
            pai("logview", "--stop", env={**served.env, "PAI_HOME": str(stop)})


@pytest.mark.parametrize("kind", ["python", "compiled"])
def test_a_server_that_never_answers_costs_one_line_and_no_submit(served, tmp_path, kind):
    """A socket that accepts and never answers (a wedged server): the client says so
    and exits 1 after its deadline, and submits nothing, not even cold. The compiled
    client finds the socket the Python one names: the same key."""
    import socket

    env = served.full_env()
    path = subprocess.run([sys.executable, "-c", "from paicli import submit_client as c; "
                           "print(c.socket_path(c.server_dir()))"], capture_output=True, text=True, env=env,
                          check=True).stdout.strip()
    wedged = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    wedged.bind(path)
    wedged.listen(8)
    # Output to files, not pipes: the descriptors the client sent sit in the wedged
    # socket's queue until it is closed, and a pipe would not reach EOF before that.
    err_path = tmp_path / "client.err"
    try:
        code = ("import sys; from paicli import submit_client as c; c.ANSWER_TIMEOUT = 1.0; "
                f"c.submit({served.statement()!r})")
        argv = [sys.executable, "-c", code]
        if kind == "compiled":
            built = submit_client.compile_client(str(tmp_path / "no-fallback"), answer_timeout=1)
            if built is None:
                pytest.skip("no C compiler here: .ci/setup leaves `pai` the Python launcher")
            (tmp_path / "pai").write_bytes(built)
            (tmp_path / "pai").chmod(0o700)
            argv = [str(tmp_path / "pai"), *served.statement()]
        with open(err_path, "w") as err:
            returncode = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=err, env=env, timeout=60).returncode
    finally:
        wedged.close()
    assert returncode == 1, err_path.read_text()
    assert err_path.read_text().strip().splitlines() == [
        "pai: error: the submit server did not answer within 1 s; nothing was submitted "
        "(PAI_SUBMIT_SERVER=0 submits without it)"]
    assert not (Path(os.environ["PAI_HOME"]) / "pai.db").exists()
