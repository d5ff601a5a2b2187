"""Pluto, the planner, as the commands and the console call it (`__all__`):
`make_plan(stmt)` / `plan_prepared(prepared)` calibrate the script (short real
runs through pai, cached per script and cluster), describe where the job would
run and hand both to the pure engine, `paicli.cluster.pluto`;
`auto_strategy(prepared)` applies the recommendation before a submit. The
command is paicli/cli_plan.py; this module never imports the CLI or click.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import tarfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, NamedTuple

from paicli import client, steptime
from paicli.adapters.base import script_args
from paicli.cluster.node_admin import UP, probe_nodes
from paicli.cluster.nodes import load_nodes
from paicli.cluster.pluto import calibrate, planner
from paicli.cluster.pluto.calibrate import Run, _flag_value, bool_flag, choice_flag, read_report, script_facts
from paicli.cluster.pluto.model import default_strategy
from paicli.cluster.pluto.strategy import Cluster, Knobs, Node, Profile
from paicli.errors import PaiError, UsageError
from paicli.runners import pluto_helpers
from paicli.runners.runtimes import get_runtime
from paicli.statement import parse_statement
from paicli.states import JobStatus
from paicli.steptime import median
from paicli.store import Store, pai_home

PLAN_FRAMEWORKS = ("tensorflow", "mxnet", "caffe")
CALIBRATION_LIMIT_S = 180.0     # a calibration run that shows no steps by then fails
CALIBRATION_INTERVALS = 8       # step-line intervals per worker before a run is stopped
# ... and the seconds those intervals must span at least (or the script ends), so one
# burst of other load on shared cores cannot set a fast step's median.
MEASURE_SPAN_S = 2.0
# The link probe: rounds of LINK_ROUND_S seconds, one connection each; the best
# round's rate is the link's (`link_figures`), as one round's varies by a fifth.
LINK_ROUNDS = 5
LINK_ROUND_S = 0.5
CALIBRATION_MA_PERIOD = 5
STRATEGY_KEYS = ("autoStrategy", "timeout", "gradientCompression", "gradientCompressionThreshold",
                 "bigArrayBound", "psStrategy", "maPeriod", "lrScale", "warmupSteps", "learningRate",
                 "warmupIterations")
KVSTORE_FLAGS = ("kv-store", "kvstore", "kv_store")
SYNC_FLAGS = ("sync_replicas", "sync-replicas")


__all__ = ["PlanResult", "auto_strategy", "make_plan", "plan_prepared"]


class PlanResult(NamedTuple):
    plan: Any                   # paicli.cluster.pluto.planner.Plan
    profile: Any                # Profile
    cluster: Any                # Cluster
    cached: bool
    calibration_jobs: list[str]
    verification: dict[str, Any] | None = None   # {"why", "jobs", "cached"} when plans were run to check

    def to_json(self) -> dict[str, Any]:
        out = self.plan.to_json()
        out["verification"] = self.verification
        out["profile"] = self.profile.to_dict()
        out["where"] = {"source": self.cluster.source,
                        "nodes": [{"name": n.name, "cores": n.cores, "bandwidth_Bps": n.bandwidth_Bps}
                                  for n in self.cluster.nodes],
                        "loopback_Bps": self.cluster.loopback_Bps}
        out["calibration"] = {"cached": self.cached, "jobs": self.calibration_jobs}
        return out


# -- where the job would run -------------------------------------------------------


def parse_rate(text: str) -> float:
    """'100mbit', '1gbit', '12.5MB' (bytes) -> bytes/s."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(bit|b|B)?(?:/s|ps)?\s*", text, re.I)
    if not match:
        raise ValueError(f"expected a rate such as 100mbit or 1gbit, not {text!r}")
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2).lower()]
    unit = match.group(3) or "bit"
    return value / 8 if unit.lower() == "bit" and unit != "B" else value


