"""A job as the user reads it in text: the Fuxi summary table, the verdict line,
the notices under `pai status`. The data comes from paicli.jobstatus (the
JobMaster imports only that).
"""

from __future__ import annotations

from paicli.jobstatus import aligned, summary_rows
from paicli.states import JobStatus


def notice_lines(status: dict) -> list[str]:
    """Warnings `pai status` prints under the job's state."""
    lines = []
    if status.get("idle"):
        names = ", ".join(f"{i['instance']} ({i['seconds'] / 60:.0f} min)" for i in status["idle"])
        lines.append(f"Idle: no output from {names}; the job may be hung (`pai logs ID -i NAME`, `pai kill ID`)")
    if status.get("exposed"):
        names = ", ".join(f"{e['instance']} on {e['address']}:{e['port']}" for e in status["exposed"])
        lines.append(f"Warning: reachable from other machines, without authentication: {names}")
    if status.get("resumed_from") or status.get("resumed_by"):
        lines.append(" ".join(filter(None, (f"Resumes {status['resumed_from']}." if status.get("resumed_from") else "",
                                            f"Resumed by {', '.join(status['resumed_by'])}." if status.get("resumed_by")
                                            else ""))))
    if status.get("unrecorded"):
        lines.append(f"Its master is gone without recording the end; `pai kill {status['id']}` stops what it"
                     " left and records it")
    return lines


def summary_lines(status: dict) -> list[str]:
    """The Fuxi summary: one row per task (the job's own task first)."""
    return aligned(summary_rows(status))


def verdict_line(status: dict) -> str:
    if status["status"] == JobStatus.SUCCEEDED.value:
        # A distributed job whose workers trained alone is not OK.
        return f"NOT DISTRIBUTED (the job succeeded): {status['not_distributed']}" \
            if status.get("not_distributed") else "OK"
    if status["status"] == JobStatus.CANCELLED.value:
        return f"CANCELLED: {status['reason'] or 'cancelled'}"
    return f"FAILED: {status['reason'] or 'unknown reason'}"
