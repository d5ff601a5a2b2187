"""The job store's SQLite locks in a process holding several Stores: opening one
must not take the others' locks away (real processes, real SQLite in WAL mode)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

from paicli.store import Store, every_store_closed

# Another process's short use of the store: open, read the job IDs, close (its
# close is the last one it makes, the moment SQLite checkpoints and deletes the
# WAL if no other process holds a lock on the database).
OTHER_PROCESS = ("import sys; from pathlib import Path; from paicli.store import Store;"
                 "store = Store(Path(sys.argv[1])); print(' '.join(row['id'] for row in store.jobs())); store.close()")


def _record(store: Store, job_id: str, job_dir: Path) -> None:
    store.create_job(job_id, name="x", framework="python", project=None, task_name="t", job_dir=job_dir,
                     roles=[{"name": "worker", "count": 1, "must_finish": True}])


def _ids_seen_elsewhere(home: Path) -> set[str]:
    done = subprocess.run([sys.executable, "-c", OTHER_PROCESS, str(home)], capture_output=True, text=True,
                          timeout=60, check=True)
    return set(done.stdout.split())


def test_a_second_store_keeps_the_locks_of_the_first_so_no_write_is_lost(tmp_path):
    """Closing any descriptor of a file drops every POSIX lock the process holds
    on it. Opening a Store used to open and close the database files (to make
    them 0600) while another Store of the same process was connected: the process
    then held no lock, another process's last close deleted the WAL under the
    live connection, and what it wrote afterwards was seen by no one. Seen: the
    console, with an earlier statement's Store not yet collected, followed a job
    whose Ctrl-C cancel went into a deleted WAL, then "database disk image is
    malformed"."""
    home = tmp_path / "home"
    first = Store(home)
    second = Store(home)
    try:
        _record(first, "job1", tmp_path)
        assert _ids_seen_elsewhere(home) == {"job1"}
        _record(first, "job2", tmp_path)
        _record(second, "job3", tmp_path)
        assert _ids_seen_elsewhere(home) == {"job1", "job2", "job3"}
        assert {row["id"] for row in first.jobs()} == {"job1", "job2", "job3"}
    finally:
        first.close()
        second.close()
    assert {row["id"] for row in Store(home).jobs()} == {"job1", "job2", "job3"}


def _locked_by(pid: int, path: Path) -> bool:
    """Whether process `pid` holds a POSIX lock on `path` (from /proc/locks)."""
    device_inode = os.stat(path).st_ino
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if fields[1] == "POSIX" and fields[4] == str(pid) and fields[5].rsplit(":", 1)[1] == str(device_inode):
            return True
    return False


def test_a_fork_closes_the_connection_of_a_dropped_store_too(tmp_path):
    """A dropped Store closes its connection at once. A sqlite3.Connection is
    freed only by the cyclic collector, so an earlier statement's Store (the
    console makes one per statement) left its connection open, unknown to
    every_store_closed: the forked master inherited it, and its own Store, sharing
    SQLite's inherited lock bookkeeping, never took a lock of its own."""
    home = tmp_path / "home"
    collecting = gc.isenabled()
    gc.disable()   # as when no collection happens to run between the statements
    try:
        earlier = Store(home)
        earlier.jobs()
        del earlier
        store = Store(home)
        with every_store_closed():
            open_here = [fd for fd in os.listdir("/proc/self/fd")
                         if "pai.db" in os.path.realpath(f"/proc/self/fd/{fd}")]
            pid = os.fork()
            if pid == 0:  # the child: a master's Store, then does it hold its locks?
                code = 1
                try:
                    child = Store(home)
                    child.jobs()
                    code = 0 if _locked_by(os.getpid(), child.path) else 3
                finally:
                    os._exit(code)
        _, status = os.waitpid(pid, 0)
        store.close()
    finally:
        if collecting:
            gc.enable()
    assert open_here == [], "a connection stayed open across the fork"
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child's Store holds no lock on the database"


# Many processes creating the same new store at once, each recording a job as soon as it is open.
RACER = ("import sys, time; from pathlib import Path; from paicli.store import Store;"
         "home, me, start = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]);"
         "time.sleep(max(0.0, start - time.time()));"
         "store = Store(home); store.create_job(me, name='x', framework='python', project=None, task_name='t',"
         "job_dir=home, roles=[{'name': 'worker', 'count': 1, 'must_finish': True}]); store.close()")


