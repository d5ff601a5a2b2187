"""The library API the CLI and the console share: prepare, submit, status, kill.

Each function raises paicli.errors on known failures; the callers render. The
client writes the job and starts its JobMaster; reading a job never writes it,
signals or starts anything. `kill` and `revive_queued` go through
paicli.cluster.lifecycle, the one writer outside the master.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paicli.adapters import get_adapter
from paicli.cluster import backends, datasets, lifecycle, policy, queue as queue_policy, queue_turns
from paicli.cluster.procinfo import output_files, start_time
from paicli.cluster.requirement_layers import prepare_job_env
from paicli.cluster.spawn import MasterProcess, start_master
from paicli.envvars import exported
from paicli.errors import PaiError, UsageError
from paicli.jobstatus import (MASTER_START_DEADLINE, build_status, job_over, master_alive, read_job,  # noqa: F401
                              service_url)
from paicli.jobstatus import final_status as final
from paicli.jobplan import JobPlan
from paicli.private import private_dir, write_private
from paicli.runners.runtimes import RuntimeSetupError, get_runtime
from paicli.spec import CORE_PARAMS, JobSpec, build_spec
from paicli.staging import stage_code
from paicli.statement import Statement, dump_yaml
from paicli.states import InstanceStatus, JobStatus
from paicli.store import Store, new_job_id



@dataclass
class Prepared:
    adapter: Any
    spec: JobSpec


def prepare(stmt: Statement) -> Prepared:
    """Validate a statement into a JobSpec for its adapter (no side effects)."""
    adapter = get_adapter(stmt.framework or "")
    # TFCOMPAT: a name that selects a runtime (PAI's versioned TensorFlow names) stays in the spec.
    framework = adapter.spec_framework(stmt.framework) if hasattr(adapter, "spec_framework") else adapter.name
    spec = build_spec(framework, stmt.params, params=(*CORE_PARAMS, *adapter.params), project=stmt.project)
    adapter.validate(spec)
    return Prepared(adapter, spec)


def export_yaml(prepared: Prepared) -> str:
    out = prepared.spec.to_dict()
    return dump_yaml({**out, "env": exported(out["env"])} if "env" in out else out)


def submit(prepared: Prepared, store: Store | None = None,
           progress: Callable[[str], None] = lambda line: None,
           meanwhile: Callable[[str, int], None] | None = None) -> str:
    """Stage the code, plan, provision the runtime, record the job and hand it to
    its master; the job ID. `meanwhile(job_id, recorded_fd)` runs once the job is
    handed over (see hand_over). Nothing is left in the store or the job folder
    unless every step succeeded. The master probes the nodes once the job is
    planned and keeps those connections (one login per node and job): bad input
    touches no node."""
    store = store or Store()
    adapter, spec = prepared.adapter, prepared.spec
    policy.check_launcher_env()
    config = backends.submit_config(store.home)
    job_id = new_job_id()
    # Filled first, recorded last: a failure before that removes the folder.
    job_dir = store.jobs_dir / job_id
    private_dir(job_dir)  # 0700: argv and logs are the owner's business
    private_dir(job_dir / "logs")
    master = None
    try:
        # Started first, it imports its modules while this process stages the job.
        master = start_master(store.home, job_dir)
        code = stage_code(spec, job_dir, backends.probed_by_login(config), progress)
        plan: JobPlan = adapter.plan(spec, code)
        _check_planned(spec, plan)
        datasets.prepare(spec, plan, job_dir)   # -Dtables/-Doutputs checked (exit 2) and sliced
        plan.runtime = adapter.runtime or None
        # A job that could never start is refused now; one that must wait is queued
        # (docs/queue.md). Ray places jobs itself (no nodes: None). Only remote nodes
        # are worth the master's round trip; this machine is read here.
        if backends.probed_by_login(config):
            nodes = master.nodes(config)
        else:
            nodes = backends.get_backend(config).nodes()
        entry = None if nodes is None else queue_turns.check_and_describe(
            store, plan, nodes, spec.get("priority"), spec.project)
        if adapter.runtime:
            try:
                get_runtime(adapter.runtime).ensure(progress)
            except RuntimeSetupError as err:
                raise PaiError(f"the {adapter.runtime} runtime: {err}",
                               f"retry with `pai runtime install {adapter.runtime}`") from None
        if spec.get("env") or spec.get("requirements"):   # into the roles; the layer built here first
            prepare_job_env(spec, plan, job_dir, progress, store.home)
        # JSON, not YAML: a submit imports no yaml (`pai export` gives YAML).
        write_private(job_dir / "spec.json", json.dumps(spec.to_dict(), indent=2))
        write_private(job_dir / "plan.json", plan.to_json())
        write_private(job_dir / "foreign.json", json.dumps(output_files()))   # `> log`, `| tee log`: never outputs
        backends.write_snapshot(job_dir, config)
    except BaseException:
        if master is not None:
            master.close()   # it leaves at EOF, with its connections
        shutil.rmtree(job_dir, ignore_errors=True)
        raise
    lifecycle.revive_queued(store)   # a writer keeps the queue going (docs/queue.md)
    store.create_job(job_id, name=plan.job_name, framework=adapter.name, project=spec.project,
                     task_name=plan.task_name, job_dir=job_dir,
                     roles=[{"name": r.name, "count": r.count, "must_finish": r.must_finish} for r in plan.roles])
    if entry is not None:
        # Its master waits for its turn (paicli.cluster.queue_turns.wait_turn), and
        # places it when the turn comes: the GPUs are claimed then, in the store.
        store.enqueue(job_id, spec.get("priority"), spec.project, entry)
    hand_over(store, job_id, master, meanwhile)
    return job_id


def _check_planned(spec: JobSpec, plan: JobPlan) -> None:
    """-DautoStrategy=true is applied before a submit (paicli.pluto.auto_strategy,
    which every statement submit calls); a library caller that skipped it is told,
    rather than the job running without Pluto's plan."""
    if spec.get("autoStrategy") == "true" and plan.pluto is None:
        raise UsageError("-DautoStrategy=true: the job was not planned",
                         "call paicli.pluto.auto_strategy(prepared, store) before client.submit")


