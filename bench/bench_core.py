#!/usr/bin/env python3
"""Core launcher benchmarks for paicli: start-up, launch overhead, supervisor
memory, log tail. Each prints its figures, the load average and the goal.

Run from the repository root with the project's venv (PAI_HOME is set to a
fresh temporary folder for every run; nothing under ~/.pai is touched):

    .venv/bin/python bench/bench_core.py help                  # 1. `pai --help` wall time
    .venv/bin/python bench/bench_core.py overhead              # 2. pai vs plain launcher, + 3. master RSS
    .venv/bin/python bench/bench_core.py logtail               # 4. 64 instances x 15625 lines through `pai`
    .venv/bin/python bench/bench_core.py all                   # all of the above, in that order
    .venv/bin/python bench/bench_core.py all --json out.json   # also write the figures as JSON

Figures and goals (from the issue):
  1. `pai --help` wall time, median of --runs runs .................. <= 0.25 s
     (its CPU time, user+sys, is printed too: it moves less with the load)
  2. 1 ps + 2 worker plain-Python job (examples/python/ps_worker.py) through
     `pai`, vs the same three processes started by a shell-like launcher
     (subprocess, same PAI_ROLE/PAI_INDEX/PAI_PORT/PAI_CLUSTER, ps stopped
     with SIGTERM when the workers are done); both with stdout on a pipe
     this script drains. Median of --reps wall-time ratios ............ <= 1.05
  3. JobMaster peak RSS (VmHWM of /proc/<master pid>/status, sampled every
     50 ms until the master exits; the pid read from the job store as soon
     as the CLI records it, checked against `pai status ID --json`
     afterwards) during the jobs of 2 and 4 ........................... <= 60 MB
  4. --instances writers (default 64) x --lines lines (default 15625, 1M in
     all), each line "<index> <seq> <time_ns>" written with one write(2)
     as fast as possible, all released together once every writer is up;
     `pai` attached with stdout on a pipe this script reads. Checks every
     line arrives, in order per instance. Lines/s = lines / (last arrival -
     release) ....................................................... >= 200k/s
     write-to-display delay p50/p99 .................................. p99 <= 100 ms

The machine is shared (2 cores), so every figure comes with os.getloadavg()
taken before and after it; prefer medians over several runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PS_WORKER = REPO / "examples" / "python" / "ps_worker.py"

GOALS = {"help_s": 0.25, "ratio": 1.05, "rss_mb": 60.0, "lines_per_s": 200_000, "p99_ms": 100.0}

WRITER = r'''
import os, sys, time
n = int(sys.argv[1]); go = sys.argv[2]; ready = sys.argv[3]
idx = os.environ["PAI_INDEX"].encode()
open(os.path.join(ready, idx.decode()), "w").close()
while not os.path.exists(go):
    time.sleep(0.005)
w = os.write; t = time.time_ns
kv = len(sys.argv) > 4 and sys.argv[4] == "kv"
fmt = b"id=%s seq=%d t=%d\n" if kv else b"%s %d %d\n"
for s in range(n):
    w(1, fmt % (idx, s, t()))
'''


# -- helpers ---------------------------------------------------------------------------


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def default_pai() -> str:
    here = Path(sys.executable).parent / "pai"
    if here.exists():
        return str(here)
    venv = REPO / ".venv" / "bin" / "pai"
    return str(venv) if venv.exists() else (shutil.which("pai") or "pai")


def compile_sources() -> str:
    """Write the .pyc of the project's sources (what `pip install` does), so a
    wall-time figure is not paying for compiling: this checkout is installed
    editable, and PYTHONDONTWRITEBYTECODE=1 would otherwise recompile every
    module on every `pai`."""
    import compileall

    dirs = [REPO / name for name in ("paicli", "adapters", "cluster", "runners")]
    for folder in dirs:
        compileall.compile_dir(str(folder), quiet=1)
    return ", ".join(f"{d.name}/" for d in dirs)


def fresh_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PAI_HOME"] = str(home)
    env.pop("PAI_DEBUG", None)
    env["NO_COLOR"] = "1"
    return env


class MasterSampler(threading.Thread):
    """Finds the JobMaster's pid in the job store of the (fresh, one-job) PAI_HOME,
    read-only, as soon as the CLI has recorded it, and samples its VmHWM/VmRSS and
    CPU time every 50 ms until it exits. Reading the store costs no extra process
    during the timed run; `pai status ID --json` is asked afterwards to check that
    it was the right pid. (The master may be a forked CLI or a new interpreter:
    neither its parent nor its command line is relied on.)"""

    def __init__(self, home: Path):
        super().__init__(daemon=True)
        self.db_path = home / "pai.db"
        self.master_pid: int | None = None
        self.hwm_kb = 0
        self.rss_max_kb = 0
        self.samples = 0
        self.cpu_s = 0.0     # the master's user+sys CPU time at the last sample
        self.stop = threading.Event()

    def _find(self) -> int | None:
        if not self.db_path.exists():
            return None
        try:
            db = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=0.5)
            try:
                row = db.execute("SELECT master_pid FROM jobs WHERE master_pid IS NOT NULL LIMIT 1").fetchone()
            finally:
                db.close()
        except sqlite3.Error:
            return None
        return row[0] if row else None

    def run(self) -> None:
        while not self.stop.is_set() and self.master_pid is None:
            self.master_pid = self._find()
            if self.master_pid is None:
                time.sleep(0.01)
        while self.master_pid and not self.stop.is_set():
            try:
                with open(f"/proc/{self.master_pid}/status") as f:
                    text = f.read()
            except OSError:
                return
            fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
            if fields.get("State", "").strip().startswith("Z"):
                return
            try:
                with open(f"/proc/{self.master_pid}/stat", "rb") as f:
                    stat = f.read()
                utime, stime = stat[stat.rfind(b")") + 2:].split()[11:13]
                self.cpu_s = (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")
            except (OSError, ValueError):
                pass
            self.hwm_kb = max(self.hwm_kb, int(fields.get("VmHWM", "0 kB").split()[0]))
            self.rss_max_kb = max(self.rss_max_kb, int(fields.get("VmRSS", "0 kB").split()[0]))
            self.samples += 1
            time.sleep(0.05)


def status_json(pai: str, env: dict, job_id: str) -> dict:
    out = subprocess.run([pai, "status", job_id, "--json"], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def drain(stream, sink: list[bytes]) -> threading.Thread:
    def run():
        fd = stream.fileno()
        while True:
            data = os.read(fd, 1 << 16)
            if not data:
                break
            sink.append(data)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


# -- 1. pai --help --------------------------------------------------------------------------


def bench_help(args) -> dict:
    home = Path(tempfile.mkdtemp(prefix="bench-pai-"))
    env = fresh_env(home)
    try:
        subprocess.run([args.pai, "--help"], env=env, stdout=subprocess.DEVNULL, check=True)  # warm the caches
        before = load()
        times, cpus = [], []
        for _ in range(args.runs):
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            subprocess.run([args.pai, "--help"], env=env, stdout=subprocess.DEVNULL, check=True)
            times.append(time.perf_counter() - t0)
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
        after = load()
    finally:
        shutil.rmtree(home, ignore_errors=True)
    med = statistics.median(times)
    cpu = statistics.median(cpus)
    res = {"figure": "pai --help", "runs": args.runs, "median_s": round(med, 4), "min_s": round(min(times), 4),
           "median_cpu_s": round(cpu, 4),
           "max_s": round(max(times), 4), "load_before": before, "load_after": after,
           "goal": f"<= {GOALS['help_s']} s", "met": med <= GOALS["help_s"]}
    print(f"[1] pai --help: median {med:.3f} s (min {min(times):.3f}, max {max(times):.3f}, n={args.runs}), "
          f"CPU time (user+sys) median {cpu:.3f} s; "
          f"load {before} -> {after}; goal <= {GOALS['help_s']} s: {verdict(res['met'])}", flush=True)
    return res


# -- 2+3. launch overhead and master RSS ------------------------------------------------------


def run_pai_job(args, home: Path) -> dict:
    env = fresh_env(home)
    argv = [args.pai, "-name", "python", f"-Dscript={PS_WORKER}",
            "-Dcluster=" + json.dumps({"ps": {"count": 1}, "worker": {"count": 2}}),
            f"-DuserDefinedParameters=--steps={args.steps} --sleep={args.sleep}"]
    chunks: list[bytes] = []
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO)
    sampler = MasterSampler(home)
    sampler.start()
    reader = drain(proc.stdout, chunks)
    code = proc.wait()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    reader.join()
    sampler.stop.set()
    sampler.join()
    text = b"".join(chunks).decode("utf-8", "replace")
    steps = sum(1 for line in text.splitlines() if line.startswith("[worker:") and "step=" in line)
    job_id = next((line.split("=", 1)[1].strip() for line in text.splitlines() if line.startswith("ID = ")), None)
    master_pid = status_json(args.pai, env, job_id).get("master_pid") if job_id else None
    if code != 0 or steps != 2 * args.steps:
        raise SystemExit(f"pai job failed (exit {code}, {steps} step lines):\n{text[-2000:]}")
    return {"wall_s": wall, "hwm_kb": sampler.hwm_kb, "rss_max_kb": sampler.rss_max_kb,
            "cli_cpu_s": r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime, "master_cpu_s": sampler.cpu_s,
            "master_pid": sampler.master_pid, "status_master_pid": master_pid, "samples": sampler.samples}


def exit_on_signals() -> None:
    """SIGTERM or SIGHUP end a bench as Ctrl-C does: through its finally blocks, so
    that the processes it started (the by-hand baseline's ps and workers) go with it."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda signum, frame: sys.exit(128 + signum))


def run_plain_job(args, python: str | None = None) -> dict:
    """What a shell script would do: start the ps, the two workers, wait for the
    workers, SIGTERM the ps, wait for it. `python`: the interpreter the three run
    with (this one's by default; a checkout's own when another is measured)."""
    t0 = time.perf_counter()
    port = free_port()
    cluster = json.dumps({"ps": [f"127.0.0.1:{port}"]})
    read_fd, write_fd = os.pipe()
    reader_file = os.fdopen(read_fd, "rb", buffering=0)
    chunks: list[bytes] = []
    argv = [python or sys.executable, "-u", str(PS_WORKER), f"--steps={args.steps}", f"--sleep={args.sleep}"]
    procs = []
    try:
        for role, idx in (("ps", 0), ("worker", 0), ("worker", 1)):
            env = dict(os.environ, PAI_ROLE=role, PAI_INDEX=str(idx), PAI_CLUSTER=cluster, PYTHONUNBUFFERED="1")
            if role == "ps":
                env["PAI_PORT"] = str(port)
            procs.append(subprocess.Popen(argv, env=env, stdout=write_fd, stderr=write_fd, cwd=REPO,
                                          stdin=subprocess.DEVNULL))
        os.close(write_fd)
        write_fd = -1
        reader = drain(reader_file, chunks)
        codes = [p.wait() for p in procs[1:]]
        procs[0].send_signal(signal.SIGTERM)
        procs[0].wait()
        wall = time.perf_counter() - t0
    finally:
        # The bench interrupted (Ctrl-C, a kill of its own) or a start refused: the
        # by-hand processes go with it, as pai's would.
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if write_fd >= 0:
            os.close(write_fd)
    reader.join()
    reader_file.close()
    text = b"".join(chunks).decode("utf-8", "replace")
    # Three processes share one pipe and print() writes the text and its "\n" in
    # two write(2)s, so lines may be interleaved: count records, not lines.
    steps = text.count("global_step=")
    if codes != [0, 0] or steps != 2 * args.steps:
        raise SystemExit(f"plain launcher job failed ({codes}, {steps} step lines):\n{text[-2000:]}")
    return {"wall_s": wall}


def bench_overhead(args) -> dict:
    before = load()
    reps = []
    for rep in range(args.reps):
        home = Path(tempfile.mkdtemp(prefix="bench-pai-"))
        try:
            # Alternate the order so that a drift in the machine's load hits both alike.
            if rep % 2 == 0:
                p = run_pai_job(args, home)
                b = run_plain_job(args)
            else:
                b = run_plain_job(args)
                p = run_pai_job(args, home)
        finally:
            shutil.rmtree(home, ignore_errors=True)
        ratio = p["wall_s"] / b["wall_s"]
        reps.append({"pai_s": round(p["wall_s"], 3), "plain_s": round(b["wall_s"], 3), "ratio": round(ratio, 4),
                     "master_hwm_mb": round(p["hwm_kb"] / 1024, 1), "load": load(),
                     "cli_cpu_s": round(p["cli_cpu_s"], 3), "master_cpu_s": round(p["master_cpu_s"], 3),
                     "master_pid_ok": p["master_pid"] == p["status_master_pid"]})
        print(f"    rep {rep + 1}/{args.reps}: pai {p['wall_s']:.3f} s, plain {b['wall_s']:.3f} s, "
              f"ratio {ratio:.3f}, CPU: pai CLI {p['cli_cpu_s']:.2f} s + master {p['master_cpu_s']:.2f} s, master VmHWM {p['hwm_kb'] / 1024:.1f} MB ({p['samples']} samples, "
              f"pid {p['master_pid']} = status {p['status_master_pid']}), load {load()}", flush=True)
    after = load()
    ratio = statistics.median(r["ratio"] for r in reps)
    hwm = max(r["master_hwm_mb"] for r in reps)
    measured = all(r["master_pid_ok"] and r["master_hwm_mb"] > 0 for r in reps)
    res = {"figure": "launch overhead", "steps": args.steps, "sleep": args.sleep, "reps": reps,
           "median_ratio": ratio, "median_pai_s": statistics.median(r["pai_s"] for r in reps),
           "median_plain_s": statistics.median(r["plain_s"] for r in reps),
           "median_extra_s": round(statistics.median(r["pai_s"] - r["plain_s"] for r in reps), 3),
           "master_hwm_mb_max": hwm, "load_before": before, "load_after": after,
           "goal": f"ratio <= {GOALS['ratio']}, master RSS <= {GOALS['rss_mb']} MB",
           "met": ratio <= GOALS["ratio"], "rss_met": measured and hwm <= GOALS["rss_mb"], "rss_measured": measured}
    print(f"[2] 1 ps + 2 workers, {args.steps} steps x {args.sleep} s: pai {res['median_pai_s']:.3f} s vs plain "
          f"{res['median_plain_s']:.3f} s (medians), median ratio {ratio:.3f} (+{res['median_extra_s']:.2f} s); "
          f"load {before} -> {after}; goal <= {GOALS['ratio']}: {verdict(res['met'])}", flush=True)
    print(f"[3] JobMaster peak RSS (VmHWM) over {args.reps} ps/worker jobs: max {hwm:.1f} MB; "
          f"goal <= {GOALS['rss_mb']} MB: {verdict(res['rss_met']) if measured else 'NOT MEASURED (master not found)'}",
          flush=True)
    return res


# -- 4. log tail ----------------------------------------------------------------------------


def print_timeline(samples: list[tuple[int, int]], t_go: int) -> None:
    """Per 0.5 s of arrival time after the release: lines that arrived and their
    write-to-display delay (p50, max)."""
    buckets: dict[int, list[int]] = {}
    for arrival, delay in samples:
        buckets.setdefault((arrival - t_go) // 500_000_000, []).append(delay)
    print("    arrival(s)    lines  delay p50 ms  delay max ms")
    for b in sorted(buckets):
        d = sorted(buckets[b])
        print(f"    {b * 0.5:9.1f} {len(d):8d} {pct(d, 50) / 1e6:13.1f} {d[-1] / 1e6:13.1f}")


def bench_logtail(args) -> dict:
    home = Path(tempfile.mkdtemp(prefix="bench-pai-"))
    env = fresh_env(home)
    env["PAI_LOG_MAX_BYTES"] = str(1 << 34)  # 16 GB: nothing rotates
    work = home / "work"
    (work / "ready").mkdir(parents=True)
    script = work / "writer.py"
    script.write_text(WRITER)
    go = work / "go"
    n, per = args.instances, args.lines
    udp = f"{per} {go} {work / 'ready'}" + (" kv" if args.kv else "")
    argv = [args.pai, "-name", "python", f"-Dscript={script}",
            "-Dcluster=" + json.dumps({"worker": {"count": n}}), f"-DuserDefinedParameters={udp}"]
    chunks: list[tuple[int, bytes]] = []
    before = load()
    try:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=work)
        sampler = MasterSampler(home)
        sampler.start()

        def read():
            fd = proc.stdout.fileno()
            tn = time.time_ns
            append = chunks.append
            while True:
                data = os.read(fd, 1 << 20)
                if not data:
                    break
                append((tn(), data))
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        # Release every writer at once, when all are up.
        deadline = time.monotonic() + 120
        while len(os.listdir(work / "ready")) < n:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the writers did not all start:\n" + b"".join(c for _, c in chunks).decode()[-2000:])
            time.sleep(0.01)
        t_launch = time.perf_counter() - t0
        load_release = load()
        t_go = time.time_ns()
        go.touch()
        code = proc.wait()
        wall = time.perf_counter() - t0
        reader.join()
        sampler.stop.set()
        sampler.join()
        after = load()
        # -- check and measure
        delays: list[int] = []
        per_instance_max = [0] * n
        samples: list[tuple[int, int]] = []
        next_seq = [0] * n
        bad: list[str] = []
        other = 0
        malformed = 0
        last_arrival = 0
        partial = b""
        for arrival, data in chunks:
            data = partial + data
            cut = data.rfind(b"\n")
            partial = data[cut + 1:]
            for line in data[:cut].split(b"\n"):
                if not line.startswith(b"[worker:"):
                    other += 1
                    continue
                body = line[line.index(b"] ") + 2:]
                if args.kv:
                    body = body.replace(b"id=", b"").replace(b"seq=", b"").replace(b"t=", b"")
                try:
                    idx, seq, ts = body.split(b" ")
                    i, s = int(idx), int(seq)
                    int(ts)
                except ValueError:
                    if len(bad) < 10:
                        bad.append(f"malformed line {line[:120]!r}")
                    malformed += 1
                    continue
                if s != next_seq[i]:
                    if len(bad) < 10:
                        bad.append(f"worker:{i} line {s} after {next_seq[i] - 1}")
                next_seq[i] = s + 1
                delays.append(arrival - int(ts))
                per_instance_max[i] = max(per_instance_max[i], arrival - int(ts))
                if args.timeline:
                    samples.append((arrival, arrival - int(ts)))
                last_arrival = arrival
        received = len(delays)
        if args.timeline:
            print_timeline(samples, t_go)
        missing = sum(per - s for s in next_seq)
        delays.sort()
        span = (last_arrival - t_go) / 1e9
        rate = received / span if span > 0 else float("nan")
        p50, p99, pmax = (pct(delays, 50) / 1e6, pct(delays, 99) / 1e6, delays[-1] / 1e6 if delays else float("nan"))
        p90, p95 = pct(delays, 90) / 1e6, pct(delays, 95) / 1e6
        worst = sorted(range(n), key=lambda k: -per_instance_max[k])[:5]
        job_id = next((c.split(b"=", 1)[1].split(b"\n")[0].strip().decode()
                       for _, c in chunks[:3] if c.startswith(b"ID = ")), None)
        status_pid = status_json(args.pai, env, job_id).get("master_pid") if job_id else None
    finally:
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)
    ok_lines = received == n * per and not bad and missing == 0 and code == 0 and not malformed
    res = {"figure": "log tail", "instances": n, "lines_each": per, "kv_lines": args.kv, "exit_code": code,
           "received": received, "expected": n * per, "malformed": malformed, "out_of_order": bad, "all_in_order": ok_lines,
           "launch_s": round(t_launch, 3), "tail_span_s": round(span, 3), "wall_s": round(wall, 3),
           "lines_per_s": round(rate), "delay_p50_ms": round(p50, 1), "delay_p99_ms": round(p99, 1),
           "delay_max_ms": round(pmax, 1),
           "delay_p90_ms": round(p90, 1), "delay_p95_ms": round(p95, 1),
           "worst_instances_max_ms": {f"worker:{k}": round(per_instance_max[k] / 1e6, 1) for k in worst}, "master_hwm_mb": round(sampler.hwm_kb / 1024, 1),
           "master_pid_ok": sampler.master_pid == status_pid,
           "load_before": before, "load_at_release": load_release, "load_after": after,
           "goal": f">= {GOALS['lines_per_s']} lines/s, p99 <= {GOALS['p99_ms']} ms",
           "rate_met": rate >= GOALS["lines_per_s"], "p99_met": p99 <= GOALS["p99_ms"]}
    print(f"[4] log tail, {n} instances x {per} lines{' (key=value lines)' if args.kv else ''}: "
          f"{received}/{n * per} lines, in order per instance: {'yes' if ok_lines else 'NO ' + str(bad)}; "
          f"{rate:,.0f} lines/s over {span:.2f} s from release to last line "
          f"(goal >= {GOALS['lines_per_s']:,}: {verdict(res['rate_met'])}); delay p50 {p50:.1f} ms, "
          f"p90 {p90:.1f}, p95 {p95:.1f}, p99 {p99:.1f} ms, max {pmax:.1f} ms (goal p99 <= {GOALS['p99_ms']:g} ms: {verdict(res['p99_met'])}); "
          f"launch of {n} instances {t_launch:.2f} s, pai wall {wall:.2f} s; master VmHWM "
          f"{sampler.hwm_kb / 1024:.1f} MB (goal <= {GOALS['rss_mb']:g} MB: "
          f"{verdict(sampler.hwm_kb / 1024 <= GOALS['rss_mb']) if sampler.samples else 'NOT MEASURED'}); load {before} -> {load_release} -> {after}",
          flush=True)
    print(f"    worst instances (max delay, ms): {res['worst_instances_max_ms']}", flush=True)
    if args.keep:
        print(f"    kept PAI_HOME={home}", flush=True)
    return res


