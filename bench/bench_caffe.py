#!/usr/bin/env python3
"""Caffe benchmarks: LeNet iterations/s through `pai` vs `caffe train` by hand, and
the model-averaging job's time per averaging round.

    .venv/bin/python bench/bench_caffe.py                    # both, 5 pairs for the first
    .venv/bin/python bench/bench_caffe.py --reps 9 --json out.json
    .venv/bin/python bench/bench_caffe.py rate               # only 1.
    .venv/bin/python bench/bench_caffe.py averaging          # only 2.

1. Iterations/s of the LeNet example (examples/caffe/lenet, data generated into a
   temporary copy) with one worker, no testing or snapshots during the run:
     pai   `pai -name caffe -Dsolver=...` attached, stdout on a pipe read here;
     hand  the Caffe runtime's `caffe train --solver=...` in the same folder.
   The rate is read from Caffe's own glog timestamps in both arms: iterations
   between the first and last display line over the time between them (start-up
   is not training speed). Arms alternate so that load drift hits both alike;
   the figure is the median of the per-pair ratios pai/hand. Goal >= 0.95.
   Beside it, the same ratio by iterations per CPU second of the caffe process
   (the runner's wait4 figure vs this script's RUSAGE_CHILDREN), which load on the
   shared machine moves far less. Both arms get OPENBLAS_NUM_THREADS=1 by default.
2. 1 ps + 2 workers, -DmaPeriod=20: the ps's own summary (time per round from the
   first worker's arrival to the average sent back, mostly waiting for the slower
   worker), the median time the ps spends averaging, and the median of the
   workers' `exchange took X ms` (send, wait for the slower worker, receive).

The Caffe runtime must be installed (`pai runtime install caffe`). The machine is
shared (2 cores): every figure comes with os.getloadavg() before and after.
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

REPO = Path(__file__).resolve().parents[1]
LENET = REPO / "examples" / "caffe" / "lenet"
PAI = [sys.executable, "-m", "paicli"]
GLOG_TIME = re.compile(r"I\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*\] Iteration (\d+)(?: \(|, loss)")


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


def prepare(workdir: Path, max_iter: int) -> Path:
    from paicli.runners.runtimes import get_runtime
    runtime = get_runtime("caffe")
    if not runtime.is_installed():
        sys.exit("the Caffe runtime is not installed: run `pai runtime install caffe` first")
    folder = workdir / "lenet"
    shutil.copytree(LENET, folder, ignore=shutil.ignore_patterns("data", "snapshots"))
    subprocess.run([runtime.python(), str(folder / "make_data.py")], check=True)
    text = (folder / "lenet_solver.prototxt").read_text()
    for name, value in (("max_iter", max_iter), ("test_interval", 100000), ("snapshot", 0),
                        ("display", 20)):
        text = re.sub(rf"^{name}:.*$", f"{name}: {value}", text, flags=re.M)
    text += "snapshot_after_train: false\ntest_initialization: false\n"
    (folder / "bench_solver.prototxt").write_text(text)
    return folder


def rate_from(lines: list[str]) -> float:
    """Iterations per second between Caffe's first and last display lines."""
    points = []
    for line in lines:
        match = GLOG_TIME.search(line)
        if match:
            h, m, s, it = match.groups()
            points.append((int(h) * 3600 + int(m) * 60 + float(s), int(it)))
    if len(points) < 2:
        raise RuntimeError("fewer than two Iteration lines: " + " | ".join(lines[-5:]))
    (t0, i0), (t1, i1) = points[0], points[-1]
    if t1 < t0:  # past midnight
        t1 += 86400
    return (i1 - i0) / (t1 - t0)


CPU_LINE = re.compile(r"exited with 0: CPU ([\d.]+) s")


def run_hand(folder: Path) -> tuple[float, float, float]:
    """(iterations/s by glog time, wall seconds, CPU seconds of `caffe train`)."""
    import resource
    from paicli.runners.runtimes import get_runtime
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    # Its own session, like a terminal's and like every `pai` instance: with the kernel's
    # autogroup scheduling a session is a scheduling group, so on a loaded machine a
    # process sharing this script's session would get a smaller share than pai's.
    proc = subprocess.run([get_runtime("caffe").caffe(), "train", "--solver=bench_solver.prototxt"],
                          cwd=folder, capture_output=True, text=True, start_new_session=True,
                          env=dict(os.environ, GLOG_logtostderr="1"))
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return rate_from(proc.stderr.splitlines()), wall, cpu


def run_pai(folder: Path, home: Path, *extra: str) -> tuple[list[str], float]:
    started = time.monotonic()
    proc = subprocess.run([*PAI, "-name", "caffe", f"-Dsolver={folder}/bench_solver.prototxt", *extra],
                          capture_output=True, text=True, env=dict(os.environ, PAI_HOME=str(home), NO_COLOR="1"))
    wall = time.monotonic() - started
    lines = proc.stdout.splitlines()
    if proc.returncode != 0:
        raise RuntimeError("\n".join(lines[-10:]) + proc.stderr[-2000:])
    return lines, wall


