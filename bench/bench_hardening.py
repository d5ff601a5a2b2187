#!/usr/bin/env python3
"""The launcher under progress bars, faults, load and a full disk.

    .venv/bin/python bench/bench_hardening.py bars        # a \\r progress bar through pai vs a pipe
    .venv/bin/python bench/bench_hardening.py overhead    # seconds pai adds to a 1 ps + 2 worker job
    .venv/bin/python bench/bench_hardening.py chaos       # SIGKILLs at 5% / 10% of instance-minutes
    .venv/bin/python bench/bench_hardening.py load        # 200 detached jobs at once; list/status at 10k jobs
    .venv/bin/python bench/bench_hardening.py diskfull    # a small tmpfs under the job folders (root)

  bars      300,000 redraws of a 100-character bar (\\r, no newline until the end) by
            tests/scripts/bar.py: into a plain pipe this script drains, and as a
            one-worker job through an attached `pai` whose stdout is a pipe. The bar's
            own time (it prints it) and the wall time, median of --reps; the master's
            peak RSS (VmHWM) ........................... ratio <= 1.2, master <= 60 MB
  overhead  bench_core.py's paired runs (pai vs the same three processes started by
            hand), reported as seconds added per pair, median ...... <= 0.25 s,
            and the ratio pai / by hand, median .............................. <= 1.03.
            `--against OTHER/.venv/bin/pai`: both checkouts rep by rep, alternating,
            and the paired difference. `--busy 0.5`: measured beside a process that
            keeps a core busy half the time (a load of about 0.5)
  chaos     1 ps + 4 workers of bench/chaos_job.py (a worker resumes from its own
            checkpoint and reconnects to a restarted ps, as real training does),
            ~2.5 min without faults; a driver SIGKILLs a random running instance at
            Poisson times, RATE kills per instance-minute (0.05, 0.10). Reports the
            job's end, slowdown vs no faults (goal <= 25% at 5%), whether every
            attempt is in the store with its exit code, and processes left behind.
  load      --jobs (200) `pai --detach` at once (1 ps + 1 worker each, a few seconds):
            all recorded and terminal, "database is locked" anywhere (outputs,
            master logs), a port held by two jobs that ran at the same time; then
            10,000 jobs in the store and `pai list` / `pai status` wall time .. < 0.3 s
  diskfull  a 1 MiB tmpfs mounted on $PAI_HOME/jobs (the store stays on disk), then
            on all of $PAI_HOME: a job that prints 8 MB. Its verdict and reason, the
            store's `PRAGMA integrity_check`, and files half-written (*.tmp, a job
            folder without spec.json/plan.json).

`--pai CMD` measures another checkout (default: this venv's pai). Every figure comes
with os.getloadavg(): the machine is shared, read figures with their load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

import bench_core  # noqa: E402  (MasterSampler, drain, load, the paired overhead runs)

BAR = REPO / "tests" / "scripts" / "bar.py"
CHAOS_JOB = BENCH / "chaos_job.py"
BEHAVE = REPO / "tests" / "scripts" / "behave.py"
TERMINAL = {"Succeeded", "Failed", "Cancelled"}
ADDED_BUDGET_S = 0.25   # overhead: seconds pai may add to the job, median of the pairs
RATIO_BUDGET = 1.03     # overhead: pai's wall time over the by-hand run's, median


def pai_argv(args) -> list[str]:
    return shlex.split(args.pai)


def env_for(home: Path, **extra: str) -> dict[str, str]:
    env = bench_core.fresh_env(home)
    env.update(extra)
    return env


def status(args, env: dict, job_id: str) -> dict:
    out = subprocess.run([*pai_argv(args), "status", job_id, "--json"], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"pai status {job_id}: {out.stderr}")
    return json.loads(out.stdout)


def job_id_of(text: str) -> str | None:
    return next((line[5:].strip() for line in text.splitlines() if line.startswith("ID = ")), None)


def processes_in(groups: set[int]) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if fields[0] != b"Z" and (int(fields[2]) in groups or int(fields[3]) in groups):
            found.append(int(entry))
    return found


# -- bars ---------------------------------------------------------------------------------


def bar_env(steps: int) -> dict[str, str]:
    return {"BAR_STEPS": str(steps), "BAR_SLEEP": "0", "BAR_WIDTH": "100", "BAR_REPORT": "1"}


def own_time(text: str) -> float:
    for line in text.splitlines():
        if "redraws took " in line:
            return float(line.rsplit("redraws took ", 1)[1].rstrip("s"))
    raise SystemExit(f"no 'redraws took' line in:\n{text[-1000:]}")


def bars_plain(steps: int) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-u", str(BAR)], env=dict(os.environ, **bar_env(steps)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    chunks: list[bytes] = []
    reader = bench_core.drain(proc.stdout, chunks)
    code = proc.wait()
    reader.join()
    wall = time.perf_counter() - t0
    text = b"".join(chunks).decode("utf-8", "replace")
    if code:
        raise SystemExit(f"bar.py failed: {text[-500:]}")
    return {"wall_s": wall, "own_s": own_time(text)}


def bars_pai(args, steps: int) -> dict:
    home = Path(tempfile.mkdtemp(prefix="A-bench-bars-"))
    try:
        env = env_for(home, **bar_env(steps))
        t0 = time.perf_counter()
        proc = subprocess.Popen([*pai_argv(args), "-name", "python", f"-Dscript={BAR}"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        sampler = bench_core.MasterSampler(home)
        sampler.start()
        chunks: list[bytes] = []
        reader = bench_core.drain(proc.stdout, chunks)
        code = proc.wait()
        wall = time.perf_counter() - t0
        reader.join()
        sampler.stop.set()
        sampler.join()
        text = b"".join(chunks).decode("utf-8", "replace")
        if code:
            raise SystemExit(f"pai bar job failed (exit {code}):\n{text[-1000:]}")
        final = [line for line in text.splitlines() if line.startswith("[worker:0]") and "|" in line]
        return {"wall_s": wall, "own_s": own_time(text), "hwm_mb": sampler.hwm_kb / 1024, "master_cpu_s": sampler.cpu_s,
                "final_line_ok": len(final) == 1 and f"{steps}/{steps} |" in final[0]}
    finally:
        shutil.rmtree(home, ignore_errors=True)


def bench_bars(args) -> dict:
    before = bench_core.load()
    reps = []
    for rep in range(args.reps):
        plain, through = (bars_plain(args.redraws), bars_pai(args, args.redraws)) if rep % 2 == 0 else \
            tuple(reversed((bars_pai(args, args.redraws), bars_plain(args.redraws))))
        reps.append({"plain_own_s": round(plain["own_s"], 3), "pai_own_s": round(through["own_s"], 3),
                     "plain_wall_s": round(plain["wall_s"], 3), "pai_wall_s": round(through["wall_s"], 3),
                     "master_hwm_mb": round(through["hwm_mb"], 1), "final_line_ok": through["final_line_ok"],
                     "master_cpu_s": round(through["master_cpu_s"], 2),
                     "load": bench_core.load()})
        print(f"    rep {rep + 1}: bar's own time: pipe {plain['own_s']:.2f} s, pai {through['own_s']:.2f} s; "
              f"wall: pipe {plain['wall_s']:.2f} s, pai {through['wall_s']:.2f} s; master VmHWM "
              f"{through['hwm_mb']:.1f} MB, CPU {through['master_cpu_s']:.2f} s; final line {'ok' if through['final_line_ok'] else 'WRONG'}", flush=True)
    ratio = statistics.median(r["pai_own_s"] / r["plain_own_s"] for r in reps)
    wall_ratio = statistics.median(r["pai_wall_s"] / r["plain_wall_s"] for r in reps)
    hwm = max(r["master_hwm_mb"] for r in reps)
    res = {"figure": "progress bar", "redraws": args.redraws, "reps": reps, "own_time_ratio": round(ratio, 3),
           "wall_ratio": round(wall_ratio, 3), "master_hwm_mb_max": hwm, "load_before": before,
           "load_after": bench_core.load(), "met": ratio <= 1.2 and hwm <= 60}
    print(f"[bars] {args.redraws} redraws of a 100-char bar: the bar's own time through pai / into a pipe "
          f"{ratio:.3f} (median), wall {wall_ratio:.3f} (pai's start and end included); master peak RSS "
          f"{hwm:.1f} MB; goal <= 1.2 and <= 60 MB: {'MET' if res['met'] else 'NOT MET'}; load {before} -> "
          f"{res['load_after']}", flush=True)
    return res


# -- overhead -------------------------------------------------------------------------------


def job_phases(home: Path, t_submit: float, t_exit: float) -> dict:
    """Where pai's time went, from the store's own timestamps: submit -> job
    recorded -> master running -> last instance started (its identity recorded:
    the instances' `started`; before 2026-11-29 the attempts' `started`, written
    as an instance was asked for, which the master now writes for the workers
    while the ps starts); last worker's exit -> verdict recorded -> the CLI's exit."""
    db = sqlite3.connect(home / "pai.db")
    try:
        created, started, ended = db.execute("SELECT created, started, ended FROM jobs").fetchone()
        starts = [r[0] for r in db.execute("SELECT started FROM instances WHERE started IS NOT NULL")]
        worker_ends = [r[0] for r in db.execute("SELECT ended FROM attempts WHERE role = 'worker'")]
    finally:
        db.close()
    return {"to_recorded": round(created - t_submit, 3), "to_master_running": round(started - created, 3),
            "to_instances_started": round(max(starts) - started, 3),
            "last_worker_to_verdict": round(ended - max(worker_ends), 3), "verdict_to_cli_exit": round(t_exit - ended, 3)}


BUSY_CODE = """
import sys, time
busy = float(sys.argv[1])
while True:
    until = time.monotonic() + 0.01 * busy
    while time.monotonic() < until:
        pass
    time.sleep(0.01 * (1 - busy))
