"""Where the master puts what instances print.

Every chunk an instance writes goes to its own attempt log (raw), and each
complete line also goes to the job's combined log prefixed `[worker:1] `, in the
order the master received it: the CLI tails that one file, so lines from
different instances reach the terminal in arrival order. Files are capped: past
the cap the file is renamed to `<name>.1` (replacing the previous one) and a new
one begun, so the tail is always kept.

Lines are also matched against the plan's metric patterns.
"""

from __future__ import annotations

import collections
import os
import re
import time
from pathlib import Path

DEFAULT_CAP = 64 * 1024 * 1024
# At most this many lines of one read (a few KB of one instance's output) are
# searched for metrics. A training loop prints a metric line per step, far fewer
# than this between two reads; only a flood is sampled.
METRIC_LINES_PER_READ = 16


def log_cap() -> int:
    try:
        return max(4096, int(os.environ.get("PAI_LOG_MAX_BYTES", DEFAULT_CAP)))
    except ValueError:
        return DEFAULT_CAP


class CappedFile:
    def __init__(self, path: Path, cap: int):
        self.path = path
        self.cap = cap
        self.file = open(path, "ab", buffering=0)
        self.size = self.file.tell()

    def write(self, data: bytes) -> None:
        if self.size + len(data) > self.cap and self.size:
            self.file.close()
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            self.file = open(self.path, "ab", buffering=0)
            self.size = 0
        self.file.write(data)
        self.size += len(data)

    def close(self) -> None:
        self.file.close()


class MetricParser:
    """Applies the plan's regexes to log text. A pattern with named groups gives a
    metric per group (`(?P<loss>…)`); a pattern with groups `key` and `value`
    gives a metric named by the key's text. A line's step is its `step`,
    `iteration` or `global_step` value.

    Each pattern runs once over a whole chunk of lines (in C), and Python only
    touches the matches: a log without metrics costs almost nothing per line.
    Patterns are compiled MULTILINE so `^`/`$` mean a line's start and end; a
    match whose captures run into the next line is ignored, as it would be line
    by line."""

    STEP_KEYS = ("step", "iteration", "iter", "global_step", "batch")

    def __init__(self, patterns: list[str]):
        self.patterns = [re.compile(p, re.MULTILINE) for p in patterns]

    def parse(self, line: str) -> tuple[float | None, dict[str, float]]:
        found = self.parse_text(line)
        return found[0] if found else (None, {})

    def parse_text(self, text: str) -> list[tuple[float | None, dict[str, float]]]:
        """(step, metrics) for every line of `text` that has any, in line order."""
        per_line: dict[int, dict[str, float]] = {}
        for pattern in self.patterns:
            for match in pattern.finditer(text):
                newline = text.find("\n", match.start(), match.end())
                if newline != -1 and any(end > newline for _, end in match.regs[1:]):
                    continue  # what it captured runs into the next line
                start = text.rfind("\n", 0, match.start()) + 1
                values = per_line.setdefault(start, {})
                groups = match.groupdict()
                if "key" in groups and "value" in groups:
                    if groups["key"] is not None and groups["value"] is not None:
                        self._put(values, groups["key"], groups["value"])
                    continue
                for key, found in groups.items():
                    if found is not None:
                        self._put(values, key, found)
        out = []
        for start in sorted(per_line):
            values = per_line[start]
            if values:
                out.append((next((values[k] for k in self.STEP_KEYS if k in values), None), values))
        return out

    @staticmethod
    def _put(values: dict[str, float], key: str, text: str) -> None:
        try:
            number = float(text)
        except ValueError:
            return
        if number == number and abs(number) != float("inf"):
            values.setdefault(key, number)


def _last_redraw(line: bytes) -> bytes:
    """What a line finally showed: CRLF endings dropped, and of a progress bar
    redrawn with \r only its last state."""
    if b"\r" not in line:
        return line
    line = line.rstrip(b"\r")
    return line.rsplit(b"\r", 1)[-1]


class InstanceLog:
    """One instance attempt's output: its file, its partial last line, its tail."""

    def __init__(self, path: Path, prefix: str, cap: int, tail_lines: int = 20):
        self.path = path
        self.prefix = prefix.encode()
        self.file = CappedFile(path, cap)
        self.partial = b""
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)

    def feed(self, data: bytes) -> bytes:
        """Write raw data; return the complete lines it finished, as one chunk
        that ends with a newline (or b"")."""
        self.file.write(data)
        cut = data.rfind(b"\n")
        if cut < 0:
            self.partial += data
            return b""
        complete, self.partial = self.partial + data[:cut + 1], data[cut + 1:]
        if b"\r" in complete:
            complete = b"".join(_last_redraw(line) + b"\n" for line in complete[:-1].split(b"\n"))
        return complete

    def flush(self) -> bytes:
        if not self.partial:
            return b""
        complete, self.partial = _last_redraw(self.partial) + b"\n", b""
        return complete

    def close(self) -> None:
        self.file.close()


class JobLog:
    """The combined, prefixed log and the metrics found in it."""

    def __init__(self, path: Path, parser: MetricParser, cap: int):
        self.file = CappedFile(path, cap)
        self.parser = parser
        self.pending_metrics: list[tuple] = []

    def lines(self, job_id: str, role: str, idx: int, log: InstanceLog, chunk: bytes) -> None:
        """Record a chunk of complete lines (ending with a newline) of one instance."""
        if not chunk:
            return
        prefix = log.prefix
        self.file.write(prefix + chunk[:-1].replace(b"\n", b"\n" + prefix) + b"\n")
        text = chunk.decode("utf-8", "replace")
        for line in text.rsplit("\n", log.tail.maxlen + 1)[-(log.tail.maxlen + 1):]:
            if line.strip():
                log.tail.append(line)
        if self.parser.patterns:
            now = time.time()
            lines = text.count("\n")
            if lines > METRIC_LINES_PER_READ:
                # A flood: parse an even sample of the chunk's lines, always with
                # its last one, so metrics cost the log path a bounded amount.
                every = text.split("\n")[:-1]
                stride = -(-len(every) // METRIC_LINES_PER_READ)
                sample = every[len(every) - 1::-stride][::-1]
                text = "\n".join(sample) + "\n"
            for step, values in self.parser.parse_text(text):
                for key, value in values.items():
                    self.pending_metrics.append((job_id, role, idx, now, step, key, value))

    def take_metrics(self) -> list[tuple]:
        rows, self.pending_metrics = self.pending_metrics, []
        return rows

    def note(self, text: str) -> None:
        """A line from the launcher itself, in the same stream."""
        self.file.write(f"[pai] {text}\n".encode())

    def close(self) -> None:
        self.file.close()