def target_cluster(loopback_Bps: float, measured_Bps: float | None = None,
                   machines: dict[str, list] | None = None):
    """The nodes of the nodes file (cores declared or 1; link bandwidth from
    PAI_PLUTO_BANDWIDTH, else `measured_Bps` (the probe), else assumed 1 Gbit/s and
    said so), else this machine. `machines` (`probe_machines`): node name -> [boot
    id, cores]; nodes of one boot id share the machine's cores
    (PAI_PLUTO_SHARED_CORES: one machine of that many cores)."""
    config = load_nodes()
    if config is None or not config.nodes:
        cores = local_cores()
        return Cluster((Node("local", float(cores), loopback_Bps),), loopback_Bps=loopback_Bps,
                       source=f"this machine ({cores} cores)")
    raw = os.environ.get("PAI_PLUTO_BANDWIDTH")
    try:
        bandwidth = parse_rate(raw) if raw else (measured_Bps or 125e6)
    except ValueError as err:
        raise UsageError(f"PAI_PLUTO_BANDWIDTH: {err}", "e.g. PAI_PLUTO_BANDWIDTH=100mbit") from None
    machines = machines or {}
    # cores as placement counts them: the nodes file's cpu, else what the node reported
    nodes = tuple(Node(n.name, n.cpu / 100.0 if n.cpu else float((machines.get(n.name) or [None, 1])[1] or 1),
                       bandwidth, *shared_machine(n.name, machines)) for n in config.nodes)
    said = (f"{raw} links" if raw else
            f"links measured at {bandwidth * 8 / 1e6:.0f} Mbit/s" if measured_Bps else
            "links assumed 1 Gbit/s (set PAI_PLUTO_BANDWIDTH)")
    shared = os.environ.get("PAI_PLUTO_SHARED_CORES")
    try:
        machine_cores = float(shared) if shared else None
    except ValueError:
        raise UsageError(f"PAI_PLUTO_SHARED_CORES: expected a number of cores, not {shared!r}",
                         "e.g. PAI_PLUTO_SHARED_CORES=2 when the nodes are virtual hosts of one machine") from None
    virtual = virtual_hosts(nodes)
    if virtual and not machine_cores:
        said += f", {virtual}"
    return Cluster(nodes, loopback_Bps=loopback_Bps, machine_cores=machine_cores,
                   source=f"{len(nodes)} nodes of {config.path}, {said}")


def local_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def shared_machine(name: str, machines: dict[str, list]) -> tuple[str | None, float | None]:
    """(boot id, cores) of a node that shares its boot id with another node, else
    (None, None): only virtual hosts of one machine need the machine's picture."""
    mine = machines.get(name)
    if not mine or not mine[0]:
        return None, None
    if sum(1 for other in machines.values() if other and other[0] == mine[0]) < 2:
        return None, None
    return str(mine[0]), float(mine[1] or 1)


def virtual_hosts(nodes) -> str:
    """'3 nodes are virtual hosts of one 2-core machine (one boot id)', or ''."""
    groups: dict[str, list] = {}
    for node in nodes:
        if node.machine:
            groups.setdefault(node.machine, []).append(node)
    return "; ".join(f"{len(g)} nodes are virtual hosts of one {g[0].machine_cores:g}-core machine (one boot id)"
                     for g in groups.values())


def probe_machines(say: Callable[[str], None]) -> dict[str, list]:
    """Every node of the nodes file's [boot id, cores], as its node agent reports them
    (`pai nodes`' probe); nodes that do not answer are left out."""
    config = load_nodes()
    if config is None or len(config.nodes) < 2:
        return {}
    rows = probe_nodes(config)
    out = {row["name"]: [row.get("boot"), row.get("cores")] for row in rows if row["state"] == UP}
    missing = [row["name"] for row in rows if row["state"] != UP]
    if missing:
        say(f"boot ids: {', '.join(missing)} did not answer; they count as machines of their own")
    return out


def _runtime_probe(framework: str, measure, missing):
    """A calibrate.measure_* probe run in the framework's runtime (`missing` when
    the runtime is not there)."""
    def probe():
        runtime = get_runtime(framework)
        return measure(runtime.python(), pluto_helpers.__file__) if runtime.is_installed() else missing
    return probe


probe_quantize = _runtime_probe("mxnet", calibrate.measure_quantize, 0.0)
probe_update = _runtime_probe("mxnet", calibrate.measure_update, 0.0)
probe_kvstore = _runtime_probe("mxnet", calibrate.measure_kvstore, {})
probe_rpc = _runtime_probe("tensorflow", calibrate.measure_rpc, {})


