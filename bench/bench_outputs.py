"""A job's files coming back (issue 17): throughput against scp, the cost of the
checkpoint sync on step time, and `pai outputs` on 10,000 files.

    flock /tmp/paicli-bench.lock .venv/bin/python bench/bench_outputs.py [--runs 2] [--mb 1024]
        [--skip-scp] [--skip-sync] [--skip-list]

Builds its own SSH cluster (tests/netns.py: network namespaces, one sshd per host,
private /tmp; needs root) and tears it down at the end.

1. 1 GB back from an SSH node: a one-instance job writes one large file (half the
   size) and 1,000 small ones (the other half) into PAI_OUTPUT_DIR, prints the time
   and ends; the time from that line to the end of `pai` (the files written aside,
   checked and renamed here, the job recorded) against `scp -r` (OpenSSH) of the
   same files, made the same way on the same node, into a folder here. Runs
   alternate; medians and the throughput ratio (goal >= 0.8).
2. Step time with a 50 MB checkpoint written every 10 s and -DcheckpointSyncSeconds=10
   against the same job with -DcheckpointSyncSeconds=0 (written, never synced while
   it runs): the median step time of each (goal <= 3% slower).
3. `pai outputs ID` and `pai outputs ID --json` on a job with 10,000 files: the
   median wall time of 5 runs of the command (goal <= 0.3 s).

Prints a table and a JSON line; the load average next to each figure (the machine
is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from netns import build_cluster, can_build  # noqa: E402

PAI = [sys.executable, "-m", "paicli"]
SMALL = 1000

MAKE_FILES = r'''
import os, sys, time
root, total = sys.argv[1], int(sys.argv[2])
os.makedirs(os.path.join(root, "small"), exist_ok=True)
block = os.urandom(1 << 20)
with open(os.path.join(root, "large.bin"), "wb") as f:
    for _ in range(total // 2 // len(block)):
        f.write(block)
small = total // 2 // SMALL
for i in range(SMALL):
    with open(os.path.join(root, "small", f"f{i:04d}.bin"), "wb") as f:
        f.write(os.urandom(16) + block[:small - 16])
print(f"written {time.time():.6f}", flush=True)
'''.replace("SMALL", str(SMALL))

JOB_SCRIPT = "import os, sys\nsys.argv = ['make', os.environ['PAI_OUTPUT_DIR'], sys.argv[1]]\n" + MAKE_FILES

SYNC_SCRIPT = r'''
import argparse, os, time
p = argparse.ArgumentParser(); p.add_argument("--checkpointDir"); p.add_argument("--seconds", type=float)
a, _ = p.parse_known_args()
data, last, step, began = os.urandom(50 << 20), 0.0, 0, time.monotonic()
while time.monotonic() - began < a.seconds:
    t = time.perf_counter()
    x = 0
    for i in range(200_000):
        x += i * i
    if time.monotonic() - last >= 10:
        with open(os.path.join(a.checkpointDir, "model.ckpt.tmp"), "wb") as f:
            f.write(data)
        os.replace(os.path.join(a.checkpointDir, "model.ckpt.tmp"), os.path.join(a.checkpointDir, "model.ckpt"))
        last = time.monotonic()
    step += 1
    print(f"step={step} step_time={time.perf_counter() - t:.6f}", flush=True)
'''


def load() -> str:
    return "%.1f" % os.getloadavg()[0]


def env_for(home: Path, nodes_file: Path) -> dict:
    return {**os.environ, "PAI_HOME": str(home), "PAI_NODES": str(nodes_file), "NO_COLOR": "1",
            "PAI_LOGVIEW": "file"}


def through_pai(nodes_file: Path, work: Path, total: int) -> float:
    home = Path(tempfile.mkdtemp(prefix="bench-out-"))
    try:
        result = subprocess.run([*PAI, "-name", "python", "-Dscript=job.py", '-Dcluster={"worker":{"count":1}}',
                                 f"-DuserDefinedParameters={total}"], cwd=work, env=env_for(home, nodes_file),
                                capture_output=True, text=True, timeout=1800)
        ended = time.time()
        if result.returncode != 0:
            raise SystemExit(f"the job failed:\n{result.stdout[-3000:]}\n{result.stderr[-2000:]}")
        written = float(result.stdout.split("written ", 1)[1].split()[0])
        got = sum(p.stat().st_size for p in (home / "jobs").rglob("*.bin"))
        if got != (total // 2 // (1 << 20)) * (1 << 20) + SMALL * (total // 2 // SMALL):
            raise SystemExit(f"{got} bytes came back, not the {total} written")
        return ended - written
    finally:
        shutil.rmtree(home, ignore_errors=True)


def by_scp(cluster, host, total: int) -> float:
    src = "/tmp/bench-outputs-src"
    made = cluster.ssh(host.name, ["python3", "-c", MAKE_FILES, src, str(total)], timeout=600)
    if made.returncode != 0:
        raise SystemExit(made.stderr)
    dest = Path(tempfile.mkdtemp(prefix="bench-scp-"))
    try:
        started = time.time()
        subprocess.run(["scp", "-q", "-r", "-i", str(cluster.client_key), "-o",
                        f"UserKnownHostsFile={cluster.known_hosts}", "-o", "BatchMode=yes", "-P", str(host.port),
                        f"{cluster.user}@{host.addr}:{src}", str(dest)], check=True, timeout=1800)
        return time.time() - started
    finally:
        shutil.rmtree(dest, ignore_errors=True)
        cluster.ssh(host.name, ["rm", "-rf", src])


def outputs_vs_scp(cluster, nodes_file: Path, runs: int, total: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-work-"))
    (work / "job.py").write_text(JOB_SCRIPT)
    pai_s, scp_s = [], []
    try:
        for run in range(runs):
            pai_s.append(through_pai(nodes_file, work, total))
            scp_s.append(by_scp(cluster, cluster.hosts[0], total))
            print(f"run {run + 1}: pai {pai_s[-1]:.2f}s, scp -r {scp_s[-1]:.2f}s (load {load()})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mb = total / (1 << 20)
    pai_rate, scp_rate = mb / statistics.median(pai_s), mb / statistics.median(scp_s)
    return {"mb": mb, "pai_s": pai_s, "scp_s": scp_s, "pai_mb_s": round(pai_rate, 1),
            "scp_mb_s": round(scp_rate, 1), "ratio": round(pai_rate / scp_rate, 2)}


def step_times(nodes_file: Path, sync: int, seconds: float) -> float:
    home = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    work = Path(tempfile.mkdtemp(prefix="bench-syncw-"))
    (work / "sync.py").write_text(SYNC_SCRIPT)
    try:
        result = subprocess.run([*PAI, "-name", "python", "-Dscript=sync.py", '-Dcluster={"worker":{"count":1}}',
                                 f"-DcheckpointDir={work / 'ckpt'}", f"-DcheckpointSyncSeconds={sync}",
                                 f"-DuserDefinedParameters=--seconds {seconds}"], cwd=work,
                                env=env_for(home, nodes_file), capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise SystemExit(f"the job failed:\n{result.stdout[-3000:]}\n{result.stderr[-2000:]}")
        times = [float(line.rsplit("=", 1)[1]) for line in result.stdout.splitlines() if "step_time=" in line]
        return statistics.median(times[5:])
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def sync_overhead(nodes_file: Path, runs: int, seconds: float) -> dict:
    synced, plain = [], []
    for run in range(runs):
        synced.append(step_times(nodes_file, 10, seconds))
        plain.append(step_times(nodes_file, 0, seconds))
        print(f"run {run + 1}: step {synced[-1] * 1000:.2f} ms with sync, {plain[-1] * 1000:.2f} ms without"
              f" (load {load()})", flush=True)
    s, p = statistics.median(synced), statistics.median(plain)
    return {"sync_ms": round(s * 1000, 3), "plain_ms": round(p * 1000, 3), "slower_pct": round((s / p - 1) * 100, 2)}


def list_ten_thousand() -> dict:
    home = Path(tempfile.mkdtemp(prefix="bench-list-"))
    env = {**os.environ, "PAI_HOME": str(home), "NO_COLOR": "1", "PAI_LOGVIEW": "file"}
    code = ("from paicli.store import Store; from pathlib import Path; s = Store(); "
            "s.create_job('j10k', name='big', framework='python', project=None, task_name='T', "
            "job_dir=Path(s.jobs_dir) / 'j10k', roles=[{'name': 'worker', 'count': 1, 'must_finish': True}]); "
            "s.add_outputs([('j10k', f'worker:{i % 4}', f'/w/out/file-{i:05d}.bin', 1000 + i, "
            "1700000000000000000, 'ab' * 32, 'here', 'h1', None, None) for i in range(10000)])")
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    out = {}
    try:
        for args in (["outputs", "j10k"], ["outputs", "j10k", "--json"]):
            times = []
            for _ in range(5):
                started = time.monotonic()
                subprocess.run([*PAI, *args], env=env, check=True, stdout=subprocess.DEVNULL)
                times.append(time.monotonic() - started)
            out[" ".join(args[:1] + args[2:])] = round(statistics.median(times), 3)
            print(f"pai {' '.join(args)}: median {out[' '.join(args[:1] + args[2:])]:.3f}s (load {load()})")
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--mb", type=int, default=1024, help="megabytes of outputs (half one file, half 1,000)")
    parser.add_argument("--sync-seconds", type=float, default=40.0, help="how long each step-time job runs")
    parser.add_argument("--skip-scp", action="store_true")
    parser.add_argument("--skip-sync", action="store_true")
    parser.add_argument("--skip-list", action="store_true")
    args = parser.parse_args()
    results: dict = {}
    if not args.skip_list:
        results["outputs_10k_s"] = list_ten_thousand()
    if not (args.skip_scp and args.skip_sync):
        reason = can_build()
        if reason:
            raise SystemExit(f"needs network namespaces: {reason}")
        cluster = build_cluster(hosts=1, prefix="pbo", first_subnet=180)
        try:
            from paicli.runners.runtimes import runtime_root

            nodes_file = cluster.write_nodes_file(Path(cluster.state) / "nodes.yaml", cpu=100,
                                                  runtime_dir=str(runtime_root()))
            if not args.skip_scp:
                results["outputs_vs_scp"] = outputs_vs_scp(cluster, nodes_file, args.runs, args.mb << 20)
            if not args.skip_sync:
                results["checkpoint_sync"] = sync_overhead(nodes_file, args.runs, args.sync_seconds)
        finally:
            cluster.close()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
