#!/usr/bin/env python3
"""Pluto's forecast against measured runs, and the communication-bound proof.

    # the grid on the multi-host test cluster (root: network namespaces, veth, tc tbf)
    sudo .venv/bin/python bench/bench_pluto.py grid --rates 100mbit,1gbit
    sudo .venv/bin/python bench/bench_pluto.py grid --rates 100mbit --frameworks mxnet
    # ...with two dist_async rows (Pluto's async MXNet forecast against measured)
    sudo .venv/bin/python bench/bench_pluto.py grid --rates 100mbit --frameworks mxnet --mxnet-async
    # the same grid on this machine alone (loopback; tc cannot shape loopback usefully)
    .venv/bin/python bench/bench_pluto.py grid --local
    # -DautoStrategy=true against the default 1 ps, side by side, at 100 Mbit/s
    # (TF 3 workers at 18x the grid's steps, MXNet 3x, Caffe 12x: docs/pluto.md's rows)
    sudo .venv/bin/python bench/bench_pluto.py proof --rate 100mbit
    # Caffe communication-bound: the widened mlp at a per-worker batch of 16
    sudo .venv/bin/python bench/bench_pluto.py proof --rate 100mbit --frameworks caffe --caffe-batch 16
    # held-out: scripts and shapes the model was not fitted on (examples/pluto/heldout_*.py,
    # 3-4 nodes, 100 Mbit/s and 1 Gbit/s), each plan forecast then measured in one run
    sudo .venv/bin/python bench/bench_pluto.py heldout --json /tmp/heldout.json
    # ...measuring every candidate where no measured plan is 1.5x the default
    sudo .venv/bin/python bench/bench_pluto.py heldout --all-plans --json /tmp/heldout.json
    .venv/bin/python bench/bench_pluto.py heldout-table A.json B.json   # one table over runs made in chunks
    # markdown rows of saved results (grid --json FILE)
    .venv/bin/python bench/bench_pluto.py table FILE...

For every framework the grid first runs `pai plan` (its calibration runs go
through pai on the same cluster), then runs each configuration of the grid for
real through pai and compares the forecast step time with the measured
`step_seconds`. It prints one line per configuration, the median absolute error
(goal <= 20%) and the recommended plan's measured speed against the best
measured configuration (goal: within 10%).

The test cluster's hosts are network namespaces of this one machine: they share
its cores, which the forecast is told (PAI_PLUTO_SHARED_CORES) so that compute
contention is modelled as it really is here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

TF_SCRIPT = ROOT / "examples" / "pluto" / "tf_wide_mlp.py"
MX_SCRIPT = ROOT / "examples" / "pluto" / "mxnet_wide_mlp.py"
CAFFE_SOLVER = ROOT / "examples" / "caffe" / "mlp" / "mlp_solver.prototxt"
STEPS_PER_WORKER = 24
HOSTS = 7
# The proof's step targets, times the grid's: long enough that start-up (10-20 s a
# job) is a small share of a communication-bound job.
PROOF_STEPS_FACTOR = {"tensorflow": 18, "mxnet": 3, "caffe": 12}
# plan parameters that change what a step learns, not how long it takes
NOT_SPEED = ("gradientCompressionThreshold", "learningRate", "warmupIterations", "warmupSteps", "lrScale")


MXNET_ASYNC = False      # grid --mxnet-async


def grid(framework: str) -> list[dict]:
    """Configurations as (cluster, params): >= 8 per framework."""
    if framework == "tensorflow":
        out = []
        for ps, workers, partition in ((1, 1, "roundRobin"), (1, 2, "roundRobin"), (2, 2, "roundRobin"),
                                       (2, 2, "greedy"), (3, 2, "greedy"), (4, 2, "greedy"),
                                       (1, 3, "roundRobin"), (2, 3, "roundRobin"), (2, 3, "greedy"),
                                       (4, 3, "greedy")):
            params = {"psStrategy": partition} if ps > 1 else {}
            out.append({"cluster": {"ps": {"count": ps}, "worker": {"count": workers}}, "params": params})
        return out
    if framework == "mxnet":
        out = []
        for servers, comp, ours in ((1, "none", False), (1, "2bit", False), (2, "none", False),
                                    (2, "none", True), (2, "2bit", True), (3, "none", True),
                                    (4, "none", True), (4, "2bit", True)):
            params = {"gradientCompression": comp}
            if comp == "2bit":
                params["gradientCompressionThreshold"] = 0.5
            if ours:
                params["bigArrayBound"] = "PLUTO"   # filled in with pluto_bound once sizes are known
            out.append({"cluster": {"server": {"count": servers}, "worker": {"count": 2}}, "params": params})
        out.append({"cluster": {"server": {"count": 1}, "worker": {"count": 1}}, "params": {"gradientCompression": "none"}})
        if MXNET_ASYNC:   # grid --mxnet-async: dist_async rows beside their dist_sync twins above
            out.append({"cluster": {"server": {"count": 1}, "worker": {"count": 2}},
                        "params": {"gradientCompression": "none", "kvstore": "dist_async"}})
            out.append({"cluster": {"server": {"count": 2}, "worker": {"count": 2}},
                        "params": {"gradientCompression": "2bit", "gradientCompressionThreshold": 0.5,
                                   "bigArrayBound": "PLUTO", "kvstore": "dist_async"}})
        return out
    if framework == "caffe":
        out = [{"cluster": {"worker": {"count": 1}}, "params": {}}]
        for period in (1, 2, 5, 10, 20, 50):
            out.append({"cluster": {"ps": {"count": 1}, "worker": {"count": 2}}, "params": {"maPeriod": period}})
        out.append({"cluster": {"ps": {"count": 1}, "worker": {"count": 3}}, "params": {"maPeriod": 5}})
        return out
    raise SystemExit(f"unknown framework {framework}")


CAFFE_HIDDEN = 12000    # the MLP's hidden layer: about 1 MB of weights to average


CAFFE_ITERS = 400       # the grid's step target (solver max_iter)


def caffe_archive(max_iter: int = CAFFE_ITERS, batch: int | None = None) -> Path:
    """examples/caffe/mlp widened (a model worth averaging), its data made, max_iter
    (and the training batch, when given) set, as an archive: on other nodes a job
    sees only its script or archive."""
    import re
    import shutil
    import subprocess
    import tarfile

    from paicli.runners.runtimes import get_runtime

    folder = Path(tempfile.mkdtemp(prefix="pai-bench-caffe-"))
    mlp = folder / "mlp"
    shutil.copytree(CAFFE_SOLVER.parent, mlp, ignore=shutil.ignore_patterns("data", "snapshots"))
    net = (mlp / "mlp_train_test.prototxt").read_text()
    net = net.replace("num_output: 64", f"num_output: {CAFFE_HIDDEN}")
    if batch:
        net = net.replace('source: "data/train.txt" batch_size: 64', f'source: "data/train.txt" batch_size: {batch}')
        assert f"batch_size: {batch}" in net, "the training data layer's batch_size was not found"
    (mlp / "mlp_train_test.prototxt").write_text(net)
    solver = (mlp / "mlp_solver.prototxt").read_text()
    for name, value in (("max_iter", max_iter), ("display", 20), ("snapshot", 0), ("test_interval", 1000)):
        solver = re.sub(rf"^{name}:.*$", f"{name}: {value}", solver, flags=re.M)
    (mlp / "mlp_solver.prototxt").write_text(solver)
    runtime = get_runtime("caffe")
    runtime.ensure(lambda line: None)
    subprocess.run([runtime.python(), str(mlp / "make_data.py")], check=True, timeout=300, cwd=mlp,
                   capture_output=True)
    archive = folder / "mlp.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(mlp, arcname="mlp")
    return archive


_CAFFE_ARCHIVE: dict[tuple[int, int | None], Path] = {}


def base_tokens(framework: str, caffe_iters: int = CAFFE_ITERS, caffe_batch: int | None = None) -> list[str]:
    if framework == "tensorflow":
        return ["-name", "tensorflow", f"-Dscript={TF_SCRIPT}"]
    if framework == "mxnet":
        return ["-name", "mxnet", f"-Dscript={MX_SCRIPT}",
                '-Dcluster={"server":{"count":1},"worker":{"count":2}}']
    key = (caffe_iters, caffe_batch)
    if key not in _CAFFE_ARCHIVE:
        _CAFFE_ARCHIVE[key] = caffe_archive(caffe_iters, caffe_batch)
    return ["-name", "caffe", f"-Dscript={_CAFFE_ARCHIVE[key]}", "-DentryFile=mlp/mlp_solver.prototxt",
            '-Dcluster={"ps":{"count":1},"worker":{"count":2}}']


def steps_args(framework: str, workers: int) -> list[str]:
    if framework == "tensorflow":
        return [f"-DuserDefinedParameters=--steps={STEPS_PER_WORKER * workers}"]
    if framework == "mxnet":
        return [f"-DuserDefinedParameters=--steps={STEPS_PER_WORKER}"]
    return []


_STORES: dict[str, object] = {}


def the_store():
    """ONE store per PAI_HOME for this whole process: every submit forks a master, and
    a second open SQLite connection inherited across that fork (which only the store
    handed to submit closes) can corrupt the database when the child drops it."""
    from paicli.store import Store, pai_home

    home = str(pai_home())
    if home not in _STORES:
        _STORES[home] = Store()
    return _STORES[home]


def run_job(tokens: list[str], limit: float = 600.0) -> tuple[str, float | None, str, float]:
    """Submit through pai's library, wait for the end; (id, step_seconds, status, wall seconds)."""
    from paicli import client, steptime
    from paicli.states import JobStatus
    from paicli.statement import parse_statement

    from paicli.errors import PaiError

    store = the_store()
    started = time.monotonic()
    for attempt in range(4):
        try:
            job_id = client.submit(client.prepare(parse_statement(tokens)), store)
            break
        except PaiError as err:
            # A machine shared with other test runs can leave the hosts' sshd too slow
            # to answer for a moment: try again rather than lose the grid.
            if "answers" not in str(err) or attempt == 3:
                raise
            print(f"   (submit failed: {str(err)[:120]}...; retrying in 15 s)", flush=True)
            time.sleep(15)
    while True:
        job = client.refresh(store, job_id)
        if JobStatus(job["status"]).is_terminal() and not client.master_alive(job):
            break
        if time.monotonic() - started > limit:
            client.kill(store, job_id, reason="bench limit")
        time.sleep(0.3)
    return job_id, steptime.job_step_seconds(store, job_id), job["status"], time.monotonic() - started


