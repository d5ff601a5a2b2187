"""A job's status as data: its row as the user should see it (with "master gone"
and a queued job's "supervisor gone" derived, never written), the status record
`pai status --json` shows, the signs of trouble, and the plain summary file the
JobMaster keeps. Reads the store and /proc only; the text the CLI prints is in
paicli.jobview.
"""

from __future__ import annotations

import ipaddress
import json
import os
import time
from pathlib import Path
from typing import Any

from paicli import steptime
from paicli.cluster import distribution
from paicli.cluster.pluto import view as pluto_view
from paicli.cluster.procinfo import boot_time, is_alive
from paicli.jobplan import front_url, is_loopback
from paicli.private import write_private
from paicli.states import InstanceStatus, JobStatus
from paicli.store import Store, lease_lapsed, master_here

# A job recorded this long ago with no master pid never got its master (the CLI
# died between recording it and starting the master, or the start failed).
MASTER_START_DEADLINE = 30.0
# What a reader shows of a queued job whose supervisor is gone (a reboot, a kill):
# nothing of it ran, nothing is lost; a writer starts a new one (cluster/lifecycle.py).
SUPERVISOR_GONE = ("its supervisor is gone: a new one starts at the queue's next move"
                   " (a job's end, a submit, `pai kill`) or with `pai queue --revive`")


def master_alive(job) -> bool:
    if "master_host" in job.keys() and not master_here(job):
        # Another machine's: its pid means nothing here; its lease says (a team store).
        return not lease_lapsed(job)
    # A queued job's supervisor may be started again (after a reboot): since then.
    since = max(job["created"] or 0, (job["supervised"] if "supervised" in job.keys() else None) or 0)
    if not job["master_pid"]:
        # Not started yet: alive while it may still be starting, not forever.
        return time.time() - since < MASTER_START_DEADLINE
    if since < boot_time():
        return False  # started before this boot: its pid and start time may name a new process
    return is_alive(job["master_pid"], job["master_start"])


def master_exit_fd(job) -> int:
    """A pidfd of the job's live master, readable once it exits (a follower
    waits on it instead of polling), or -1: no pidfd here, or no live master."""
    if not job["master_pid"]:
        return -1
    try:
        fd = os.pidfd_open(job["master_pid"])
    except (AttributeError, OSError):
        return -1
    if not master_alive(job):   # checked after the open: the fd is the master's, not a reused pid's
        os.close(fd)
        return -1
    return fd


def job_over(job) -> bool:
    """The job has ended and its master is gone: its logs will not grow again."""
    return JobStatus(job["status"]).is_terminal() and not master_alive(job)


def lost_reason(job) -> str | None:
    """Why a job not recorded as ended will never end by itself (its master is
    gone), or None."""
    if JobStatus(job["status"]).is_terminal() or master_alive(job):
        return None
    return "master lost" if job["master_pid"] else \
        f"its master never started (none within {MASTER_START_DEADLINE:g}s)"


def supervisor_gone(reason: str | None) -> str:
    """A queued job's waiting reason, as shown once its supervisor is gone."""
    return f"{reason}; {SUPERVISOR_GONE}" if reason else SUPERVISOR_GONE


def read_job(store: Store, job_id: str) -> dict[str, Any]:
    """The job's row as the user should see it. A job whose master is gone without
    recording its end is shown Failed with the reason its record will get
    (`unrecorded`: True); one waiting in the queue is shown Waiting for a new
    supervisor. Nothing is written, nothing signalled (paicli.cluster.lifecycle
    writes)."""
    job = store.job(job_id)
    if lost_reason(job) is None:
        return {**dict(job), "unrecorded": False}
    # A dead master writes nothing more, but its last transition may have landed
    # between the read above and the look at /proc: read once more.
    job = store.job(job_id)
    reason = lost_reason(job)
    if reason is None:
        return {**dict(job), "unrecorded": False}
    if store.queue_entry(job_id) is not None:
        return {**dict(job), "reason": supervisor_gone(job["reason"]), "unrecorded": False}
    return {**dict(job), "status": JobStatus.FAILED.value, "reason": reason, "unrecorded": True}


def service_front(job) -> dict | None:
    """A live serving job's front (its plan's router: host, port, a client token when it
    listens beyond this machine); None for any other job."""
    if job["framework"] != "serving" or JobStatus(job["status"]).is_terminal():
        return None   # only the serving adapter plans a front
    try:
        return json.loads((Path(job["job_dir"]) / "plan.json").read_text()).get("front")
    except (OSError, ValueError):
        return None


def service_url(job) -> str | None:
    """The URL a live serving job answers at; None for any other job."""
    front = service_front(job)
    return front_url(front) if front else None


