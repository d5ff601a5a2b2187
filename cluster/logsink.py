"""Where the master puts what instances print.

Every chunk an instance writes goes to its own attempt log (raw), and each
complete line also goes to the job's combined log prefixed `[worker:1] `, in
arrival order. Past its cap a file is renamed to `<name>.1` and a new one begun.

Lines are also matched against the plan's metric patterns.
"""

from __future__ import annotations

import collections
import functools
import os
import re
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from paicli.private import open_append_fd, write_private

DEFAULT_CAP = 64 * 1024 * 1024
# At most this many metric-carrying lines of one read are stored: only a flood of
# metric lines is sampled, and the sample is taken among the lines that carry
# metrics, so a burst of warnings cannot push the step lines out.
METRIC_LINES_PER_READ = 16
# ...and at most this many lines of one read are searched for them (an even sample
# of a longer read, with its last line): a burst of a whole run's output is read
# whole, while the search costs a flood of any kind a bounded amount.
SCANNED_LINES_PER_READ = 256


def log_cap() -> int:
    try:
        return max(4096, int(os.environ.get("PAI_LOG_MAX_BYTES", DEFAULT_CAP)))
    except ValueError:
        return DEFAULT_CAP


def job_log_note(job_dir: str) -> Callable[[str], None]:
    """Whole `[pai] ...` lines appended to the job's job.log. The master opens it
    O_APPEND and writes whole lines too, so lines never interleave (a backend's
    staging and provisioning lines, from a process or thread that holds no JobLog)."""
    path = Path(job_dir) / "job.log"
    lock = threading.Lock()

    def note(line: str) -> None:
        data = f"[pai] {line}\n".encode("utf-8", "replace")
        with lock, suppress(OSError):   # a note that cannot be written must not stop the job
            fd = open_append_fd(path)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)

    return note


class CappedFile:
    """A log appended to, readable by its owner only, renamed to `<name>.1` past its cap."""

    def __init__(self, path: Path, cap: int):
        self.path = path
        self.cap = cap
        self.file = open(open_append_fd(path), "ab", buffering=0)
        self.size = self.file.tell()

    def write(self, data: bytes) -> None:
        try:
            if self.size + len(data) > self.cap and self.size:
                self.file.close()
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                self.file = open(open_append_fd(self.path), "ab", buffering=0)
                self.size = 0
            self.file.write(data)
        except OSError as err:
            if err.filename is None:  # say which file: "no space left on device" alone says little
                raise OSError(err.errno, err.strerror, str(self.path)) from None
            raise
        self.size += len(data)

    def close(self) -> None:
        self.file.close()


# A `name=number` pair inside a `<prefix>_pairs` group (MetricParser).
PAIR = re.compile(r"(?<![\w.\-])([A-Za-z_][\w.\-]*)\s*=\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(?![\w.])")


@functools.lru_cache(maxsize=256)
def compiled_pattern(pattern: str) -> tuple[re.Pattern, tuple[str, ...]]:
    """A metric pattern compiled MULTILINE, once per process, and its literal_runs:
    a text without one of them has no match."""
    return re.compile(pattern, re.MULTILINE), literal_runs(pattern)


def literal_runs(pattern: str) -> tuple[str, ...]:
    """Pieces of literal text that every match of `pattern` contains (`=` for a
    `key = value` pattern; `loss = ` and `, step = ` for TensorFlow's hook line),
    read from the pattern's parse tree. () when nothing is certain, or the tree is
    not one this reads (it is re's own, private)."""
    try:
        from re import _constants as sre, _parser
        tree = _parser.parse(pattern, re.MULTILINE)
        if tree.state.flags & re.IGNORECASE:
            return ()
        runs: list[str] = []
        run: list[str] = []

        def cut() -> None:
            if run:
                runs.append("".join(run))
                run.clear()

        def walk(items) -> None:
            for op, av in items:
                if op is sre.LITERAL:
                    run.append(chr(av))
                elif op is sre.SUBPATTERN and not av[1] & re.IGNORECASE:
                    walk(av[3].data)   # (group, add_flags, del_flags, pattern): in line with its neighbours
                elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT) and av[0] >= 1:
                    cut()
                    walk(av[2].data)   # (min, max, pattern): there at least once
                    cut()
                else:
                    cut()

        walk(tree.data)
        cut()
        return tuple(runs)
    except Exception:
        return ()


