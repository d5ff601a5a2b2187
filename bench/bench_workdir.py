"""The project folder to SSH nodes (-DworkDir, cluster/workdir.py) against `rsync -a`.

    flock /tmp/paicli-bench.lock .venv/bin/python bench/bench_workdir.py [--mb 50] [--files 2000] [--reps 3]

Builds its own SSH cluster of 2 hosts (tests/netns.py: network namespaces, one sshd
per host, private /tmp; needs root and rsync) and tears it down at the end. A
project folder of --files files, --mb MB in all (random bytes: nothing compresses),
and a two-worker job (one worker per node) whose script counts the folder's files:

1. First job: the wall time of the job from the folder, each node's cache emptied
   first, minus that of the same job with -DworkDir=none (only the script travels):
   what sending the folder costs a job (it sends to both nodes at once). Against
   `rsync -a` of the same folder to the same two nodes into emptied folders, one
   after the other and both at once. Runs alternate; medians and the ratios
   (goal <= 1.2).
2. Second job, one file changed: the bytes each node was sent (the job log's
   `workdir:` line) against the first job's (goal <= 5%).

Prints a table and a JSON line; the load average next to each figure (the machine
is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from netns import build_cluster, can_build  # noqa: E402

PAI = [sys.executable, "-m", "paicli"]
SCRIPT = ("import os\n"
          "count = sum(len(files) for _dir, _dirs, files in os.walk('.'))\n"
          "print('files', count, flush=True)\n")
TWO = '-Dcluster={"worker":{"count":2}}'
SENT = re.compile(r"workdir: (\S+): (\d+) file\(s\) sent \(([\d.]+) (bytes|KB|MB|GB)\), (\d+) already there")
UNITS = {"bytes": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def make_project(folder: Path, mb: int, files: int) -> None:
    """`files` files in 20 folders, `mb` MB in all: a tenth of them hold nine tenths
    of the bytes (data), the rest are small (code, configuration)."""
    total = mb * 1_000_000
    big = max(1, files // 10)
    sizes = [total * 9 // 10 // big] * big + [total // 10 // (files - big - 1)] * (files - big - 1)
    (folder / "train.py").parent.mkdir(parents=True, exist_ok=True)
    (folder / "train.py").write_text(SCRIPT)
    for n, size in enumerate(sizes):
        path = folder / f"part{n % 20:02d}" / f"f{n:05d}.bin"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(size))


def run_pai(args: list[str], cwd: Path, env: dict) -> tuple[float, subprocess.CompletedProcess]:
    began = time.monotonic()
    result = subprocess.run([*PAI, *args], cwd=str(cwd), env=env, capture_output=True, text=True, timeout=1800)
    took = time.monotonic() - began
    if result.returncode != 0:
        raise SystemExit(f"the job failed:\n{result.stdout[-3000:]}\n{result.stderr[-2000:]}")
    return took, result


def sent_bytes(stdout: str) -> dict[str, float]:
    return {m.group(1): float(m.group(3)) * UNITS[m.group(4)] for m in SENT.finditer(stdout)}


def empty(cluster, path: str) -> None:
    for host in cluster.hosts:
        cluster.ssh(host.name, ["rm", "-rf", path])


def by_rsync(cluster, folder: Path, parallel: bool) -> float:
    """`rsync -a` to each node into an emptied folder: one after the other, or all at once."""
    empty(cluster, "/tmp/bench-rsync")
    began = time.monotonic()
    procs = []
    for host in cluster.hosts:
        ssh = (f"ssh -i {cluster.client_key} -o UserKnownHostsFile={cluster.known_hosts} -o BatchMode=yes "
               f"-p {host.port}")
        procs.append(subprocess.Popen(["rsync", "-a", "-e", ssh, f"{folder}/",
                                       f"{cluster.user}@{host.addr}:/tmp/bench-rsync/"]))
        if not parallel:
            procs[-1].wait(timeout=1800)
    if any(proc.wait(timeout=1800) for proc in procs):
        raise SystemExit("rsync failed")
    return time.monotonic() - began


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    if can_build():
        print(f"cannot build the cluster: {can_build()}")
        return 1
    if not shutil.which("rsync"):
        print("rsync is not installed (apt-get install rsync)")
        return 1
    from paicli.runners.runtimes import runtime_root

    work = Path(tempfile.mkdtemp(prefix="bench-workdir-"))
    cluster = build_cluster(hosts=2, prefix="pbw", first_subnet=220)
    try:
        proj = work / "proj"
        make_project(proj, args.mb, args.files)
        nodes = cluster.write_nodes_file(work / "nodes.yaml", cpu=100, runtime_dir=str(runtime_root()))
        env = {**os.environ, "PAI_HOME": str(work / "home"), "PAI_NODES": str(nodes), "NO_COLOR": "1",
               "PAI_LOGVIEW": "file"}
        cache = f"/tmp/paicli-{cluster.user}/.cache"
        run_pai(["-name", "python", "-Dscript=train.py", TWO, "-DworkDir=none"], proj, env)   # warm: runners, logins
        with_dir, without, rsync, rsync_par, first_sent = [], [], [], [], {}
        for _rep in range(args.reps):
            without.append(run_pai(["-name", "python", "-Dscript=train.py", TWO, "-DworkDir=none"], proj, env)[0])
            empty(cluster, cache)
            took, result = run_pai(["-name", "python", "-Dscript=train.py", TWO], proj, env)
            with_dir.append(took)
            first_sent = sent_bytes(result.stdout)
            if result.stdout.count(f"files {args.files}") != 2:
                raise SystemExit(f"the workers did not see {args.files} files:\n{result.stdout[-2000:]}")
            rsync.append(by_rsync(cluster, proj, parallel=False))
            rsync_par.append(by_rsync(cluster, proj, parallel=True))
        changed = next(proj.glob("part00/*.bin"))
        changed.write_bytes(os.urandom(changed.stat().st_size))
        _took, second = run_pai(["-name", "python", "-Dscript=train.py", TWO], proj, env)
        second_sent = sent_bytes(second.stdout)
        cost = statistics.median(with_dir) - statistics.median(without)
        figures = {
            "mb": args.mb, "files": args.files, "reps": args.reps,
            "job_with_folder_s": round(statistics.median(with_dir), 2),
            "job_without_folder_s": round(statistics.median(without), 2),
            "folder_cost_s": round(cost, 2), "rsync_s": round(statistics.median(rsync), 2),
            "ratio": round(cost / statistics.median(rsync), 2),
            "rsync_parallel_s": round(statistics.median(rsync_par), 2),
            "ratio_parallel": round(cost / statistics.median(rsync_par), 2),
            "first_sent_mb": {n: round(b / 1e6, 2) for n, b in first_sent.items()},
            "second_sent_mb": {n: round(b / 1e6, 3) for n, b in second_sent.items()},
            "second_share": round(sum(second_sent.values()) / sum(first_sent.values()), 4),
            "load": [round(x, 2) for x in os.getloadavg()],
        }
        print(f"{'':38} {'median s':>9}")
        print(f"{'job from the folder (cold cache)':38} {figures['job_with_folder_s']:>9}")
        print(f"{'same job, -DworkDir=none':38} {figures['job_without_folder_s']:>9}")
        print(f"{'sending the folder (difference)':38} {figures['folder_cost_s']:>9}")
        print(f"{'rsync -a to one node, then the other':38} {figures['rsync_s']:>9}")
        print(f"{'rsync -a to both nodes at once':38} {figures['rsync_parallel_s']:>9}")
        print(f"ratio {figures['ratio']} (goal <= 1.2), {figures['ratio_parallel']} to rsync at once; second job, one file changed: "
              f"{figures['second_share'] * 100:.2f}% of the first's bytes (goal <= 5%); load {figures['load']}")
        print(json.dumps(figures))
        return 0
    finally:
        cluster.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
