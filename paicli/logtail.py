"""Following a job in the terminal: its log lines live, progress lines, summary.

Following the job's combined log keeps arrival order; on a TTY each prefix is
coloured by instance. After the job ends the file is read once more to its end.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import select
import signal
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO

from paicli import client, jobstatus
from paicli.states import InstanceStatus, JobStatus
from paicli.store import Store

COLOURS = (36, 32, 33, 35, 34, 91, 92, 93, 94, 95, 96)
PREFIX = re.compile(rb"^\[([A-Za-z0-9_]+:\d+)\] ", re.M)
NOTE = re.compile(rb"^\[pai\] .*$", re.M)
STATUS_POLL = 0.25
EARLY_POLL, EARLY_SECONDS = 0.05, 2.0  # the pace of status looks in a job's first seconds
IDLE_SLEEP = 0.005  # where inotify is missing: how soon a new line is seen
IDLE_CHECK = 5.0  # how often the attached view looks for workers gone quiet


def use_colour(stream: IO) -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return hasattr(stream, "isatty") and stream.isatty()


def _colour_prefix(match: re.Match) -> bytes:
    name = match.group(1)
    colour = COLOURS[zlib.crc32(name) % len(COLOURS)]
    return b"\x1b[%dm[%s]\x1b[0m " % (colour, name)


def colourise(chunk: bytes) -> bytes:
    chunk = PREFIX.sub(_colour_prefix, chunk)
    return NOTE.sub(lambda m: b"\x1b[2m" + m.group(0) + b"\x1b[0m", chunk)


class FileFollower:
    """Reads a growing file from an offset; survives the writer's rotation
    (rename to .1 and a new file) by finishing the old file first."""

    def __init__(self, path: Path, offset: int | str = 0):
        self.path = path
        self.file: IO[bytes] | None = None
        self.inode: int | None = None
        self.start = offset

    def _open(self) -> bool:
        try:
            self.file = open(self.path, "rb")
        except FileNotFoundError:
            return False
        self.inode = os.fstat(self.file.fileno()).st_ino
        if self.start == "end":
            self.file.seek(0, os.SEEK_END)
        elif self.start:
            self.file.seek(int(self.start))
        self.start = 0
        return True

    def read(self) -> bytes:
        if self.file is None and not self._open():
            return b""
        assert self.file is not None
        data = self.file.read(1 << 20)
        if data:
            return data
        try:
            inode = os.stat(self.path).st_ino
        except FileNotFoundError:
            return b""
        if inode != self.inode:  # rotated: the old file is finished, start the new one
            self.file.close()
            self.file = None
            return self.read()
        return b""

    def close(self) -> None:
        if self.file:
            self.file.close()


@functools.lru_cache(maxsize=1)
def inotify_libc():
    """libc through ctypes, for inotify: loaded once per process."""
    return ctypes.CDLL(None, use_errno=True)


class DirectoryWatch:
    """Wakes a follower when a file in a folder changes (Linux inotify, through
    ctypes), so an idle `pai` sleeps instead of polling and a new line is shown
    as soon as it is written. Where inotify is missing, `wait` just sleeps."""

    IN_MODIFY, IN_MOVED_TO, IN_CREATE = 0x2, 0x80, 0x100

    def __init__(self, folder: Path):
        self.fd = self.wd = -1
        self.libc = None
        self._released = -1   # a descriptor whose watch is removed, closed by close()
        try:
            libc = inotify_libc()
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            wd = libc.inotify_add_watch(fd, os.fsencode(folder),
                                        self.IN_MODIFY | self.IN_MOVED_TO | self.IN_CREATE) if fd >= 0 else -1
            if wd >= 0:
                self.fd, self.wd, self.libc = fd, wd, libc
            elif fd >= 0:
                os.close(fd)
        except (OSError, AttributeError):
            self.fd = -1

    def wait(self, timeout: float, also: int = -1, exited: int = -1) -> bool:
        """Sleep until a file in the folder changes, `timeout` passes, the
        optional fd `also` (a signal wake-up pipe) becomes readable, or the process
        of the pidfd `exited` ends (then nothing short-polls: its exit wakes us).
        True when that process has ended."""
        fds = [fd for fd in (self.fd, also, exited) if fd >= 0]
        if not fds:
            # A look that came due while the last step ran asks for a negative wait:
            # time.sleep raised on it (`pai` ended an attached job with an internal error).
            time.sleep(min(max(timeout, 0), IDLE_SLEEP))
            return False
        if self.fd < 0 and exited < 0:
            timeout = min(timeout, IDLE_SLEEP)
        ended = False
        for fd in select.select(fds, [], [], max(timeout, 0))[0]:
            if fd == exited:
                ended = True   # a pidfd: readable once the process is gone, nothing to read
                continue
            try:
                while os.read(fd, 65536):
                    pass
            except BlockingIOError:
                pass
        return ended

    def close(self) -> None:
        self.release()
        if self._released >= 0:
            os.close(self._released)
            self._released = -1

    def release(self) -> None:
        """Stop watching now; the descriptor is closed by close(). Closing an
        inotify descriptor right after its watch is removed (or with the watch in
        place, as the process's exit does) waits for the kernel to reap the watch;
        a moment after the removal, the close does not wait. So a follower releases
        at the verdict and closes as it leaves."""
        if self.fd >= 0:
            self.libc.inotify_rm_watch(self.fd, self.wd)
            self._released, self.fd, self.wd = self.fd, -1, -1


class LiveLine:
    """The bottom line of a terminal: the latest state of a line an instance is
    still redrawing (a progress bar), from the master's `job.live` (one line per
    instance with an open line, the most recently changed last). Whole lines are
    written above it; it is cleared before they are and drawn again after."""

    def __init__(self, path: Path, out: IO[bytes], colour: bool):
        self.path = path
        self.out = out
        self.colour = colour
        self.stamp: tuple | None = None
        self.text = b""  # what the file says
        self.shown = b""  # what is on the screen now

    def _width(self) -> int:
        try:
            columns = os.get_terminal_size(self.out.fileno()).columns
        except (OSError, AttributeError, ValueError):
            columns = 0
        return max(20, columns - 1) if columns else 79  # a terminal of unknown size says 0

    def poll(self) -> None:
        """Read job.live if it changed and show its last line."""
        try:
            st = os.stat(self.path)
            stamp: tuple | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp == self.stamp:
            return
        self.stamp = stamp
        text = b""
        if stamp is not None:
            try:
                lines = self.path.read_bytes().splitlines()
            except OSError:
                lines = []
            text = lines[-1] if lines else b""
        # Cut to the terminal's width (a wrapped line cannot be redrawn in place).
        self.text = text.decode("utf-8", "replace")[:self._width()].encode()
        self.draw()

    def hide(self) -> None:
        if self.shown:
            self.out.write(b"\r\x1b[K")
            self.shown = b""

    def draw(self) -> None:
        if self.text == self.shown:
            return
        self.out.write(b"\r\x1b[K" + (colourise(self.text) if self.colour else self.text))
        self.shown = self.text
        self.out.flush()


def idle_note(idle: list[dict]) -> str | None:
    """A line for the attached view when running workers have gone quiet."""
    if not idle:
        return None
    names = ", ".join(i["instance"] for i in idle)
    quiet = min(i["seconds"] for i in idle)
    return f"[pai] no output from {names} for {quiet / 60:.0f} min while the job runs: it may be hung"


def progress_line(task_name: str, instances: list) -> tuple[tuple[int, int, int], str]:
    total = len(instances)
    running = sum(i["status"] == InstanceStatus.RUNNING.value for i in instances)
    terminated = sum(InstanceStatus(i["status"]).is_terminal() for i in instances)
    pct = int(100 * terminated / total) if total else 0
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return (running, terminated, total), f"train: {stamp} {task_name}_job:{running}/{terminated}/{total}[{pct}%]"


class InterruptCatcher:
    """Ctrl-C while following, counted instead of raised.

    A KeyboardInterrupt can land between any two statements, outside the `try`
    meant to catch it. So while a job is followed, SIGINT only sets a flag and wakes
    the follower through a pipe; the loop acts on it at a known point. Off the main
    thread, or with SIGINT ignored, nothing changes."""

    def __init__(self):
        self.count = 0
        self.handled = False
        self.wake_fd = -1
        self._write_fd = -1
        self._previous = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        self.wake_fd, self._write_fd = read_fd, write_fd
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame) -> None:
        self.count += 1
        try:
            os.write(self._write_fd, b"\0")
        except OSError:
            pass

    def take(self) -> bool:
        if self.count:
            self.count -= 1
            return True
        return False

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        for fd in (self.wake_fd, self._write_fd):
            if fd >= 0:
                os.close(fd)
        self.wake_fd = self._write_fd = -1


def follow_job(store: Store, job_id: str, out: IO[bytes], *, from_end: bool = False,
               progress: bool = True, colour: bool = False,
               on_interrupt: Callable[[], None] | None = None, recorded_fd: int = -1) -> dict:
    """Tail the job's combined log to `out` until the job ends; print progress lines
    when running/terminated counts change. The first Ctrl-C calls `on_interrupt`
    (which cancels the job) and following goes on, so the lines written while the
    job stops are shown too. Returns the final status dict. `recorded_fd` (closed
    here): a pipe the master closes once the job's record is complete, the end of
    following an ended job without waiting for the master's own exit."""
    job = store.job(job_id)
    job_dir = Path(job["job_dir"])
    follower = FileFollower(job_dir / "job.log", "end" if from_end else 0)
    live = LiveLine(job_dir / "job.live", out, colour) if hasattr(out, "isatty") and out.isatty() else None
    state = {"counts": None, "next_check": 0.0, "partial": b"", "watch": DirectoryWatch(job_dir),
             "live": live, "idle_check": time.monotonic(), "idle": [], "recorded_fd": recorded_fd}
    catcher = InterruptCatcher() if on_interrupt is not None else None
    try:
        if catcher:
            catcher.install()
            state["wake_fd"] = catcher.wake_fd
        while True:
            if _follow_step(store, job_id, follower, out, progress, colour, state):
                break
            if catcher and catcher.take():
                if catcher.handled:
                    raise KeyboardInterrupt  # the second Ctrl-C: stop waiting
                catcher.handled = True
                on_interrupt()
    finally:
        if catcher:
            catcher.restore()
        if live is not None:
            live.hide()
            out.flush()
        follower.close()
        state["watch"].close()
        for fd in {state.get("master_exit", -1), recorded_fd} - {-1}:
            os.close(fd)
    return client.final_status(store, job_id)