class MetricParser:
    """Applies the plan's regexes to log text. A pattern with named groups gives a
    metric per group (`(?P<loss>…)`); a pattern with groups `key` and `value`
    gives a metric named by the key's text. A group named `<prefix>_pairs` gives
    each `name=number` pair of its text as `<prefix>_<name>`, and claims its line:
    no key/value pattern reads that line. A line's step is its `step`, `iteration`
    or `global_step` value.

    Each pattern runs once over a whole chunk of lines, compiled MULTILINE; a match
    whose captures run into the next line is ignored, as it would be line by line."""

    STEP_KEYS = ("step", "iteration", "iter", "global_step", "batch")

    def __init__(self, patterns: list[str]):
        self.needs = dict(compiled_pattern(p) for p in patterns)
        self.patterns = list(self.needs)
        self.pairs_patterns = {p for p in self.patterns if any(g.endswith("_pairs") for g in p.groupindex)}

    def patterns_for(self, text: str) -> list[re.Pattern]:
        """The patterns that can match somewhere in `text`: those whose literal
        runs it contains. A regex scan costs time per character even where nothing
        matches (a pattern that starts with a group or an assertion has no
        first-character prefilter in re); the check is a substring search, far cheaper."""
        return [p for p in self.patterns if all(n in text for n in self.needs[p])]

    @staticmethod
    def _matches(pattern: re.Pattern, text: str):
        """(the line's start, match) for each match that stays within its line."""
        for match in pattern.finditer(text):
            newline = text.find("\n", match.start(), match.end())
            if newline != -1 and any(end > newline for _, end in match.regs[1:]):
                continue  # what it captured runs into the next line
            yield text.rfind("\n", 0, match.start()) + 1, match

    def parse(self, line: str) -> tuple[float | None, dict[str, float]]:
        found = self.parse_text(line)
        return found[0] if found else (None, {})

    def parse_text(self, text: str) -> list[tuple[float | None, dict[str, float]]]:
        """(step, metrics) for every line of `text` that has any, in line order."""
        patterns = self.patterns_for(text)
        if not patterns:
            return []
        per_line: dict[int, dict[str, float]] = {}
        claimed = {start for pattern in patterns if pattern in self.pairs_patterns
                   for start, _ in self._matches(pattern, text)}
        for pattern in patterns:
            for start, match in self._matches(pattern, text):
                values = per_line.setdefault(start, {})
                groups = match.groupdict()
                if "key" in groups and "value" in groups:
                    if groups["key"] is not None and groups["value"] is not None and start not in claimed:
                        self._put(values, groups["key"], groups["value"])
                    continue
                for key, found in groups.items():
                    if found is None:
                        continue
                    if key.endswith("_pairs"):
                        for name, number in PAIR.findall(found):
                            self._put(values, f"{key[:-len('_pairs')]}_{name}", number)
                    else:
                        self._put(values, key, found)
        return [(next((values[k] for k in self.STEP_KEYS if k in values), None), values)
                for _, values in sorted(per_line.items()) if values]

    @staticmethod
    def _put(values: dict[str, float], key: str, text: str) -> None:
        try:
            number = float(text)
        except ValueError:
            return
        if number == number and abs(number) != float("inf"):
            values.setdefault(key, number)


# The line an instance is still writing (no newline yet) is kept collapsed: of a
# bar redrawn with \r only its current state. A line without any \r or newline
# is cut into pieces of this size, so no output can grow the master's memory.
MAX_PARTIAL = 1 << 20
# A line still open after this long is shown live (job.live), rewritten at most
# this often: a progress bar's latest state reaches the attached view, while the
# usual line split over two reads never does.
LIVE_DELAY = 0.3
LIVE_INTERVAL = 0.25


class InstanceLog:
    """One instance attempt's output: its file, its partial last line, its tail."""

    def __init__(self, path: Path, prefix: str, cap: int, tail_lines: int = 20):
        self.path = path
        self.prefix = prefix.encode()
        self.file = CappedFile(path, cap)
        # The open line: its current state, and whether a \r is pending (the next
        # text redraws the line, unless it is the newline of a CRLF).
        self.partial = bytearray()
        self.cr = False
        self.line_began: float | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)

    def _extend(self, data: bytes) -> bytes:
        """Add text without a newline to the open line; linear in len(data).
        Returns a piece of an over-long line, cut off as a line of its own."""
        if data and self.line_began is None:
            self.line_began = time.monotonic()
        body = data.rstrip(b"\r")
        last = body.rfind(b"\r")
        if last >= 0:
            self.partial = bytearray(body[last + 1:])
        elif body:
            if self.cr:
                self.partial = bytearray(body)
            else:
                self.partial += body
        if data:
            self.cr = data.endswith(b"\r") or (self.cr and not body)
        if len(self.partial) > MAX_PARTIAL:
            piece, self.partial = bytes(self.partial[:MAX_PARTIAL]) + b"\n", self.partial[MAX_PARTIAL:]
            return piece
        return b""

    def feed(self, data: bytes) -> bytes:
        """Write raw data; return the complete lines it finished, as one chunk
        that ends with a newline (or b"")."""
        self.file.write(data)
        cut = data.rfind(b"\n")
        if cut < 0:
            return self._extend(data)
        head = bytes(self.partial) + (b"\r" if self.cr else b"")
        complete = head + data[:cut + 1]
        self.partial, self.cr, self.line_began = bytearray(), False, None
        if b"\r" in complete:   # what each line finally showed: CRLF endings dropped, a redrawn bar's last state
            complete = b"".join(line.rstrip(b"\r").rsplit(b"\r", 1)[-1] + b"\n" for line in complete[:-1].split(b"\n"))
        return complete + self._extend(data[cut + 1:])

    def live(self, now: float) -> bytes | None:
        """The open line's current state, once it has been open LIVE_DELAY."""
        if self.partial and self.line_began is not None and now - self.line_began >= LIVE_DELAY:
            return bytes(self.partial)
        return None

    def flush(self) -> bytes:
        complete = bytes(self.partial) + b"\n" if self.partial else b""
        self.partial, self.cr, self.line_began = bytearray(), False, None
        return complete

    def close(self) -> None:
        self.file.close()


