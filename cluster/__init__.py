"""The launcher side: the master, the backends, placement, the queue."""

from pathlib import Path

# runners/ beside cluster/, in the source tree and in the installed package alike
# (paicli/cluster next to paicli/runners): the files nodes and instances are given.
RUNNERS_DIR = Path(__file__).resolve().parent.parent / "runners"