def bench_rate(workdir: Path, reps: int, max_iter: int) -> dict:
    folder = prepare(workdir, max_iter)
    before = load()
    pairs = []
    for rep in range(reps):
        arms = ("hand", "pai") if rep % 2 == 0 else ("pai", "hand")
        got = {}
        for arm in arms:
            if arm == "hand":
                got["hand"] = run_hand(folder)
            else:
                lines, wall = run_pai(folder, workdir / f"home-{rep}")
                worker = [x for x in lines if x.startswith("[worker:0]")]
                cpu = next(float(m.group(1)) for x in worker for m in [CPU_LINE.search(x)] if m)
                got["pai"] = (rate_from(worker), wall, cpu)
        ratio = got["pai"][0] / got["hand"][0]
        cpu_ratio = got["hand"][2] / got["pai"][2]  # iterations per CPU second, pai / hand
        pairs.append({"pai_iter_s": got["pai"][0], "hand_iter_s": got["hand"][0], "ratio": ratio,
                      "pai_wall_s": got["pai"][1], "hand_wall_s": got["hand"][1],
                      "pai_cpu_s": got["pai"][2], "hand_cpu_s": got["hand"][2], "cpu_ratio": cpu_ratio})
        print(f"  pair {rep + 1}: pai {got['pai'][0]:.1f} iter/s ({got['pai'][1]:.1f} s wall, "
              f"{got['pai'][2]:.2f} s CPU), hand {got['hand'][0]:.1f} iter/s ({got['hand'][1]:.1f} s wall, "
              f"{got['hand'][2]:.2f} s CPU), ratio {ratio:.3f}, per-CPU-second ratio {cpu_ratio:.3f}", flush=True)
    ratio = statistics.median(p["ratio"] for p in pairs)
    cpu_ratio = statistics.median(p["cpu_ratio"] for p in pairs)
    print(f"1. LeNet, 1 worker, {max_iter} iterations: median ratio pai/hand = {ratio:.3f} by iterations/s, "
          f"{cpu_ratio:.3f} by iterations per CPU second of caffe (goal >= 0.95); {before} -> {load()}")
    return {"ratio_median": ratio, "cpu_ratio_median": cpu_ratio, "pairs": pairs,
            "load_before": before, "load_after": load()}


def bench_averaging(workdir: Path, max_iter: int, period: int) -> dict:
    folder = prepare(workdir / "avg", max_iter)
    before = load()
    lines, wall = run_pai(folder, workdir / "home-avg", f"-DmaPeriod={period}",
                          '-Dcluster={"ps":{"count":1},"worker":{"count":2}}')
    summary = next((x for x in lines if "model averaging done:" in x), "")
    per_round = re.search(r"(\d+) rounds, ([\d.]+) ms per round", summary)
    exchanges = [float(m.group(1)) for x in lines for m in [re.search(r"exchange took ([\d.]+) ms", x)] if m]
    averaging = [float(m.group(1)) for x in lines for m in [re.search(r"averaged in ([\d.]+) ms", x)] if m]
    result = {
        "rounds": int(per_round.group(1)) if per_round else None,
        "ps_ms_per_round": float(per_round.group(2)) if per_round else None,
        "worker_exchange_ms_median": round(statistics.median(exchanges), 1) if exchanges else None,
        "ps_average_ms_median": round(statistics.median(averaging), 2) if averaging else None,
        "wall_s": wall, "load_before": before, "load_after": load(),
    }
    print(f"2. LeNet, 1 ps + 2 workers, maPeriod {period}, {max_iter} iterations: {result['rounds']} rounds, "
          f"{result['ps_ms_per_round']} ms per round at the ps, worker exchange median "
          f"{result['worker_exchange_ms_median']} ms, averaging itself {result['ps_average_ms_median']} ms, "
          f"{wall:.1f} s wall; {before} -> {load()}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", default="all", choices=("all", "rate", "averaging"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--ma-period", type=int, default=20)
    parser.add_argument("--json")
    parser.add_argument("--blas-threads", type=int, default=1,
                        help="OPENBLAS_NUM_THREADS for both arms (0: leave unset); one thread keeps "
                             "OpenBLAS's spinning threads from turning load into noise")
    args = parser.parse_args()
    if args.blas_threads:
        os.environ["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)
    out = {}
    with tempfile.TemporaryDirectory(prefix="bench-caffe-") as tmp:
        workdir = Path(tmp)
        if args.what in ("all", "rate"):
            out["rate"] = bench_rate(workdir, args.reps, args.iters)
        if args.what in ("all", "averaging"):
            out["averaging"] = bench_averaging(workdir, args.iters, args.ma_period)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