def training_seconds(job_id: str) -> float | None:
    """From the first step line of any worker to the last: the time to the step target
    without the job's start-up (runtime import, connecting)."""

    stamps = [r["ts"] for r in the_store().metrics(job_id) if r["role"] in ("worker", "chief") and r["step"] is not None]
    return (max(stamps) - min(stamps)) if len(stamps) > 1 else None


def mean_step_seconds(job_id: str) -> float | None:
    """Seconds per step from each training instance's second step line to its last
    (the first interval dropped, as step_seconds does), the median over instances.
    Unlike step_seconds' median interval this counts every pause: Caffe averages
    every maPeriod iterations while its display lines come every 20, so with a
    period of 50 or 100 most intervals hold no averaging round and their median
    leaves the rounds out."""
    series: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in the_store().metrics(job_id):
        if r["role"] in ("worker", "chief") and r["step"] is not None:
            series.setdefault((r["role"], r["idx"]), []).append((r["ts"], r["step"]))
    rates = []
    for points in series.values():
        first_seen: dict[float, float] = {}
        for ts, step in sorted(points):
            first_seen.setdefault(step, ts)
        ordered = sorted((ts, step) for step, ts in first_seen.items())[1:]
        if len(ordered) >= 2 and ordered[-1][1] > ordered[0][1]:
            rates.append((ordered[-1][0] - ordered[0][0]) / (ordered[-1][1] - ordered[0][1]))
    return statistics.median(rates) if rates else None