def main() -> int:
    exit_on_signals()
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("help", "overhead", "logtail", "all"),
                        help="help: `pai --help` wall time; overhead: pai vs a plain launcher and the "
                             "master's peak RSS; logtail: lines/s and write-to-display delay; all: every one")
    parser.add_argument("--pai", default=default_pai(), help="the pai executable (default: next to this python)")
    parser.add_argument("--runs", type=int, default=21, help="help: runs of `pai --help` (default 21)")
    parser.add_argument("--reps", type=int, default=5, help="overhead: repetitions of the pair (default 5)")
    parser.add_argument("--steps", type=int, default=150, help="overhead: steps per worker (default 150)")
    parser.add_argument("--sleep", type=float, default=0.05, help="overhead: seconds per step (default 0.05)")
    parser.add_argument("--instances", type=int, default=64, help="logtail: writer instances (default 64)")
    parser.add_argument("--lines", type=int, default=15625, help="logtail: lines per instance (default 15625)")
    parser.add_argument("--kv", action="store_true",
                        help="logtail: write `id=I seq=S t=T` lines, so the master's metric parser finds "
                             "3 metrics per line and stores them (default: plain `I S T` lines)")
    parser.add_argument("--timeline", action="store_true",
                        help="logtail: also print lines and delays per 0.5 s of arrival time")
    parser.add_argument("--keep", action="store_true", help="logtail: keep the PAI_HOME folder (its path is printed)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")
    args = parser.parse_args()
    print(f"pai: {args.pai}; {os.cpu_count()} cores; load {load()}; {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; "
          f"bytecode of {compile_sources()} compiled first", flush=True)
    results = []
    if args.what in ("help", "all"):
        results.append(bench_help(args))
    if args.what in ("overhead", "all"):
        results.append(bench_overhead(args))
    if args.what in ("logtail", "all"):
        results.append(bench_logtail(args))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