def measure_links(store, say: Callable[[str], None], node_cpu: int = 100) -> tuple[float | None, float]:
    """(bytes/s, CPU seconds per byte) between two nodes, measured through pai: a job
    of one ps (a sink) and one worker (a source) running runners/pluto_helpers.py.
    The ps asks for the cpu of the largest node, so the worker lands on another. The
    rate is None when both landed on one node or the probe failed; the CPU per byte
    is 0.0 when unknown."""
    cluster = {"ps": {"count": 1, "cpu": max(100, int(node_cpu))}, "worker": {"count": 1}}
    stmt = parse_statement(["-name", "python", f"-Dscript={pluto_helpers.__file__}",
                            f"-Dcluster={json.dumps(cluster)}",
                            f"-DuserDefinedParameters=bandwidth {LINK_ROUND_S} {LINK_ROUNDS}", "-DmaxRetries=0",
                            "-DjobName=pluto-bandwidth-probe"])
    job_id = client.submit(client.prepare(stmt), store)
    say(f"link bandwidth probe {job_id}")
    if not wait_job(store, job_id, 120):
        client.kill(store, job_id, reason="pluto bandwidth probe: too slow")
        return None, 0.0
    hosts = {i["role"]: i["host"] for i in store.instances(job_id)}
    said = store.metric_values_by_role(job_id, ("bytes_per_s", "cpu_ns_per_byte")).get("worker", {})
    rate, cpu_ns = link_figures(said.get("bytes_per_s") or [], said.get("cpu_ns_per_byte") or [])
    if rate is None or hosts.get("ps") == hosts.get("worker"):
        return None, 0.0
    rounds = said.get("bytes_per_s") or []
    say(f"link: {rate * 8 / 1e6:.0f} Mbit/s, the best of {len(rounds)} rounds "
        f"({', '.join(f'{r * 8 / 1e6:.0f}' for r in rounds)}); {cpu_ns:.1f} ns of CPU a byte (their median)")
    return rate, cpu_ns * 1e-9


def link_figures(rates: list[float], cpu_ns: list[float]) -> tuple[float | None, float]:
    """(bytes/s, CPU ns per byte) of a link from the probe's rounds: the best rate
    (other work on the cores only slows a round down) and the median CPU (which
    varies both ways)."""
    good = [r for r in rates if r > 0]
    cpus = [c for c in cpu_ns if c > 0]
    return (max(good) if good else None), (median(cpus) if cpus else 0.0)


# -- the user's strategy and script ------------------------------------------------


def user_strategy(framework: str, spec):
    cluster = spec.get("cluster") or {}
    counts = {role: conf.get("count", 1) for role, conf in cluster.items()}
    workers = counts.get("worker", 1)
    if framework == "mxnet":
        ps = counts.get("server", counts.get("ps", 1))
    elif framework == "caffe":
        ps = counts.get("ps", 1 if workers > 1 else 0)
    else:
        ps = counts.get("ps", 1)
    strategy = default_strategy(framework, max(ps, 0), workers)
    if framework == "mxnet":
        strategy = strategy.with_(compression=spec.get("gradientCompression") or "none",
                                  threshold=spec.get("gradientCompressionThreshold") or 0.5,
                                  big_array_bound=spec.get("bigArrayBound"),
                                  sync=spec.get("kvstore") != "dist_async")
    if framework == "caffe" and workers > 1:
        strategy = strategy.with_(ma_period=spec.get("maPeriod"))
    if framework == "tensorflow" and spec.get("psStrategy") == "greedy":
        strategy = strategy.with_(partition="greedy")
    return strategy


def _read(path: str | None) -> str:
    if not path:
        return ""
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def script_inputs(prepared):
    """(facts, files the cache key covers, script arguments)."""
    spec = prepared.spec
    args = script_args(spec)
    source, solver, net, files = script_sources(spec)
    facts = script_facts(args, source=source, solver=solver, net=net)
    # Caffe's -DbatchSize / -DlearningRate replace the net's and the solver's (the
    # runner writes them into the job's copies; calibration runs with them too).
    for attr, key in (("batch_size", "batchSize"), ("learning_rate", "learningRate")):
        if prepared.adapter.name == "caffe" and spec.params.get(key) is not None:
            setattr(facts, attr, spec.params[key])
            facts.where[attr] = f"-D{key}"
    return facts, files, args


NET_LINE = re.compile(r'^\s*(?:train_)?net\s*:\s*"([^"]+)"', re.M)   # a Caffe solver's net file


def script_sources(spec) -> tuple[str, str, str, list[Path]]:
    """(the .py script's source, the solver's text, its net's text, the files the
    cache key covers); an archive's entry file is read without extracting."""
    files = [Path(p) for p in (spec.get("script"), spec.get("solver"), spec.get("hyperParameters")) if p]
    script = str(spec.get("script") or "")
    if script.endswith((".tar.gz", ".tgz", ".tar")) and spec.get("entryFile"):
        return (*_archive_texts(script, spec.get("entryFile")), files)
    source, solver, net = (_read(script) if script.endswith(".py") else ""), _read(spec.get("solver")), ""
    match = NET_LINE.search(solver)
    if match:
        base = Path(spec.get("solver")).parent
        for folder in (base, *base.parents):
            if (folder / match.group(1)).is_file():
                net = _read(str(folder / match.group(1)))
                files.append(folder / match.group(1))
                break
    return source, solver, net, files


