"""Issue 12: the defects found by trying the core as a new user would. Each test
here failed before its fix."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import BEHAVE, PAI, default_signals, job_id_from, pai, pai_json, wait_until
from paicli.cluster import logsink
from paicli.cluster.logsink import InstanceLog, JobLog, MetricParser
from paicli.plan import KEY_VALUE_METRIC

BAR = Path(__file__).resolve().parent / "scripts" / "bar.py"


# -- 1. progress bars ----------------------------------------------------------------


def _bar_states(count: int, width: int = 100) -> list[bytes]:
    return [(b"%6d/%d |" % (i, count)).ljust(width - 1, b"#") + b"|" for i in range(count + 1)]


def test_a_redrawn_line_is_kept_collapsed_and_its_complete_line_is_unchanged(tmp_path):
    """300,000 redraws of a 100-character bar, read the way a 4 KB pipe hands
    them over: the open line never holds more than one state."""
    log = InstanceLog(tmp_path / "w.log", "[worker:0] ", cap=1 << 40)
    states = _bar_states(300_000)
    stream = b"epoch 1\n" + b"\r".join(states) + b"\n" + b"done\n"
    largest = 0
    out = []
    for i in range(0, len(stream), 4096):
        out.append(log.feed(stream[i:i + 4096]))
        largest = max(largest, len(log.partial))
    log.close()
    assert b"".join(out) == b"epoch 1\n" + states[-1] + b"\n" + b"done\n"
    assert largest <= 100
    assert (tmp_path / "w.log").stat().st_size == len(stream)  # the instance's own log stays raw


def test_redraw_edge_cases_match_what_a_whole_line_shows(tmp_path):
    """Byte by byte or at once, the complete line is the same (CRLF, \\r\\r, a
    trailing \\r, a redraw that starts the next read)."""
    cases = [b"a\r\n", b"ab\rcd\r\n", b"x\r\ry\n", b"bar 10%\rbar 100%\r\n", b"plain\n", b"\r\rz\n",
             b"one\rtwo\rthree", b"k\r"]
    for case in cases:
        whole = InstanceLog(Path("/dev/null"), "[w:0] ", cap=1 << 40)
        expected = whole.feed(case) + whole.flush()
        byte = InstanceLog(Path("/dev/null"), "[w:0] ", cap=1 << 40)
        got = b"".join(byte.feed(case[i:i + 1]) for i in range(len(case))) + byte.flush()
        assert got == expected, case
    assert expected == b"k\n"


def test_a_line_without_end_is_cut_so_memory_stays_bounded(tmp_path):
    log = InstanceLog(Path("/dev/null"), "[w:0] ", cap=1 << 40)
    pieces = [log.feed(b"x" * 65536) for _ in range(40)]
    assert len(log.partial) <= logsink.MAX_PARTIAL
    cut = b"".join(pieces)
    assert cut.count(b"\n") == (40 * 65536) // logsink.MAX_PARTIAL and set(cut.replace(b"\n", b"")) == {ord("x")}


def test_an_open_line_is_shown_live_and_removed_when_it_completes(tmp_path, monkeypatch):
    job = JobLog(tmp_path / "job.log", MetricParser([KEY_VALUE_METRIC]), cap=1 << 20)
    log = InstanceLog(tmp_path / "w.log", "[worker:0] ", cap=1 << 20)
    job.lines("j", "worker", 0, log, log.feed(b"start\n 10%\r 20%"))
    live = tmp_path / "job.live"
    job.refresh_live(time.monotonic(), force=True)
    assert not live.exists()  # a line split over two reads is never shown
    job.refresh_live(time.monotonic() + 1, force=True)
    assert live.read_bytes() == b"[worker:0]  20%\n"
    assert stat.S_IMODE(live.stat().st_mode) == 0o600
    job.lines("j", "worker", 0, log, log.feed(b"\r 30%\r100%\n"))
    job.refresh_live(time.monotonic() + 2, force=True)
    assert not live.exists()
    job.close()
    assert (tmp_path / "job.log").read_bytes() == b"[worker:0] start\n[worker:0] 100%\n"


def test_a_progress_bar_reaches_the_attached_terminal_before_its_line_ends(pai_home):
    """A real job redraws a bar for a few seconds; `pai` on a terminal shows its
    states while it runs, and the combined log gets only the finished line."""
    import pty

    env = dict(os.environ, BAR_STEPS="40", BAR_SLEEP="0.1")
    env.pop("NO_COLOR", None)
    pid, fd = pty.fork()
    if pid == 0:
        default_signals()
        os.execvpe(PAI[0], [*PAI, "-name", "python", f"-Dscript={BAR}"], env)
    chunks = []
    try:
        while True:
            try:
                data = os.read(fd, 4096)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    out = b"".join(chunks).decode()
    assert os.waitstatus_to_exitcode(status) == 0, out
    shown = [int(part.split("/")[0].split()[-1]) for part in out.split("\r") if "/40 |" in part]
    assert len([s for s in shown if 0 < s < 40]) >= 3, out  # intermediate states, live
    job_id = job_id_from(out)
    combined = (pai_home / "jobs" / job_id / "job.log").read_text()
    assert combined.splitlines()[0] == "[worker:0] " + "    40/40 |".ljust(99, "#") + "|"
    assert not (pai_home / "jobs" / job_id / "job.live").exists()