def _write(out: IO[bytes], state: dict, data: bytes) -> None:
    """Whole lines above the live line."""
    live = state.get("live")
    if live is not None:
        live.hide()
    out.write(data)
    out.flush()


def _follow_step(store: Store, job_id: str, follower: FileFollower, out: IO[bytes], progress: bool,
                 colour: bool, state: dict) -> bool:
    """One step of following; True once the job has ended and its log is read out.

    Only whole lines are written: a read can end inside a line the master is still
    writing, and a progress line must not land in the middle of it."""
    data = follower.read()
    if data:
        data = state["partial"] + data
        cut = data.rfind(b"\n") + 1
        state["partial"] = data[cut:]
        if cut:
            _write(out, state, colourise(data[:cut]) if colour else data[:cut])
            if b"[pai] job " in data[:cut]:
                state["next_check"] = 0.0  # the master's verdict: look at the job now
        if state["live"] is not None:
            state["live"].stamp = None  # hidden by these lines: draw it again
            state["live"].poll()
        if time.monotonic() < state["next_check"]:
            return False
        # Due for a look at the job even while lines keep coming: a chatty job
        # must not hold back its progress lines until it pauses.
    now = time.monotonic()
    if now >= state["next_check"]:
        # Quick looks while a job starts (its instances may all run, and even end,
        # within a quarter of a second), the usual pace after.
        early = now - state.setdefault("since", now) < EARLY_SECONDS
        state["next_check"] = now + (EARLY_POLL if early else STATUS_POLL)
        job = client.refresh(store, job_id)
        if progress:
            counts, line = progress_line(job["task_name"] or "Task", store.instances(job_id))
            if counts != state["counts"]:
                state["counts"] = counts
                _write(out, state, (line + "\n").encode())
        if now >= state["idle_check"] and not JobStatus(job["status"]).is_terminal():
            state["idle_check"] = now + min(IDLE_CHECK, jobstatus.idle_after() / 2)
            idle = jobstatus.idle_now(store, job_id)
            names = [i["instance"] for i in idle]
            # Said once when workers go quiet, again if the set of quiet ones changes.
            if idle and names != state["idle"]:
                note = idle_note(idle).encode()
                _write(out, state, (colourise(note) if colour else note) + b"\n")
            state["idle"] = names
        if client.job_over(job) or (state.get("recorded") and JobStatus(job["status"]).is_terminal()):
            # One more read after the end, so no last line is lost.
            rest = state["partial"]
            while data := follower.read():
                rest += data
            if state["live"] is not None:
                state["live"].hide()
            if rest:
                rest += b"" if rest.endswith(b"\n") else b"\n"
                out.write(colourise(rest) if colour else rest)
            out.flush()
            return True
        if JobStatus(job["status"]).is_terminal():
            # The master is writing its last lines: look again once its record is
            # complete (the pipe it closes then) or it exits (its pidfd), or soon where
            # there is neither.
            state["watch"].release()
            if "master_exit" not in state:
                state["master_exit"] = state["recorded_fd"] if state["recorded_fd"] >= 0 \
                    else jobstatus.master_exit_fd(job)
            state["next_check"] = now + (STATUS_POLL if state["master_exit"] >= 0 else IDLE_SLEEP)
    if state["live"] is not None:
        state["live"].poll()
        if state["live"].shown:
            out.flush()
    if state["watch"].wait(state["next_check"] - time.monotonic(), state.get("wake_fd", -1),
                           state.get("master_exit", -1)):
        state["next_check"] = 0.0   # the master is gone, or its record complete: look at the job now
        state["recorded"] = state["master_exit"] == state["recorded_fd"]
    return False


def binary_stdout() -> IO[bytes]:
    return sys.stdout.buffer
