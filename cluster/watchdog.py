"""The watchdog: ends a job's instances when its JobMaster dies.

The master starts it with a pipe on stdin and writes each instance's process
group ID to it. EOF on that pipe without a prior "done" means the master is gone
(kill -9, a crash, OOM): the watchdog stops every group it was told about and
marks the job failed with reason "master lost".
"""

from __future__ import annotations

import signal
import sys
import time

from paicli.cluster.backends.local import group_exists, signal_group
from paicli.states import InstanceStatus, JobStatus
from paicli.store import Store


def stop_groups(pgids: set[int], timeout: float = 3.0) -> None:
    """SIGTERM to every group, a bounded wait, SIGKILL to what is left."""
    for pgid in pgids:
        signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(group_exists(p) for p in pgids):
        time.sleep(0.05)
    for pgid in pgids:
        signal_group(pgid, signal.SIGKILL)


def mark_master_lost(store: Store, job_id: str, pgids: set[int] | None = None) -> None:
    """The job's master is gone: record it, then stop whatever it left running
    (the groups given, and every group the store knows for the job)."""
    # Write the verdict first, then act: anyone who looks sees why.
    store.set_job(job_id, JobStatus.FAILED, "master lost")
    pgids = set(pgids or ())
    for inst in store.instances(job_id):
        if inst["pgid"] and not InstanceStatus(inst["status"]).is_terminal():
            pgids.add(inst["pgid"])
    stop_groups(pgids)
    for inst in store.instances(job_id):
        if not InstanceStatus(inst["status"]).is_terminal():
            store.set_instance(job_id, inst["role"], inst["idx"], InstanceStatus.KILLED, "master lost")


def main(argv: list[str]) -> int:
    job_id = argv[0]
    # Our own session already: a signal to the master's group does not reach us.
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    pgids: set[int] = set()
    done = False
    for line in sys.stdin.buffer:
        word = line.strip()
        if word == b"done":
            done = True
        elif word.isdigit():
            pgids.add(int(word))
    if done:
        return 0
    mark_master_lost(Store(), job_id, pgids)
    print(f"{time.ctime()}: master of {job_id} lost; stopped process groups {sorted(pgids)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
