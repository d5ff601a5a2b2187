#!/usr/bin/env python3
"""Ray backend benchmarks (issue 9): what a Ray cluster costs a user here.

Run from the repository root as root (it builds network namespaces), with Ray
installed in the project's venv (`pip install 'paicli[ray]'`):

    .venv/bin/python bench/bench_ray.py              # one run of each figure
    .venv/bin/python bench/bench_ray.py --json out.json

It starts its own 3-node Ray cluster (tests/ray_cluster.py: a head and two
workers, each `ray start` in its own network namespace, 1 CPU each, dashboard
off) and removes it at the end. Figures:

  1. `ray start` -> usable cluster: the head's `ray start`, each worker's, and
     from the head's start until the head sees every node alive AND a task has
     run (what a user waits before the first submit).
  2. Submit -> first step, one run each, the same job: a 1 ps + 2 worker plain
     Python job (examples/python/ps_worker.py, 30 steps) through `pai` on the
     Ray cluster (pai run on the head node, PAI_RAY_ADDRESS set) and through the
     local backend (no Ray). Time from starting `pai` to the first
     `[worker:N] step=` line on its stdout, and to its end.
  3. The JobMaster's peak RSS (VmHWM of /proc/<master pid>/status, sampled every
     50 ms until the master exits; the pid read from the job store) for both runs
     of 2: the Ray driver's cost inside the master. For comparison, a bare driver
     (import ray + ray.init on the head): seconds and peak RSS; and the RSS of the
     three idle Ray nodes.

The machine is shared (2 cores), so the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from ray_cluster import RayCluster, cannot_run  # noqa: E402

JOB = ["-name", "python", f"-Dscript={REPO}/examples/python/ps_worker.py",
       '-Dcluster={"ps":{"count":1},"worker":{"count":2}}', "-DuserDefinedParameters=--steps 30"]


def vm_hwm_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def master_pid(home: Path, deadline: float) -> int | None:
    """The master's pid from the job store, as soon as the CLI records it."""
    import sqlite3

    db = home / "pai.db"
    while time.monotonic() < deadline:
        if db.exists():
            try:
                with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
                    row = conn.execute("SELECT master_pid FROM jobs ORDER BY rowid DESC LIMIT 1").fetchone()
                if row and row[0]:
                    return int(row[0])
            except sqlite3.Error:
                pass
        time.sleep(0.02)
    return None


def run_job(argv: list[str], env: dict[str, str], home: Path) -> dict:
    """Start `pai` (argv), time the first worker step and the end, sample the
    master's peak RSS."""
    began = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=str(REPO))
    first_step: list[float] = []
    peak = {"kb": 0}

    def sample() -> None:
        pid = master_pid(home, time.monotonic() + 60)
        if pid is None:
            return
        while True:
            kb = vm_hwm_kb(pid)
            if kb is None:
                return
            peak["kb"] = max(peak["kb"], kb)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = []
    for line in proc.stdout:
        out.append(line)
        if not first_step and re.match(r"\[worker:\d+\] step=", line):
            first_step.append(time.monotonic() - began)
    err = proc.stderr.read()
    code = proc.wait()
    ended = time.monotonic() - began
    sampler.join(5)
    if code != 0:
        raise RuntimeError(f"the job failed ({code}): {''.join(out)[-2000:]}{err[-2000:]}")
    return {"first_step_s": round(first_step[0], 2) if first_step else None, "end_s": round(ended, 2),
            "master_peak_rss_mb": round(peak["kb"] / 1024, 1) if peak["kb"] else None}


