#!/usr/bin/env python3
"""Micro-benchmark of the JobMaster's per-line log work, without processes.

Feeds 64 KB chunks of log lines through the code the master runs for every
chunk it reads from an instance's pipe (cluster/logsink.py: InstanceLog.feed,
then JobLog.lines with the python adapter's metric patterns, then
take_metrics), and prints lines per CPU-second and CPU microseconds per line (process time,
so the machine's load moves it little). It isolates the
master's CPU cost per line from the machine's load and from process
scheduling, which the end-to-end `bench_core.py logtail` figure mixes in: at
N lines/s here, the master cannot forward more than N lines/s there.

    .venv/bin/python bench/bench_pump.py                 # plain lines "I S T"
    .venv/bin/python bench/bench_pump.py --kv            # "id=I seq=S t=T": 3 metrics a line
    .venv/bin/python bench/bench_pump.py --profile       # + cProfile, top functions by own time

Goal context: the log-tail goal is >= 200k lines/s end to end, so the master's
share must be well under 5 us a line.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=200_000, help="lines per run (default 200000)")
    parser.add_argument("--runs", type=int, default=5, help="runs; the median is reported (default 5)")
    parser.add_argument("--kv", action="store_true", help="key=value lines, so every line yields metrics")
    parser.add_argument("--profile", action="store_true", help="also run once under cProfile")
    args = parser.parse_args()

    from paicli.adapters.python import PythonAdapter
    from paicli.cluster.logsink import InstanceLog, JobLog, MetricParser

    fmt = b"id=%d seq=%d t=%d\n" if args.kv else b"%d %d %d\n"
    blob = b"".join(fmt % (i % 64, i, time.time_ns()) for i in range(args.lines))
    chunks = [blob[i:i + 65536] for i in range(0, len(blob), 65536)]
    work = Path(tempfile.mkdtemp(prefix="bench-pump-"))
    patterns = list(PythonAdapter.metric_patterns)

    def run() -> float:
        inst = InstanceLog(work / "worker-7.0.log", "[worker:7] ", 1 << 40)
        joblog = JobLog(work / "job.log", MetricParser(patterns), 1 << 40)
        t0 = time.process_time()
        for chunk in chunks:
            joblog.lines("job", "worker", 7, inst, inst.feed(chunk))
            joblog.take_metrics()
        dt = time.process_time() - t0
        inst.close()
        joblog.close()
        for f in work.iterdir():
            f.unlink()
        return dt

    try:
        load0 = os.getloadavg()
        times = [run() for _ in range(args.runs)]
        load1 = os.getloadavg()
        med = statistics.median(times)
        print(f"master per-line CPU work ({'key=value' if args.kv else 'plain'} lines, {args.lines} lines, "
              f"median of {args.runs}): {args.lines / med:,.0f} lines per CPU-s, "
              f"{med / args.lines * 1e6:.2f} CPU-us/line (best {args.lines / min(times):,.0f} lines per CPU-s); load {[round(x, 2) for x in load0]} -> "
              f"{[round(x, 2) for x in load1]}")
        if args.profile:
            prof = cProfile.Profile()
            prof.runcall(run)
            pstats.Stats(prof).sort_stats("tottime").print_stats(10)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