def losses_fall(job_id: str) -> bool:

    rows = [r for r in the_store().metrics(job_id) if r["key"] == "loss" and r["role"] == "worker" and r["idx"] == 0]
    if len(rows) < 4:
        return False
    first = statistics.mean(r["value"] for r in rows[:3])
    last = statistics.mean(r["value"] for r in rows[-3:])
    return last < first


def strategy_of(framework: str, config: dict, profile):
    from paicli.cluster.pluto.model import default_strategy

    cluster, params = config["cluster"], config["params"]
    workers = cluster["worker"]["count"]
    ps = cluster.get("ps", cluster.get("server", {"count": 0}))["count"]
    s = default_strategy(framework, ps, workers)
    if framework == "tensorflow":
        s = s.with_(partition="greedy" if params.get("psStrategy") == "greedy" else "round_robin",
                    sync=profile.sync)
    elif framework == "mxnet":
        s = s.with_(compression=params.get("gradientCompression", "none"),
                    big_array_bound=params.get("bigArrayBound"),
                    sync=params["kvstore"] != "dist_async" if "kvstore" in params else profile.sync,
                    mode_chosen="kvstore" in params)
    elif framework == "caffe" and workers > 1:
        s = s.with_(ma_period=params.get("maPeriod", 20))
    return s


def tokens_for(framework: str, config: dict) -> list[str]:
    base = [t for t in base_tokens(framework) if not t.startswith("-Dcluster=")]
    workers = config["cluster"]["worker"]["count"]
    out = base + [f"-Dcluster={json.dumps(config['cluster'], separators=(',', ':'))}"]
    out += [f"-D{k}={v}" for k, v in config["params"].items()]
    return out + steps_args(framework, workers)


