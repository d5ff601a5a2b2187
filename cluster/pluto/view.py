"""What `pai status` and the end-of-job summary show of a job Pluto planned
(-DautoStrategy=true): the plan and its forecast from plan.json, beside the
measured step time. Reads files and a status record only, so the master and
jobstatus (the cluster layer) can read it as well as the commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def record(job_dir: str | Path) -> dict[str, Any] | None:
    """The `pluto` entry of the job's plan.json (None for a job Pluto did not plan)."""
    try:
        data = json.loads((Path(job_dir) / "plan.json").read_text())
    except (OSError, ValueError):
        return None
    entry = data.get("pluto") if isinstance(data, dict) else None
    return entry if isinstance(entry, dict) else None


def forecast_line(status: dict[str, Any]) -> str | None:
    """`Pluto: forecast 0.120 s/step, measured 0.131 s/step (+9%)`, or None."""
    pluto = status.get("pluto")
    if not pluto:
        return None
    forecast = pluto.get("forecast_step_s")
    measured = status.get("step_seconds")
    text = f"Pluto: forecast {forecast:.4f} s/step"
    if measured:
        text += f", measured {measured:.4f} s/step ({(measured - forecast) / forecast:+.0%})"
    else:
        text += ", measured: no step lines yet"
    return text


def status_lines(status: dict[str, Any]) -> list[str]:
    """The plan as `pai status` prints it: the plan, the forecast against the
    measurement, the bytes each ps holds, and the reasons."""
    pluto = status.get("pluto")
    if not pluto:
        return []
    lines = [f"Pluto plan: {pluto.get('label', '')}"]
    line = forecast_line(status)
    if line:
        lines.append(line)
    ps_bytes = pluto.get("ps_bytes") or []
    role = pluto.get("ps_role", "ps")
    if ps_bytes and pluto.get("param_bytes"):
        lines.append(f"Bytes per {role}: " + ", ".join(f"{role}:{i} {b / 1e6:.2f} MB" for i, b in enumerate(ps_bytes)))
    for reason in pluto.get("reasons", []):
        lines.append(f"  - {reason}")
    return lines