def sample_points(points: list, most: int) -> list:
    """At most `most` of `points` (a read's lines, or its metric lines), an even
    sample that always keeps the newest, so a flood costs a bounded amount."""
    if len(points) <= most:
        return points
    stride = -(-len(points) // most)
    return points[len(points) - 1::-stride][::-1]


# The combined log is written this many bytes at a time within one round of the
# master's loop, and the rest at the round's end: each write is an inotify event
# that wakes the attached `pai`.
HELD_BYTES = 1 << 16


class JobLog:
    """The combined, prefixed log and the metrics found in it."""

    def __init__(self, path: Path, parser: MetricParser, cap: int):
        self.file = CappedFile(path, cap)
        self.parser = parser
        self.pending_metrics: list[tuple] = []
        # job.live: the open line of every instance that has one (a progress bar),
        # one `[worker:0] state` line each, most recently changed last. Replaced
        # whole (rename), at most every LIVE_INTERVAL; the attached view shows it.
        self.live_path = path.with_name(path.stem + ".live")
        self.open_lines: dict[bytes, InstanceLog] = {}
        self.live_shown: dict[bytes, bytes] = {}
        self.live_written = 0.0
        self.held: list[bytes] | None = None   # hold() .. release(): what is not written yet
        self.held_bytes = 0

    def hold(self) -> None:
        """Until release(), lines are written HELD_BYTES at a time."""
        if self.held is None:
            self.held = []

    def release(self) -> None:
        held, self.held = self.held, None
        self.held_bytes = 0
        if held:
            self.file.write(b"".join(held))

    def _write(self, data: bytes) -> None:
        if self.held is None:
            self.file.write(data)
            return
        self.held.append(data)
        self.held_bytes += len(data)
        if self.held_bytes >= HELD_BYTES:
            self.release()
            self.hold()

    def lines(self, job_id: str, role: str, idx: int, log: InstanceLog, chunk: bytes) -> None:
        """Record a chunk of complete lines (ending with a newline) of one instance."""
        if log.partial:
            self.open_lines[log.prefix] = log
        if not chunk:
            return
        prefix = log.prefix
        self._write(prefix + chunk[:-1].replace(b"\n", b"\n" + prefix) + b"\n")
        text = chunk.decode("utf-8", "replace")
        for line in text.rsplit("\n", log.tail.maxlen + 1)[-(log.tail.maxlen + 1):]:
            if line.strip():
                log.tail.append(line)
        if self.parser.patterns:
            now = time.time()
            if text.count("\n") > SCANNED_LINES_PER_READ:
                text = "\n".join(sample_points(text.split("\n")[:-1], SCANNED_LINES_PER_READ)) + "\n"
            for step, values in sample_points(self.parser.parse_text(text), METRIC_LINES_PER_READ):
                for key, value in values.items():
                    self.pending_metrics.append((job_id, role, idx, now, step, key, value))

    def take_metrics(self) -> list[tuple]:
        """The metrics found since the last call. The master calls this once per
        round of its loop, so it is also where the live lines are refreshed."""
        self.refresh_live(time.monotonic())
        rows, self.pending_metrics = self.pending_metrics, []
        return rows

    def refresh_live(self, now: float, force: bool = False) -> None:
        if not force and now - self.live_written < LIVE_INTERVAL:
            return
        shown: dict[bytes, bytes] = {}
        for prefix, log in list(self.open_lines.items()):
            state = log.live(now)
            if log.partial or log.line_began is not None:
                if state is not None:
                    shown[prefix] = state
            else:
                del self.open_lines[prefix]
        if shown == self.live_shown:
            return
        # Unchanged lines first, the ones that moved last: the view shows the last.
        order = sorted(shown, key=lambda k: (self.live_shown.get(k) != shown[k], k))
        self.live_shown = shown
        self.live_written = now
        text = b"".join(prefix + shown[prefix] + b"\n" for prefix in order)
        try:
            if text:
                write_private(self.live_path, text, sync=False)   # rewritten every moment; a crash loses nothing
            elif self.live_path.exists():
                os.unlink(self.live_path)
        except OSError:
            pass  # a full disk must not stop the job; the complete lines are what count

    def note(self, text: str) -> None:
        """A line from the launcher itself, in the same stream."""
        self._write(f"[pai] {text}\n".encode())

    def close(self) -> None:
        self.release()
        self.open_lines.clear()
        self.refresh_live(time.monotonic(), force=True)
        self.file.close()