def script_texts(prepared) -> tuple[str, str]:
    """(script source, solver text) as script_inputs reads them."""
    return script_sources(prepared.spec)[:2]


def script_knobs(prepared, facts, args: list[str], texts: tuple[str, str] | None = None):
    """What the user and the script leave Pluto to set (strategy.Knobs): the
    script's learning-rate flag, where sync/async is chosen and whether the user
    chose it, how sync workers' gradients combine. `texts`: script_texts(prepared),
    when the caller has read them already."""
    spec = prepared.spec
    framework = prepared.adapter.name
    source, solver = texts or script_texts(prepared)
    lr_pinned = facts.where.get("learning_rate") == "arguments" or "learningRate" in spec.params
    knobs = dict(lr_flag=facts.flags.get("learning_rate") if not lr_pinned else None, lr_pinned=lr_pinned,
                 user_args=spec.get("userDefinedParameters") or "")
    if framework == "mxnet":
        flag = choice_flag(source, KVSTORE_FLAGS)
        given = _flag_value(args, (flag[0][2:],)) if flag else None
        if "kvstore" in spec.params:
            knobs["sync_pinned"] = f"-Dkvstore={spec.params['kvstore']}"
        elif given is not None:
            knobs["sync_pinned"] = f"{flag[0]} {given}"
        elif flag:
            knobs["sync_switch"] = flag[0]
        elif "PAI_MXNET_KVSTORE" in source:
            knobs["sync_switch"] = "-Dkvstore"
        module = re.search(r"\bmod\.Module\(|\.fit\(", source) and not re.search(r"\bTrainer\(", source)
        knobs["aggregation"] = "mean" if module else "sum"
    elif framework == "tensorflow":
        flag = bool_flag(source, SYNC_FLAGS)
        if flag:
            given = [a for a in args if a.split("=", 1)[0] in (flag[0], flag[2] or flag[0])]
            if given:
                knobs["sync_pinned"] = " ".join(given)
            else:
                knobs["sync_switch"], knobs["sync_flag_negation"] = flag[0], flag[2]
    elif framework == "caffe":
        match = re.search(r'^\s*(?:type|solver_type)\s*:\s*"?(\w+)', solver, re.M)
        knobs["solver_type"] = match.group(1) if match else "SGD"
    return Knobs(**knobs)


def tf_sync(prepared, args: list[str], source: str | None = None) -> bool:
    """Does a TF script train sync: its --sync_replicas flag (given, else its
    default) when it has one, else whether it uses SyncReplicasOptimizer at all
    (TF1 between-graph replication and ParameterServerStrategy steps are async)."""
    if source is None:
        source = script_texts(prepared)[0]
    flag = bool_flag(source, SYNC_FLAGS)
    if flag is None:
        return "SyncReplicasOptimizer" in source
    for arg in args:
        name, _sep, value = arg.partition("=")
        if name == flag[0]:
            return value.lower() not in ("false", "0", "no") if value else True
        if flag[2] and name == flag[2]:
            return False
    return flag[1]


def _archive_texts(archive: str, entry: str) -> tuple[str, str, str]:
    """(script source, solver, net) of an archive's entry file, read without extracting."""
    def member_text(tar, name: str) -> str:
        try:
            member = tar.getmember(name)
        except KeyError:
            return ""
        if not member.isfile() or member.size > 2_000_000:
            return ""
        handle = tar.extractfile(member)
        return handle.read().decode("utf-8", "replace") if handle else ""

    try:
        with tarfile.open(archive) as tar:
            text = member_text(tar, entry)
            if not entry.endswith((".prototxt", ".pbtxt", ".txt")):
                return text, "", ""
            net = ""
            match = NET_LINE.search(text)
            if match:
                folder = posixpath.dirname(entry)
                while True:
                    net = member_text(tar, posixpath.normpath(posixpath.join(folder, match.group(1))))
                    if net or not folder:
                        break
                    folder = posixpath.dirname(folder)
            return "", text, net
    except (OSError, tarfile.TarError):
        return "", "", ""


# -- calibration through pai itself ---------------------------------------------------


