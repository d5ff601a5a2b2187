"""The queue at work: no daemon, the jobs' own supervisors and the store.

- `check_and_describe` (the submit): exit 2 for a job that could never start
  (bigger than the cluster or its project's quota); the queue entry.
- `wait_turn` (the job's JobMaster): run the policy (cluster.queue.turns) in one
  store transaction; until it is the job's turn, say why in job.log and sleep
  until a master that frees room wakes it (SIGUSR1) or, at the head, a second passes.
- `lifecycle.job_ended` (every master's end): its holds go, the policy runs, the
  jobs that may start now are woken. Reading the queue (`listing`) writes nothing.

Ray places jobs itself: its jobs never enter this queue.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paicli.cluster import placement as placing, queue as policy
from paicli.cluster.backends.base import NodeSpec, Placement
from paicli.cluster.procinfo import Unverified, signal_verified, start_time
from paicli.errors import UsageError
from paicli.jobstatus import master_alive, supervisor_gone
from paicli.states import JobStatus
from paicli.store import Store

HEAD_POLL = 1.0        # the head of the queue runs the policy this often, woken or not
WAITER_POLL = 3.0      # others look at their own row this often
WAKE_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# -- submit ---------------------------------------------------------------------------


def quota_path(home: Path) -> Path | None:
    given = os.environ.get("PAI_QUOTA")
    if given:
        return Path(given).expanduser()
    path = Path(home) / "quota.yaml"
    return path if path.is_file() else None


def _quota_file(home: Path, path: Path | None = None) -> tuple[Any, str]:
    """The quota file's content (`path`, else $PAI_QUOTA, else $PAI_HOME/quota.yaml;
    none: None) and how errors name it."""
    path = path or quota_path(home)
    if path is None:
        return None, ""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"quota file {path}: cannot read it ({type(err).__name__})",
                         "fix the file or unset PAI_QUOTA") from None
    import yaml

    try:
        return yaml.safe_load(text), f"quota file {path}"
    except (yaml.YAMLError, ValueError, RecursionError):
        raise UsageError(f"quota file {path}: not valid YAML",
                         "e.g. vision: {cpu: 800, memory: 32000, gpu: 200}") from None


def load_quotas(store: Store) -> dict[str, dict[str, int]]:
    """The quotas: a team store's own (`pai quota set`), else the quota file's (no
    file: no quotas)."""
    return store.quotas() if store.postgres else policy.parse_quota(*_quota_file(store.home))


def load_admins(store: Store) -> frozenset[str]:
    """Who may act on any job: a team store's admins, else the quota file's (no file: nobody)."""
    return store.admins() if store.postgres else policy.parse_admins(*_quota_file(store.home))


def read_quota_file(path: Path) -> tuple[dict[str, dict[str, int]], frozenset[str]]:
    """A quota file's quotas and admins (`pai quota set --file`)."""
    data, where = _quota_file(path.parent, path)
    return policy.parse_quota(data, where), policy.parse_admins(data, where)


def check_and_describe(store: Store, plan, nodes: list[NodeSpec], priority: int, project: str | None) -> str:
    """UsageError (exit 2) when the job could never start; else the queue entry
    (JSON) to record with the job."""
    demands = placing.demands(plan)
    policy.check_submit(policy.Entry("", priority, project, 0.0, tuple(demands), tuple(nodes)),
                        load_quotas(store))
    return json.dumps({"demands": [list(d) for d in demands], "nodes": [n.to_dict() for n in nodes]})


def _entry(row) -> policy.Entry:
    return policy.Entry(row["job_id"], row["priority"] or 0, row["project"], row["submitted"] or 0.0,
                        *_shape(row["entry"]))


@functools.lru_cache(maxsize=4096)
def _shape(entry: str) -> tuple[tuple[placing.Demand, ...], tuple[NodeSpec, ...]]:
    """A queue entry's demands and nodes. Every decision reads the whole queue, whose
    jobs are mostly alike (one nodes file, sweeps of one job): each text is decoded
    once per process."""
    data = json.loads(entry)
    return tuple(placing.Demand(*d) for d in data["demands"]), tuple(NodeSpec.from_dict(n) for n in data["nodes"])


