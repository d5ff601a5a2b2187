#!/usr/bin/env python3
"""Where the submit overhead goes, process by process: the overhead figure run
under `perf record` (kernel tracepoints, system-wide), then each pai run and each
by-hand run cut into windows, with the CPU each kind of process used in them.

    sudo .venv/bin/python bench/bench_windows.py --reps 6 --busy 0.5 [--steps 20]
    .venv/bin/python bench/bench_windows.py --script FILE      # analyse a `perf script` output again

Needs perf and the right to trace (root, or kernel.perf_event_paranoid <= -1).
The tracepoints cost the traced processes almost nothing (no ptrace, no
per-syscall stop): exec, fork, exit, listen, connect and sched_stat_runtime.

Windows of a pai run (ms):
  submit      `pai` exec -> the ps's exec
  start       the ps's exec -> the last worker connected to it
  middle      -> the last worker's exit
  end         the last worker's exit -> the CLI's exit
and of a by-hand run: start (the ps's fork -> the last worker connected), middle,
end (-> the ps's exit). In each window: CPU ms of the CLI (`pai`), the master
(with its other forks), the node agents, the instances
(their threads too) and everything else (the background load, the bench). The
figure's `added` is, pair by pair, (submit + start + middle + end) of pai minus
the same of the by-hand run next to it; the table says which window holds it.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

BENCH = Path(__file__).resolve().parent
EVENTS = ("sched:sched_process_fork", "sched:sched_process_exec", "sched:sched_process_exit",
          "syscalls:sys_enter_listen", "syscalls:sys_exit_connect", "sched:sched_stat_runtime")
LINE = re.compile(r"\s*(.+?)\s+(\d+)\s+\[\d+\]\s+([\d.]+):\s+(\S+):\s*(.*)")
KINDS = ("cli", "master", "agents", "instances", "other")


class Trace:
    """The events of one `perf script` output, by process."""

    def __init__(self, text: str):
        self.parent: dict[int, int] = {}
        self.forks: dict[int, list[tuple[float, int]]] = defaultdict(list)
        self.execs: dict[int, tuple[float, str]] = {}
        self.exits: dict[int, float] = {}
        self.listens: dict[int, float] = {}
        self.connects: dict[int, list[tuple[float, bool]]] = defaultdict(list)
        self.runtime: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for line in text.splitlines():
            m = LINE.match(line)
            if m:
                self._event(int(m.group(2)), float(m.group(3)), m.group(4).split(":")[-1], m.group(5))

    def _event(self, pid: int, t: float, name: str, rest: str) -> None:
        if name == "sched_process_fork":
            child = int(re.search(r"child_pid=(\d+)", rest).group(1))
            self.parent[child] = pid
            self.forks[pid].append((t, child))
        elif name == "sched_process_exec":
            self.execs[pid] = (t, re.search(r"filename=(\S+)", rest).group(1))
        elif name == "sched_process_exit":
            self.exits.setdefault(pid, t)
        elif name == "sys_enter_listen":
            self.listens.setdefault(pid, t)
        elif name == "sys_exit_connect":
            self.connects[pid].append((t, rest.strip() == "0x0"))
        elif name == "sched_stat_runtime":
            m = re.search(r"pid=(\d+) runtime=(\d+)", rest)
            self.runtime[int(m.group(1))].append((t, int(m.group(2)) / 1e6))

    def tree(self, pid: int) -> list[int]:
        out, todo = [pid], [pid]
        while todo:
            for _, child in self.forks.get(todo.pop(), ()):
                out.append(child)
                todo.append(child)
        return out

    def cpu(self, pids, start: float, end: float) -> float:
        return sum(ms for pid in pids for t, ms in self.runtime.get(pid, ()) if start <= t < end)

    def instance(self, pid: int) -> bool:
        """A ps (it listens) or a worker (it connected to one) of a job: an exec'd process."""
        return pid in self.execs and (pid in self.listens or any(ok for _, ok in self.connects.get(pid, ())))

    def connected(self, pid: int) -> float:
        return max(t for t, ok in self.connects[pid] if ok)


def _windows(trace: Trace, start: float, ps: int, workers: list[int], end: float) -> dict[str, tuple[float, float]]:
    began = trace.execs[ps][0]
    connected = max(trace.connected(w) for w in workers)
    last_exit = max(trace.exits[w] for w in workers)
    windows = {"start": (began, connected), "middle": (connected, last_exit), "end": (last_exit, end)}
    if start < began:
        windows = {"submit": (start, began), **windows}
    return windows


