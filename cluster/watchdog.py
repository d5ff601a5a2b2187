"""The watchdog: ends a job's instances when its JobMaster dies.

The master writes each instance's identity (an InstanceRef, one JSON line) to its
stdin. EOF without a prior "done" means the master is gone: the watchdog declares
it lost (lifecycle.declare_master_lost). Meanwhile it makes the job's backend ready
to stop from here at once (Backend.ready_to_stop: Ray Client connects ahead). It
also sweeps the home's jobs whose master and watchdog both died
(lifecycle.sweep_lost), since readers never write.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from paicli.cluster import lifecycle, outputs
from paicli.cluster.backends import backend_for_job
from paicli.cluster.backends.base import InstanceRef
from paicli.cluster.spawn import stop_router
from paicli.store import OUTAGE_WAIT, Store

SWEEP_AFTER = 2.0  # the sweep waits out the instances' start
READY_AFTER = 0.5  # so does getting ready to stop: both are CPU the instances' start needs


def sweep(start: threading.Event) -> None:
    """lifecycle.sweep_lost, once: SWEEP_AFTER seconds in, or when `start` is set."""
    start.wait(SWEEP_AFTER)
    try:
        store = Store()  # this thread's own connection
        try:
            recorded = lifecycle.sweep_lost(store)
        finally:
            store.close()
        lifecycle.to_stderr(f"{time.ctime()}: swept the home's lost jobs ({len(recorded)} recorded)")
    except Exception as err:  # noqa: BLE001 - another job's trouble must not end this watchdog
        lifecycle.to_stderr(f"{time.ctime()}: the sweep of lost jobs failed: {err}")


def get_ready(job_id: str) -> None:
    """Backend.ready_to_stop while the master still runs: a stop from here is then quick."""
    time.sleep(READY_AFTER)
    try:
        store = Store()  # this thread's own connection
        job_dir = Path(store.job(job_id)["job_dir"])
        store.close()
        if backend_for_job(job_dir).ready_to_stop():
            lifecycle.to_stderr(f"{time.ctime()}: ready to stop the job's instances through its backend")
    except Exception as err:  # noqa: BLE001 - a stop tries again; this only makes it quicker
        lifecycle.to_stderr(f"{time.ctime()}: getting ready to stop the job's instances failed: {err}")


def main(argv: list[str]) -> int:
    job_id = argv[0]
    # Our own session already: a signal to the master's group does not reach us.
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    print(f"{time.ctime()}: watchdog of {job_id}: pid {os.getpid()}", file=sys.stderr, flush=True)
    job_ended = threading.Event()
    sweeper = threading.Thread(target=sweep, args=(job_ended,), name="sweep", daemon=True)
    sweeper.start()
    threading.Thread(target=get_ready, args=(job_id,), name="ready", daemon=True).start()
    refs: list[InstanceRef] = []
    routers: list[InstanceRef] = []   # a serving job's router, on this machine whatever the backend
    done = False
    for line in sys.stdin.buffer:
        word = line.strip()
        if word == b"done":
            done = True
        elif word.startswith((b"{", b"router {")):
            try:
                ref = InstanceRef.from_dict(json.loads(word.removeprefix(b"router ")))
                (routers if word.startswith(b"router") else refs).append(ref)
            except (ValueError, KeyError, TypeError):
                print(f"{time.ctime()}: ignored a bad line from the master: {word[:200]!r}", file=sys.stderr)
    if not done:
        for ref in routers:
            if stop_router(ref, lifecycle.STOP_TIMEOUT):
                print(f"{time.ctime()}: stopped the router {ref.pid}", file=sys.stderr, flush=True)
        store = Store(outage_wait=OUTAGE_WAIT)
        stopped = lifecycle.declare_master_lost(store, job_id, refs)
        print(f"{time.ctime()}: master of {job_id} lost; stopped {[f'{r.node}:{r.pid}' for r in stopped]} "
              f"(of {len(refs)} instance(s) it was told about)", file=sys.stderr)
        try:
            # What the master would have brought back and removed at its end.
            job_dir = Path(store.job(job_id)["job_dir"])
            backend = backend_for_job(job_dir)
            try:
                outputs.collect_after_master(store, job_id, backend, outputs.job_log_note(job_dir))
            except Exception as err:  # noqa: BLE001 - the folders are kept then: nothing is lost
                print(f"{time.ctime()}: bringing the job's files back failed: {err}", file=sys.stderr)
                backend.keep_nodes.add("*")
            backend.cleanup(str(job_dir))
        except Exception as err:  # noqa: BLE001 - a clean-up failure must not hide the verdict
            print(f"{time.ctime()}: clean-up after the lost master failed: {err}", file=sys.stderr)
    job_ended.set()
    sweeper.join(lifecycle.STOP_TIMEOUT + lifecycle.STOP_DEADLINE)
    return 0