class EditedAdapter:
    """The user's adapter, each plan it makes changed by `edit(plan)`."""

    def __init__(self, adapter, edit: Callable[[Any], None]):
        self._adapter, self._edit = adapter, edit

    def __getattr__(self, name):
        return getattr(self._adapter, name)

    def plan(self, spec, code):
        plan = self._adapter.plan(spec, code)
        self._edit(plan)
        return plan


def _reporting_sizes(plan) -> None:
    """A calibration run's instances report their model's sizes (stderr: lines that
    reach the instance logs from any node)."""
    for role in plan.roles:
        role.env["PAI_PLUTO_REPORT"] = "stderr"
    plan.notes.append("Pluto calibration run: instances report their model's sizes")


def _brief_spec(prepared, cluster_value: dict, params: dict, kind: str):
    """The job's spec for a brief run of Pluto's on `cluster_value`: the user's -D
    values minus what Pluto decides (STRATEGY_KEYS), then `params`, no retries."""
    stem = Path(str(prepared.spec.get("script") or prepared.spec.get("solver") or "job")).stem
    kept = {k: v for k, v in prepared.spec.params.items() if k not in STRATEGY_KEYS}
    return replace(prepared.spec, params={**kept, "cluster": cluster_value, **params, "maxRetries": 0,
                                          "jobName": f"pluto-{kind}-{stem}"})


def _calibration_configs(framework: str):
    """(cluster, extra params) of each calibration run."""
    if framework == "mxnet":
        return [({"server": {"count": 1}, "worker": {"count": 1}}, {}),
                ({"server": {"count": 1}, "worker": {"count": 2}}, {}),
                ({"server": {"count": 2}, "worker": {"count": 1}}, {})]
    if framework == "caffe":
        return [({"worker": {"count": 1}}, {}),
                ({"ps": {"count": 1}, "worker": {"count": 2}}, {"maPeriod": CALIBRATION_MA_PERIOD})]
    return [({"ps": {"count": 1}, "worker": {"count": 1}}, {}),
            ({"ps": {"count": 1}, "worker": {"count": 2}}, {}),
            ({"ps": {"count": 2}, "worker": {"count": 1}}, {})]


def _enough_steps(store, job_id: str, workers: int, intervals: int = CALIBRATION_INTERVALS) -> bool:
    """Every worker printed `intervals` + 2 step lines (the first interval is dropped)
    and its intervals after the first span MEASURE_SPAN_S seconds."""
    counts = store.step_counts(job_id, ("worker", "chief"))
    if len(counts) < workers or any(n < intervals + 2 for n in counts.values()):
        return False
    times: dict[tuple[str, int], list[float]] = {}
    for row in store.step_points(job_id, ("worker", "chief")):
        times.setdefault((row[0], row[1]), []).append(row[3])
    return len(times) >= workers and all(len(ts) >= 2 and max(ts) - sorted(ts)[1] >= MEASURE_SPAN_S
                                         for ts in times.values())


def wait_job(store, job_id: str, limit_s: float, enough: Callable[[], bool] = lambda: False) -> bool:
    """Refresh the job until it ends or `enough()`; False when `limit_s` passes first
    (the job is left running: the caller stops it)."""
    deadline = time.monotonic() + limit_s
    while True:
        job = client.refresh(store, job_id)
        if JobStatus(job["status"]).is_terminal() or enough():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.3)


def calibration_run(prepared, store, cluster_value: dict, extra: dict, say: Callable[[str], None]):
    """Submit the user's script on `cluster_value`, let it run a few steps, stop it,
    and read what it measured. Raises PaiError when the script fails or shows no steps.
    Pluto's own -D values are left out: the calibration's communication model assumes
    no compression, MXNet's own slicing, TF round-robin."""
    spec = _brief_spec(prepared, cluster_value, extra, "calibration")
    workers = cluster_value.get("worker", {}).get("count", 1)
    job_id = client.submit(client.Prepared(EditedAdapter(prepared.adapter, _reporting_sizes), spec), store)
    say(f"calibration job {job_id}: {json.dumps(cluster_value)}")
    if not wait_job(store, job_id, CALIBRATION_LIMIT_S, lambda: _enough_steps(store, job_id, workers)):
        client.kill(store, job_id, reason="pluto calibration: no steps in time")
        raise PaiError(f"calibration: the script printed fewer than {CALIBRATION_INTERVALS + 2} step "
                       f"lines per worker in {CALIBRATION_LIMIT_S:.0f} s (job {job_id})",
                       f"see `pai logs {job_id}`; a step line has step=N (or Caffe's Iteration N)")
    job = store.job(job_id)
    if not JobStatus(job["status"]).is_terminal():
        client.kill(store, job_id, reason="pluto calibration done")
    elif job["status"] == JobStatus.FAILED.value:
        raise PaiError(f"calibration: the script failed on {json.dumps(cluster_value)}: {job['reason']}",
                       f"see `pai logs {job_id}`")
    return job_id, _measured_run(store, job, cluster_value, extra)