def bench_framework(framework: str, label: str) -> dict:
    from paicli.pluto import make_plan
    from paicli.cluster.pluto.model import forecast
    from paicli.cluster.pluto.planner import pluto_bound
    from paicli.statement import parse_statement

    print(f"\n== {framework} on {label}", flush=True)
    t0 = time.monotonic()
    result = make_plan(parse_statement(base_tokens(framework) + steps_args(framework, 2)), store=the_store(),
                       say=lambda line: print(f"   {line}", flush=True))
    profile, where = result.profile, result.cluster
    print(f"   calibrated in {time.monotonic() - t0:.0f}s: model {profile.param_bytes / 1e6:.2f} MB "
          f"({len(profile.var_bytes)} arrays), {profile.compute_s_per_sample * 1e3:.3f} ms/sample, "
          f"fan-in {profile.fanin_s * 1e3:.2f} ms, per ps {profile.per_ps_s * 1e3:.2f} ms, sync={profile.sync}, "
          f"step target {profile.step_target} ({'global' if profile.target_global else 'per worker'})", flush=True)
    calibration_runs = newest_calibration_runs()
    for run in calibration_runs:
        print(f"   calibration run: {run.get('ps')} ps, {run.get('workers')} worker: step {run.get('step_s')} s, "
              f"iteration {run.get('iter_s')} s, round {run.get('exchange_s')} s", flush=True)
    rec = result.plan.recommended.to_json()
    configs = grid(framework)
    for config in configs:
        if config["params"].get("bigArrayBound") == "PLUTO":
            ps = config["cluster"]["server"]["count"]
            config["params"]["bigArrayBound"] = pluto_bound(profile.var_bytes or (profile.param_bytes,), ps)
    rec_config = {"cluster": rec["cluster"], "params": rec["params"]}
    def essential(params: dict) -> dict:   # dist_sync is MXNet's default whether or not Pluto names it
        # (the learning rate and warm-up a plan adds change what a step learns, not its time)
        return {k: v for k, v in params.items()
                if k not in NOT_SPEED and (k, v) != ("kvstore", "dist_sync")}

    same = [c for c in configs if c["cluster"] == rec_config["cluster"] and
            essential(c["params"]) == essential(rec_config["params"])]
    if not same:
        configs.append(rec_config)
    rows = []
    for config in configs:
        strategy = strategy_of(framework, config, profile)
        predicted = forecast(profile, strategy, where).step_s
        job_id, median_interval, status, wall = run_job(tokens_for(framework, config))
        mean = mean_step_seconds(job_id)
        # Caffe: the mean over the run, averaging rounds included (mean_step_seconds)
        measured = mean if framework == "caffe" else median_interval
        err = (predicted - measured) / measured if measured else None
        is_rec = config is rec_config or (same and config is same[0])
        rows.append({"config": strategy.label(), "cluster": config["cluster"], "params": config["params"],
                     "forecast_s": predicted, "measured_s": measured, "error": err, "status": status,
                     "job": job_id, "recommended": bool(is_rec), "wall_s": wall,
                     "step_seconds": median_interval, "mean_step_s": mean})
        print(f"   {'*' if is_rec else ' '} {strategy.label():42s} forecast {predicted:8.4f}s  measured "
              f"{(measured or float('nan')):8.4f}s  error {(err if err is not None else float('nan')):+6.0%}  "
              f"{status} {job_id} ({wall:.0f}s; step_seconds {(median_interval or float('nan')):.4f}, "
              f"mean {(mean or float('nan')):.4f})", flush=True)
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    med = statistics.median(errors) if errors else None
    # The planner's objective: time to the step target. When the target counts every
    # worker's steps (TF global_step), W workers reach it W times sooner per step.
    for r in rows:
        workers = r["cluster"]["worker"]["count"]
        r["measured_per_target_step_s"] = (r["measured_s"] / workers if profile.target_global
                                           else r["measured_s"]) if r["measured_s"] else None
    recd = next((r for r in rows if r["recommended"]), None)
    # A per-worker step target: plans with other worker counts train on other amounts
    # of data, so the recommendation is judged against plans with its worker count.
    same_work = (lambda r: True) if profile.target_global or recd is None else \
        (lambda r: r["cluster"]["worker"]["count"] == recd["cluster"]["worker"]["count"])
    measured = [r for r in rows if r["measured_per_target_step_s"] and same_work(r)]
    best = min(measured, key=lambda r: r["measured_per_target_step_s"]) if measured else None
    recd = next((r for r in rows if r["recommended"]), None)
    ratio = (recd["measured_per_target_step_s"] / best["measured_per_target_step_s"]) \
        if (best and recd and recd["measured_per_target_step_s"]) else None
    unit = "s per global step" if profile.target_global else "s/step"
    print(f"   median |error| {med:.1%} over {len(errors)} configurations (goal <= 20%)" if med is not None
          else "   no measurements", flush=True)
    if ratio:
        print(f"   recommended ({recd['config']}) measured {recd['measured_per_target_step_s']:.4f} {unit}; best "
              f"measured ({best['config']}) {best['measured_per_target_step_s']:.4f} {unit}: {ratio:.2f}x "
              f"(goal <= 1.10)", flush=True)
    return {"framework": framework, "where": label, "rows": rows, "median_abs_error": med,
            "recommended_vs_best": ratio, "profile": profile.to_dict(), "calibration_runs": calibration_runs,
            "loadavg": os.getloadavg()}


def newest_calibration_runs() -> list[dict]:
    """What the calibration runs measured (the cache entry written last)."""
    from paicli.cluster.pluto.calibrate import cache_path
    from paicli.store import pai_home

    try:
        entries = json.loads(cache_path(pai_home()).read_text()).values()
        return max(entries, key=lambda e: e.get("saved", 0)).get("runs") or []
    except (OSError, ValueError):
        return []


def with_cluster(rate: str | None, body, hosts: int = HOSTS, tell: bool = True):
    """Run body() with PAI_NODES set to a fresh test cluster of `hosts` hosts limited
    to `rate` (or on this machine when rate is None), in a PAI_HOME of its own,
    removed afterwards unless PAI_BENCH_KEEP=1 (to look at the jobs the lines name).
    tell=False: Pluto is not told the rate or the shared cores (it measures the links
    and reads the hosts' boot ids)."""
    import shutil

    home = Path(tempfile.mkdtemp(prefix="pai-bench-pluto-"))
    os.environ["PAI_HOME"] = str(home)
    try:
        return _in_cluster(rate, body, home, hosts, tell)
    finally:
        store = _STORES.pop(str(home), None)
        if store is not None:
            store.close()
        if os.environ.get("PAI_BENCH_KEEP") != "1":
            shutil.rmtree(home, ignore_errors=True)
        else:
            print(f"   jobs kept in PAI_HOME={home}", flush=True)


