"""A tiny model for `pai tune` tests: its loss has a known optimum at lr = 0.01
(log10 lr = -2) and falls with the steps; one `step=N, loss=X` line per step."""

import argparse
import math
import time

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, required=True)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--sleep", type=float, default=0.1)
args, _ = parser.parse_known_args()   # other parameters of a space are welcome
floor = (math.log10(args.lr) + 2) ** 2
for step in range(1, args.steps + 1):
    print(f"step={step}, loss={floor + 1.0 / step:.6f}", flush=True)
    time.sleep(args.sleep)