def runs(trace: Trace) -> list[dict]:
    """Every pai run (a `pai` exec whose processes started a ps and workers) and
    every by-hand run (three instances forked in a row by the bench), in order."""
    found = []
    for pid, (t, path) in trace.execs.items():
        if not path.endswith("/pai"):
            continue
        tree = trace.tree(pid)
        cli = [pid]
        instances = [p for p in tree if p not in cli and trace.instance(p)]
        ps = [p for p in instances if p in trace.listens]
        if len(ps) != 1 or len(instances) < 2 or pid not in trace.exits:
            continue
        workers = [p for p in instances if p != ps[0]]
        agents = sorted({trace.parent[p] for p in instances})
        inst_tree = [x for p in instances for x in trace.tree(p)]
        kinds = {"cli": cli, "agents": agents, "instances": inst_tree,
                 "master": [p for p in tree if p not in cli and p not in agents and p not in inst_tree]}
        found.append(_run(trace, "pai", t, ps[0], workers, trace.exits[pid], kinds, tree))
    launchers = {trace.parent.get(p) for p, (_, path) in trace.execs.items() if path.endswith("/pai")}
    for bench in launchers - {None}:
        kids = [child for _, child in trace.forks[bench] if trace.instance(child)]
        for i, ps in enumerate(kids):
            workers = [p for p in kids[i + 1:i + 3] if p not in trace.listens]
            if ps not in trace.listens or ps not in trace.exits or len(workers) != 2:
                continue
            t = next(t for t, child in trace.forks[bench] if child == ps)
            inst_tree = [x for p in (ps, *workers) for x in trace.tree(p)]
            found.append(_run(trace, "hand", t, ps, workers, trace.exits[ps], {"instances": inst_tree}, inst_tree))
    return sorted(found, key=lambda r: r["t0"])


def _run(trace: Trace, kind: str, t0: float, ps: int, workers: list[int], end: float,
         kinds: dict[str, list[int]], ours: list[int]) -> dict:
    others = [p for p in trace.runtime if p not in set(ours)]
    windows = _windows(trace, t0, ps, workers, end)
    table = {}
    for name, (a, b) in windows.items():
        row = {"ms": round((b - a) * 1000, 1)}
        for k in KINDS:
            pids = others if k == "other" else kinds.get(k)
            if pids is not None:
                row[k] = round(trace.cpu(pids, a, b), 1)
        table[name] = row
    return {"kind": kind, "t0": t0, "total_ms": round((end - t0) * 1000, 1), "windows": table,
            "refused_connects": sum(1 for w in workers for _, ok in trace.connects[w] if not ok)}


def report(found: list[dict]) -> dict:
    for r in found:
        cells = " | ".join(f"{name} {w['ms']:6.1f}: " + " ".join(f"{k} {w[k]:5.1f}" for k in KINDS if k in w)
                           for name, w in r["windows"].items())
        print(f"  {r['kind']:4} {r['total_ms']:8.1f} ms  {cells}", flush=True)
    medians = {}
    for kind in ("pai", "hand"):
        rows = [r for r in found if r["kind"] == kind]
        if not rows:
            continue
        medians[kind] = {name: {key: statistics.median(r["windows"][name][key] for r in rows)
                                for key in rows[0]["windows"][name]} for name in rows[0]["windows"]}
        print(f"[windows] {kind} ({len(rows)} runs), medians: " + " | ".join(
            f"{name} {w['ms']:.1f} ms (" + ", ".join(f"{k} {w[k]:.1f}" for k in KINDS if k in w) + ")"
            for name, w in medians[kind].items()), flush=True)
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", help="analyse this `perf script` output instead of recording")
    parser.add_argument("--keep", help="also keep the `perf script` output in this file")
    args, overhead_args = parser.parse_known_args()
    if args.script:
        report(runs(Trace(Path(args.script).read_text())))
        return 0
    perf = shutil.which("perf")
    if perf is None:
        print("bench_windows: perf is not installed (apt-get install linux-tools-common, or your kernel's "
              "linux-tools package)", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="bench-windows-"))
    try:
        data = folder / "perf.data"
        record = [perf, "record", "-q", "-a", "-o", str(data), "-e", ",".join(EVENTS), "--",
                  sys.executable, str(BENCH / "bench_hardening.py"), "overhead", *overhead_args]
        if subprocess.run(record).returncode != 0:
            print("bench_windows: `perf record` failed (tracing needs root, or kernel.perf_event_paranoid "
                  "<= -1)", file=sys.stderr)
            return 1
        text = subprocess.run([perf, "script", "-i", str(data)], capture_output=True, text=True, check=True).stdout
        if args.keep:
            Path(args.keep).write_text(text)
        report(runs(Trace(text)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