def _in_cluster(rate: str | None, body, home: Path, hosts: int = HOSTS, tell: bool = True):
    os.environ.pop("PAI_NODES", None)
    if rate is None:
        return body("this machine (loopback, not shaped)")
    from netns import TestCluster, can_build

    reason = can_build()
    if reason:
        raise SystemExit(f"cannot build the test cluster: {reason}; use --local")
    with TestCluster(prefix="eplu", hosts=hosts, subnet="10.213.44") as cluster:
        cluster.rate_limit(rate)
        # netns' tbf bucket (256 KB) lets a small step through unshaped: re-shape honestly
        from test_pluto_shaping import shape_links
        shape_links(cluster, rate)
        # told: one core a host (cpu 100); not told: each host reports its cores, as placement counts them
        nodes = cluster.write_nodes_file(home / "nodes.yaml", **({"cpu": 100} if tell else {}))
        os.environ["PAI_NODES"] = str(nodes)
        if tell:
            os.environ["PAI_PLUTO_BANDWIDTH"] = rate
            os.environ["PAI_PLUTO_SHARED_CORES"] = str(len(os.sched_getaffinity(0)))
        try:
            return body(f"{hosts} hosts at {rate}")
        finally:
            for key in ("PAI_NODES", "PAI_PLUTO_BANDWIDTH", "PAI_PLUTO_SHARED_CORES"):
                os.environ.pop(key, None)


