#!/usr/bin/env python3
"""`pai tune` with pruning vs the same trials run to completion (issue 19 goals:
the best metric within 2% of the full run's best, with <= 50% of its trial-seconds).

1. A 24-trial sweep (`--pruner`, default sha; TPE, seeded) of tests/scripts/tune_quad.py,
   a model whose loss falls with the steps to a floor lowest at lr = 0.01
   (`--steps` steps of `--sleep` s each), `--parallel` trials at a time.
2. The same 24 learning rates, every one run to completion (a grid over them, no pruner).

Trial-seconds: the sum over trials of each trial job's run time, from its start to the
end of its last instance, as the store records them (a pruned trial's instances end when
its cancel has stopped them). Prints
both bests, their gap, both sums, their ratio, each sweep's wall time and the load.

    .venv/bin/python bench/bench_tune.py                  # 24 trials, 2 at a time, ~1.5 min
    .venv/bin/python bench/bench_tune.py --pruner median --seed 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "scripts" / "tune_quad.py"


def sweep(home: Path, name: str, space: str, args, extra: list[str]) -> tuple[dict, float]:
    path = home.parent / f"{name}.yaml"
    path.write_text(space)
    env = {**os.environ, "PAI_HOME": str(home), "PAI_LOGVIEW": "file", "NO_COLOR": "1"}
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "paicli", "tune", "-name", "python", f"-Dscript={MODEL}",
                          f"-DuserDefinedParameters=--steps {args.steps} --sleep {args.sleep}",
                          "--space", str(path), "--trials", str(args.trials), "--parallel", str(args.parallel),
                          "--study", name, *extra], env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    if run.returncode != 0:
        raise SystemExit(f"{name}: pai tune exited {run.returncode}\n{run.stdout}\n{run.stderr}")
    view = json.loads(subprocess.run([sys.executable, "-m", "paicli", "tune", "status", name, "--json"], env=env,
                                     capture_output=True, text=True, check=True).stdout)
    return view, wall


def trial_seconds(home: Path, view: dict) -> float:
    from paicli.store import Store

    store = Store(home)
    try:
        total = 0.0
        for trial in view["trials"]:
            job = store.job(trial["job_id"])
            # to the last instance's end: a cancel records the job's end first, then stops them
            ended = max([job["ended"] or time.time(), *(i["ended"] or 0 for i in store.instances(job["id"]))])
            total += ended - (job["started"] or job["created"])
        return total
    finally:
        store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sleep", type=float, default=0.1)
    parser.add_argument("--pruner", default="sha", choices=("median", "sha", "hyperband"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="Also write the figures to this file.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tune-") as tmp:
        home = Path(tmp) / "home"
        pruned, pruned_wall = sweep(home, "pruned", "lr: {type: loguniform, low: 1e-3, high: 1e-1}\n", args,
                                    ["--pruner", args.pruner, "--seed", str(args.seed)])
        lrs = [t["params"]["lr"] for t in pruned["trials"]]
        full, full_wall = sweep(home, "full", "lr: {type: choice, values: %s}\n" % json.dumps(lrs), args,
                                ["--sampler", "grid", "--pruner", "none"])
        assert sorted(t["params"]["lr"] for t in full["trials"]) == sorted(lrs), "the full run ran other trials"
        seconds = {"pruned": trial_seconds(home, pruned), "full": trial_seconds(home, full)}
    best_p, best_f = pruned["best"]["value"], full["best"]["value"]
    gap = (best_p - best_f) / abs(best_f)
    ratio = seconds["pruned"] / seconds["full"]
    load = os.getloadavg()[0]
    print(f"pai tune, {args.trials} trials x {args.steps} steps of {args.sleep:g} s, {args.parallel} at a time, "
          f"TPE seed {args.seed}, pruner {args.pruner}: {pruned['pruned']} pruned")
    print(f"  best loss: pruned sweep {best_p:.6f} (lr={pruned['best']['params']['lr']:.5g}), "
          f"full run {best_f:.6f} (lr={full['best']['params']['lr']:.5g}): gap {gap:+.2%} (goal <= 2%)")
    print(f"  trial-seconds: pruned {seconds['pruned']:.1f} s, full {seconds['full']:.1f} s: "
          f"{ratio:.0%} (goal <= 50%)")
    print(f"  wall: pruned sweep {pruned_wall:.1f} s, full run {full_wall:.1f} s (load {load:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"best_pruned": best_p, "best_full": best_f, "gap": gap,
                                               "seconds": seconds, "ratio": ratio, "pruned": pruned["pruned"],
                                               "wall": [pruned_wall, full_wall], "load": load}, indent=2))
    return 0 if gap <= 0.02 and ratio <= 0.5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
