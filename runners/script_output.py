"""How a framework runner's script output reaches the job: every line whole.

Standard library only: it runs inside any framework's Python (Python 3.9 in Caffe's
root filesystem). The runners import it as a sibling module, staged with them on
every node, as they import runtime_lock.

Every instance starts under `python -u`, where `print(x)` writes x and then its
newline: two writes. stderr shares the instance's pipe with stdout, so a line that
another thread logs, or the framework's C++ logging writes, between the two breaks
both: `step=413, loss=7.25[23:00:00] ...`, a step line the metric parser no longer
reads. The peer tf_cnn_benchmarks lost its step-1 line so: its GlobalStepWatcher
thread logs "Starting real work" just as a worker prints step 1.
"""

from __future__ import annotations

import sys


def whole_lines() -> None:
    """stdout and stderr line-buffered without write-through: a line stays in the
    stream until its newline (or a carriage return, so a progress bar still redraws)
    and goes out in one write, as a terminal's line buffering has it. Output stays
    live line by line; text printed with no newline at all waits for the next one
    or for the end of the process."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True, write_through=False)
        except (AttributeError, ValueError):   # not a TextIOWrapper, or closed
            pass
