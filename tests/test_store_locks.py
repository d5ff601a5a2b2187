"""The job store's SQLite locks in a process holding several Stores: opening one
must not take the others' locks away (real processes, real SQLite in WAL mode)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from paicli.store import Store

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