def _measured_run(store, job, cluster_value: dict, extra: dict):
    """What a calibration run measured: its step time, model size, iteration and
    exchange times. Raises PaiError when its output had no step timing."""
    job_id = job["id"]
    step_s = steptime.job_step_seconds(store, job_id)
    reported = store.metric_values_by_role(job_id, ("model_mb", "iter_per_s", "exchange_ms", "global_step"))
    workers_m = reported.get("worker", {})
    iter_rates = workers_m.get("iter_per_s") or []
    exchange = workers_m.get("exchange_ms") or []
    model_mb = (reported.get("ps", {}).get("model_mb") or [None])[-1]
    if step_s is None and not iter_rates:
        raise PaiError(f"calibration: no step timing in the script's output (job {job_id})",
                       "print a line with step=N per step (or every few steps)")
    return Run(ps=cluster_value.get("ps", cluster_value.get("server", {})).get("count", 0),
               workers=cluster_value.get("worker", {}).get("count", 1), step_s=step_s, model_mb=model_mb,
               var_bytes=read_report(sorted((Path(job["job_dir"]) / "logs").glob("*.log"))),
               iter_s=(1.0 / median(iter_rates)) if iter_rates else None,
               exchange_s=(median(exchange[1:] or exchange) / 1000.0) if exchange else None,
               ma_period=extra.get("maPeriod"), global_step=bool(workers_m.get("global_step")))


def make_plan(stmt, budget_s: float | None = None, store=None,
              say: Callable[[str], None] = lambda line: None, verify: bool = False) -> PlanResult:
    """Calibrate (or read the cache), describe the cluster, plan; verify=True: run
    the plans too close to call (or outside the calibrated shapes) briefly and
    recommend by what they measured (`verify_plan`). Raises UsageError for bad input
    and PaiError when calibration fails."""
    return plan_prepared(client.prepare(stmt), budget_s, store, say, verify=verify)


def calibration_key(prepared, files, args, here) -> str:
    """The calibration cache's key: the script's files and arguments, kvstore and
    entry file, and where it calibrates (`here`: node names and cores)."""
    return calibrate.cache_key(prepared.adapter.name, files, args, here,
                               extra=json.dumps({k: prepared.spec.get(k) for k in ("kvstore", "entryFile")}))


