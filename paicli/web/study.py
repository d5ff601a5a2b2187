"""The logview's study page of `pai tune`: the trials, their parameters and their
curves on one chart. Plain functions over a Store (tested without a server); the
routes are a block at the end of paicli/web/server.py. Optuna is not needed: the
store holds the study (paicli.tune.study_view) and every trial is a job."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from paicli import tune
from paicli.errors import PaiError
from paicli.store import Store
from paicli.web import launch
from paicli.web.data import MAX_POINTS, even_sample, fmt_time

EVERY = 2   # seconds between two looks of an open study page


def _fmt(value) -> str:
    if value is None:
        return ""
    return f"{value:.5g}" if isinstance(value, float) else str(value)


def study_page(store: Store, name: str) -> dict[str, Any]:
    """The study and its trials as the page shows them (text, escaped by the templates)."""
    view = tune.study_view(store, name)
    best = view["best"]["number"] if view["best"] else None
    trials = [{**t, "params_text": " ".join(f"{k}={_fmt(v)}" for k, v in t["params"].items()),
               "value_text": _fmt(t["value"]), "step_text": "" if t["step"] is None else f"{t['step']:g}",
               "is_best": t["number"] == best, "label": f"trial {t['number']}"} for t in view["trials"]]
    return {**view, "trials": trials, "created_text": fmt_time(view["created"]), "ended_text": fmt_time(view["ended"]),
            "best_text": (f"trial {view['best']['number']} {view['metric']}={_fmt(view['best']['value'])}"
                          if view["best"] else "")}


def curves(store: Store, name: str) -> dict[str, Any]:
    """Each trial's metric against step, from the instance that printed it first (as
    the tuner read it), at most MAX_POINTS per trial; and whether the study is over."""
    view = tune.study_view(store, name)
    jobs = {t["job_id"]: t for t in view["trials"] if t["job_id"]}
    source: dict[str, tuple] = {}
    lines: dict[str, list] = {}
    for row in store.metric_series(list(jobs), view["metric"]):
        where = source.setdefault(row["job_id"], (row["role"], row["idx"]))
        if (row["role"], row["idx"]) == where:
            lines.setdefault(row["job_id"], []).append([row["step"], row["value"]])
    out = sorted(({"trial": jobs[job_id]["number"], "state": jobs[job_id]["state"],
                   "points": even_sample(points, MAX_POINTS)} for job_id, points in lines.items()),
                 key=lambda c: c["trial"])
    return {"name": name, "metric": view["metric"], "status": view["status"], "over": view["over"],
            "best": view["best"]["number"] if view["best"] else None, "curves": out}


def study_list(store: Store) -> list[dict[str, Any]]:
    return [study_page(store, row["name"]) for row in store.studies()]


def study_url_line(home: Path, name: str) -> tuple[str | None, str | None]:
    """The study page's URL for a `Log view:` line (the server started if needed),
    or (None, note) when no server can be had; (None, None) with PAI_LOGVIEW=file."""
    if launch.mode() == "file":
        return None, None
    try:
        base = launch.url_for(launch.ensure_server(home))
    except (PaiError, OSError) as err:
        return None, f"note: no logview page ({getattr(err, 'strerror', None) or err})"
    token = base.split("token=", 1)[1]
    return base.split("/logview/", 1)[0] + "/logview/study?" + urlencode({"s": name, "token": token}), None
