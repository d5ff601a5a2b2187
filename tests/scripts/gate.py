"""A queue test's job: says it started, then waits until the file named by its
first argument exists (at most 120 s), and ends with exit 0."""

import os
import sys
import time

gate = sys.argv[1]
print(f"started {os.environ.get('PAI_JOB_ID')}", flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(gate) and time.monotonic() < deadline:
    time.sleep(0.05)
print("done", flush=True)