# -- the policy in one transaction ------------------------------------------------------


def dispatch(store: Store, me: str | None = None) -> None:
    """Run the policy over the whole queue in one store transaction, record each
    verdict, wake the supervisors of the jobs that may start (not `me`)."""
    try:
        quotas, quota_error = load_quotas(store), None
    except UsageError as err:
        quotas, quota_error = {}, f"the quota file is broken ({err.message}); nothing starts until it is fixed"

    def decide(rows, holds, claims) -> list[dict[str, Any]]:
        entries = [_entry(row) for row in rows]
        # What a job whose master is gone held is free, even before it is recorded lost.
        held = [policy.Hold(h["job_id"], h["project"], h["node"], h["cpu"], h["memory"], h["gpu"])
                for h in holds if master_alive(h)]
        gpus: dict[str, set[str]] = {}
        for claim in claims:
            if claim["holder"] is None or master_alive(claim):
                gpus.setdefault(claim["node"], set()).add(claim["item"])
        if quota_error:
            turns = [policy.Turn(e.job_id, n, reason=quota_error) for n, e in enumerate(policy.ordered(entries), 1)]
        else:
            turns = policy.turns(entries, held, gpus, quotas)
        # Only what changes is written: while no job starts, no line moves.
        said = {row["job_id"]: (row["reason"], row["position"]) for row in rows}
        return [_verdict(turn) for turn in turns if turn.start or said[turn.job_id] != (turn.reason, turn.position)]

    for job in store.queue_dispatch(decide):
        if job["id"] != me:
            _wake(store, job["id"])


def _verdict(turn: policy.Turn) -> dict[str, Any]:
    gpus: dict[str, list[str]] = {}
    for p in turn.placements or ():
        gpus.setdefault(p.node, []).extend(p.gpus)
    event = (f"backfilled: starts ahead of {turn.backfill}, which it cannot delay (it uses only room that job"
             f" will not need)") if turn.backfill else None
    return {"job_id": turn.job_id, "start": turn.start, "position": turn.position, "reason": turn.reason,
            "line": policy.waiting_line(turn) if not turn.start else None,
            "placement": json.dumps([p.to_dict() for p in turn.placements]) if turn.placements else None,
            "holds": [(h.node, h.cpu, h.memory, h.gpu) for h in turn.holds], "gpus": gpus, "event": event}


def _wake(store: Store, job_id: str) -> None:
    row = store.queue_entry(job_id)
    pid, _, start = ((row["waiter"] or "") if row is not None else "").partition(":")
    if pid:
        try:
            signal_verified(int(pid), start, signal.SIGUSR1)
        except (Unverified, OSError):
            pass   # it looks at its row within WAITER_POLL anyway


# -- the job's supervisor ---------------------------------------------------------------