def hand_over(store: Store, job_id: str, master: MasterProcess,
              meanwhile: Callable[[str, int], None] | None = None) -> None:
    """The recorded job handed to its master and the master's pid recorded;
    `meanwhile(job_id, recorded_fd)` runs then and owns `recorded_fd`, a pipe the
    master closes once the job's record is complete. Its error (Ctrl-C) is raised
    once the master's pid is recorded."""
    try:
        pid = master.start(job_id)
    except OSError as err:
        # Recorded but never supervised: say so rather than leave it Waiting.
        store.set_job(job_id, JobStatus.FAILED, f"its master did not start: {err}")
        store.release_claims(job_id)
        raise PaiError(f"job {job_id}: its master did not start: {err}", "see master.log in the job folder") from None
    recorded_fd = master.take_recorded()
    try:
        if meanwhile is not None:
            meanwhile(job_id, recorded_fd)
        else:
            os.close(recorded_fd)
    finally:
        if store.job(job_id)["master_pid"] != pid:
            # The master records itself first thing (JobMaster.run); this write is
            # for one still starting.
            store.update_job(job_id, master_pid=pid, master_start=start_time(pid))


# -- reading: never writes, never signals, never builds a backend ------------------


def queue(store: Store) -> list[dict[str, Any]]:
    """The waiting jobs, in queue order (`pai queue`); one whose supervisor is gone
    is shown so, not revived (see revive_queued)."""
    return queue_turns.listing(store)


def refresh(store: Store, job_id: str) -> dict[str, Any]:
    """The job's row as the user should see it: a job whose master is gone
    without recording its end is shown Failed ("master lost"), derived, not
    written (paicli.jobstatus.read_job)."""
    return read_job(store, job_id)


def status(store: Store, job_id: str, with_series: bool = False) -> dict[str, Any]:
    return build_status(store, job_id, with_series)


def final_status(store: Store, job_id: str) -> dict[str, Any]:
    """status() of a job whose master has exited (paicli.jobstatus.final_status)."""
    return final(store, job_id)