def plan_prepared(prepared, budget_s: float | None = None, store=None,
                  say: Callable[[str], None] = lambda line: None, verify: bool = False) -> PlanResult:
    framework = prepared.adapter.name
    if framework not in PLAN_FRAMEWORKS:
        raise UsageError(f"-name {framework}: pai plan plans {', '.join(PLAN_FRAMEWORKS)} jobs",
                         "a plain Python job has no parameter server or model to plan")
    store = store or Store()
    facts, files, args = script_inputs(prepared)
    user = user_strategy(framework, prepared.spec)
    cores = local_cores()

    def clusters(loopback: float, links: float | None = None, machines: dict | None = None):
        where = target_cluster(loopback, links, machines)
        # Calibration runs where `pai` runs jobs (this machine without a nodes file).
        here = where if len(where.nodes) > 1 else Cluster((Node("local", float(cores), loopback),),
                                                          loopback_Bps=loopback, source=where.source)
        return where, here

    unmeasured = clusters(0.0)   # the nodes file, read once before anything is measured
    key = calibration_key(prepared, files, args, unmeasured[1])
    home = pai_home()
    cached = calibrate.cache_get(home, key)
    # The loopback rate (and, on nodes, the links' rate) is measured with the calibration
    # and kept with it, so a cached plan forecasts exactly what the first one did.
    loopback = (cached or {}).get("loopback_Bps") or calibrate.measure_loopback()
    links = (cached or {}).get("links_Bps")
    link_cpu = (cached or {}).get("link_cpu_s_per_byte") or 0.0
    # Which nodes are one machine: their node agents' boot ids, probed once and kept
    # with the calibration (PAI_PLUTO_SHARED_CORES, when set, overrides them).
    machines = (cached or {}).get("machines")
    if machines is None and len(unmeasured[0].nodes) > 1:
        machines = probe_machines(say)
    if links is None and len(unmeasured[0].nodes) > 1 and not os.environ.get("PAI_PLUTO_BANDWIDTH"):
        biggest = max(node.cores for node in clusters(loopback, None, machines)[0].nodes)
        links, link_cpu = measure_links(store, say, node_cpu=round(biggest * 100))
    where, here = clusters(loopback, links, machines)
    jobs: list[str] = []
    runs = []
    if not cached:
        # The script's calibration before the runtime's probes, which take many seconds:
        # a script that fails says so at once.
        for cluster_value, extra in _calibration_configs(framework):
            job_id, run = calibration_run(prepared, store, cluster_value, extra, say)
            jobs.append(job_id)
            runs.append(run)
    # The runtime's CPU costs (MXNet: 2bit, a server's update, the kvstore per value and
    # key; TensorFlow: gRPC per byte and variable), probed once on this machine and kept
    # with the calibration like the rates: the planner weighs them for every plan.
    probed = {}
    for field, probe_framework, probe in (("quantize_s_per_value", "mxnet", probe_quantize),
                                          ("update_s_per_value", "mxnet", probe_update),
                                          ("kvstore_s_per_value", "mxnet", probe_kvstore),
                                          ("rpc", "tensorflow", probe_rpc)):
        probed[field] = (cached or {}).get(field)
        if probed[field] is None and framework == probe_framework:
            probed[field] = probe()
    costs = {"quantize_s_per_value": probed["quantize_s_per_value"] or 0.0,
             "update_s_per_value": probed["update_s_per_value"] or 0.0, "link_cpu_s_per_byte": link_cpu,
             **(probed["kvstore_s_per_value"] or {}), **(probed["rpc"] or {})}
    where, here = replace(where, **costs), replace(here, **costs)
    texts = script_texts(prepared)   # read once for tf_sync and script_knobs
    if cached:
        profile = Profile.from_dict(cached["profile"])
        say("calibration: cached")
    else:
        sync = tf_sync(prepared, args, texts[0]) if framework == "tensorflow" else user.sync
        profile = calibrate.build_profile(framework, runs, facts, here, sync=sync)
        calibrate.cache_put(home, key, {"profile": profile.to_dict(), "runs": [r.to_dict() for r in runs],
                                        "jobs": jobs, "loopback_Bps": loopback, "links_Bps": links,
                                        "machines": machines, "link_cpu_s_per_byte": link_cpu, **probed})
    knobs = script_knobs(prepared, facts, args, texts)
    result = planner.plan(profile, where, user, budget_s=budget_s, knobs=knobs)
    verification = None
    if verify:
        result, verification = verify_plan(prepared, store, key, profile, where, user, knobs, result, budget_s, say)
    return PlanResult(plan=result, profile=profile, cluster=where, cached=bool(cached), calibration_jobs=jobs,
                      verification=verification)


# -- checking before recommending ----------------------------------------------------------

VERIFY_INTERVALS = 6       # step-line intervals per worker a verification run measures
VERIFY_STARTUP_S = 15.0    # what a verification job is reckoned to take before its first step


def calibrated_shapes(framework: str) -> tuple[tuple[int, int], ...]:
    """The (ps, workers) shapes calibration runs."""
    out = []
    for cluster_value, _extra in _calibration_configs(framework):
        ps = cluster_value.get("ps", cluster_value.get("server", {})).get("count", 0)
        out.append((ps, cluster_value["worker"]["count"]))
    return tuple(out)


