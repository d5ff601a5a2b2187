#!/usr/bin/env python3
"""Placement speed: 10,000 instances on 1,000 nodes (issue 8 goal: <= 1 s).

Times `paicli.cluster.placement.place_plan` alone (no processes, no store): a
job of 100 ps (spread) + 9,900 workers (bin-packed, half a GPU each) on 1,000
nodes of 16 cores, 64 GB and 12 GPUs, some cards already held by other jobs.
Prints the median and worst of `--reps` runs, with the machine's load.

    .venv/bin/python bench/bench_placement.py               # 10,000 on 1,000
    .venv/bin/python bench/bench_placement.py --instances 100000 --nodes 10000
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from paicli.cluster import placement as placing
from paicli.cluster.backends.base import NodeSpec
from paicli.jobplan import JobPlan, RolePlan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=1_000)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    nodes = [NodeSpec(f"n{i}", f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}", 1600, 64000,
                      tuple(str(g) for g in range(12))) for i in range(args.nodes)]
    held = {f"n{i}": {"0", "1"} for i in range(0, args.nodes, 3)}  # other jobs hold 2 cards on every third node
    ps = max(1, args.instances // 100)
    plan = JobPlan("bench", "python", "T", [
        RolePlan("ps", ps, ["true"], must_finish=False, cpu=100, memory=2000),
        RolePlan("worker", args.instances - ps, ["true"], cpu=100, memory=2000, gpu=50)])
    times = []
    for _ in range(args.reps):
        started = time.perf_counter()
        placed = placing.place_plan(plan, nodes, held)
        times.append(time.perf_counter() - started)
    used = len({p.node for p in placed})
    print(f"placement of {len(placed)} instances on {args.nodes} nodes ({used} used): "
          f"median {statistics.median(times):.3f} s, worst {max(times):.3f} s over {args.reps} runs "
          f"(goal <= 1 s; load {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
