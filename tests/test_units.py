"""Unit tests of the launcher's parts: states, exit policy, ports, the store
under concurrent writers, archives, metrics and capped logs."""

from __future__ import annotations

import io
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from paicli.cluster.logsink import CappedFile, InstanceLog, JobLog, MetricParser, literal_runs
from paicli.cluster.ports import allocate_ports
from paicli.private import write_private
from paicli.jobplan import KEY_VALUE_METRIC, JobPlan, RolePlan
from paicli.runners.archive import UnsafeArchive, extract
from paicli.states import InstanceStatus, JobStatus, can_move, describe_exit, is_retryable
from paicli.store import Store, new_job_id

ROOT = Path(__file__).resolve().parent.parent


def test_terminal_states_have_no_way_out():
    for status in JobStatus:
        if status.is_terminal():
            assert not any(can_move(status, other) for other in JobStatus)
    for status in InstanceStatus:
        if status.is_terminal():
            assert not any(can_move(status, other) for other in InstanceStatus)
    assert can_move(JobStatus.WAITING, JobStatus.RUNNING) and not can_move(JobStatus.RUNNING, JobStatus.WAITING)
    assert can_move(InstanceStatus.RUNNING, InstanceStatus.WAITING)  # a restart


def test_store_refuses_transitions_out_of_terminal_states(tmp_path, store_kind):
    store = Store(tmp_path)
    store.create_job("j1", name="n", framework="python", project=None, task_name="T", job_dir=tmp_path,
                     roles=[{"name": "worker", "count": 1, "must_finish": True}])
    assert store.set_job("j1", JobStatus.RUNNING)
    assert store.set_job("j1", JobStatus.CANCELLED, "by user")
    assert not store.set_job("j1", JobStatus.FAILED, "late")
    assert store.job("j1")["status"] == "Cancelled" and store.job("j1")["reason"] == "by user"
    assert store.set_instance("j1", "worker", 0, InstanceStatus.RUNNING)
    assert store.set_instance("j1", "worker", 0, InstanceStatus.KILLED)
    assert not store.set_instance("j1", "worker", 0, InstanceStatus.TERMINATED)
    kinds = [e["message"] for e in store.events("j1")]
    assert kinds[:3] == ["python job n", "Running", "Cancelled: by user"]


@pytest.mark.parametrize("code, retry", [(1, False), (2, False), (126, False), (127, False), (128, False),
                                         (139, False), (-11, False), (130, True), (137, True), (138, True),
                                         (143, True), (-9, True), (-15, True), (3, False)])
def test_exit_code_policy(code, retry):
    assert is_retryable(code) is retry


def test_describe_exit():
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(3) == "exited with code 3"


def test_job_ids_are_unique_and_well_formed():
    ids = [new_job_id() for _ in range(200)]
    # Digits and lower-case letters only (not islower(): an ID whose random part is
    # all digits has no cased letter, 2.6% of 200-ID runs).
    assert len(set(ids)) == 200 and all(re.fullmatch(r"[0-9a-z]{24}", i) for i in ids)


# Fixed instants, each pair a boundary the stamp must carry across: a millisecond,
# a second (x.999 -> y.000), a minute, a day, a year; 1 ms apart is the finest the ID holds.
ID_TIMES = [(1750000000.001, 1750000000.002), (1750000000.999, 1750000001.0),
            (1750000059.5, 1750000060.25), (1750031999.999, 1750032000.0), (1767225599.9, 1767225600.1),
            (1750000000.009, 1750000000.010), (1750000000.099, 1750000000.100)]


@pytest.mark.parametrize("earlier, later", ID_TIMES)
def test_job_ids_sort_by_submit_time(earlier, later):
    # Made in both orders: the later instant's ID sorts after, whatever the random tail.
    first, second = new_job_id(earlier), new_job_id(later)
    assert first < second
    second, first = new_job_id(later), new_job_id(earlier)
    assert first < second