def verify_plan(prepared, store, key: str, profile, where, user, knobs, result, budget_s, say):
    """Run the plans planner.to_verify picks (each cached per plan, with the
    calibration) and recommend by their measured step times. With a budget, the
    runs still to do are counted against it: the plan is made again for what is
    left. Returns (plan, verification record or None)."""
    home = pai_home()
    shapes = calibrated_shapes(prepared.adapter.name)
    picks, why = planner.to_verify(result, shapes, profile.sync)
    if not picks:
        return result, None

    def cached_run(choice):
        return calibrate.cache_get(home, f"{key}:verify:{planner.plan_key(choice)}")

    cost = sum(VERIFY_STARTUP_S + max((VERIFY_INTERVALS + 2) * c.forecast.step_s,
                                      MEASURE_SPAN_S + 2 * c.forecast.step_s)
               for c in picks if not cached_run(c))
    if budget_s is not None and cost > 0:
        left = max(0.0, budget_s - cost)
        result = planner.plan(profile, where, user, budget_s=left, knobs=knobs)
        result.reasons.insert(0, f"budget {planner.duration_text(budget_s)}: the verification runs take about "
                                 f"{planner.duration_text(cost)} of it; plans are judged against the "
                                 f"{planner.duration_text(left)} left")
        picks, why = planner.to_verify(result, shapes, profile.sync)
        if not picks:
            return result, None
    measured: dict[str, tuple[float, str]] = {}
    jobs, hits = [], 0
    for choice in picks:
        entry = cached_run(choice)
        if entry and entry.get("step_s"):
            hits += 1
        else:
            entry = verify_run(prepared, store, choice.to_json(), say)
            if entry.get("step_s"):
                calibrate.cache_put(home, f"{key}:verify:{planner.plan_key(choice)}", entry)
        jobs.append(entry["job"])
        if entry.get("step_s"):
            measured[planner.plan_key(choice)] = (entry["step_s"], entry["job"])
    planner.apply_measured(result, measured, why, profile.sync)
    if measured:   # the reasons speak of the figures the plan is now judged by
        planner.explain_again(result, profile, where, knobs)
    return result, {"why": why, "jobs": jobs, "cached": hits, "plans": [c.strategy.label() for c in picks]}


def verify_run(prepared, store, choice_json: dict, say: Callable[[str], None]) -> dict[str, Any]:
    """Submit the job as the plan would (its -Dcluster and -D values), let every
    worker print VERIFY_INTERVALS + 2 step lines spanning MEASURE_SPAN_S, stop it; {"job", "step_s"} (step_s
    None when the run failed or showed too few steps: the plan keeps its forecast)."""
    spec = _brief_spec(prepared, choice_json["cluster"], choice_json["params"], "verify")
    prepared.adapter.validate(spec)
    workers = choice_json["cluster"].get("worker", {}).get("count", 1)
    job_id = client.submit(client.Prepared(prepared.adapter, spec), store)
    say(f"verification job {job_id}: {choice_json['label']}")

    # the plans it compares are within 15%: the same window as calibration's
    wait_job(store, job_id, CALIBRATION_LIMIT_S, lambda: _enough_steps(store, job_id, workers, VERIFY_INTERVALS))
    job = store.job(job_id)
    if not JobStatus(job["status"]).is_terminal():
        client.kill(store, job_id, reason="pluto verification done")
    step_s = steptime.job_step_seconds(store, job_id)
    if job["status"] == JobStatus.FAILED.value or not step_s:
        say(f"verification job {job_id} measured nothing ({job['status']}): its plan keeps the forecast; "
            f"see `pai logs {job_id}`")
        return {"job": job_id, "step_s": None}
    return {"job": job_id, "step_s": step_s}


# -- -DautoStrategy=true ----------------------------------------------------------------


def auto_strategy(prepared, store=None, progress: Callable[[str], None] = lambda line: None):
    """The prepared job with Pluto's recommendation applied: -Dcluster and the
    strategy's -D values replaced (what the user set for them is overridden, and
    said in the reasons), the plan and forecast carried into plan.json."""
    result = plan_prepared(prepared, store=store, say=lambda line: progress(f"pluto: {line}"))
    rec = result.plan.recommended
    chosen = rec.to_json()
    reasons = list(result.plan.reasons)
    overridden = [k for k in chosen["params"] if k in prepared.spec.params and k != "userDefinedParameters"
                  and prepared.spec.params[k] != chosen["params"][k]]
    if overridden:
        reasons.append("overrode " + ", ".join(f"-D{k}" for k in overridden) + " (-DautoStrategy=true decides them)")
    if rec.strategy.script_flags:
        reasons.append("appended " + " ".join(rec.strategy.script_flags) + " to the script's arguments "
                       "(-DuserDefinedParameters; your own arguments come first)")
    params = {**prepared.spec.params, "cluster": chosen["cluster"], **chosen["params"]}
    spec = replace(prepared.spec, params=params)
    prepared.adapter.validate(spec)
    record = {**chosen, "reasons": reasons, "default": result.plan.default.to_json(),
              "param_bytes": result.profile.param_bytes, "ps_role": rec.strategy.ps_role(),
              "where": result.cluster.source, "calibration_jobs": result.calibration_jobs,
              "cached": result.cached}

    def planned(plan) -> None:   # recorded in plan.json (JobPlan.pluto)
        plan.pluto = record
        plan.notes.append(f"Pluto (-DautoStrategy=true): {record['label']}, forecast "
                          f"{record['forecast_step_s']:.4f} s/step")
    return client.Prepared(EditedAdapter(prepared.adapter, planned), spec)