def list_jobs(store: Store, limit: int = 50, everyone: bool = False) -> list[dict[str, Any]]:
    """The newest jobs: this user's, or (everyone) the team's. A store under PAI_HOME
    is its owner's alone: every job in it is listed."""
    jobs = store.jobs(limit, everyone=everyone or not store.postgres)
    nodes = store.job_nodes([job["id"] for job in jobs])
    out = []
    for job in jobs:
        if not JobStatus(job["status"]).is_terminal():
            job = refresh(store, job["id"])
        end = job["ended"] or time.time()
        out.append({"id": job["id"], "name": job["name"], "framework": job["framework"],
                    "status": job["status"], "start_time": job["started"] or job["created"],
                    "run_time": (end - job["started"]) if job["started"] else 0.0, "reason": job["reason"],
                    "user": job["db_role"] or job["user_name"], "project": job["project"],
                    "nodes": nodes.get(job["id"], []), "url": service_url(job)})
    return out


# -- writing: the lifecycle module writes ----------------------------------------------


def kill(store: Store, job_id: str, reason: str = "cancelled by user", wait: float = 5.0) -> bool:
    """Cancel a job (paicli.cluster.lifecycle.cancel): recorded, its master
    stopped (killed if it does not end in time), every instance group the store
    knows stopped through the identity-checked path. A job whose master is gone
    is declared lost instead. False if the job had already ended."""
    return lifecycle.cancel(store, job_id, reason, wait)


def revive_queued(store: Store) -> list[str]:
    """`pai queue --revive`: a new supervisor for every queued job whose supervisor
    is gone (after a reboot, when nothing of paicli runs to do it); their IDs.
    Every writer that frees room does this anyway (paicli.cluster.lifecycle)."""
    return lifecycle.revive_queued(store)


def scale(store: Store, name_or_job: str, count: int) -> dict[str, Any]:
    """`pai serve scale`: a running serving job (its ID, an ID prefix or its name)
    asked for `count` replicas (paicli.cluster.lifecycle.request_scale); its master
    adds or removes them. {"id", "role", "from", "to"}."""
    named = store.live_jobs_named(name_or_job)
    job = may_act(store, named[0], "scale") if named else resolve_job(store, name_or_job, to="scale")
    where = f"job {job['id']}" + (f" ({job['name']})" if job["name"] else "")
    plan = JobPlan.from_json((Path(job["job_dir"]) / "plan.json").read_text())
    if not plan.front:
        raise UsageError(f"{where} is a {job['framework']} job, not a service", "only a serving job scales")
    if backends.job_config(Path(job["job_dir"])).get("backend") == "ray":
        raise UsageError(f"{where} runs on Ray, where a serving job keeps the replicas it started with",
                         f"submit it again with the count you want (-Dcluster or --replicas)")
    status = refresh(store, job["id"])["status"]
    if status != JobStatus.RUNNING.value:
        raise UsageError(f"{where} is {status}, not Running", "only a running job scales")
    role = plan.front["role"]
    before = sum(1 for row in store.instances(job["id"])
                 if row["role"] == role and not InstanceStatus(row["status"]).is_terminal())
    lifecycle.request_scale(store, job["id"], role, count)
    return {"id": job["id"], "role": role, "from": before, "to": count}


def resolve_job(store: Store, job_id: str, to: str | None = None):
    """The job of an ID or unique prefix. With `to` (what the caller is about to do:
    "kill", "resume", "get the files of"), a job of another user is refused unless
    this user is an admin (cluster.queue.may_act)."""
    if not job_id:
        raise UsageError("missing job ID", "`pai list` shows the jobs")
    job = store.find_job(job_id)
    return may_act(store, job, to) if to else job


def may_act(store: Store, job, to: str):
    """`job`, when this user may `to` it (cluster.queue.may_act; the admins: a team
    store's, else the quota file's); else UsageError."""
    owner = (job["user_name"], job["db_role"])
    if not queue_policy.may_act(owner, store.me(), queue_turns.load_admins(store)):
        raise UsageError(f"{job['id']} is {owner[1] or owner[0]}'s job: you may not {to} it",
                         "only its owner or an admin may (`pai quota show` names them)")
    return job