def test_write_private_never_follows_a_planted_symlink(tmp_path):
    """A file written through a temporary name (known_hosts, at a path the user
    chooses) must not be redirected by a symlink planted at a name it could guess."""
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    target = tmp_path / "known_hosts"
    # Every name the old scheme could have used (".NAME.PID.tmp" with this pid) and a few more.
    for pid in {os.getpid(), *range(1, 50)}:
        os.symlink(victim, tmp_path / f".{target.name}.{pid}.tmp")
    write_private(target, "host key\n")
    assert victim.read_text() == "keep me"
    assert target.read_text() == "host key\n" and not target.is_symlink()
    assert oct(target.stat().st_mode & 0o777) == oct(0o600)
    left = sorted(p.name for p in tmp_path.iterdir() if not p.is_symlink())
    assert left == ["known_hosts", "victim"]   # no temporary left behind


def test_write_private_takes_a_fresh_temporary_name_each_time(tmp_path, monkeypatch):
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, flags, mode=0o777: (opened.append((str(path), flags)),
                                                                     real_open(path, flags, mode))[1])
    write_private(tmp_path / "f", "a")
    write_private(tmp_path / "f", "b")
    assert len({path for path, _ in opened}) == 2
    for _path, flags in opened:
        assert flags & os.O_EXCL and flags & os.O_NOFOLLOW and flags & os.O_CREAT
    assert (tmp_path / "f").read_text() == "b"


def test_a_replaced_file_is_the_old_or_the_whole_new_never_a_link_followed(tmp_path, monkeypatch):
    from paicli.private import ReplacingFile

    victim = tmp_path / "victim"
    victim.write_text("keep me")
    target = tmp_path / "model.h5"
    os.symlink(victim, target)               # the target itself a link: replaced, not followed
    os.umask(0o022)
    write_private(target, "weights")
    assert victim.read_text() == "keep me" and not target.is_symlink() and target.read_text() == "weights"
    assert target.stat().st_mode & 0o777 == 0o600

    # a write that fails halfway leaves the old content and no temporary
    with pytest.raises(OSError):
        with ReplacingFile(target) as out:
            out.write(b"half of new")
            raise OSError("disk full")
    assert target.read_text() == "weights"

    # so does a failure at the very end (the fsync before the rename)
    def failing_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space"):
        write_private(target, "new weights")
    monkeypatch.undo()
    assert target.read_text() == "weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.h5", "victim"]

    # a committed file takes its mode and the time it is given
    with ReplacingFile(target, mode=0o400) as out:
        out.write(b"read-only")
    assert target.read_text() == "read-only" and target.stat().st_mode & 0o777 == 0o400
    out = ReplacingFile(tmp_path / "dated", prefix=".pai-part-")
    assert os.path.basename(out.temp).startswith(".pai-part-")
    out.write(b"x")
    out.commit(mtime_ns=1_700_000_000_000_000_000)
    assert (tmp_path / "dated").stat().st_mtime_ns == 1_700_000_000_000_000_000


def test_tensorflow_keeps_its_cpp_log_at_errors_unless_the_user_chose_a_level():
    from paicli.runners.tensorflow_runner import quiet_tensorflow_log

    env: dict[str, str] = {}
    assert quiet_tensorflow_log(env) is True and env["TF_CPP_MIN_LOG_LEVEL"] == "2"   # WARNING and INFO hidden
    for chosen in ("0", "1", "3", ""):
        env = {"TF_CPP_MIN_LOG_LEVEL": chosen}    # -Denv=TF_CPP_MIN_LOG_LEVEL=...: theirs, banner kept too
        assert quiet_tensorflow_log(env) is False and env == {"TF_CPP_MIN_LOG_LEVEL": chosen}