def usable_cluster(cluster: RayCluster) -> dict:
    """Seconds from the head's `ray start` until a driver sees every node and ran a task."""
    began = time.monotonic()
    cluster.net.start()
    head = cluster.start_node(cluster.head.name)
    workers = [cluster.start_node(h.name) for h in cluster.net.hosts[1:]]
    code = ("import ray, logging; ray.init(address=%r, logging_level=logging.ERROR, log_to_driver=False); "
            "import time\n"
            "while sum(n['Alive'] for n in ray.nodes()) < %d: time.sleep(0.1)\n"
            "print(ray.get(ray.remote(lambda: 'ok').remote()))" % (cluster.address, len(cluster.net.hosts)))
    result = cluster.run([sys.executable, "-c", code], timeout=120)
    if "ok" not in result.stdout:
        raise RuntimeError(f"the cluster did not become usable: {result.stderr[-2000:]}")
    return {"ray_start_head_s": round(head, 2), "ray_start_worker_s": [round(w, 2) for w in workers],
            "start_to_usable_s": round(time.monotonic() - began, 2),
            "note": "includes building the namespaces (well under a second)"}


def cluster_memory(cluster: RayCluster) -> float:
    """MB of RSS of every process on the Ray nodes (the harness's sshd excluded), idle."""
    total = 0
    for host in cluster.net.hosts:
        for pid in cluster.ray_pids(host.name):
            try:
                with open(f"/proc/{pid}/status") as f:
                    total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
            except OSError:
                pass
    return round(total / 1024, 1)


def driver_cost(cluster: RayCluster) -> dict:
    """A bare Ray driver on the head: seconds to import Ray and to connect, its peak RSS."""
    code = ("import time; t0 = time.monotonic(); import ray, logging; t1 = time.monotonic(); "
            "ray.init(address=%r, logging_level=logging.ERROR, log_to_driver=False); t2 = time.monotonic(); "
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]; "
            "print(round(t1 - t0, 2), round(t2 - t1, 2), round(int(hwm) / 1024, 1))" % cluster.address)
    out = cluster.run([sys.executable, "-c", code], timeout=120).stdout.split()
    return {"import_ray_s": float(out[0]), "ray_init_s": float(out[1]), "driver_peak_rss_mb": float(out[2])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    reason = cannot_run()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    figures: dict = {"load_before": [round(x, 2) for x in os.getloadavg()]}
    cluster = RayCluster(prefix="fbench", subnet="10.213.19")
    try:
        figures["cluster"] = usable_cluster(cluster)
        print(f"ray start -> usable 3-node cluster: {figures['cluster']}", flush=True)
        time.sleep(5)
        figures["cluster_idle_rss_mb"] = cluster_memory(cluster)
        print(f"RSS of the 3 idle Ray nodes: {figures['cluster_idle_rss_mb']} MB", flush=True)
        figures["driver"] = driver_cost(cluster)
        print(f"a bare Ray driver: {figures['driver']}", flush=True)
        with tempfile.TemporaryDirectory(prefix="paicli-bench-ray-") as tmp:
            ray_home = Path(tmp) / "ray-home"
            env = dict(os.environ, PAI_HOME=str(ray_home), PAI_RAY_ADDRESS=cluster.address, NO_COLOR="1")
            env.pop("PAI_NODES", None)
            figures["ray"] = run_job(cluster.exec_argv([sys.executable, "-m", "paicli", *JOB]), env, ray_home)
            print(f"Ray backend (3 nodes): {figures['ray']}", flush=True)
            local_home = Path(tmp) / "local-home"
            env = dict(os.environ, PAI_HOME=str(local_home), NO_COLOR="1")
            env.pop("PAI_RAY_ADDRESS", None)
            env.pop("PAI_NODES", None)
            figures["local"] = run_job([sys.executable, "-m", "paicli", *JOB], env, local_home)
            print(f"local backend:         {figures['local']}", flush=True)
    finally:
        cluster.close()
    figures["load_after"] = [round(x, 2) for x in os.getloadavg()]
    r, loc = figures["ray"], figures["local"]
    print(f"submit -> first step: Ray {r['first_step_s']} s vs local {loc['first_step_s']} s "
          f"(+{r['first_step_s'] - loc['first_step_s']:.2f} s); master peak RSS: Ray {r['master_peak_rss_mb']} MB "
          f"vs local {loc['master_peak_rss_mb']} MB; load {figures['load_before']} -> {figures['load_after']}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
