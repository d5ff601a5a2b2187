"""Provisioning progress (runtimes and requirements layers) as the user sees it.

The provisioning code (runners/runtimes.py) reports its own phases and, indented by
DETAIL, every line of the tools it runs (pip, debootstrap). Here:

- on a terminal, one line redrawn in place: a bar over the phases, the phase,
  packages seen, megabytes downloaded, time elapsed (at each line pip prints);
- in a pipe, one line per phase (a new step of pip or debootstrap is a phase),
  never the tools' own lines.

`Tracker` is the pure part (lines -> state), unit-tested.
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from collections.abc import Callable
from typing import TextIO

DETAIL = "  "   # what runners/runtimes.py puts before a tool's own output line
PREFIX = "runtime: "

# A tool's line -> (step, package name or None, megabytes or None)
STEPS: list[tuple[re.Pattern, str]] = [
    (re.compile(r"^Collecting (?P<pkg>[^\s(]+)"), "collecting"),
    (re.compile(r"^Downloading \S+ \((?P<size>[\d.]+) (?P<unit>kB|MB|GB)\)"), "downloading"),
    (re.compile(r"^Installing collected packages"), "installing"),
    (re.compile(r"^I: Retrieving (?P<pkg>\S+)"), "retrieving"),
    (re.compile(r"^I: (Validating|Checking)"), "validating"),
    (re.compile(r"^I: (Extracting|Unpacking) (?P<pkg>\S+)?"), "unpacking"),
    (re.compile(r"^I: (Installing|Configuring) (?P<pkg>\S+)?"), "configuring"),
]
ORDER = ["", "collecting", "downloading", "retrieving", "validating", "unpacking", "installing", "configuring",
         "ready"]
UNITS = {"kB": 1e-3, "MB": 1.0, "GB": 1e3}


def clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"


class Tracker:
    """The state of one provisioning, from its lines."""

    def __init__(self, now: float | None = None):
        self.started = time.monotonic() if now is None else now
        self.phase = ""          # the last phase line of our own
        self.step = ""           # the tool's current step (collecting, downloading, ...)
        self.packages: set[str] = set()
        self.mb = 0.0
        self.done = False

    def feed(self, line: str) -> str | None:
        """Take one line; what changed: "phase", "step", or None (only counts)."""
        if not line.startswith(DETAIL):
            self.phase, self.step = line, ""
            # The last line of a provisioning: ready, or failed (its error is printed next).
            self.done = " ready" in line or line.endswith(("ready", " failed"))
            if self.done:
                self.step = "ready"
            return "phase"
        text = line.strip()
        for pattern, step in STEPS:
            match = pattern.match(text)
            if not match:
                continue
            groups = match.groupdict()
            if groups.get("pkg"):
                self.packages.add(groups["pkg"])
            if groups.get("size"):
                self.mb += float(groups["size"]) * UNITS[groups["unit"]]
            # Steps only move forward (pip collects and downloads package by package):
            # a pipe gets one line per step, not one per package.
            if ORDER.index(step) > ORDER.index(self.step):
                self.step = step
                return "step"
            return None
        return None

    def fraction(self) -> float:
        if self.done:
            return 1.0
        return ORDER.index(self.step) / (len(ORDER) - 1) if self.step in ORDER else 0.0

    def summary(self, now: float | None = None) -> str:
        elapsed = (time.monotonic() if now is None else now) - self.started
        parts = [self.step or "starting"]
        if self.packages:
            parts.append(f"{len(self.packages)} packages")
        if self.mb:
            parts.append(f"{self.mb:.0f} MB" if self.mb >= 10 else f"{self.mb:.1f} MB")
        parts.append(clock(elapsed))
        return ", ".join(parts)


def bar(fraction: float, width: int = 12) -> str:
    filled = int(round(fraction * width))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


class _Terminal:
    """One line redrawn in place at each line of progress (no thread of its own: a
    ticker would redraw over whatever the command prints after a failure)."""

    def __init__(self, stream: TextIO, width: int | None = None):
        self.stream = stream
        self.width = width or max(40, shutil.get_terminal_size((100, 24)).columns - 1)
        self.tracker = Tracker()
        self.open = False

    def __call__(self, line: str) -> None:
        if self.tracker.done and not line.startswith(DETAIL):
            self.tracker = Tracker()   # a second provisioning (a layer after a runtime)
        self.tracker.feed(line)
        self._draw()
        if self.tracker.done:
            self.stream.write("\n")
            self.stream.flush()
            self.open = False

    def _draw(self) -> None:
        t = self.tracker
        text = f"{PREFIX}{bar(t.fraction())} " + (t.phase if t.done else f"{t.summary()} | {t.phase}")
        self.stream.write("\r\x1b[2K" + text[:self.width])
        self.stream.flush()
        self.open = not t.done

def provisioning_progress(stream: TextIO | None = None, tty: bool | None = None) -> Callable[[str], None]:
    """The progress callback for provisioning: a redrawn bar on a terminal, one line
    per phase in a pipe."""
    stream = stream or sys.stderr
    if tty if tty is not None else stream.isatty():
        return _Terminal(stream)
    tracker = Tracker()

    def plain(line: str) -> None:
        nonlocal tracker
        if tracker.done and not line.startswith(DETAIL):
            tracker = Tracker()
        changed = tracker.feed(line)
        if changed == "phase":
            stream.write(f"{PREFIX}{line}\n")
        elif changed == "step" and tracker.step != "ready":
            stream.write(f"{PREFIX}  {tracker.summary()}\n")
        stream.flush()

    return plain