"""


@contextlib.contextmanager
def busy_core(fraction: float):
    """A background load: one process busy `fraction` of each 10 ms (none for 0),
    given 30 s to show in the load average before the figure starts."""
    if fraction <= 0:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", BUSY_CODE, str(min(fraction, 1.0))])
    try:
        time.sleep(30)
        print(f"[overhead] a core kept {fraction:.0%} busy in the background; load {bench_core.load()}", flush=True)
        yield
    finally:
        proc.kill()
        proc.wait()


def bench_overhead(args) -> dict:
    if args.against:
        return bench_overhead_against(args)
    core = argparse.Namespace(pai=args.pai, steps=args.steps, sleep=args.sleep, reps=args.reps)
    before = bench_core.load()
    extras = []
    for rep in range(args.reps):
        home = Path(tempfile.mkdtemp(prefix="A-bench-overhead-"))
        try:
            if rep % 2 == 0:
                t_submit = time.time()
                p = bench_core.run_pai_job(core, home)
                b = bench_core.run_plain_job(core)
            else:
                b = bench_core.run_plain_job(core)
                t_submit = time.time()
                p = bench_core.run_pai_job(core, home)
            phases = job_phases(home, t_submit, t_submit + p["wall_s"])
        finally:
            shutil.rmtree(home, ignore_errors=True)
        extras.append({"pai_s": round(p["wall_s"], 3), "plain_s": round(b["wall_s"], 3),
                       "added_s": round(p["wall_s"] - b["wall_s"], 3), "phases_s": phases, "load": bench_core.load()})
        print(f"    pair {rep + 1}: pai {p['wall_s']:.3f} s, by hand {b['wall_s']:.3f} s, "
              f"added {p['wall_s'] - b['wall_s']:+.3f} s; pai's phases {phases}; load {bench_core.load()}", flush=True)
    added = statistics.median(e["added_s"] for e in extras)
    res = {"figure": "submit overhead", "steps": args.steps, "sleep": args.sleep, "pairs": extras,
           "median_added_s": added, "median_ratio": round(statistics.median(e["pai_s"] / e["plain_s"] for e in extras), 3),
           "load_before": before, "load_after": bench_core.load()}
    res["met"] = added <= ADDED_BUDGET_S and res["median_ratio"] <= RATIO_BUDGET
    res["median_phases_s"] = {k: statistics.median(e["phases_s"][k] for e in extras) for k in extras[0]["phases_s"]}
    print(f"[overhead] pai's phases (medians): {res['median_phases_s']}", flush=True)
    print(f"[overhead] 1 ps + 2 workers, {args.steps} x {args.sleep} s: pai adds {added:+.3f} s (median of "
          f"{len(extras)} pairs; ratio {res['median_ratio']}); budget <= {ADDED_BUDGET_S} s and ratio <= "
          f"{RATIO_BUDGET}: {'MET' if res['met'] else 'NOT MET'}; "
          f"load {before} -> {res['load_after']}", flush=True)
    return res


def checkout_python(pai: str) -> str:
    """The interpreter of the checkout whose `pai` command this is (its venv's python)."""
    return str(Path(shlex.split(pai)[0]).parent / "python")


def bench_overhead_against(args) -> dict:
    """`overhead --against OTHER`: this pai and OTHER's in the same window, rep by
    rep in alternating order, each run right after a by-hand run with its own
    checkout's interpreter; the median of each side's added time and of the
    paired differences (a change of a few ms is lost between two separate runs
    of 15 pairs, whose medians move by 20 ms with the machine's pace)."""
    sides = {"this": args.pai, "other": args.against}
    added: dict[str, list[float]] = {side: [] for side in sides}
    phases: dict[str, list[dict]] = {side: [] for side in sides}
    for rep in range(args.reps):
        for side in (("this", "other") if rep % 2 == 0 else ("other", "this")):
            pai = sides[side]
            python = checkout_python(pai)
            core = argparse.Namespace(pai=pai, steps=args.steps, sleep=args.sleep, reps=1)
            plain = bench_core.run_plain_job(core, python=python if os.path.exists(python) else None)
            home = Path(tempfile.mkdtemp(prefix="A-bench-overhead-"))
            try:
                t_submit = time.time()
                wall = bench_core.run_pai_job(core, home)["wall_s"]
                added[side].append(wall - plain["wall_s"])
                phases[side].append(job_phases(home, t_submit, t_submit + wall))
            finally:
                shutil.rmtree(home, ignore_errors=True)
        print(f"    rep {rep + 1}: this {added['this'][-1]:+.3f} s, other {added['other'][-1]:+.3f} s; "
              f"load {bench_core.load()}", flush=True)
    diffs = [a - b for a, b in zip(added["this"], added["other"])]
    res = {"figure": "submit overhead, paired", "steps": args.steps, "sleep": args.sleep, "reps": args.reps,
           "this": args.pai, "other": args.against,
           "median_added_s": {side: round(statistics.median(v), 4) for side, v in added.items()},
           "median_paired_this_minus_other_s": round(statistics.median(diffs), 4),
           "mean_paired_this_minus_other_s": round(statistics.mean(diffs), 4),
           "se_paired_s": round(statistics.stdev(diffs) / len(diffs) ** 0.5, 4) if len(diffs) > 1 else None,
           # pai's own windows, from the store's timestamps: steadier than the whole job,
           # whose run (the workers' steps) varies by more than a change of a few ms
           "median_phases_s": {side: {k: round(statistics.median(p[k] for p in v), 4) for k in v[0]}
                               for side, v in phases.items()},
           "median_paired_phases_s": {k: round(statistics.median(a[k] - b[k] for a, b in
                                                                 zip(phases["this"], phases["other"])), 4)
                                      for k in phases["this"][0]}}
    print(f"[overhead] pai's phases, medians: this {res['median_phases_s']['this']}, "
          f"other {res['median_phases_s']['other']}; paired (this - other) {res['median_paired_phases_s']}",
          flush=True)
    print(f"[overhead] {args.steps} x {args.sleep} s, {args.reps} reps: this adds "
          f"{res['median_added_s']['this']:+.3f} s, other {res['median_added_s']['other']:+.3f} s; "
          f"paired (this - other) {res['median_paired_this_minus_other_s']:+.4f} s "
          f"(mean {res['mean_paired_this_minus_other_s']:+.4f} +- {res['se_paired_s']} s)", flush=True)
    return res


# -- chaos ------------------------------------------------------------------------------------


class ChaosDriver(threading.Thread):
    """SIGKILLs a random running instance of the job at the times of a Poisson
    process of `rate` kills per instance-minute (over the instances running)."""

    def __init__(self, args, env: dict, job_id: str, rate: float, seed: int):
        super().__init__(daemon=True)
        self.args, self.env, self.job_id, self.rate = args, env, job_id, rate
        self.rng = random.Random(seed)
        self.kills: list[tuple[float, str, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        if self.rate <= 0:
            return
        t0 = time.monotonic()
        while not self.stop.is_set():
            st = status(self.args, self.env, self.job_id)
            if st["status"] in TERMINAL:
                return
            running = [i for i in st["instances"] if i["status"] == "Running" and i["pid"]]
            if not running:
                self.stop.wait(0.5)
                continue
            # Next kill after an exponential wait; the rate scales with the instances running.
            wait = self.rng.expovariate(self.rate * len(running) / 60.0)
            if self.stop.wait(wait):
                return
            st = status(self.args, self.env, self.job_id)
            running = [i for i in st["instances"] if i["status"] == "Running" and i["pid"]]
            if st["status"] in TERMINAL or not running:
                continue
            victim = self.rng.choice(running)
            try:
                os.kill(victim["pid"], signal.SIGKILL)
                self.kills.append((round(time.monotonic() - t0, 1), f"{victim['role']}:{victim['index']}",
                                   victim["pid"]))
            except ProcessLookupError:
                pass


def chaos_run(args, rate: float, seed: int) -> dict:
    home = Path(tempfile.mkdtemp(prefix="A-bench-chaos-"))
    try:
        env = env_for(home)
        argv = [*pai_argv(args), "-name", "python", f"-Dscript={CHAOS_JOB}",
                "-Dcluster=" + json.dumps({"ps": {"count": 1}, "worker": {"count": 4}}),
                "-DmaxRetries=50", f"-DuserDefinedParameters=--steps={args.steps} --sleep={args.sleep}", "--detach"]
        t0 = time.perf_counter()
        out = subprocess.run(argv, env=env, capture_output=True, text=True)
        job_id = out.stdout.strip()
        if out.returncode != 0:
            raise SystemExit(f"submit failed: {out.stderr}")
        driver = ChaosDriver(args, env, job_id, rate, seed)
        driver.start()
        done = subprocess.run([*pai_argv(args), "wait", job_id, "--no-progress"], env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        driver.stop.set()
        driver.join()
        st = status(args, env, job_id)
        db = sqlite3.connect(home / "pai.db")
        attempts = db.execute("SELECT role, idx, attempt, pid, pgid, exit_code, ended FROM attempts WHERE job_id=?",
                              (job_id,)).fetchall()
        integrity = db.execute("PRAGMA integrity_check").fetchone()[0]
        db.close()
        unrecorded = [a for a in attempts if a[5] is None or a[6] is None]
        killed_recorded = sum(1 for a in attempts if a[5] in (-9, 137))
        groups = {a[4] for a in attempts if a[4]}
        time.sleep(0.5)
        left = processes_in(groups)
        return {"rate": rate, "wall_s": round(wall, 1), "status": st["status"], "exit": done.returncode,
                "kills": len(driver.kills), "kill_log": driver.kills, "attempts": len(attempts),
                "killed_attempts_recorded": killed_recorded, "unrecorded_attempts": len(unrecorded),
                "integrity": integrity, "orphans": left,
                "instance_minutes": round(5 * wall / 60, 1)}
    finally:
        shutil.rmtree(home, ignore_errors=True)


def bench_chaos(args) -> dict:
    before = bench_core.load()
    runs = []
    for rep in range(args.reps):
        for rate in (0.0, *args.rates):
            run = chaos_run(args, rate, seed=1000 * rep + int(rate * 100))
            runs.append(run)
            print(f"    rep {rep + 1} rate {rate:.2f}/instance-min: {run['status']} in {run['wall_s']} s, "
                  f"{run['kills']} kills {[k[1] for k in run['kill_log']]}, {run['attempts']} attempts "
                  f"({run['killed_attempts_recorded']} recorded as SIGKILL, {run['unrecorded_attempts']} without "
                  f"an exit), store {run['integrity']}, left behind {run['orphans']}, load {bench_core.load()}",
                  flush=True)
    base = statistics.median(r["wall_s"] for r in runs if r["rate"] == 0)
    summary = {}
    for rate in args.rates:
        mine = [r for r in runs if r["rate"] == rate]
        slow = statistics.median(r["wall_s"] for r in mine) / base - 1
        summary[str(rate)] = {"slowdown": round(slow, 3), "kills": [r["kills"] for r in mine],
                              "all_ok": all(r["status"] == "Succeeded" for r in mine)}
        print(f"[chaos] rate {rate:.2f} kills/instance-minute: slowdown {slow:+.1%} vs no faults ({base:.1f} s), "
              f"kills {[r['kills'] for r in mine]}, jobs {'all Succeeded' if summary[str(rate)]['all_ok'] else 'NOT all ok'}"
              + (f"; goal <= 25%: {'MET' if slow <= 0.25 else 'NOT MET'}" if rate == 0.05 else ""), flush=True)
    consistent = all(r["unrecorded_attempts"] == 0 and r["integrity"] == "ok" and not r["orphans"] and
                     r["killed_attempts_recorded"] >= r["kills"] for r in runs)
    print(f"[chaos] store consistent and nothing left behind in every run: {consistent}; load {before} -> "
          f"{bench_core.load()}", flush=True)
    return {"figure": "chaos", "runs": runs, "baseline_s": base, "summary": summary, "consistent": consistent}


# -- load -------------------------------------------------------------------------------------


def bench_load(args) -> dict:
    home = Path(tempfile.mkdtemp(prefix="A-bench-load-"))
    before = bench_core.load()
    try:
        env = env_for(home, BEHAVE_PS="serve", BEHAVE_WORKER="print:3,sleep:2")
        argv = [*pai_argv(args), "-name", "python", f"-Dscript={BEHAVE}",
                "-Dcluster=" + json.dumps({"ps": {"count": 1}, "worker": {"count": 1}}), "--detach"]

        def submit(_):
            return subprocess.run(argv, env=env, capture_output=True, text=True)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(submit, range(args.jobs)))
        submitted_s = time.perf_counter() - t0
        ids = [r.stdout.strip() for r in results if r.returncode == 0]
        failed_submits = [r.stderr.strip()[-200:] for r in results if r.returncode != 0]
        deadline = time.monotonic() + args.wait
        db = sqlite3.connect(home / "pai.db", timeout=60)
        while time.monotonic() < deadline:
            rows = db.execute("SELECT status FROM jobs").fetchall()
            if len(rows) >= len(ids) and all(r[0] in TERMINAL for r in rows):
                break
            time.sleep(1)
        all_s = time.perf_counter() - t0
        jobs = db.execute("SELECT id, status, reason, started, ended FROM jobs").fetchall()
        ports = db.execute("SELECT a.job_id, a.port, a.started, a.ended FROM attempts a WHERE a.port IS NOT NULL"
                           ).fetchall()
        integrity = db.execute("PRAGMA integrity_check").fetchone()[0]
        db.close()
        # A port handed out twice: two attempts of different jobs on it whose lives overlap.
        twice = []
        by_port: dict[int, list] = {}
        for job, port, started, ended in ports:
            by_port.setdefault(port, []).append((job, started or 0, ended or time.time()))
        for port, uses in by_port.items():
            for i, a in enumerate(uses):
                for b in uses[i + 1:]:
                    if a[0] != b[0] and a[1] < b[2] and b[1] < a[2]:
                        twice.append((port, a[0], b[0]))
        locked = sum(r.stderr.count("database is locked") + r.stdout.count("database is locked") for r in results)
        for log in home.glob("jobs/*/*.log"):
            locked += log.read_text(errors="replace").count("database is locked")
        states: dict[str, int] = {}
        for job in jobs:
            states[job[1]] = states.get(job[1], 0) + 1
        reasons = sorted({job[2] for job in jobs if job[1] != "Succeeded"})[:5]
        print(f"[load] {args.jobs} concurrent `pai --detach`: {len(ids)} submitted in {submitted_s:.1f} s "
              f"({len(failed_submits)} refused{': ' + failed_submits[0] if failed_submits else ''}); "
              f"{len(jobs)} recorded, states {states} after {all_s:.0f} s; reasons {reasons}; "
              f"'database is locked': {locked}; ports held twice at once: {len(twice)}; store {integrity}; "
              f"load {before} -> {bench_core.load()}", flush=True)
        res = {"jobs": args.jobs, "submitted": len(ids), "refused": failed_submits[:5], "recorded": len(jobs),
               "states": states, "reasons": reasons, "locked": locked, "ports_twice": twice[:10],
               "integrity": integrity, "submit_s": round(submitted_s, 1), "all_terminal_s": round(all_s, 1)}
        res.update(bench_list_status(args, home, env))
        return res
    finally:
        # Nothing may outlive the benchmark: cancel whatever has not ended.
        try:
            db = sqlite3.connect(home / "pai.db", timeout=60)
            live = [r[0] for r in db.execute("SELECT id, status FROM jobs").fetchall() if r[1] not in TERMINAL]
            db.close()
        except sqlite3.Error:
            live = []
        for job_id in live:
            subprocess.run([*pai_argv(args), "kill", job_id], env=env_for(home), capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


def bench_list_status(args, home: Path, env: dict) -> dict:
    """10,000 jobs in the store (recorded through the Store API, ended), then
    `pai list` and `pai status` timed (median of 7)."""
    sys.path.insert(0, str(REPO))
    from paicli.states import JobStatus
    from paicli.store import Store, new_job_id

    store = Store(home)
    have = store.db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
    t0 = time.perf_counter()
    last = None
    for i in range(max(0, args.store_jobs - have)):
        job_id = new_job_id()
        job_dir = home / "jobs" / job_id
        store.create_job(job_id, name=f"filler-{i}", framework="python", project=None, task_name="PythonTask",
                         job_dir=job_dir, roles=[{"name": "ps", "count": 1, "must_finish": False},
                                                 {"name": "worker", "count": 2, "must_finish": True}])
        store.set_job(job_id, JobStatus.RUNNING)
        store.set_job(job_id, JobStatus.SUCCEEDED)
        last = job_id
    fill_s = time.perf_counter() - t0
    total = store.db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
    store.close()

    def timed(*cmd: str) -> float:
        times = []
        for _ in range(7):
            t = time.perf_counter()
            out = subprocess.run([*pai_argv(args), *cmd], env=env, capture_output=True, text=True)
            times.append(time.perf_counter() - t)
            if out.returncode != 0:
                raise SystemExit(f"pai {' '.join(cmd)}: {out.stderr}")
        return statistics.median(times)

    list_s, list_json_s = timed("list"), timed("list", "--json")
    status_s = timed("status", last) if last else None
    status_json_s = timed("status", last, "--json") if last else None
    met = max(list_s, list_json_s, status_s or 0, status_json_s or 0) < 0.3
    print(f"[load] {total} jobs in the store (filled in {fill_s:.0f} s): pai list {list_s:.3f} s, --json "
          f"{list_json_s:.3f} s; pai status {status_s:.3f} s, --json {status_json_s:.3f} s (medians of 7); "
          f"goal < 0.3 s: {'MET' if met else 'NOT MET'}; load {bench_core.load()}", flush=True)
    return {"store_jobs": total, "list_s": round(list_s, 3), "list_json_s": round(list_json_s, 3),
            "status_s": round(status_s, 3), "status_json_s": round(status_json_s, 3), "list_status_met": met}


# -- disk full --------------------------------------------------------------------------------


def diskfull_case(args, where: str) -> dict:
    base = Path(tempfile.mkdtemp(prefix="A-bench-disk-"))
    home = base / "home"
    home.mkdir()
    target = home / "jobs" if where == "jobs" else home
    target.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.tmpfs_kb}k", "A-bench-tmpfs", str(target)], check=True)
    try:
        env = env_for(home, BAR_STEPS="0", BEHAVE="print:1")
        script = base / "flood.py"
        script.write_text("import sys\nfor i in range(%d):\n    sys.stdout.write('flood line %%08d %%s\\n' %% "
                          "(i, 'x' * 80))\nprint('flood done', flush=True)\n" % (args.flood_mb * 1024 * 1024 // 100))
        t0 = time.perf_counter()
        out = subprocess.run([*pai_argv(args), "-name", "python", f"-Dscript={script}"], env=env,
                             capture_output=True, text=True, timeout=300)
        wall = time.perf_counter() - t0
        last = (out.stdout.strip().splitlines() or [""])[-1]
        job_id = job_id_of(out.stdout)
        st = None
        if job_id:
            done = subprocess.run([*pai_argv(args), "status", job_id, "--json"], env=env, capture_output=True,
                                  text=True)
            st = json.loads(done.stdout) if done.returncode == 0 else None
        try:
            db = sqlite3.connect(home / "pai.db")
            integrity = db.execute("PRAGMA integrity_check").fetchone()[0]
            rows = db.execute("SELECT id, status, reason FROM jobs").fetchall()
            db.close()
        except sqlite3.Error as err:
            integrity, rows = f"cannot open: {err}", []
        half = [str(p.relative_to(home)) for p in home.rglob("*.tmp")]
        half += [str(p.relative_to(home)) for p in (home / "jobs").iterdir()
                 if p.is_dir() and not ((p / "spec.json").exists() and (p / "plan.json").exists())]
        for p in (home / "jobs").glob("*/*.json"):
            try:
                json.loads(p.read_text())
            except ValueError:
                half.append(str(p.relative_to(home)) + " (not whole JSON)")
        res = {"tmpfs_on": where, "exit": out.returncode, "last_line": last[:300],
               "stderr": out.stderr.strip()[-300:], "job": job_id, "status": st and st["status"],
               "reason": st and st["reason"], "store_rows": rows[:3], "integrity": integrity,
               "half_written": half, "wall_s": round(wall, 1)}
        print(f"[diskfull] {args.tmpfs_kb} KB tmpfs on {'$PAI_HOME/jobs' if where == 'jobs' else '$PAI_HOME'}, "
              f"a job printing {args.flood_mb} MB: exit {out.returncode}; {last[:200]!r}"
              f"{'; stderr ' + repr(res['stderr'][:200]) if res['stderr'] else ''}; store: {integrity}, jobs "
              f"{[(r[1], (r[2] or '')[:120]) for r in rows]}; half-written: {half or 'none'}", flush=True)
        return res
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)
        shutil.rmtree(base, ignore_errors=True)


def bench_diskfull(args) -> dict:
    if os.geteuid() != 0:
        raise SystemExit("diskfull mounts a tmpfs: run it as root")
    return {"figure": "disk full", "cases": [diskfull_case(args, "jobs"), diskfull_case(args, "home")]}


# ---------------------------------------------------------------------------------------------


def main() -> int:
    bench_core.exit_on_signals()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figure", choices=["bars", "overhead", "chaos", "load", "diskfull"])
    parser.add_argument("--pai", default=bench_core.default_pai(), help="the pai command (split like a shell)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (bars, overhead, chaos)")
    parser.add_argument("--redraws", type=int, default=300_000, help="bars: redraws of the bar")
    parser.add_argument("--steps", type=int, default=None, help="overhead: 150 steps; chaos: 600 steps")
    parser.add_argument("--sleep", type=float, default=None, help="overhead: 0.05 s a step; chaos: 0.25 s")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.05, 0.10],
                        help="chaos: kills per instance-minute")
    parser.add_argument("--jobs", type=int, default=200, help="load: concurrent detached jobs")
    parser.add_argument("--wait", type=float, default=900, help="load: seconds to wait for every job to end")
    parser.add_argument("--store-jobs", type=int, default=10_000, help="load: jobs in the store for list/status")
    parser.add_argument("--tmpfs-kb", type=int, default=1024, help="diskfull: size of the tmpfs")
    parser.add_argument("--flood-mb", type=int, default=8, help="diskfull: output of the job")
    parser.add_argument("--against", help="overhead: another checkout's pai, measured rep by rep beside this one")
    parser.add_argument("--busy", type=float, default=0.0,
                        help="overhead: a background process keeps one core busy this fraction of the time "
                             "(10 ms slices) while it runs, e.g. 0.5")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 600 if args.figure == "chaos" else 150
    if args.sleep is None:
        args.sleep = 0.25 if args.figure == "chaos" else 0.05
    if args.figure in ("overhead", "load"):
        compiled = bench_core.compile_sources()
        print(f"bytecode of {compiled} compiled first (as pip does at install; an editable checkout under "
              f"PYTHONDONTWRITEBYTECODE=1 would recompile every module on every pai)", flush=True)
    print(f"bench_hardening {args.figure} with {args.pai}; load {bench_core.load()}", flush=True)
    with busy_core(args.busy if args.figure == "overhead" else 0.0):
        res = {"bars": bench_bars, "overhead": bench_overhead, "chaos": bench_chaos,
               "load": bench_load, "diskfull": bench_diskfull}[args.figure](args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