def build_status(store: Store, job_id: str, with_series: bool = False) -> dict[str, Any]:
    """Everything `pai status --json` shows, read from the store. The last value of
    each metric comes from SQL; the whole series (which can be millions of rows)
    only when asked for."""
    job = read_job(store, job_id)
    instances = [_as_shown(i, job) for i in store.instances(job_id)]
    tasks = []
    for task in store.tasks(job_id):
        mine = [i for i in instances if i["role"] == task["role"]]
        tasks.append({
            "name": task["role"], "total": task["count"], "retries": task["retries"],
            "fatal": sum(i["status"] == InstanceStatus.FAILED.value for i in mine),
            "finished": sum(i["status"] == InstanceStatus.TERMINATED.value for i in mine),
            "running": sum(i["status"] == InstanceStatus.RUNNING.value for i in mine),
            "must_finish": bool(task["must_finish"]),
        })
    job_dir = Path(job["job_dir"])
    metrics: dict[str, dict[str, float]] = {}
    for row in store.latest_metrics(job_id):
        metrics.setdefault(f"{row['role']}:{row['idx']}", {})[row["key"]] = row["value"]
    series: dict[str, dict[str, list]] = {}
    if with_series:
        for row in store.metrics(job_id):
            name = f"{row['role']}:{row['idx']}"
            series.setdefault(name, {}).setdefault(row["key"], []).append([row["step"], row["value"]])
    out = {
        "id": job["id"], "name": job["name"], "framework": job["framework"], "project": job["project"],
        "task_name": job["task_name"], "status": job["status"], "reason": job["reason"],
        "created": job["created"], "started": job["started"], "ended": job["ended"],
        "job_dir": str(job_dir), "log_view": str(job_dir / "summary.txt"), "master_pid": job["master_pid"],
        "job_attempt": job["job_attempt"], "tasks": tasks, "unrecorded": job["unrecorded"],
        "instances": [{
            "role": i["role"], "index": i["idx"], "status": i["status"], "exit_code": i["exit_code"],
            "attempts": (i["attempt"] or 0) + 1, "pid": i["pid"], "pgid": i["pgid"],
            "node": i["node"], "host": i["host"],
            "port": i["port"], "log": instance_log_path(job_dir, i["role"], i["idx"], i["attempt"] or 0),
        } for i in instances],
        "step_seconds": steptime.job_step_seconds(store, job_id),
        "pluto": pluto_view.record(job_dir),
        "metrics": metrics, **({"metric_series": series} if with_series else {}),
    }
    front = service_front(job)
    out["url"] = front_url(front) if front else None
    if front and front.get("token"):
        out["token"] = front["token"]   # plan.json is the owner's alone (0600)
    out["not_distributed"] = distribution.cause_of(out["status"], out["reason"])
    out["outputs"] = store.output_totals(job_id)   # count, bytes, missing
    out.update(store.resume_links(job_id))          # pai resume
    out["idle"] = idle_instances(out)
    out["exposed"] = exposed_instances(out)
    return out


# -- signs of trouble while a job runs --------------------------------------------

IDLE_AFTER = 300.0  # seconds without a line before a running instance counts as idle


def idle_after() -> float:
    """$PAI_IDLE_SECONDS, or IDLE_AFTER."""
    try:
        value = float(os.environ.get("PAI_IDLE_SECONDS", IDLE_AFTER))
    except ValueError:
        return IDLE_AFTER
    return value if value > 0 else IDLE_AFTER


def idle_instances(status: dict, now: float | None = None) -> list[dict[str, Any]]:
    """Running workers that printed nothing for idle_after() seconds, judged by
    their log file's modification time (the master writes every byte there at
    once), so no master is asked. A finished job has none."""
    if JobStatus(status["status"]).is_terminal():
        return []
    now = time.time() if now is None else now
    limit = idle_after()
    # Services (a ps) are quiet by nature: only the instances that must finish count.
    services = {t["name"] for t in status["tasks"] if not t["must_finish"]}
    idle = []
    for inst in status["instances"]:
        if inst["status"] != InstanceStatus.RUNNING.value or inst["role"] in services:
            continue
        try:
            quiet = now - os.stat(inst["log"]).st_mtime
        except OSError:
            continue
        if quiet >= limit:
            idle.append({"instance": f"{inst['role']}:{inst['index']}", "seconds": round(quiet, 1)})
    return idle


def idle_now(store: Store, job_id: str) -> list[dict[str, Any]]:
    """idle_instances() from the job's row, tasks and instances only: cheap enough
    for the attached view to ask every few seconds (no metrics, no step times)."""
    job = store.job(job_id)
    job_dir = Path(job["job_dir"])
    status = {"status": job["status"],
              "tasks": [{"name": t["role"], "must_finish": bool(t["must_finish"])} for t in store.tasks(job_id)],
              "instances": [{"role": i["role"], "index": i["idx"], "status": i["status"],
                             "log": instance_log_path(job_dir, i["role"], i["idx"], i["attempt"] or 0)}
                            for i in store.instances(job_id)]}
    return idle_instances(status)


