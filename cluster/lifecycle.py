"""The only writers of a job's state outside its JobMaster.

`cancel` (`pai kill`): record Cancelled, SIGTERM the master, SIGKILL it after its
grace, stop every instance the store knows. `declare_master_lost` (the watchdog's)
records the verdict and stops what the master left. `hand_over_queue` revives
queued jobs whose supervisor is gone and runs the queue's policy. `record_resume`
links a resumed job to the one it continues.

Every signal goes to a verified identity (pid and start time; instances through
their backend's identity check). An identity that cannot be verified is
reported in one line and left alone.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path
from collections.abc import Callable

from paicli.cluster import queue_turns, spawn
from paicli.cluster.backends import backend_for_job
from paicli.cluster.backends.base import InstanceRef
from paicli.cluster.procinfo import Unverified, is_alive, signal_verified, start_time
from paicli.errors import PaiError
from paicli.jobstatus import lost_reason, master_alive
from paicli.states import InstanceStatus, JobStatus
from paicli.store import Store

STOP_TIMEOUT = 3.0     # SIGTERM to SIGKILL for an instance group
STOP_DEADLINE = 4.0    # the most a stop through the job's backend may take (SSH, Ray round trips)
REVIVE_GRACE = 30.0    # a restarted supervisor has this long to record itself
Report = Callable[[str], None]


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def stop_job_instances(store: Store, job_id: str, refs: list[InstanceRef] | None = None,
                       timeout: float = STOP_TIMEOUT, report: Report = to_stderr) -> list[InstanceRef]:
    """Stop what a job may have left running: the refs given and every attempt
    the store knows, through the job's backend (identity checked, SIGTERM,
    bounded wait, SIGKILL). Returns what was signalled. A backend that cannot be
    reached within STOP_DEADLINE is reported, not waited for: the nodes end what
    they run themselves (the agents' heartbeat, Ray killing a dead driver's actors)."""
    job_dir = Path(store.job(job_id)["job_dir"])
    # Every attempt's identity the store holds: an attempt may have left processes in its group.
    stored = [InstanceRef.from_dict(json.loads(row["ref"])) for row in store.attempts(job_id) if row["ref"]]
    wanted = list({ref: None for ref in [*(refs or ()), *stored]})
    if not wanted:
        return []  # nothing ever started: no backend to build (a Ray connect may itself hang)
    result: dict[str, object] = {}

    def stop() -> None:  # no store in here: it stays in the calling thread
        try:
            result["stopped"] = backend_for_job(job_dir).stop_all(wanted, timeout)
        except PaiError as err:
            result["error"] = err
        except Exception as err:  # noqa: BLE001 - a transport's own error: one line, not a thread's traceback
            result["error"] = f"{type(err).__name__}: {err}"

    worker = threading.Thread(target=stop, name=f"stop {job_id}", daemon=True)
    worker.start()
    worker.join(timeout + STOP_DEADLINE)
    if "error" in result:
        report(f"{time.ctime()}: cannot reach the job's backend to stop its instances: {result['error']}")
    elif worker.is_alive():
        report(f"{time.ctime()}: the job's backend did not answer within {timeout + STOP_DEADLINE:g}s;"
               " its nodes stop what they run themselves")
    return list(result.get("stopped") or [])


def _mark_instances(store: Store, job_id: str, reason: str) -> None:
    for inst in store.instances(job_id):
        if not InstanceStatus(inst["status"]).is_terminal():
            store.set_instance(job_id, inst["role"], inst["idx"], InstanceStatus.KILLED, reason)


def declare_master_lost(store: Store, job_id: str, refs: list[InstanceRef] | None = None,
                        reason: str = "master lost", report: Report = to_stderr) -> list[InstanceRef]:
    """The job's master is gone: record it, then stop whatever it left running.
    Returns what was stopped."""
    # The verdict first, then the acts: anyone who looks meanwhile sees why.
    store.set_job(job_id, JobStatus.FAILED, reason)
    stopped = stop_job_instances(store, job_id, refs, report=report)
    _mark_instances(store, job_id, reason)
    hand_over_queue(store, report=report)   # what it held is free: the queue moves, as at a master's end
    return stopped


def cancel(store: Store, job_id: str, reason: str = "cancelled by user", wait: float = 5.0,
           report: Report = to_stderr) -> bool:
    """Cancel a job and make sure every instance group is gone: within `wait`
    seconds when the master and the backend answer, and its master ended for good
    in any case. False if the job had already ended."""
    job = store.job(job_id)
    if JobStatus(job["status"]).is_terminal():
        return False
    lost = lost_reason(job)
    if lost and store.queue_entry(job_id) is not None:
        # Waiting in the queue, its supervisor gone: nothing of it ever ran.
        store.set_job(job_id, JobStatus.CANCELLED, reason)
        hand_over_queue(store, report=report)
        return True
    if lost:
        report(f"{job_id}: {lost}; recorded, and what it left is stopped")
        declare_master_lost(store, job_id, reason=lost, report=report)
        return True
    store.set_job(job_id, JobStatus.CANCELLED, reason)
    _end_master(store, job_id, time.monotonic() + max(wait - 1.0, 0.5), report)
    # Whatever the master could not stop in time: the one stop path, identity
    # checked, for every attempt the store knows.
    stop_job_instances(store, job_id, timeout=0.5, report=report)
    _mark_instances(store, job_id, reason)
    return True


def request_scale(store: Store, job_id: str, role: str, count: int) -> None:
    """Ask a running job's master for `count` instances of `role`: the count in the
    store, then SIGUSR1 to the master (pid and start time verified), which acts on it."""
    store.set_task_count(job_id, role, count)
    job = store.job(job_id)
    try:
        if not signal_verified(job["master_pid"], job["master_start"], signal.SIGUSR1):
            raise PaiError(f"the master of {job_id} is gone", f"`pai status {job_id}` shows the job")
    except Unverified as err:
        raise PaiError(f"the master of {job_id}: {err}", f"`pai status {job_id}` shows the job") from None


def _end_master(store: Store, job_id: str, deadline: float, report: Report) -> None:
    """SIGTERM the master (it stops its instances and records them), wait until it
    is gone and nothing runs, or the deadline; then SIGKILL it, so a master blocked
    in a call that never returns (a Ray call, a dead SSH peer) ends anyway. Its
    watchdog then sees it gone and stops what it left."""
    job = store.job(job_id)
    pid, start = job["master_pid"], job["master_start"]
    if not pid:
        return  # not started yet: it finds the job Cancelled when it starts
    try:
        if not signal_verified(pid, start, signal.SIGTERM):
            return
    except Unverified as err:
        report(f"the master of {job_id}: {err}")
        return
    while time.monotonic() < deadline:
        running = any(i["status"] == InstanceStatus.RUNNING.value for i in store.instances(job_id))
        if not running and not is_alive(pid, start):
            return
        time.sleep(0.05)
    if signal_verified(pid, start, signal.SIGKILL):
        report(f"the master of {job_id} did not end within its grace: killed")


def sweep_lost(store: Store, report: Report = to_stderr) -> list[str]:
    """Record every job of this store whose master is gone without recording its
    end, and stop what it left: the next job's watchdog runs this, so a job whose
    master and watchdog both died does not stay Running. Returns the jobs declared
    lost."""
    lost = []
    for job in store.unfinished_jobs():
        reason = store.mine_here(job) and lost_reason(job)
        if reason and store.queue_entry(job["id"]) is None:   # a queued one is revived below
            lost.append(job["id"])
            stopped = declare_master_lost(store, job["id"], reason=reason, report=report)
            report(f"{time.ctime()}: job {job['id']}: {reason}; stopped {[f'{r.node}:{r.pid}' for r in stopped]}")
    for job_id in revive_queued(store, report):
        report(f"{time.ctime()}: job {job_id}: waiting in the queue, its supervisor gone: a new one started")
    return lost


def record_resume(store: Store, ended_id: str, new_id: str) -> None:
    """`pai resume`: the new job and the ended one it continues name each other
    (an event of each; neither's state changes)."""
    store.event(new_id, "resumed-from", ended_id)
    store.event(ended_id, "resumed-by", new_id)


# -- the queue: no daemon, so whoever writes keeps it going ------------------------------


def hand_over_queue(store: Store, me: str | None = None, report: Report = to_stderr) -> None:
    """Room may be free (a job ended, was cancelled or recorded lost): the queued
    jobs whose supervisor is gone get a new one first (so the policy counts them
    as live), then the policy runs and wakes the jobs whose turn came."""
    revive_queued(store, report)
    queue_turns.dispatch(store, me=me)


def job_ended(store: Store, job_id: str) -> None:
    """A job's end (its master's last act): what it held is free; who is next?"""
    store.release_holds(job_id)
    hand_over_queue(store, me=job_id, report=lambda line: print(line, flush=True))


def revive_queued(store: Store, report: Report = to_stderr) -> list[str]:
    """Start a new supervisor for every queued job whose supervisor is gone (a
    reboot, a kill): queued jobs are not lost, nothing of them ever ran. One
    writer takes each (store.mark_revived, in a transaction). Returns their IDs."""
    revived = []
    for row in store.queued():
        if master_alive(row) or not store.mine_here(row):   # another user's: theirs to revive
            continue
        if store.mark_revived(row["job_id"], row["master_pid"], time.time() - REVIVE_GRACE):
            try:
                _start_supervisor(store, row["job_id"])
            except OSError as err:
                # Recorded as taken: the next writer after REVIVE_GRACE tries again.
                report(f"{time.ctime()}: job {row['job_id']}: its new supervisor did not start: {err}")
                continue
            revived.append(row["job_id"])
    return revived


def _start_supervisor(store: Store, job_id: str) -> None:
    job_dir = Path(store.job(job_id)["job_dir"])
    store.event(job_id, "queue", "its supervisor was gone; a new one takes its place in the queue")
    master = spawn.start_master(store.home, job_dir)
    try:
        pid = master.start(job_id)
    finally:
        master.close()
    store.update_job(job_id, master_pid=pid, master_start=start_time(pid))