def test_a_new_store_created_by_many_processes_at_once_is_one_store_with_every_job(tmp_path):
    import sqlite3
    import time

    home = tmp_path / "home"
    start = time.time() + 1.0
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(home), f"job{k}", str(start)]) for k in range(6)]
    assert [p.wait(timeout=120) for p in racers] == [0] * 6
    assert sorted(os.listdir(home)) == ["jobs", "pai.db"]   # no copy built aside is left
    assert os.stat(home / "pai.db").st_mode & 0o777 == 0o600
    db = sqlite3.connect(home / "pai.db")
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert {row[0] for row in db.execute("SELECT id FROM jobs")} == {f"job{k}" for k in range(6)}
    finally:
        db.close()


def test_a_store_made_meanwhile_by_another_process_is_kept_not_replaced(tmp_path):
    """The loser of the creation race (it saw no store, built its copy aside, and
    another process linked theirs first) leaves the winner's store as it is."""
    from paicli.store import _create_store

    home = tmp_path / "home"
    store = Store(home)
    try:
        _record(store, "winner", home)
        _create_store(store.path)
        assert [row["id"] for row in store.jobs()] == ["winner"]
        assert _ids_seen_elsewhere(home) == {"winner"}
        assert sorted(os.listdir(home)) == ["jobs", "pai.db", "pai.db-shm", "pai.db-wal"]
    finally:
        store.close()


def test_a_store_on_a_filesystem_without_hard_links_is_created_in_place(tmp_path, monkeypatch):
    import errno

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    home = tmp_path / "home"
    store = Store(home)
    try:
        _record(store, "only", home)
        assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert [row["id"] for row in store.jobs()] == ["only"]
        assert not [name for name in os.listdir(home) if name.endswith(".new")]
    finally:
        store.close()


# -- the schema's version ----------------------------------------------------------------

SCHEMA_FINGERPRINT = 3643369684   # crc32 of SCHEMA's statements and ADDED_COLUMNS at SCHEMA_VERSION


def test_a_schema_change_comes_with_a_new_version():
    """Stores carrying SCHEMA_VERSION skip the schema on open: a change to it that
    kept the version would never reach them."""
    import re
    import zlib

    from paicli import store

    statements = re.sub(r"--[^\n]*\n", "", store.SCHEMA)   # its comments are no change
    fingerprint = zlib.crc32(repr((statements, store.ADDED_COLUMNS)).encode())
    assert (store.SCHEMA_VERSION, fingerprint) == (4, SCHEMA_FINGERPRINT), \
        "SCHEMA or ADDED_COLUMNS changed: bump SCHEMA_VERSION, then set both numbers here"


def test_a_new_store_has_every_table_and_added_column(tmp_path):
    """A new store is stamped as it is built, so it must be built whole: the added
    columns too, which no later open will add."""
    import sqlite3

    from paicli import store

    Store(tmp_path).close()
    db = sqlite3.connect(tmp_path / "pai.db")
    try:
        for table, column, _kind in store.ADDED_COLUMNS:
            assert column in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}, (table, column)
        assert db.execute("PRAGMA user_version").fetchone()[0] == store.SCHEMA_VERSION
    finally:
        db.close()


def test_an_open_of_a_current_store_runs_no_schema_statement(tmp_path, monkeypatch):
    import sqlite3

    from paicli import store

    Store(tmp_path).close()   # created: stamped with the version
    statements = []
    real_connect = sqlite3.connect

    def traced(*args, **kwargs):
        db = real_connect(*args, **kwargs)
        db.set_trace_callback(statements.append)
        return db

    monkeypatch.setattr(store.sqlite3, "connect", traced)
    s = Store(tmp_path)
    try:
        assert s.db.execute("PRAGMA user_version").fetchone()[0] == store.SCHEMA_VERSION
        assert not [q for q in statements if "CREATE" in q or "table_info" in q or "ALTER" in q], statements
    finally:
        s.close()


def test_a_store_of_an_older_version_gets_its_tables_and_columns(tmp_path):
    """A store from before a column existed (user_version 0, as every store before
    versions were kept): its open adds what is missing and stamps the version."""
    import sqlite3

    from paicli import store

    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    old = sqlite3.connect(home / "pai.db")
    old.execute("CREATE TABLE instances (job_id TEXT, role TEXT, idx INTEGER, status TEXT NOT NULL,"
                " attempt INTEGER DEFAULT 0, host TEXT, port INTEGER, pid INTEGER, pgid INTEGER, started REAL,"
                " ended REAL, exit_code INTEGER, PRIMARY KEY (job_id, role, idx))")
    old.commit()
    old.close()
    s = Store(home)
    try:
        columns = {row[1] for row in s.db.execute("PRAGMA table_info(instances)")}
        assert {"node", "ref", "gpus"} <= columns
        assert s.db.execute("SELECT count(*) FROM sqlite_master WHERE name = 'outputs'").fetchone()[0] == 1
        assert s.db.execute("PRAGMA user_version").fetchone()[0] == store.SCHEMA_VERSION
    finally:
        s.close()
