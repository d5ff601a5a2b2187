"""A job's placement outside the pure function: placed with the GPUs no live job
holds, those GPUs claimed in the store, and the result kept in the job folder
(`placement.json`, 0600) for the master, the watchdog and `pai status`."""

from __future__ import annotations

import json
import time
from pathlib import Path

from paicli.cluster import placement as placing
from paicli.cluster.backends.base import Backend, NodeSpec, Placement
from paicli.jobplan import JobPlan
from paicli.private import write_private
from paicli.store import Store

PLACEMENT_FILE = "placement.json"


def write_placements(job_dir: Path, placements: list[Placement] | None) -> None:
    if placements is None:
        return  # a backend that places jobs itself has not placed this one yet
    write_private(Path(job_dir) / PLACEMENT_FILE, json.dumps([p.to_dict() for p in placements], indent=2))


def read_placements(job_dir: Path) -> list[Placement] | None:
    try:
        return [Placement.from_dict(p) for p in json.loads((Path(job_dir) / PLACEMENT_FILE).read_text())]
    except FileNotFoundError:
        return None


def claim_gpus(store: Store, job_id: str, placements: list[Placement]) -> bool:
    by_node: dict[str, list[str]] = {}
    for p in placements:
        by_node.setdefault(p.node, []).extend(p.gpus)
    for node, gpus in by_node.items():
        if gpus and not store.claim("gpu", node, gpus, job_id):
            store.release_claims(job_id, "gpu")
            return False
    return True


def place_job(store: Store, job_id: str, plan: JobPlan, backend: Backend,
              nodes: list[NodeSpec] | None = None) -> list[Placement] | None:
    """Place every instance on the backend's nodes with the GPUs no running job
    holds, and claim those GPUs (UsageError when the job cannot fit). A backend
    that schedules jobs itself (`places_jobs`: Ray, which waits for room) is not
    placed here: None, and the master asks it when the job starts."""
    if backend.places_jobs:
        return None
    nodes = nodes if nodes is not None else backend.nodes()
    for _ in range(20):  # another job may claim a card between our look and our claim
        placements = placing.place_plan(plan, nodes, store.held("gpu", except_job=job_id))
        if claim_gpus(store, job_id, placements):
            return placements
        time.sleep(0.05)
    raise OSError("GPU claims kept changing under us")
