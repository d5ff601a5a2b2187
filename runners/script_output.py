"""How a framework runner's script output reaches the job: every line whole.

Standard library only. Under `python -u`, `print(x)` writes x and then its
newline: two writes, between which another thread or the framework's C++ logging
can write to the shared pipe and break a step line the metric parser then misses.
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
