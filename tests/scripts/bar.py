"""A progress bar redrawn with \r, as tqdm draws one: BAR_STEPS states,
BAR_SLEEP seconds apart (0: as fast as it can), then a newline. With
BAR_REPORT=1 it prints how long the redraws took."""

import os
import sys
import time

steps = int(os.environ.get("BAR_STEPS", "20"))
pause = float(os.environ.get("BAR_SLEEP", "0.1"))
width = int(os.environ.get("BAR_WIDTH", "100"))
out = sys.stdout
started = time.perf_counter()
for i in range(steps + 1):
    out.write(("\r" if i else "") + ("%6d/%d |" % (i, steps)).ljust(width - 1, "#") + "|")
    if pause:
        out.flush()
        time.sleep(pause)
out.write("\n")
out.flush()
if os.environ.get("BAR_REPORT"):
    print(f"redraws took {time.perf_counter() - started:.3f}s", flush=True)
