"""The watchdog: ends a job's instances when its JobMaster dies.

The master starts it with a pipe on stdin and writes each instance's identity
(an InstanceRef as one JSON line) to it as it starts. EOF on that pipe without a
prior "done" means the master is gone (kill -9, a crash, OOM): the watchdog
stops every instance it was told about, and every one the store knows, through
the job's backend (`Backend.stop_all`: identity checked, SIGTERM, bounded wait,
SIGKILL), and marks the job failed with reason "master lost".
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from paicli.cluster.backends import backend_for_job
from paicli.cluster.backends.base import InstanceRef
from paicli.errors import PaiError
from paicli.states import InstanceStatus, JobStatus
from paicli.store import Store

STOP_TIMEOUT = 3.0


def stored_refs(store: Store, job_id: str) -> list[InstanceRef]:
    """The identities the store holds for a job: every attempt's (an attempt may
    have left processes in its group)."""
    return [InstanceRef.from_dict(json.loads(row["ref"])) for row in store.attempts(job_id) if row["ref"]]


def stop_job_instances(store: Store, job_id: str, refs: list[InstanceRef] | None = None,
                       timeout: float = STOP_TIMEOUT) -> list[InstanceRef]:
    """Stop what a job may have left running: the refs given and every attempt
    the store knows, through the job's backend. Returns what was signalled."""
    job = store.job(job_id)
    backend = backend_for_job(Path(job["job_dir"]))
    wanted = {ref: None for ref in [*(refs or ()), *stored_refs(store, job_id)]}
    return backend.stop_all(list(wanted), timeout)


def mark_master_lost(store: Store, job_id: str, refs: list[InstanceRef] | None = None,
                     reason: str = "master lost") -> list[InstanceRef]:
    """The job's master is gone: record it, then stop whatever it left running.
    Returns what was stopped."""
    # Write the verdict first, then act: anyone who looks sees why.
    store.set_job(job_id, JobStatus.FAILED, reason)
    try:
        stopped = stop_job_instances(store, job_id, refs)
    except PaiError as err:
        # The job's backend cannot be had (a Ray head that no longer answers): the
        # nodes stop what they run themselves (the agents' heartbeat, Ray killing the
        # dead driver's actors). The instances are still recorded as ended.
        print(f"{time.ctime()}: cannot reach the job's backend to stop its instances: {err}", file=sys.stderr)
        stopped = []
    for inst in store.instances(job_id):
        if not InstanceStatus(inst["status"]).is_terminal():
            store.set_instance(job_id, inst["role"], inst["idx"], InstanceStatus.KILLED, reason)
    return stopped


def main(argv: list[str]) -> int:
    job_id = argv[0]
    # Our own session already: a signal to the master's group does not reach us.
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    print(f"{time.ctime()}: watchdog of {job_id}: pid {os.getpid()}", file=sys.stderr, flush=True)
    refs: list[InstanceRef] = []
    done = False
    for line in sys.stdin.buffer:
        word = line.strip()
        if word == b"done":
            done = True
        elif word.startswith(b"{"):
            try:
                refs.append(InstanceRef.from_dict(json.loads(word)))
            except (ValueError, KeyError, TypeError):
                print(f"{time.ctime()}: ignored a bad line from the master: {word[:200]!r}", file=sys.stderr)
    if done:
        return 0
    store = Store()
    stopped = mark_master_lost(store, job_id, refs)
    print(f"{time.ctime()}: master of {job_id} lost; stopped {[f'{r.node}:{r.pid}' for r in stopped]} "
          f"(of {len(refs)} instance(s) it was told about)", file=sys.stderr)
    try:
        # What the master would have removed at its end (SSH: the per-job folders on the nodes).
        job_dir = Path(store.job(job_id)["job_dir"])
        backend_for_job(job_dir).cleanup(str(job_dir))
    except Exception as err:  # noqa: BLE001 - a clean-up failure must not hide the verdict
        print(f"{time.ctime()}: clean-up after the lost master failed: {err}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