def _listening(path: str) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket in /proc/net/tcp or tcp6."""
    found = []
    try:
        with open(path) as f:
            next(f, None)
            for line in f:
                fields = line.split()
                if len(fields) < 4 or fields[3] != "0A":  # 0A: LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                # The kernel prints each 32-bit word in host (little-endian) order.
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.append((str(ipaddress.ip_address(raw)), int(port, 16)))
    except (OSError, ValueError):
        pass
    return found


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "")


def exposed_instances(status: dict) -> list[dict[str, Any]]:
    """Running instances on this machine whose port is listened on at an address
    other than loopback (TensorFlow's servers bind every interface): anyone who
    can reach the machine can talk to them, and they check no credentials."""
    if JobStatus(status["status"]).is_terminal():
        return []
    mine = {inst["port"]: f"{inst['role']}:{inst['index']}" for inst in status["instances"]
            if inst["port"] and inst["status"] == InstanceStatus.RUNNING.value
            and (inst["host"] or "") in LOCAL_HOSTS}
    if not mine:
        return []
    exposed: dict[str, dict[str, Any]] = {}
    for address, port in _listening("/proc/net/tcp") + _listening("/proc/net/tcp6"):
        if port in mine and not is_loopback(address):
            exposed.setdefault(mine[port], {"instance": mine[port], "port": port, "address": address})
    return sorted(exposed.values(), key=lambda e: e["instance"])


def _as_shown(inst, job: dict) -> dict[str, Any]:
    """An instance row; an unfinished one of a job whose master is gone is shown as
    its record will be written (Killed): nothing supervises it any more."""
    inst = dict(inst)
    if job["unrecorded"] and not InstanceStatus(inst["status"]).is_terminal():
        inst["status"] = InstanceStatus.KILLED.value
    return inst


def instance_log_path(job_dir: Path, role: str, idx: int, attempt: int) -> str:
    return str(job_dir / "logs" / f"{role}-{idx}.{attempt}.log")


def summary_rows(status: dict) -> list[tuple[str, str, str]]:
    """The Fuxi summary as rows (TaskName, Fatal/Finished/Total, Retries): a
    header, the job's own task, then one row per task."""
    rows = [("TaskName", "Fatal/Finished/Total", "Retries")]
    tasks = status["tasks"]
    rows.append((status["task_name"] or "Task",
                 f"{sum(t['fatal'] for t in tasks)}/{sum(t['finished'] for t in tasks)}/{sum(t['total'] for t in tasks)}",
                 str(sum(t["retries"] for t in tasks))))
    for task in tasks:
        rows.append((task["name"], f"{task['fatal']}/{task['finished']}/{task['total']}", str(task["retries"])))
    return rows


def aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows of cells as lines, each column as wide as its widest cell."""
    width = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width[c]) for c, cell in enumerate(row)).rstrip() for row in rows]


# Beside summary.txt once the job has ended: the status it was written from, as JSON,
# for the CLI that followed the job (final_status) to print instead of building it again.
FINAL_STATUS = "status.json"


def final_status(store: Store, job_id: str) -> dict[str, Any]:
    """An ended job's status: the one its master wrote last (FINAL_STATUS), when
    the store still says what it says (the same status, attempt and end); else
    built from the store. Its master has exited: nothing it summarised changes
    after that file, so the CLI need not build it again at the end of every
    attached job."""
    job = store.job(job_id)
    try:
        with open(os.path.join(job["job_dir"], FINAL_STATUS), "rb") as f:
            kept = json.loads(f.read())
    except (OSError, ValueError):
        kept = None
    if isinstance(kept, dict) and all(kept.get(key) == job[key] for key in ("id", "status", "job_attempt", "ended")) \
            and JobStatus(job["status"]).is_terminal():
        return kept
    return build_status(store, job_id)


def write_summary_file(status: dict) -> None:
    """The plain per-job log view (summary.txt) the master keeps: the record a
    reader without the logview server gets. Once the job has ended, its status
    too (FINAL_STATUS)."""
    path = Path(status["log_view"])
    if JobStatus(status["status"]).is_terminal():
        try:
            text = json.dumps(status)
        except (TypeError, ValueError):
            text = None   # not JSON (a bug of ours): the CLI builds it itself
        if text is not None:
            write_private(path.with_name(FINAL_STATUS), text)
    lines = [f"Job {status['id']}  {status['name']}  ({status['framework']})",
             f"Status: {status['status']}" + (f"  ({status['reason']})" if status["reason"] else ""), ""]
    lines += aligned(summary_rows(status)) + ["", "Instances:"]
    for inst in status["instances"]:
        lines.append(f"  {inst['role']}:{inst['index']:<3} {inst['status']:<10} exit={inst['exit_code']}"
                     f"  attempts={inst['attempts']}  log={inst['log']}")
    for name, values in status["metrics"].items():
        lines.append(f"  {name} last metrics: " + ", ".join(f"{k}={v:g}" for k, v in values.items()))
    files = status.get("outputs") or {}
    if files.get("count"):
        lines.append(f"Outputs: {files['count']} file(s), {files['bytes']} bytes" +
                     (f"; {files['missing']} not brought back (pai outputs {status['id']} says where)"
                      if files["missing"] else ""))
    write_private(path, "\n".join(lines) + "\n")