def test_the_cluster_watch_wraps_tensorflow_once_it_is_whole(tmp_path):
    """TensorFlow's session module imports others while it loads: a watch that wrapped
    it then found it half made (AttributeError: no BaseSession) and failed the job
    whenever the user set TF_CPP_MIN_LOG_LEVEL (the import then goes unquieted)."""
    fake = tmp_path / "tensorflow"
    for package in ("", "python", "python/client", "python/training"):
        (fake / package).mkdir(parents=True, exist_ok=True)
        (fake / package / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("from tensorflow.python.client import session\n"
                                      "from tensorflow.python.training import server_lib\n")
    (fake / "python" / "client" / "session.py").write_text(
        "import json  # imported while this module is half made\n"
        "class BaseSession:\n"
        "    graph = None\n"
        "    def __init__(self, target='', graph=None, config=None):\n"
        "        pass\n")
    (fake / "python" / "training" / "server_lib.py").write_text(
        "class Server:\n    def __init__(self, *args, **kwargs):\n        pass\n")
    probe = (f"import sys; sys.path[:0] = [{str(ROOT / 'runners')!r}, {str(tmp_path)!r}]\n"
             "from tensorflow_runner import ClusterWatch, install_cluster_watch\n"
             "watch = ClusterWatch()\n"
             "install_cluster_watch(watch)\n"
             "import tensorflow\n"
             "tensorflow.session.BaseSession('grpc://ps:1')\n"
             "print(watch.targets)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['grpc://ps:1']"


def _writer(home, worker, count, errors):
    try:
        store = Store(home)
        for i in range(count):
            job_id = f"w{worker}-{i}"
            store.create_job(job_id, name=job_id, framework="python", project=None, task_name="T",
                             job_dir=home, roles=[{"name": "worker", "count": 2, "must_finish": True}])
            store.set_job(job_id, JobStatus.RUNNING)
            store.set_instance(job_id, "worker", 0, InstanceStatus.RUNNING, pid=1, pgid=1)
            store.add_metrics([(job_id, "worker", 0, 0.0, float(s), "loss", 1.0) for s in range(20)])
            store.set_job(job_id, JobStatus.SUCCEEDED)
    except Exception as err:  # reported to the parent, which asserts there were none
        errors.put(f"{type(err).__name__}: {err}")


def test_eight_concurrent_writers_never_see_database_is_locked(tmp_path, store_kind):
    Store(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(tmp_path, w, 25, errors)) for w in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 8
    assert errors.empty(), errors.get()
    store = Store(tmp_path)
    assert len(store.jobs(1000)) == 200
    assert store.db.execute("SELECT COUNT(*) FROM metrics").fetchone()[0] == 200 * 20
    if store_kind == "sqlite":
        assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_ports_are_claimed_once_across_jobs(tmp_path, store_kind):
    store = Store(tmp_path)
    a = allocate_ports(store, "job-a", "127.0.0.1", 20)
    b = allocate_ports(store, "job-b", "127.0.0.1", 20)
    assert len(set(a) | set(b)) == 40
    assert not store.claim_port(a[0], "job-c")
    store.release_ports("job-a")
    assert store.claim_port(a[0], "job-c")


def _listener(host: str) -> socket.socket:
    sock = socket.socket()
    sock.bind((host, 0))
    sock.listen()
    return sock


def test_the_free_port_routine_refuses_a_port_held_on_any_address():
    """The one free-port routine (the node agent's, used by every backend) is steered
    to ports held by listeners: on 0.0.0.0, and on another address than the host
    asked for (an instance may bind 0.0.0.0, which would then fail). It must skip
    both and take the free one; a routine that trusted the port, or checked only
    the host's own address, fails here."""
    from paicli.runners.node_agent import free_ports

    wildcard, elsewhere = _listener("0.0.0.0"), _listener("127.0.0.2")
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        free = probe.getsockname()[1]
    held = [wildcard.getsockname()[1], elsewhere.getsockname()[1]]
    try:
        assert free_ports("127.0.0.1", 1, set(), candidates=[*held, free]) == [free]
        assert free_ports("127.0.0.1", 2, set(), candidates=held) == []
        assert free_ports("127.0.0.1", 1, {free}, candidates=[free]) == []   # `avoid`
    finally:
        wildcard.close()
        elsewhere.close()


def test_a_port_in_use_is_never_handed_out(tmp_path, store_kind):
    store = Store(tmp_path)
    held = [_listener("0.0.0.0") for _ in range(20)]
    taken = {s.getsockname()[1] for s in held}
    try:
        assert not taken & set(allocate_ports(store, "job", "127.0.0.1", 50))
    finally:
        for sock in held:
            sock.close()


def _tar(tmp_path, members):
    path = tmp_path / "a.tgz"
    with tarfile.open(path, "w:gz") as tar:
        for name, link in members:
            info = tarfile.TarInfo(name)
            if link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tar.addfile(info)
            else:
                info.size = 2
                tar.addfile(info, io.BytesIO(b"ok"))
    return str(path)


@pytest.mark.parametrize("members", [[("../x.py", None)], [("/abs.py", None)], [("a/../../x.py", None)],
                                     [("l", "/etc/passwd")], [("d/l", "../../x")], [("l", "..")]])
def test_unsafe_archives_are_refused_before_anything_is_written(tmp_path, members):
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(UnsafeArchive):
        extract(_tar(tmp_path, [("main.py", None), *members]), str(dest))
    assert os.listdir(dest) == []


def test_safe_archive_with_an_inner_link(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    extract(_tar(tmp_path, [("pkg/main.py", None), ("pkg/alias.py", "main.py")]), str(dest))
    assert (dest / "pkg" / "alias.py").read_text() == "ok"


def test_metric_parser_reads_the_seed_line():
    parser = MetricParser([KEY_VALUE_METRIC])
    step, values = parser.parse("step=3, global_step=1, loss=7.496880, duration=26.735484s.")
    assert step == 3 and values == {"step": 3, "global_step": 1, "loss": 7.49688, "duration": 26.735484}
    assert parser.parse("no numbers here, name=abc") == (None, {})
    custom = MetricParser([r"Iteration (?P<iteration>\d+).*loss = (?P<loss>[\d.]+)"])
    assert custom.parse("Iteration 100 (2.3 iter/s, 8.6s/20 iters), loss = 0.21") == (100, {"iteration": 100,
                                                                                               "loss": 0.21})


def test_a_patterns_literal_runs_are_the_text_every_match_has():
    assert literal_runs(KEY_VALUE_METRIC) == ("=",)
    assert literal_runs(r"\bloss = (?P<loss>\d+), step = (?P<step>\d+)") == ("loss = ", ", step = ")
    assert literal_runs(r"(?:ab|cd)=x[Ll]oss") == ("=x", "oss")     # a branch, a class: cut
    assert literal_runs(r"a?b{0,3}c(?:de)+f") == ("c", "de", "f")    # optional: none; repeated: its own
    assert literal_runs(r"x(?i:loss)y") == ("x", "y")
    assert literal_runs(r"(?i)loss") == () and literal_runs("(unbalanced") == ()


def test_a_read_without_a_patterns_literal_is_not_scanned_for_it():
    """Scanning 4 KB of digits for `key=value` cost ~110 us (re has no first-character
    filter for a pattern that starts with a group): a third of the master's CPU in
    a flood of plain lines (bench_core.py logtail). A read without `=` is not scanned."""
    parser = MetricParser([KEY_VALUE_METRIC, r"\bloss = (?P<loss>\d+)"])
    plain = "".join(f"12 {seq} 1764412345678901234\n" for seq in range(150))
    assert parser.patterns_for(plain) == [] and parser.parse_text(plain) == []
    assert parser.patterns_for(plain + "step=3\n") == parser.patterns[:1]
    assert parser.parse_text(plain + "step=3\n") == [(3, {"step": 3})]
    assert parser.patterns_for("loss = 4\n") == parser.patterns


def test_instance_log_lines_partial_lines_and_carriage_returns(tmp_path):
    log = InstanceLog(tmp_path / "w.log", "[worker:0] ", cap=1 << 20)
    assert log.feed(b"a=1\nb=") == b"a=1\n"
    assert log.feed(b"2") == b""
    assert log.feed(b"\r\nprogress 10%\rprogress 100%\npart") == b"b=2\nprogress 100%\n"
    assert log.flush() == b"part\n"
    log.close()
    assert (tmp_path / "w.log").read_bytes() == b"a=1\nb=2\r\nprogress 10%\rprogress 100%\npart"


def test_job_log_prefixes_every_line_and_keeps_the_tail_and_metrics(tmp_path):
    job = JobLog(tmp_path / "job.log", MetricParser([KEY_VALUE_METRIC]), cap=1 << 20)
    log = InstanceLog(tmp_path / "w.log", "[worker:1] ", cap=1 << 20)
    chunk = b"".join(b"line %d step=%d, loss=%d.5\n" % (i, i, i) for i in range(12))
    job.lines("j", "worker", 1, log, log.feed(chunk))
    job.lines("j", "worker", 1, log, log.feed(b"".join(b"more %d\n" % i for i in range(30))))
    job.close()
    shown = (tmp_path / "job.log").read_bytes().splitlines()
    assert len(shown) == 42 and all(line.startswith(b"[worker:1] ") for line in shown)
    assert shown[11] == b"[worker:1] line 11 step=11, loss=11.5"
    assert list(log.tail)[-1] == "more 29" and len(log.tail) == 20
    rows = job.take_metrics()
    assert [(r[4], r[5], r[6]) for r in rows[-2:]] == [(11, "step", 11), (11, "loss", 11.5)]
    assert len(rows) == 24


def test_a_held_job_log_is_written_in_pieces_in_order(tmp_path):
    from paicli.cluster.logsink import HELD_BYTES

    path = tmp_path / "job.log"
    job = JobLog(path, MetricParser([]), cap=1 << 30)
    log = InstanceLog(tmp_path / "w.log", "[worker:0] ", cap=1 << 30)
    job.lines("j", "worker", 0, log, log.feed(b"first\n"))
    assert path.read_bytes() == b"[worker:0] first\n"             # not held: at once
    job.hold()
    job.lines("j", "worker", 0, log, log.feed(b"second\n"))
    job.note("a note between two reads")
    assert path.read_bytes() == b"[worker:0] first\n"             # held
    big = b"x" * 99 + b"\n"
    job.lines("j", "worker", 0, log, log.feed(big * (HELD_BYTES // 100 + 1)))
    written = path.read_bytes()                                     # a piece of HELD_BYTES went
    assert written.startswith(b"[worker:0] first\n[worker:0] second\n[pai] a note between two reads\n[worker:0] xx")
    job.lines("j", "worker", 0, log, log.feed(b"third\n"))
    assert path.read_bytes() == written
    job.release()
    assert path.read_bytes() == written + b"[worker:0] third\n"
    job.hold()
    job.note("job SUCCEEDED")
    job.close()                                                     # what is held is not lost
    assert path.read_bytes().endswith(b"[worker:0] third\n[pai] job SUCCEEDED\n")


def test_capped_file_keeps_the_tail(tmp_path):
    f = CappedFile(tmp_path / "x.log", cap=100)
    for i in range(50):
        f.write(f"line {i:04d}\n".encode())
    f.close()
    current = (tmp_path / "x.log").read_text()
    previous = (tmp_path / "x.log.1").read_text()
    assert current.endswith("line 0049\n") and len(current) <= 100 and len(previous) <= 100
    assert (previous + current).splitlines() == [f"line {i:04d}" for i in range(50)][-len((previous + current).splitlines()):]


def test_plan_round_trips_through_json():
    plan = JobPlan("n", "python", "PythonTask", [RolePlan("ps", 1, ["python", "x.py"], must_finish=False),
                                                 RolePlan("worker", 2, ["python", "x.py"], env={"A": "1"})])
    assert JobPlan.from_json(plan.to_json()) == plan
    assert plan.total_instances == 3 and plan.role("ps").must_finish is False


def test_a_flood_of_metric_lines_is_sampled_evenly_keeping_the_last():
    from paicli.cluster.logsink import METRIC_LINES_PER_READ

    job = JobLog(Path("/dev/null"), MetricParser([KEY_VALUE_METRIC]), cap=1 << 40)
    log = InstanceLog(Path("/dev/null"), "[worker:0] ", cap=1 << 40)
    job.lines("j", "worker", 0, log, b"".join(b"step=%d, loss=1\n" % i for i in range(160)))
    steps = [r[6] for r in job.take_metrics() if r[5] == "step"]
    assert len(steps) <= METRIC_LINES_PER_READ and steps[-1] == 159
    assert steps == sorted(steps) and steps[1] - steps[0] == 10
    job.lines("j", "worker", 0, log, b"step=7, loss=0.5\n")  # a normal read: every line counts
    assert [(r[5], r[6]) for r in job.take_metrics()] == [("step", 7), ("loss", 0.5)]


def test_ctrl_c_while_following_is_counted_at_a_known_point_not_raised_anywhere():
    """SIGINT during `follow_job` sets a flag and wakes the follower; it must not
    raise KeyboardInterrupt between two statements of the loop (the console went
    back to its prompt without cancelling the job when it did)."""
    import select
    import signal

    from paicli.logtail import InterruptCatcher

    before = signal.getsignal(signal.SIGINT)
    catcher = InterruptCatcher()
    catcher.install()
    try:
        assert catcher.wake_fd >= 0
        signal.raise_signal(signal.SIGINT)   # would raise KeyboardInterrupt here without the catcher
        assert select.select([catcher.wake_fd], [], [], 1.0)[0], "the follower is not woken"
        assert catcher.take() and not catcher.take()
    finally:
        catcher.restore()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_fork_closes_every_open_store_of_the_process(tmp_path, store_kind):
    """Two Stores open in one process (a library caller): forking the master with
    one must close the other's connection too, or the child inherits SQLite's
    lock bookkeeping for it (seen: "database disk image is malformed")."""
    from paicli.store import Store, every_store_closed

    first, second = Store(tmp_path / "home"), Store(tmp_path / "home")
    with every_store_closed():
        for store in (first, second):
            try:
                store.db.execute("SELECT 1")
            except Exception as err:   # sqlite3's ProgrammingError, psycopg's OperationalError
                assert "closed" in str(err)
                continue
            raise AssertionError("a connection stayed open across the fork")
    assert second.db.execute("SELECT count(*) FROM jobs").fetchone()[0] == 0
    assert first.db.execute("SELECT count(*) FROM jobs").fetchone()[0] == 0


def test_every_combination_of_exit_facts_meets_exactly_one_verdict_row():
    import itertools

    from paicli.cluster import policy

    for facts in itertools.product((False, True), repeat=4):
        rows = [action for pattern, action in policy.VERDICT_TABLE
                if all(want is None or want == have for want, have in zip(pattern, facts))]
        assert len(rows) == 1, (facts, rows)


@pytest.mark.parametrize("facts, action", [
    ((True, False, False, False), "finished"), ((True, True, True, True), "finished"),
    ((False, False, True, True), "fail"), ((False, True, False, False), "fail"), ((False, True, True, False), "fail"),
    ((False, True, True, True), "restart-job"), ((False, True, False, True), "restart-instance"),
])
def test_verdict_table(facts, action):
    from paicli.cluster import policy

    assert policy.verdict_for(*facts) == action


def test_step_seconds_and_live_reads_come_through_the_store(tmp_path, store_kind):
    from paicli import steptime
    from paicli.web import data

    store = Store(tmp_path)
    store.create_job("j1", name="n", framework="python", project=None, task_name="T", job_dir=tmp_path,
                     roles=[{"name": "ps", "count": 1, "must_finish": False},
                            {"name": "worker", "count": 2, "must_finish": True}])
    # worker:0 steps every 0.2 s after a slow first interval; worker:1 has one step
    # line but its own per-step durations; the ps's steps do not count.
    rows = [("j1", "worker", 0, t, s, "step", s) for s, t in ((0, 0.0), (10, 5.0), (20, 7.0), (30, 9.0))]
    rows += [("j1", "worker", 1, 1.0, 0, "step", 0)]
    rows += [("j1", "worker", 1, 1.0 + i, None, "duration", d) for i, d in enumerate((9.0, 0.4, 0.4))]
    rows += [("j1", "ps", 0, t, s, "step", s) for s, t in ((0, 0.0), (1, 50.0), (2, 100.0))]
    store.add_metrics(rows)
    assert steptime.job_step_seconds(store, "j1") == pytest.approx((0.2 + 0.4) / 2)
    store.update_job("j1", started=0.5)
    points, last = data.metric_points(store, "j1")
    # Step counters are the x axis, not points; a metric without a step is drawn over
    # the seconds since the job started.
    assert points == [["worker:1", "duration", 0.5 + i, d, "seconds"] for i, d in enumerate((9.0, 0.4, 0.4))]
    assert last == len(rows)
    store.add_metrics([("j1", "worker", 0, 9.5, 30, "loss", 0.5)])
    assert data.metric_points(store, "j1", last) == ([["worker:0", "loss", 30, 0.5]], last + 1)
    before = store.last_event_id("j1")
    store.event("j1", "note", "x")
    assert store.last_event_id("j1") > before > 0 and store.last_event_id("nope") == 0


def test_sql_lives_only_in_the_store():
    """Modules read and write the store through its methods; raw SQL elsewhere
    drifts from the schema."""
    import re

    root = Path(__file__).resolve().parents[1]
    sql = re.compile(r"""\bdb\.execute|\bimport sqlite3|["'](SELECT|INSERT|UPDATE|DELETE|PRAGMA|BEGIN)\b""")
    found = set()
    for path in [*root.glob("paicli/**/*.py"), *root.glob("cluster/**/*.py")]:
        name = path.relative_to(root).as_posix()
        if name not in ("paicli/store.py", "paicli/store_pg.py") and sql.search(path.read_text()):
            found.add(name)
    assert not found


def test_the_multihost_bench_finds_a_step_line_split_across_reads():
    """bench_multihost's by-hand baseline looked for the first step line in each read:
    a line split across two reads was never seen ("the hand-started job printed no
    step" on a fresh machine). It now reads whole lines."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_multihost.py"
    spec = importlib.util.spec_from_file_location("bench_multihost", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    reads = [b"[tensorflow runner] worker ready\n[worker:0] st", b"ep=0, global_step=1, loss=2.5\n", b"tail", b""]
    assert not any(bench.STEP_LINE.search(chunk) for chunk in reads)   # what the old per-read look saw
    pending, found = b"", []
    for data in reads:
        lines, pending = bench.step_lines(pending, data)
        found += [line for line in lines if bench.STEP_LINE.search(line)]
    assert found == [b"[worker:0] step=0, global_step=1, loss=2.5"]
    assert pending == b""


def test_backends_fill_in_underscore_methods_and_override_no_public_one():
    """SkyPilot's pattern, held: the shared work (staging progress and timing, the
    agent's spec, which nodes keep their folder, a transport call tried twice) lives
    in base.Backend's public methods; a registered backend defines none of them, only
    the `_underscore` methods they call."""
    import importlib

    from paicli.cluster.backends import BACKENDS
    from paicli.cluster.backends.base import Backend

    public = {n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_")}
    assert {"nodes", "prepare", "cleanup", "collect_outputs", "pick_ports", "remove_job_folders",
            "begin_start", "stop_all", "alive", "run_runner", "place_job"} <= public
    allowed: dict[str, set[str]] = {}   # none: a justified exception would be named here
    for name, target in BACKENDS.items():
        module, _, cls_name = target.partition(":")
        cls = getattr(importlib.import_module(module), cls_name)
        own = public & set(vars(cls))
        assert own <= allowed.get(name, set()), f"the {name} backend overrides {sorted(own)} of base.Backend"


def test_a_transport_call_is_tried_twice_then_one_line_names_the_node():
    """base.Backend retries every transport call the same way (not only a stop): a
    call that fails once is made again; twice is one PaiError naming the node and the
    call; a verdict (a cancel: `outcome`) or a usage error is raised at once."""
    from paicli.cluster.backends.local import LocalBackend
    from paicli.errors import PaiError, UsageError

    class Cancelled(PaiError):
        outcome = ("Cancelled", "cancelled by user")

    class Flaky(LocalBackend):
        def __init__(self, errors):
            super().__init__()
            self.errors, self.calls = list(errors), 0

        def _pick_ports(self, node, count, taken):
            self.calls += 1
            if self.errors:
                raise self.errors.pop(0)
            return super()._pick_ports(node, count, taken)

    once = Flaky([OSError("connection reset")])
    assert len(once.pick_ports("local", 2)) == 2 and once.calls == 2
    with pytest.raises(PaiError, match="finding free ports on node local failed twice: OSError: connection reset"):
        Flaky([OSError("connection reset")] * 2).pick_ports("local", 1)
    for verdict in (Cancelled("cancelled by user"), UsageError("no node named 'x'")):
        flaky = Flaky([verdict])
        with pytest.raises(type(verdict)):
            flaky.pick_ports("local", 1)
        assert flaky.calls == 1


def test_staging_says_in_the_job_log_how_long_it_took_once_that_is_noticeable(tmp_path, monkeypatch):
    """base.Backend.prepare owns the staging progress for every backend: lines go to
    the job's job.log unless the master gave a note, and a staging that took a
    second or more says how long (a backend that stages nothing, local, does not)."""
    import time as clock

    from paicli.cluster.backends import base

    class Remote(base.Backend):
        def _prepare(self, job_dir, plan, placements):
            self.progress("n1: copying")
            clock.sleep(0.3)

        def _staged_folders(self, nodes):
            return {"n1": "/tmp/job"}

    class Local(Remote):
        def _staged_folders(self, nodes):
            return None

    monkeypatch.setattr(base, "STAGING_NOTED", 0.2)
    placed = [base.Placement("worker", 0, "n1", "10.0.0.1")]
    for backend in (Remote(), Local()):
        job = tmp_path / backend.__class__.__name__
        job.mkdir()
        backend.prepare(str(job), None, placed)
        lines = (job / "job.log").read_text().splitlines()
        assert lines[0] == "[pai] n1: copying"
        staged = [line for line in lines if line.startswith("[pai] staged the job on n1 in 0.")]
        assert len(staged) == (1 if isinstance(backend, Remote) and not isinstance(backend, Local) else 0), lines


def test_step_seconds_of_fast_steps_read_in_pairs_is_their_rate():
    """Steps of 5 ms whose lines the master read two at a time (stored 0 and 10 ms
    apart): each single interval says 0 or 10 ms, and their median said either; rates
    over at least MIN_SPAN_S say 5 ms. Slow steps keep one rate per interval."""
    from paicli import steptime

    fast = [(0, 0.0)] + [(step, 0.5 + 0.01 * ((step + 1) // 2)) for step in range(1, 200)]
    assert steptime.instance_step_seconds(fast) == pytest.approx(0.005, rel=0.05)
    odd = fast[:-1]   # an odd number of intervals: the old median was 0 or 10 ms, never 5
    assert steptime.instance_step_seconds(odd) == pytest.approx(0.005, rel=0.05)
    slow = [(0, 0.0), (1, 5.0), (2, 5.2), (3, 5.4), (4, 6.4), (5, 6.6)]
    assert steptime.instance_step_seconds(slow) == pytest.approx(0.2)   # the 1 s pause is an outlier


def test_the_suite_never_writes_into_the_home_of_whoever_runs_it(tmp_path):
    """conftest gives every test process, and each `pai` a test starts, a PAI_HOME of
    its own: a test without the pai_home fixture once left a store in the real
    ~/.pai of the machine that ran the suite."""
    from conftest import SESSION_HOME, pai

    fake_home = tmp_path / "user"
    fake_home.mkdir()
    assert os.environ["PAI_HOME"] == str(SESSION_HOME)
    result = pai("list", "--json", env={"HOME": str(fake_home)})
    assert result.returncode == 0, result.stderr
    assert (SESSION_HOME / "pai.db").exists()       # the command opened a store, in the session's home
    assert not (fake_home / ".pai").exists()        # and nothing in the user's