def cmd_grid(args) -> None:
    global MXNET_ASYNC
    MXNET_ASYNC = args.mxnet_async
    results = []
    rates = [None] if args.local else args.rates.split(",")
    for rate in rates:
        for framework in args.frameworks.split(","):
            def one(label, fw=framework):
                try:
                    return bench_framework(fw, label)
                except Exception as err:   # report it and go on with the next framework
                    print(f"   {fw} failed: {err}", flush=True)
                    return {"framework": fw, "where": label, "rows": [], "median_abs_error": None,
                            "recommended_vs_best": None, "error": str(err)}
            results.append(with_cluster(rate, one))
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print("\n== summary")
    for r in results:
        med = r["median_abs_error"]
        ratio = r["recommended_vs_best"]
        print(f"{r['framework']:10s} {r['where']:36s} median |error| "
              f"{'n/a' if med is None else f'{med:.1%}'}  recommended/best "
              f"{'n/a' if ratio is None else f'{ratio:.2f}x'}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


def cmd_proof(args) -> None:
    """-DautoStrategy=true against the default plan (1 ps), same script, same step
    target, one after the other in one run."""
    def body(label):
        out = []
        for framework in args.frameworks.split(","):
            factor = args.steps_factor or PROOF_STEPS_FACTOR[framework]
            # Caffe's step target is the solver's max_iter: an archive of its own
            base = base_tokens(framework, caffe_iters=CAFFE_ITERS * factor, caffe_batch=args.caffe_batch)
            workers = args.tf_workers if framework == "tensorflow" else 2
            if framework == "tensorflow":
                base = [t for t in base if not t.startswith("-Dcluster=")] + \
                    ['-Dcluster={"ps":{"count":1},"worker":{"count":%d}}' % workers]
            # more steps than the grid's, so that training, not start-up, dominates
            steps = [a.replace(f"--steps={n}", f"--steps={factor * n}")
                     for a in steps_args(framework, workers)
                     for n in [STEPS_PER_WORKER * (workers if framework == "tensorflow" else 1)]]
            print(f"\n== proof: {framework} on {label}, {factor}x the grid's steps"
                  + (f", Caffe batch {args.caffe_batch}" if framework == "caffe" and args.caffe_batch else ""),
                  flush=True)
            auto_id, auto_s, auto_status, auto_wall = run_job(base + steps + ["-DautoStrategy=true"])
            default_id, default_s, default_status, default_wall = run_job(base + steps)
            # the calibration is cached by the first run: time the auto run again without it
            auto2_id, auto2_s, auto2_status, auto2_wall = run_job(base + steps + ["-DautoStrategy=true"])
            from paicli.cluster.pluto.view import record
            plan = record(the_store().job(auto2_id)["job_dir"]) or {}
            speed = default_wall / auto2_wall if auto2_wall else None
            train_default, train_auto = training_seconds(default_id), training_seconds(auto2_id)
            mean_default, mean_auto = mean_step_seconds(default_id), mean_step_seconds(auto2_id)
            print(f"   default 1 ps : {default_wall:6.1f}s submit to end, {train_default or float('nan'):6.1f}s "
                  f"first to last step, {default_s or float('nan'):.4f} s/step (mean {mean_default or float('nan'):.4f}) "
                  f"({default_status}, loss falls: {losses_fall(default_id)}) {default_id}")
            print(f"   autoStrategy : {auto2_wall:6.1f}s submit to end, {train_auto or float('nan'):6.1f}s "
                  f"first to last step, {auto2_s or float('nan'):.4f} s/step (mean {mean_auto or float('nan'):.4f}) "
                  f"({auto2_status}, loss falls: {losses_fall(auto2_id)}) {auto2_id}; plan: {plan.get('label')}, "
                  f"forecast {plan.get('forecast_step_s')}")
            print(f"   speed-up to the step target: {speed:.2f}x submit to end, "
                  f"{(train_default / train_auto) if train_default and train_auto else float('nan'):.2f}x "
                  f"training (goal >= 1.5x); the first autoStrategy submit (calibrating) took {auto_wall:.1f}s",
                  flush=True)
            out.append({"framework": framework, "where": label, "steps_factor": factor,
                        "caffe_batch": args.caffe_batch if framework == "caffe" else None,
                        "default": {"job": default_id, "step_s": default_s, "mean_step_s": mean_default,
                                    "wall_s": default_wall,
                                    "training_s": train_default, "status": default_status,
                                    "loss_falls": losses_fall(default_id)},
                        "auto": {"job": auto2_id, "step_s": auto2_s, "mean_step_s": mean_auto, "wall_s": auto2_wall,
                                 "training_s": train_auto, "status": auto2_status,
                                 "loss_falls": losses_fall(auto2_id)},
                        "first_auto_wall_s": auto_wall, "plan": plan, "speedup": speed,
                        "training_speedup": (train_default / train_auto) if train_default and train_auto else None,
                        "loadavg": os.getloadavg()})
            if args.json:
                Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        return out
    with_cluster(None if args.local else args.rate, body)


def cmd_table(args) -> None:
    """Markdown rows of saved grid results (docs/pluto.md)."""
    for path in args.files:
        for r in json.loads(Path(path).read_text()):
            print(f"\n{r['framework']} on {r['where']}: median |error| "
                  f"{r['median_abs_error']:.1%}, recommended / best measured "
                  f"{(r['recommended_vs_best'] or float('nan')):.2f}x\n")
            print("| plan | forecast s/step | measured s/step | error |")
            print("| --- | --- | --- | --- |")
            for row in r["rows"]:
                mark = " (recommended)" if row["recommended"] else ""
                measured = row["measured_s"]
                print(f"| {row['config']}{mark} | {row['forecast_s']:.4f} | "
                      f"{'n/a' if measured is None else f'{measured:.4f}'} | "
                      f"{'n/a' if row['error'] is None else format(row['error'], '+.0%')} |")


# -- held-out: scripts and shapes the model was not fitted on ------------------------------

HELD_MX = ROOT / "examples" / "pluto" / "heldout_mxnet.py"
HELD_TF = ROOT / "examples" / "pluto" / "heldout_tf.py"
HELDOUT_STEPS = 24      # per worker (TF: times the workers, its target counts global steps)
# name, framework, script, its arguments, default servers/ps, workers, hosts, link rate
HELDOUT = (
    ("mxnet deep MLP (6 x 512)", "mxnet", HELD_MX, "--model=deep", 1, 2, 3, "100mbit"),
    ("tf wide MLP (2 x 900)", "tensorflow", HELD_TF, "--model=wide", 1, 2, 3, "100mbit"),
    ("mxnet embedding (20000 x 96)", "mxnet", HELD_MX, "--model=embed --vocab=20000", 1, 2, 4, "100mbit"),
    ("mxnet embedding, 3 servers", "mxnet", HELD_MX, "--model=embed --vocab=20000", 3, 2, 3, "100mbit"),
    ("mxnet conv net", "mxnet", HELD_MX, "--model=conv", 1, 3, 3, "1gbit"),
    ("tf conv net", "tensorflow", HELD_TF, "--model=conv", 1, 3, 4, "1gbit"),
    ("mxnet wider MLP (3 x 900), 4 workers", "mxnet", HELD_MX, "--model=deep --depth=3 --width=900", 2, 4, 4, "1gbit"),
)


def held_tokens(framework: str, script: Path, script_args: str, ps: int, workers: int, params: dict | None = None,
                cluster: dict | None = None) -> list[str]:
    role = "server" if framework == "mxnet" else "ps"
    cluster = cluster or {role: {"count": ps}, "worker": {"count": workers}}
    steps = HELDOUT_STEPS * (cluster["worker"]["count"] if framework == "tensorflow" else 1)
    params = dict(params or {})
    own = f"{script_args} --steps={steps}"
    # a plan's own script flags come after the user's arguments (planner.apply_scaling)
    extra = params.pop("userDefinedParameters", "")
    if extra.startswith(script_args):
        extra = extra[len(script_args):]
    tokens = ["-name", framework, f"-Dscript={script}", f"-Dcluster={json.dumps(cluster, separators=(',', ':'))}",
              f"-DuserDefinedParameters={own} {extra}".rstrip()]
    return tokens + [f"-D{k}={v}" for k, v in params.items()]


def heldout_case(case, label: str) -> dict:
    """One held-out case: `pai plan` without verification (the model's own forecast),
    then measured: the default plan, the recommended one, the runner-up, and the plan
    the links favour (least forecast communication with the same workers: is any
    plan 1.5x faster?); then `pai plan` with verification (calibration cached) and its
    recommendation measured too when it is another plan."""
    from paicli.pluto import make_plan
    from paicli.statement import parse_statement

    name, framework, script, script_args, ps, workers, _hosts, _rate = case
    print(f"\n== held-out: {name}, {ps} {'server' if framework == 'mxnet' else 'ps'} + {workers} workers "
          f"by default, on {label}", flush=True)
    t0 = time.monotonic()
    statement = held_tokens(framework, script, script_args, ps, workers)
    say = lambda line: print(f"   {line}", flush=True)   # noqa: E731
    result = make_plan(parse_statement(statement), store=the_store(), say=say, **VERIFY_OFF)
    profile = result.profile
    print(f"   planned in {time.monotonic() - t0:.0f}s on {result.cluster.source}: model "
          f"{profile.param_bytes / 1e6:.2f} MB ({len(profile.var_bytes)} arrays), "
          f"{profile.compute_s_per_sample * 1e3:.3f} ms/sample, fan-in {profile.fanin_s * 1e3:.1f} ms, "
          f"per ps {profile.per_ps_s * 1e3:.1f} ms; calibration runs: "
          + ", ".join(f"{r.get('ps')}+{r.get('workers')}: {r.get('step_s') or float('nan'):.4f}s"
                      for r in newest_calibration_runs()), flush=True)
    plan = result.plan
    rec, default = plan.recommended, plan.default
    everything = [rec, *plan.alternatives]
    same_work = [c for c in everything if profile.target_global or c.strategy.workers == default.strategy.workers]
    links = min(same_work, key=lambda c: (c.forecast.comm_s, c.score()), default=None)
    runner_up = next((c for c in plan.alternatives if _key(c) not in {_key(default), _key(rec)}), None)
    picks = [("default", default), ("recommended", rec), ("runner-up", runner_up), ("links' best", links)]
    rows: list[dict] = []
    measured_by_key: dict[str, dict] = {}
    for role, choice in picks:
        if choice is None:
            continue
        if _key(choice) in measured_by_key:
            print(f"   {role:12s} = {measured_by_key[_key(choice)]['role']}", flush=True)
            if role == "recommended":
                rows.append({**measured_by_key[_key(choice)], "role": f"recommended (= {measured_by_key[_key(choice)]['role']})"})
            continue
        row = measure_choice(framework, script, script_args, ps, workers, choice.to_json(), role, name, label,
                             profile.target_global)
        measured_by_key[_key(choice)] = row
        rows.append(row)
    verified = None
    if VERIFY_OFF:   # the same plan as `pai plan` gives it by default: checked by short runs
        t1 = time.monotonic()
        checked = make_plan(parse_statement(statement), store=the_store(), say=say, verify=True)
        verified = checked.plan.recommended
        print(f"   verified plan in {time.monotonic() - t1:.0f}s: {verified.strategy.label()} "
              f"({verified.figure()} {verified.step_s():.4f}s); verification {checked.verification}", flush=True)
        if _key(verified) in measured_by_key:
            rows.append({**measured_by_key[_key(verified)], "role": "verified recommendation (measured above)"})
        else:
            row = measure_choice(framework, script, script_args, ps, workers, verified.to_json(),
                                 "verified recommendation", name, label, profile.target_global)
            measured_by_key[_key(verified)] = row
            rows.append(row)
    base = rows[0]["per_target_s"]
    if ALL_PLANS and default.forecast.bottleneck == "network" and base and \
            not any(r["per_target_s"] and base / r["per_target_s"] >= 1.5 for r in rows):
        # No plan measured so far is 1.5x the default: does ANY plan reach it? The bench
        # is the ground truth: measure every other candidate (the goal applies only if one does).
        others = [c for c in everything if _key(c) not in measured_by_key][:ALL_PLANS_CAP]
        print(f"   no measured plan reaches 1.5x: measuring the {len(others)} other candidates", flush=True)
        for choice in others:
            row = measure_choice(framework, script, script_args, ps, workers, choice.to_json(), "candidate",
                                 name, label, profile.target_global)
            measured_by_key[_key(choice)] = row
            rows.append(row)
    by_role = {r["role"].split(" (")[0]: r for r in rows}
    speed = lambda r: (base / r["per_target_s"]) if r and base and r["per_target_s"] else None  # noqa: E731
    best = min((r["per_target_s"] for r in rows if r["per_target_s"]), default=None)
    comm_bound = default.forecast.bottleneck == "network"
    out = {"case": name, "where": label, "rows": rows, "comm_bound": comm_bound,
           "speedup": speed(by_role.get("recommended")),
           "verified_speedup": speed(by_role.get("verified recommendation")),
           "best_speedup": (base / best) if best and base else None,
           "profile": profile.to_dict(), "calibration_runs": newest_calibration_runs(),
           "source": result.cluster.source, "loadavg": os.getloadavg()}
    print(f"   measured vs default: recommended {out['speedup'] or float('nan'):.2f}x, verified recommendation "
          f"{out['verified_speedup'] or float('nan'):.2f}x, best measured {out['best_speedup'] or float('nan'):.2f}x; "
          f"communication-bound: {comm_bound}", flush=True)
    return out


def measure_choice(framework, script, script_args, ps, workers, data: dict, role: str, name: str, label: str,
                   target_global: bool) -> dict:
    tokens = held_tokens(framework, script, script_args, ps, workers, data["params"], data["cluster"])
    job_id, measured, status, wall = run_job(tokens)
    err = (data["forecast_step_s"] - measured) / measured if measured else None
    per_target = measured / data["cluster"]["worker"]["count"] if measured and target_global else measured
    print(f"   {role:12s} {data['label']:44s} forecast {data['forecast_step_s']:8.4f}s  measured "
          f"{(measured or float('nan')):8.4f}s  error {(err if err is not None else float('nan')):+6.0%}  "
          f"{status} {job_id} ({wall:.0f}s)", flush=True)
    return {"case": name, "role": role, "plan": data["label"], "forecast_s": data["forecast_step_s"],
            "measured_s": measured, "error": err, "per_target_s": per_target, "status": status,
            "job": job_id, "wall_s": wall, "bottleneck": data["bottleneck"], "where": label,
            "loadavg": os.getloadavg()[0]}


VERIFY_OFF: dict = {}   # make_plan's switch for the verification runs, when it has one
ALL_PLANS = False       # heldout --all-plans: measure every candidate where no pick reaches 1.5x
ALL_PLANS_CAP = 24


def _key(choice) -> str:
    data = choice.to_json()
    params = {k: v for k, v in data["params"].items() if k not in NOT_SPEED and (k, v) != ("kvstore", "dist_sync")}
    return json.dumps([data["cluster"], params], sort_keys=True)


def cmd_heldout(args) -> None:
    import inspect

    from paicli.pluto import make_plan

    if "verify" in inspect.signature(make_plan).parameters:
        VERIFY_OFF["verify"] = False   # the model's own forecast, not a measured plan
    global ALL_PLANS
    ALL_PLANS = args.all_plans
    wanted = [c for c in HELDOUT if not args.only or any(word in c[0] for word in args.only.split(","))]
    groups: dict[tuple[int, str], list] = {}
    for case in wanted:
        groups.setdefault((case[6], case[7]), []).append(case)
    results = []
    for (hosts, rate), cases in groups.items():
        def body(label, cases=cases):
            out = []
            for case in cases:
                try:
                    out.append(heldout_case(case, label))
                except Exception as err:   # report it and go on with the next case
                    print(f"   {case[0]} failed: {err}", flush=True)
                    out.append({"case": case[0], "where": label, "rows": [], "error": str(err)})
            return out
        results += with_cluster(rate, body, hosts=hosts, tell=False)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    heldout_summary(results)


def heldout_summary(results: list[dict]) -> None:
    rows = [r for res in results for r in res["rows"] if r.get("error") is not None and "(" not in r["role"]]
    errors = [abs(r["error"]) for r in rows]
    print("\n| case | where | plan | forecast s/step | measured s/step | error | bound by (forecast) | load |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        miss = " **miss**" if abs(r["error"]) > 0.25 else ""
        print(f"| {r['case']} | {r['where']} | {r['role']}: {r['plan']} | {r['forecast_s']:.4f} | "
              f"{r['measured_s']:.4f} | {r['error']:+.0%}{miss} | {r.get('bottleneck')} | "
              f"{r.get('loadavg') or float('nan'):.1f} |")
    if errors:
        print(f"\nmedian |error| {statistics.median(errors):.1%} (goal <= 10%), worst {max(errors):.1%} "
              f"(goal <= 25%) over {len(errors)} measured plans")
    for res in results:
        if res.get("comm_bound"):
            print(f"{res['case']}: communication-bound; recommended {res.get('speedup') or float('nan'):.2f}x the "
                  f"default, verified recommendation {res.get('verified_speedup') or float('nan'):.2f}x, best "
                  f"measured {res.get('best_speedup') or float('nan'):.2f}x (goal >= 1.5x where any plan is)")


def main() -> None:
    import signal

    # A SIGTERM tears the test cluster down like Ctrl-C does (its `with` block exits).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grid")
    g.add_argument("--rates", default="100mbit,1gbit")
    g.add_argument("--local", action="store_true")
    g.add_argument("--frameworks", default="tensorflow,mxnet,caffe")
    g.add_argument("--json")
    g.add_argument("--mxnet-async", action="store_true", help="add two dist_async rows to the MXNet grid")
    p = sub.add_parser("proof")
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--local", action="store_true")
    p.add_argument("--frameworks", default="tensorflow,mxnet,caffe")
    p.add_argument("--tf-workers", type=int, default=3, help="workers of the TF default plan (1 ps)")
    p.add_argument("--steps-factor", type=int, help="steps per worker (Caffe: iterations), times the grid's; "
                   "default per framework: " + ", ".join(f"{k} {v}" for k, v in PROOF_STEPS_FACTOR.items()))
    p.add_argument("--caffe-batch", type=int, help="Caffe: the training batch per worker (default: the net's 64)")
    p.add_argument("--json")
    h = sub.add_parser("heldout")
    h.add_argument("--only", help="comma-separated words: only the cases whose name has one")
    h.add_argument("--json")
    h.add_argument("--all-plans", action="store_true",
                   help="where the default is communication-bound and no measured plan is 1.5x faster, "
                        "measure every other candidate too (does any plan reach 1.5x?)")
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    ht = sub.add_parser("heldout-table", help="the held-out table and figures over saved --json files "
                        "(a run made in chunks with --only)")
    ht.add_argument("files", nargs="+")
    args = parser.parse_args()
    {"grid": cmd_grid, "proof": cmd_proof, "table": cmd_table, "heldout": cmd_heldout,
     "heldout-table": cmd_heldout_table}[args.cmd](args)


def cmd_heldout_table(args) -> None:
    """heldout_summary over the cases of several held-out --json files, in the order given."""
    heldout_summary([case for path in args.files for case in json.loads(Path(path).read_text())])


if __name__ == "__main__":
    main()
