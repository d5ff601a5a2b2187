"""A job as the user sees it: the status record, the Fuxi summary table, the
verdict line, and the plain log-view file. Reads the store only, so the CLI and
the JobMaster (which writes the log view) share it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from paicli import steptime
from paicli.states import InstanceStatus, JobStatus
from paicli.store import Store


def build_status(store: Store, job_id: str, with_series: bool = False) -> dict[str, Any]:
    """Everything `pai status --json` shows, read from the store. The last value of
    each metric comes from SQL; the whole series (which can be millions of rows)
    only when asked for."""
    job = store.job(job_id)
    instances = store.instances(job_id)
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
    return {
        "id": job["id"], "name": job["name"], "framework": job["framework"], "project": job["project"],
        "task_name": job["task_name"], "status": job["status"], "reason": job["reason"],
        "created": job["created"], "started": job["started"], "ended": job["ended"],
        "job_dir": str(job_dir), "log_view": str(job_dir / "summary.txt"), "master_pid": job["master_pid"],
        "job_attempt": job["job_attempt"], "tasks": tasks,
        "instances": [{
            "role": i["role"], "index": i["idx"], "status": i["status"], "exit_code": i["exit_code"],
            "attempts": (i["attempt"] or 0) + 1, "pid": i["pid"], "pgid": i["pgid"], "host": i["host"],
            "port": i["port"], "log": instance_log_path(job_dir, i["role"], i["idx"], i["attempt"] or 0),
        } for i in instances],
        "step_seconds": steptime.job_step_seconds(store, job_id),
        "metrics": metrics, **({"metric_series": series} if with_series else {}),
    }


def instance_log_path(job_dir: Path, role: str, idx: int, attempt: int) -> str:
    return str(job_dir / "logs" / f"{role}-{idx}.{attempt}.log")


def summary_lines(status: dict) -> list[str]:
    """The Fuxi summary: one row per task (the job's own task first)."""
    rows = [("TaskName", "Fatal/Finished/Total", "Retries")]
    tasks = status["tasks"]
    rows.append((status["task_name"] or "Task",
                 f"{sum(t['fatal'] for t in tasks)}/{sum(t['finished'] for t in tasks)}/{sum(t['total'] for t in tasks)}",
                 str(sum(t["retries"] for t in tasks))))
    for task in tasks:
        rows.append((task["name"], f"{task['fatal']}/{task['finished']}/{task['total']}", str(task["retries"])))
    width = [max(len(r[c]) for r in rows) for c in range(3)]
    return ["  ".join(cell.ljust(width[c]) for c, cell in enumerate(row)).rstrip() for row in rows]


def verdict_line(status: dict) -> str:
    if status["status"] == JobStatus.SUCCEEDED.value:
        return "OK"
    if status["status"] == JobStatus.CANCELLED.value:
        return f"CANCELLED: {status['reason'] or 'cancelled'}"
    return f"FAILED: {status['reason'] or 'unknown reason'}"


def write_summary_file(status: dict) -> None:
    """The plain per-job log view (an HTML page comes later)."""
    path = Path(status["log_view"])
    lines = [f"Job {status['id']}  {status['name']}  ({status['framework']})",
             f"Status: {status['status']}" + (f"  ({status['reason']})" if status["reason"] else ""), ""]
    lines += summary_lines(status) + ["", "Instances:"]
    for inst in status["instances"]:
        lines.append(f"  {inst['role']}:{inst['index']:<3} {inst['status']:<10} exit={inst['exit_code']}"
                     f"  attempts={inst['attempts']}  log={inst['log']}")
    for name, values in status["metrics"].items():
        lines.append(f"  {name} last metrics: " + ", ".join(f"{k}={v:g}" for k, v in values.items()))
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