def wait_turn(store: Store, job_id: str, note: Callable[[str], None], deadline: float | None,
              cancelled: Callable[[], str | None], place_now: Callable[[], list[Placement]],
              before_wait: Callable[[], None] | None = None
              ) -> tuple[list[Placement] | None, tuple[JobStatus, str] | None]:
    """The JobMaster's wait for its turn: (placements, None) when it may start, or
    (None, outcome) when cancelled or timed out. A job with no queue entry is placed
    at once (`place_now`); `before_wait()` runs once if the turn does not come at once."""
    if store.queue_entry(job_id) is None:
        return place_now(), None

    # A late wake-up must not end this master (SIGUSR1's default): a no-op handler,
    # not SIG_IGN, which would stay ignored in whatever the master execs.
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, WAKE_SIGNALS)
    # Started with the signals blocked, so its thread never takes one: it sends this
    # thread the wake-up when another machine or user grants the turn.
    main = threading.get_ident()
    stop_listening = store.listen_turns(job_id, lambda: signal.pthread_kill(main, signal.SIGUSR1))
    try:
        # Recorded only once the wake-up signal is blocked: it can no longer kill us.
        store.set_waiter(job_id, f"{os.getpid()}:{start_time(os.getpid())}")
        dispatch(store, me=job_id)
        said = None
        seen = _fingerprint(store)
        while True:
            row = store.queue_entry(job_id)   # a read: 500 waiters must not queue for the write lock
            taken = store.take_turn(job_id) if row is not None and row["state"] == "granted" else None
            if taken is not None:
                return [Placement.from_dict(p) for p in json.loads(taken)], None
            job = store.job(job_id)
            ended = JobStatus(job["status"]).is_terminal()
            if job["master_pid"] not in (None, os.getpid()) or (row is None and not ended):
                # lifecycle.revive_queued gave the job another supervisor: this one holds nothing yet.
                print(f"{time.ctime()}: another supervisor (pid {job['master_pid']}) took this job over",
                      flush=True)
                os._exit(0)
            if row is None or ended or cancelled():
                return None, (JobStatus.CANCELLED, cancelled() or job["reason"] or "cancelled while waiting")
            if deadline is not None and time.monotonic() >= deadline:
                return None, (JobStatus.CANCELLED, f"timeout while waiting in the queue ({job['reason'] or ''})")
            if before_wait is not None:
                # A backend's connections let go (their threads would take the wake-up),
                # then a look again, as a wake-up may have gone to them meanwhile.
                before_wait()
                before_wait = None
                continue
            if job["reason"] and job["reason"] != said:
                said = job["reason"]
                note(said)
            head = row["position"] == 1
            pause = HEAD_POLL if head else WAITER_POLL
            if deadline is not None:
                pause = max(0.0, min(pause, deadline - time.monotonic()))
            got = signal.sigtimedwait(WAKE_SIGNALS, pause)
            if got is not None and got.si_signo != signal.SIGUSR1:
                return None, (JobStatus.CANCELLED, "cancelled while waiting")
            if got is None and head:
                # Room freed by someone who did not run the policy, or an edited quota file.
                now_seen = _fingerprint(store)
                if now_seen != seen:
                    seen = now_seen
                    dispatch(store, me=job_id)
    finally:
        stop_listening()
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def placed_again(store: Store, job_id: str, demands: list[placing.Demand], placements: list[Placement]) -> None:
    """A started job moved, added or removed an instance (failover, scaling): what
    it holds follows."""
    if store.queue_holds(job_id):
        project = store.job(job_id)["project"]
        holds = policy.holds_of(job_id, project, demands, placements)
        store.set_holds(job_id, project, [(h.node, h.cpu, h.memory, h.gpu) for h in holds])


def _fingerprint(store: Store) -> tuple:
    path = quota_path(store.home)
    try:
        mtime = path.stat().st_mtime_ns if path else None
    except OSError:
        mtime = None
    return (*store.queue_fingerprint(), mtime)


# -- `pai queue` -------------------------------------------------------------------------


def listing(store: Store) -> list[dict[str, Any]]:
    """The queue as `pai queue` shows it, in queue order. A job whose supervisor
    is gone is shown waiting for a new one (nothing is written here)."""
    rows = store.queued()
    order = {e.job_id: n for n, e in enumerate(policy.ordered(_entry(r) for r in rows))}
    out = []
    for row in sorted(rows, key=lambda r: order[r["job_id"]]):
        need = policy.totals(placing.Demand(*d) for d in json.loads(row["entry"])["demands"])
        waiting_for = row["reason"] or ("starting" if row["state"] == "granted" else "")
        out.append({"position": row["position"] or order[row["job_id"]] + 1, "id": row["job_id"],
                    "name": row["name"], "framework": row["framework"], "priority": row["priority"] or 0,
                    "project": row["project"], "submitted": row["submitted"], "needs": need,
                    "state": "starting" if row["state"] == "granted" else "waiting",
                    "waiting_for": waiting_for if master_alive(row) else supervisor_gone(waiting_for)})
    return out
