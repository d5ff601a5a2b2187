"""What the logview pages show, read from the store and the job folder only.

Plain functions over a Store, so they are tested without a web server. Every
path read is confined to its job's folder (paicli.logview.log_path).
"""

from __future__ import annotations

import json
import os
import pwd
import time
from pathlib import Path
from typing import Any

from paicli import jobstatus, jobview
from paicli.cluster.pluto import view as pluto_view
from paicli.logview import log_path
from paicli.states import JobStatus
from paicli.store import Store

TAIL_BYTES = 10 * 1024          # "Only tail 10KB is shown here", as PAI's logview
MAX_POINTS = 2000               # per instance and metric on a page; longer series are thinned
HIDDEN_METRICS = {"step", "iteration", "global_step"}


def fmt_time(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else ""


def owner_of(job_dir: str) -> str:
    """Who submitted the job: the owner of its folder."""
    try:
        uid = os.stat(job_dir).st_uid
    except OSError:
        return ""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def read_plan(job_dir: str, status: dict | None = None) -> dict[str, Any]:
    """The parts of plan.json a person reads: the adapter's notes, and Pluto's
    plan and forecast (against the measured step time) when it made one."""
    try:
        plan = json.loads((Path(job_dir) / "plan.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(plan, dict):
        return {}
    shown: dict[str, Any] = {}
    if plan.get("notes"):
        shown["notes"] = [str(note) for note in plan["notes"]]
    if status is not None and status.get("pluto"):
        shown["pluto"] = pluto_view.status_lines(status)
    return shown


def job_page(store: Store, job_id: str) -> dict[str, Any]:
    """Everything the job page shows except the log tails and the curves."""
    status = jobstatus.build_status(store, job_id)
    job = store.job(job_id)
    events = [{"time": fmt_time(ev["ts"]), "kind": ev["kind"], "message": ev["message"] or "",
               "instance": f"{ev['role']}:{ev['idx']}" if ev["role"] is not None else ""}
              for ev in store.events(job_id)]
    instances = []
    for inst in status["instances"]:
        name = f"{inst['role']}:{inst['index']}"
        metrics = status["metrics"].get(name, {})
        instances.append({**inst, "name": name, "node": inst.get("node") or inst["host"] or "",
                          "metrics": ", ".join(f"{k}={v:g}" for k, v in list(metrics.items())[:5])})
    return {
        "id": job_id, "name": status["name"], "framework": status["framework"],
        "project": status["project"] or "", "owner": owner_of(status["job_dir"]),
        "status": status["status"], "reason": status["reason"] or "", "url": status["url"] or "",
        "start": fmt_time(status["started"] or status["created"]), "end": fmt_time(status["ended"]),
        "summary": summary_rows(status), "verdict": jobview.verdict_line(status)
        if status["status"] in ("Succeeded", "Failed", "Cancelled") else "",
        "instances": instances, "events": events, "plan": read_plan(status["job_dir"], status),
        "notices": jobview.notice_lines(status),
        "step_seconds": status.get("step_seconds"),
        "task_name": status["task_name"] or "", "over": bool(job["ended"]),
    }


def summary_rows(status: dict) -> list[dict[str, str]]:
    """The Fuxi job summary (TaskName, Fatal/Finished/Total, Retries), job task first."""
    tasks = status["tasks"]
    rows = [{"task": status["task_name"] or "Task",
             "fft": f"{sum(t['fatal'] for t in tasks)}/{sum(t['finished'] for t in tasks)}/"
                    f"{sum(t['total'] for t in tasks)}",
             "retries": str(sum(t["retries"] for t in tasks))}]
    return rows + [{"task": t["name"], "fft": f"{t['fatal']}/{t['finished']}/{t['total']}",
                    "retries": str(t["retries"])} for t in tasks]


def summary_json(store: Store, job_id: str) -> dict[str, Any]:
    """The JSON summary at /api/jobs/ID.json: `pai status --json` plus events and plan."""
    status = jobstatus.build_status(store, job_id, with_series=True)
    status["events"] = [{"ts": ev["ts"], "kind": ev["kind"], "role": ev["role"], "index": ev["idx"],
                         "message": ev["message"]} for ev in store.events(job_id)]
    status["plan"] = read_plan(status["job_dir"], status)
    status["owner"] = owner_of(status["job_dir"])
    return status


def job_list(store: Store, limit: int = 100) -> list[dict[str, Any]]:
    out = []
    for job in store.jobs(limit):
        if not JobStatus(job["status"]).is_terminal():
            job = jobstatus.read_job(store, job["id"])   # a lost master shows as `pai list` shows it
        end = job["ended"] or time.time()
        out.append({"id": job["id"], "name": job["name"] or "", "framework": job["framework"],
                    "project": job["project"] or "", "status": job["status"],
                    "start": fmt_time(job["started"] or job["created"]),
                    "run_time": f"{(end - job['started']):.0f}s" if job["started"] else "",
                    "reason": job["reason"] or ""})
    return out


def tail_text(path: Path, size: int = TAIL_BYTES) -> tuple[str, int]:
    """The last `size` bytes of a log, starting at a whole line, and the offset
    where the file ended (to follow it from there)."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            start = max(0, end - size)
            f.seek(start)
            data = f.read(end - start)
    except FileNotFoundError:
        return "", 0
    if start > 0:
        cut = data.find(b"\n")
        data = data[cut + 1:] if cut >= 0 else data
    return data.decode("utf-8", "replace"), end


def instance_logs(store: Store, job_id: str) -> list[dict[str, Any]]:
    """Each instance's current log file (confined to the job's folder)."""
    job = store.job(job_id)
    names = [(f"{inst['role']}:{inst['idx']}", inst["attempt"] or 0) for inst in store.instances(job_id)]
    return [{"instance": name, "attempt": attempt, "path": log_path(store, job, name, attempt)}
            for name, attempt in names]


def first_tab(instances: list[str]) -> str:
    """The log shown first: a worker's (their lines carry the steps), else the first."""
    return next((name for name in instances if name.startswith(("worker:", "chief:"))),
                instances[0] if instances else "")


def metric_points(store: Store, job_id: str, after: int = 0, limit: int = 200_000) -> tuple[list, int]:
    """New metric points since rowid `after`: ([instance, key, step, value], ...), last rowid.
    Step counters are left out (they are the x axis). A metric from a line without a
    step (a replica's `serving: requests=..., rps=...` each second) is drawn over the
    seconds since the job started: [instance, key, seconds, value, "seconds"]."""
    rows = store.metrics_after(job_id, after, limit)
    last = rows[-1]["rowid"] if rows else after
    job = store.job(job_id)
    began = job["started"] or job["created"] or 0.0
    points = [[f"{r['role']}:{r['idx']}", r["key"], r["step"], r["value"]] if r["step"] is not None else
              [f"{r['role']}:{r['idx']}", r["key"], round(r["ts"] - began, 2), r["value"], "seconds"]
              for r in rows if r["key"] not in HIDDEN_METRICS]
    return thin(points), last


def thin(points: list, cap: int = MAX_POINTS) -> list:
    """At most `cap` points per (instance, metric), evenly spread, the newest kept."""
    groups: dict[tuple, list] = {}
    for p in points:
        groups.setdefault((p[0], p[1]), []).append(p)
    if all(len(g) <= cap for g in groups.values()):
        return points
    return [p for group in groups.values() for p in even_sample(group, cap)]


def even_sample(points: list, cap: int) -> list:
    """At most `cap` of `points`, evenly spread, the newest kept."""
    if len(points) <= cap:
        return points
    stride = len(points) / cap
    return [points[int(i * stride)] for i in range(cap - 1)] + [points[-1]]
