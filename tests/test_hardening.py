"""Issue 12: the defects found by trying the core as a new user would. Each test
here failed before its fix."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import BEHAVE, PAI, job_id_from, pai, pai_json, run_on_pty, wait_until
from paicli.cluster import logsink
from paicli.cluster.logsink import InstanceLog, JobLog, MetricParser
from paicli.jobplan import KEY_VALUE_METRIC

BAR = Path(__file__).resolve().parent / "scripts" / "bar.py"


# -- 1. progress bars ----------------------------------------------------------------


def _bar_states(count: int, width: int = 100) -> list[bytes]:
    return [(b"%6d/%d |" % (i, count)).ljust(width - 1, b"#") + b"|" for i in range(count + 1)]


def test_a_redrawn_line_is_kept_collapsed_and_its_complete_line_is_unchanged(tmp_path):
    """300,000 redraws of a 100-character bar, read the way a 4 KB pipe hands
    them over: the open line never holds more than one state."""
    log = InstanceLog(tmp_path / "w.log", "[worker:0] ", cap=1 << 40)
    states = _bar_states(300_000)
    stream = b"epoch 1\n" + b"\r".join(states) + b"\n" + b"done\n"
    largest = 0
    out = []
    for i in range(0, len(stream), 4096):
        out.append(log.feed(stream[i:i + 4096]))
        largest = max(largest, len(log.partial))
    log.close()
    assert b"".join(out) == b"epoch 1\n" + states[-1] + b"\n" + b"done\n"
    assert largest <= 100
    assert (tmp_path / "w.log").stat().st_size == len(stream)  # the instance's own log stays raw


def test_redraw_edge_cases_match_what_a_whole_line_shows(tmp_path):
    """Byte by byte or at once, the complete line is the same (CRLF, \\r\\r, a
    trailing \\r, a redraw that starts the next read)."""
    cases = [b"a\r\n", b"ab\rcd\r\n", b"x\r\ry\n", b"bar 10%\rbar 100%\r\n", b"plain\n", b"\r\rz\n",
             b"one\rtwo\rthree", b"k\r"]
    for case in cases:
        whole = InstanceLog(Path("/dev/null"), "[w:0] ", cap=1 << 40)
        expected = whole.feed(case) + whole.flush()
        byte = InstanceLog(Path("/dev/null"), "[w:0] ", cap=1 << 40)
        got = b"".join(byte.feed(case[i:i + 1]) for i in range(len(case))) + byte.flush()
        assert got == expected, case
    assert expected == b"k\n"


def test_a_line_without_end_is_cut_so_memory_stays_bounded(tmp_path):
    log = InstanceLog(Path("/dev/null"), "[w:0] ", cap=1 << 40)
    pieces = [log.feed(b"x" * 65536) for _ in range(40)]
    assert len(log.partial) <= logsink.MAX_PARTIAL
    cut = b"".join(pieces)
    assert cut.count(b"\n") == (40 * 65536) // logsink.MAX_PARTIAL and set(cut.replace(b"\n", b"")) == {ord("x")}


def test_an_open_line_is_shown_live_and_removed_when_it_completes(tmp_path, monkeypatch):
    job = JobLog(tmp_path / "job.log", MetricParser([KEY_VALUE_METRIC]), cap=1 << 20)
    log = InstanceLog(tmp_path / "w.log", "[worker:0] ", cap=1 << 20)
    job.lines("j", "worker", 0, log, log.feed(b"start\n 10%\r 20%"))
    live = tmp_path / "job.live"
    job.refresh_live(time.monotonic(), force=True)
    assert not live.exists()  # a line split over two reads is never shown
    job.refresh_live(time.monotonic() + 1, force=True)
    assert live.read_bytes() == b"[worker:0]  20%\n"
    assert stat.S_IMODE(live.stat().st_mode) == 0o600
    job.lines("j", "worker", 0, log, log.feed(b"\r 30%\r100%\n"))
    job.refresh_live(time.monotonic() + 2, force=True)
    assert not live.exists()
    job.close()
    assert (tmp_path / "job.log").read_bytes() == b"[worker:0] start\n[worker:0] 100%\n"


def test_a_progress_bar_reaches_the_attached_terminal_before_its_line_ends(pai_home):
    """A real job redraws a bar for a few seconds; `pai` on a terminal shows its
    states while it runs, and the combined log gets only the finished line."""
    env = dict(os.environ, BAR_STEPS="40", BAR_SLEEP="0.1")
    env.pop("NO_COLOR", None)
    code, raw = run_on_pty([*PAI, "-name", "python", f"-Dscript={BAR}"], env)
    out = raw.decode()
    assert code == 0, out
    shown = [int(part.split("/")[0].split()[-1]) for part in out.split("\r") if "/40 |" in part]
    assert len([s for s in shown if 0 < s < 40]) >= 3, out  # intermediate states, live
    job_id = job_id_from(out)
    combined = (pai_home / "jobs" / job_id / "job.log").read_text()
    assert combined.splitlines()[0] == "[worker:0] " + "    40/40 |".ljust(99, "#") + "|"
    assert not (pai_home / "jobs" / job_id / "job.live").exists()


# -- 4. bad input that escaped as an internal error ------------------------------------


def test_a_home_folder_of_an_unknown_user_is_bad_input_not_a_crash(pai_home):
    result = pai("-name", "python", "-Dscript=~nosuchuser_a/t.py")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "pai: error: -Dscript: ~nosuchuser_a: no such user on this machine; give the path without ~nosuchuser_a"]
    home = pai("list", env={"PAI_HOME": "~nosuchuser_a/pai"})
    assert home.returncode == 2 and "Traceback" not in home.stderr
    assert "PAI_HOME=~nosuchuser_a/pai: no such user" in home.stderr


@pytest.mark.parametrize("mode, owner, words", [
    (0o777, None, "writable by others (mode 777)"),
    (0o770, None, "writable by others (mode 770)"),
    (0o700, 65534, "owned by uid 65534"),        # nobody's (the tests run as root, who may chown)
])
def test_a_pai_home_others_own_or_may_write_is_refused_in_one_line(tmp_path, mode, owner, words):
    home = tmp_path / "shared"
    home.mkdir()
    home.chmod(mode)
    if owner is not None:
        os.chown(home, owner, -1)
    for argv in (["list"], ["-name", "python", f"-Dscript={BEHAVE}"]):
        result = pai(*argv, env={"PAI_HOME": str(home)})
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert f"PAI_HOME {home}: {words}" in result.stderr
    assert list(home.iterdir()) == [] and stat.S_IMODE(home.stat().st_mode) == mode


def _bomb(path: Path, declared: int) -> Path:
    """A .tar.gz whose one member's header claims `declared` bytes of zeros,
    followed by only the first megabyte of them: what a gzip bomb looks like
    to a reader that trusts headers only after writing."""
    import gzip
    import tarfile

    info = tarfile.TarInfo("train.py")
    info.size = declared
    with gzip.open(path, "wb") as f:
        f.write(info.tobuf(format=tarfile.GNU_FORMAT))
        f.write(b"\0" * (1 << 20))
    return path


def test_an_archive_bomb_is_refused_before_anything_is_written(pai_home, tmp_path):
    bomb = _bomb(tmp_path / "bomb.tar.gz", 64 << 30)
    result = pai("-name", "python", f"-Dscript={bomb}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"pai: error: -Dscript: archive {bomb} is too large: more than 1024 MiB once unpacked; "
        "pack only the code (data belongs in -Dbuckets), or raise PAI_ARCHIVE_MAX_BYTES / PAI_ARCHIVE_MAX_MEMBERS"]
    assert list((pai_home / "jobs").iterdir()) == []


def test_archive_member_count_and_size_limits(pai_home, tmp_path):
    import tarfile

    many = tmp_path / "many.tar.gz"
    src = tmp_path / "src"
    src.mkdir()
    for i in range(30):
        (src / f"m{i}.py").write_text("print(1)\n")
    with tarfile.open(many, "w:gz") as tar:
        tar.add(src, arcname="code")
    result = pai("-name", "python", f"-Dscript={many}", "-DentryFile=code/m1.py",
                 env={"PAI_ARCHIVE_MAX_MEMBERS": "20"})
    assert result.returncode == 2 and "too large: more than 20 members" in result.stderr
    ok = pai("-name", "python", f"-Dscript={many}", "-DentryFile=code/m1.py", env={"PAI_ARCHIVE_MAX_MEMBERS": "40"})
    assert ok.returncode == 0, ok.stderr
    assert list((pai_home / "jobs").iterdir()) != []


def test_a_bad_archive_limit_is_one_line_and_a_plain_script_ignores_it(pai_home, tmp_path):
    import tarfile

    archive = tmp_path / "code.tar.gz"
    (tmp_path / "train.py").write_text("print('step=0, loss=1.0')\n")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "train.py", arcname="train.py")
    bad = {"PAI_ARCHIVE_MAX_BYTES": "abc"}
    result = pai("-name", "python", f"-Dscript={archive}", env=bad)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "pai: error: PAI_ARCHIVE_MAX_BYTES='abc': expected a positive whole number, "
        "e.g. PAI_ARCHIVE_MAX_BYTES=1073741824; unset it to use the default"]
    assert list((pai_home / "jobs").iterdir()) == []
    plain = pai("-name", "python", f"-Dscript={tmp_path / 'train.py'}", env=bad)
    assert plain.returncode == 0, plain.stderr


def test_setup_cfg_asks_for_the_python_that_has_extraction_filters():
    import configparser
    import tarfile

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parent.parent / "setup.cfg")
    assert cfg["options"]["python_requires"] == ">=3.11.4"  # tarfile.data_filter: 3.11.4 (PEP 706)
    assert hasattr(tarfile, "data_filter")


# -- 5. permissions -------------------------------------------------------------------


def test_the_store_job_folders_and_logs_are_the_owners_only(pai_home, tmp_path):
    old = os.umask(0o022)  # the usual umask: what we write must not follow it
    try:
        result = pai("-name", "python", f"-Dscript={BEHAVE}", '-Dcluster={"worker":{"count":2}}',
                     "-DuserDefinedParameters=--key=s3cr3t", env={"BEHAVE": "print:2,sleep:1.5"})
    finally:
        os.umask(old)
    assert result.returncode == 0, result.stderr
    job_dir = pai_home / "jobs" / job_id_from(result.stdout)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert {p.name: mode(p) for p in (pai_home, pai_home / "jobs", job_dir, job_dir / "logs")} == \
        {p.name: 0o700 for p in (pai_home, pai_home / "jobs", job_dir, job_dir / "logs")}
    files = [pai_home / "pai.db", *job_dir.rglob("*")]
    files += [p for p in pai_home.glob("pai.db-*")]
    loose = {str(p.relative_to(pai_home)): oct(mode(p)) for p in files if p.is_file() and mode(p) != 0o600}
    assert loose == {}
    for name in ("spec.json", "plan.json", "job.log", "summary.txt", "master.log", "watchdog.log"):
        assert (job_dir / name).exists()
    assert len(list((job_dir / "logs").iterdir())) == 2


def test_an_existing_looser_store_is_tightened(tmp_path):
    from paicli.store import Store

    home = tmp_path / "home"
    (home / "jobs").mkdir(parents=True, mode=0o755)
    home.chmod(0o755)
    (home / "pai.db").touch(mode=0o644)
    Store(home).close()
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "jobs").stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "pai.db").stat().st_mode) == 0o600


# -- 6. the Caffe averaging ps --------------------------------------------------------


def _numpy_python() -> str:
    from paicli.runners.runtimes import get_runtime

    # Any interpreter with numpy runs the averaging ps: the mxnet runtime, provisioned
    # here on first use as the MXNet tests do (a skip would hide this test on every
    # fresh machine, CI's included). A lock makes a concurrent provisioning safe.
    rt = get_runtime("mxnet")
    rt.ensure(lambda line: print(line, file=sys.stderr))
    return rt.python()


@pytest.mark.mxnet
def test_the_averaging_ps_checks_frames_and_authenticates_workers(tmp_path):
    import hashlib
    import hmac
    import socket
    import struct

    from paicli.runners.runtimes import runner_path

    key = os.urandom(32).hex()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, PAI_HOST="127.0.0.1", PAI_PORT=str(port), PAI_CAFFE_SECRET=key)
    log = open(tmp_path / "ps.log", "wb")
    ps = subprocess.Popen([_numpy_python(), "-u", runner_path("caffe_runner.py"), "average", "--workers", "2"],
                          env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def connect():
        return wait_until(lambda: _try_connect(port), timeout=30)

    def frame(header: dict, payload: bytes = b"") -> bytes:
        head = json.dumps(header).encode()
        return struct.pack("!4sIQ", b"PAIc", len(head), len(payload)) + head + payload

    def read(sock) -> tuple[dict, bytes]:
        raw = b""
        while len(raw) < 16:
            raw += sock.recv(16 - len(raw))
        _, head_len, payload_len = struct.unpack("!4sIQ", raw)
        body = b""
        while len(body) < head_len + payload_len:
            body += sock.recv(head_len + payload_len - len(body))
        return json.loads(body[:head_len]), body[head_len:]

    def closed(sock) -> bool:
        sock.settimeout(5)
        try:
            while sock.recv(4096):
                pass
        except ConnectionResetError:
            pass
        return True

    try:
        # 1. A 64-bit length from a stranger: dropped before anything is allocated.
        bomb = connect()
        read(bomb)  # the challenge
        bomb.sendall(struct.pack("!4sIQ", b"PAIc", 2, 1 << 62))
        assert closed(bomb)
        # 2. A wrong answer to the challenge: dropped.
        liar = connect()
        challenge, _ = read(liar)
        liar.sendall(frame({"op": "hello", "worker": 0, "answer": "00" * 32}))
        assert closed(liar)
        # 3. Two workers that know the secret are averaged.
        workers = []
        for index, values in ((0, (1.0, 3.0)), (1, (3.0, 5.0))):
            sock = connect()
            challenge, _ = read(sock)
            mac = hmac.new(key.encode(), bytes.fromhex(challenge["challenge"]) + str(index).encode(),
                           hashlib.sha256).hexdigest()
            sock.sendall(frame({"op": "hello", "worker": index, "answer": mac}))
            workers.append((sock, struct.pack("<2f", *values)))
        for index, (sock, payload) in enumerate(workers):
            sock.sendall(frame({"op": "avg", "worker": index, "round": 1, "iter": 10}, payload))
        for sock, _ in workers:
            header, payload = read(sock)
            assert header["op"] == "avg" and struct.unpack("<2f", payload) == (2.0, 4.0)
        for index, (sock, _) in enumerate(workers):
            sock.sendall(frame({"op": "done", "worker": index}))
        assert ps.wait(timeout=30) == 0
    finally:
        if ps.poll() is None:
            os.killpg(ps.pid, 9)
            ps.wait()
        log.close()
    text = (tmp_path / "ps.log").read_text()
    assert "refused a connection from 127.0.0.1" in text and "frame too large" in text
    assert "wrong answer to the challenge" in text


def _try_connect(port: int):
    import socket

    try:
        return socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError:
        return None


# -- 6. a runtime in use ----------------------------------------------------------------


def test_a_runtime_a_running_instance_uses_is_not_removed(pai_home, tmp_path):
    from paicli.runners.runtimes import runner_path

    root = tmp_path / "runtimes"
    runtime = root / "mxnet"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(runtime)], check=True)
    (runtime / "paicli-runtime.json").write_text(json.dumps({"name": "mxnet", "version": "old"}))
    # What every runner does first, in the runtime's own interpreter.
    holder = subprocess.Popen(
        [str(runtime / "bin" / "python"), "-c",
         # As when run as a script: the runner's folder first on sys.path (its siblings).
         "import os, runpy, sys, time; sys.path.insert(0, os.path.dirname(sys.argv[1])); "
         "from runtime_lock import hold_runtime_lock; runpy.run_path(sys.argv[1]); "
         "print('held' if hold_runtime_lock() is not None else 'none', flush=True); time.sleep(60)",
         runner_path("mxnet_runner.py")], stdout=subprocess.PIPE, text=True, start_new_session=True)
    env = {"PAI_RUNTIME_DIR": str(root)}
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = pai("runtime", "remove", "mxnet", env=env)
        assert refused.returncode == 1 and runtime.exists()
        assert refused.stderr.strip() == (f"pai: error: cannot remove the mxnet runtime: a running job uses it "
                                          f"({runtime}); try again when its jobs have ended (`pai list`)")
    finally:
        holder.kill()
        holder.wait()
    removed = pai("runtime", "remove", "mxnet", env=env)
    assert removed.stdout.strip() == "mxnet: removed" and not runtime.exists()


# -- 7. idle workers ----------------------------------------------------------------------

LISTEN = Path(__file__).resolve().parent / "scripts" / "listen.py"
PS_W = '{"ps":{"count":1},"worker":{"count":1}}'


def test_quiet_workers_are_shown_idle_in_status_and_the_attached_view(pai_home):
    env = {"PAI_IDLE_SECONDS": "1", "QUIET": "5"}
    result = pai("-name", "python", f"-Dscript={LISTEN}", f"-Dcluster={PS_W}", env=env)
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stdout.splitlines() if "no output from" in line]
    # Said once, naming the quiet worker and not the ps (a service is quiet by nature).
    assert notes == ["[pai] no output from worker:0 for 0 min while the job runs: it may be hung"], result.stdout


def test_status_names_idle_workers(pai_home):
    proc = subprocess.Popen([*PAI, "-name", "python", f"-Dscript={LISTEN}", f"-Dcluster={PS_W}", "--detach"],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, QUIET="6"))
    job_id = proc.communicate(timeout=60)[0].strip()
    try:
        assert wait_until(lambda: pai_json("status", job_id)["status"] == "Running", timeout=20)
        quiet = wait_until(lambda: pai_json("status", job_id, env={"PAI_IDLE_SECONDS": "2"})["idle"], timeout=10)
        assert [i["instance"] for i in quiet] == ["worker:0"] and quiet[0]["seconds"] >= 2
        text = pai("status", job_id, env={"PAI_IDLE_SECONDS": "2"}).stdout
        assert "Idle: no output from worker:0" in text
        assert pai_json("status", job_id)["idle"] == []  # the default: five minutes
    finally:
        pai("kill", job_id)


# -- 8. servers reachable from outside ------------------------------------------------------


@pytest.mark.parametrize("address, exposed", [("0.0.0.0", True), ("127.0.0.1", False), ("::", True)])
def test_status_warns_when_a_server_listens_beyond_loopback(pai_home, address, exposed):
    proc = subprocess.Popen([*PAI, "-name", "python", f"-Dscript={LISTEN}", f"-Dcluster={PS_W}", "--detach"],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, LISTEN_ADDR=address, QUIET="30"))
    job_id = proc.communicate(timeout=60)[0].strip()
    try:
        logs = pai_home / "jobs" / job_id / "logs" / "ps-0.0.log"
        assert wait_until(lambda: logs.exists() and "listening" in logs.read_text(), timeout=20)
        status = pai_json("status", job_id)
        port = next(i["port"] for i in status["instances"] if i["role"] == "ps")
        text = pai("status", job_id).stdout
        if exposed:
            assert status["exposed"] == [{"instance": "ps:0", "port": port, "address": address}]
            assert f"Warning: reachable from other machines, without authentication: ps:0 on {address}:{port}" in text
        else:
            assert status["exposed"] == [] and "reachable" not in text
    finally:
        pai("kill", job_id)


# -- 6. the store's rollback ------------------------------------------------------------


def test_the_real_error_survives_sqlites_own_rollback(tmp_path):
    """A statement SQLite answers by rolling the transaction back itself (here a
    trigger's RAISE(ROLLBACK); a full disk does the same) must surface as its
    own error, not as "cannot rollback - no transaction is active"."""
    import sqlite3

    from paicli.store import Store

    store = Store(tmp_path)
    store.db.execute("CREATE TABLE t (x)")
    store.db.execute("CREATE TRIGGER t_no BEFORE INSERT ON t BEGIN SELECT RAISE(ROLLBACK, 'disk is full'); END")
    with pytest.raises(sqlite3.IntegrityError, match="disk is full"):
        with store.tx() as db:
            db.execute("INSERT INTO t VALUES (1)")
    assert not store.db.in_transaction
    with store.tx() as db:  # and the store goes on working
        db.execute("DROP TRIGGER t_no")
        db.execute("INSERT INTO t VALUES (2)")
    assert store.db.execute("SELECT x FROM t").fetchall()[0][0] == 2


# -- a wake-up that comes late ------------------------------------------------------------

_TAKE_A_LATE_WAKE = """
import sys
from pathlib import Path
from paicli.cluster import queue_turns
from paicli.store import Store

class Store_(Store):
    def take_turn(self, job_id):
        queue_turns._wake(self, job_id)   # another master's dispatch, just before we take the turn
        return super().take_turn(job_id)

store = Store_(Path(sys.argv[1]))
placed, outcome = queue_turns.wait_turn(store, sys.argv[2], print, None, lambda: None, list)
print("took", [p.node for p in placed], outcome, flush=True)
queue_turns._wake(store, sys.argv[2])     # and one after: the row is gone, nobody is signalled
print("alive", flush=True)
"""


def test_a_wake_up_that_arrives_as_the_master_takes_its_turn_does_not_kill_it(tmp_path, store_kind):
    """Every master's dispatch wakes each job granted a start (SIGUSR1). One that
    lands while the granted master is taking its turn stayed pending; when the
    master unblocked it, SIGUSR1's default action ended the master without a
    word: the job was recorded "master lost" (the flake of the ten concurrent
    jobs below)."""
    from paicli.cluster import queue_turns
    from paicli.cluster.backends.base import NodeSpec
    from paicli.jobplan import JobPlan, RolePlan
    from paicli.store import Store

    store = Store(tmp_path)
    store.create_job("2026a", name="a", framework="python", project=None, task_name="T",
                     job_dir=store.jobs_dir / "2026a", roles=[{"name": "worker", "count": 1, "must_finish": True}])
    plan = JobPlan("a", "python", "T", [RolePlan("worker", 1, ["true"], cpu=0)])
    store.enqueue("2026a", 0, None, queue_turns.check_and_describe(
        store, plan, [NodeSpec("h1", "127.0.0.1", 400, 8000, ())], 0, None))
    env = {k: v for k, v in os.environ.items() if k != "PAI_QUOTA"}
    master = subprocess.run([sys.executable, "-c", _TAKE_A_LATE_WAKE, str(tmp_path), "2026a"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert (master.returncode, master.stdout) == (0, "took ['h1'] None\nalive\n"), master.stderr


# -- tests that must be able to fail: distinct ports ------------------------------------------


@pytest.fixture
def small_port_range():
    """A network namespace (loopback only) whose ephemeral ports are 40000-40059:
    there the kernel hands the same free port to several probes, as it rarely
    does on a machine with 28,000 of them, so only the store's claims keep
    concurrent jobs apart. Torn down even when the test fails."""
    if os.geteuid() != 0:
        pytest.skip("needs root for a network namespace")
    name = f"A-ports-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv4.ip_local_port_range=40000 40059"],
                       check=True)
        yield ["ip", "netns", "exec", name]
    finally:
        for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", name], check=False)


def _job_story(home: Path, n: int, result: subprocess.CompletedProcess) -> str:
    """Why job `n` of a batch exited non-zero: its id, status, events and the tails
    of its master's and watchdog's logs (the submit's own output says too little)."""
    from paicli.store import Store

    story = [f"job {n} exited {result.returncode}; stderr: {result.stderr.strip()[-500:]!r}"]
    try:
        job_id = job_id_from(result.stdout)
    except AssertionError:
        return "\n".join([*story, f"stdout: {result.stdout[-500:]!r}"])
    store = Store(home)
    job = store.job(job_id)
    story.append(f"{job_id}: {job['status']} ({job['reason']}), master pid {job['master_pid']}")
    story += [f"  event {e['ts']:.3f} {e['kind']} {e['role'] or ''}{'' if e['idx'] is None else ':'}"
              f"{'' if e['idx'] is None else e['idx']} {e['message']}" for e in store.events(job_id)]
    for name in ("master.log", "watchdog.log", "job.log"):
        path = Path(job["job_dir"]) / name
        text = path.read_text(errors="replace")[-1500:] if path.exists() else "(none)"
        story.append(f"  {name}: {text}")
    return "\n".join(story)


def test_ten_concurrent_jobs_in_a_narrow_port_range_never_share_a_port(pai_home, small_port_range):
    from concurrent.futures import ThreadPoolExecutor

    # cpu 0: jobs that hold no cores run together (the queue makes jobs that hold them take turns)
    cluster = '{"ps":{"count":1,"cpu":0},"worker":{"count":2,"cpu":0}}'
    env = dict(os.environ, BEHAVE_PS="serve", BEHAVE_WORKER="print:2,sleep:4")

    def one(_):
        return subprocess.run([*small_port_range, *PAI, "-name", "python", f"-Dscript={BEHAVE}",
                               f"-Dcluster={cluster}"], capture_output=True, text=True, env=env, timeout=150)

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(one, range(10)))
    failed = [_job_story(pai_home, n, r) for n, r in enumerate(results) if r.returncode != 0]
    assert not failed, "\n\n".join(failed)
    jobs = [pai_json("status", job_id_from(r.stdout)) for r in results]
    spans = {}
    for job in jobs:
        ports = [i["port"] for i in job["instances"]]
        assert len(ports) == 3 and all(40000 <= p <= 40059 for p in ports)
        spans[job["id"]] = (job["started"], job["ended"], set(ports))
    overlapping = 0
    for a in spans:
        for b in spans:
            if a < b and spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]:
                overlapping += 1
                assert not spans[a][2] & spans[b][2], f"{a} and {b} ran at once on ports {spans[a][2] & spans[b][2]}"
    assert overlapping >= 15  # the jobs really ran together


# -- a full disk ----------------------------------------------------------------------------


def test_a_full_store_is_one_clear_error_and_stays_whole(tmp_path):
    from paicli.errors import PaiError
    from paicli.store import Store

    store = Store(tmp_path)
    store.create_job("j1", name="n", framework="python", project=None, task_name="T", job_dir=tmp_path,
                     roles=[{"name": "worker", "count": 1, "must_finish": True}])
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count = {pages + 2}")  # SQLite's own "database or disk is full"
    with pytest.raises(PaiError) as err:
        for i in range(10_000):
            store.event("j1", "note", "x" * 1000)
    assert str(err.value).startswith(f"the job store {tmp_path / 'pai.db'} could not be written: "
                                     "database or disk is full; free some space")
    assert not store.db.in_transaction
    assert store.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert store.job("j1")["status"] == "Waiting"


def test_a_full_disk_under_a_log_names_the_file():
    from paicli.cluster.logsink import CappedFile

    log = CappedFile(Path("/dev/full"), cap=1 << 20)  # every write: ENOSPC
    with pytest.raises(OSError) as err:
        log.write(b"a line\n")
    assert str(err.value) == "[Errno 28] No space left on device: '/dev/full'"
    log.close()
