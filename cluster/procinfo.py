"""What /proc says about a process: its state, group, session and start time.

A pid alone can be recycled; a pid with its start time (clock ticks since boot)
names one process for good, which is how a job's master is recognised later.
"""

from __future__ import annotations

import gc
import os
import signal
import stat
import time
from collections import namedtuple

# state: R, S, D, Z, ...; start: the start time in clock ticks since boot (a str).
ProcStat = namedtuple("ProcStat", "state pgid sid start")


def proc_stat(pid: int | str) -> ProcStat | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: fields start after the last ')'.
    fields = stat[stat.rfind(b")") + 2:].split()
    return ProcStat(fields[0].decode(), int(fields[2]), int(fields[3]), fields[19].decode())


def start_time(pid: int) -> str | None:
    stat = proc_stat(pid)
    return stat.start if stat else None


def is_alive(pid: int, start: str | None) -> bool:
    """The process `pid` that started at `start` is still there (zombies are not).
    Without a start time nothing says the pid is still that process: False."""
    stat = proc_stat(pid)
    return start is not None and stat is not None and stat.state != "Z" and stat.start == start


class Unverified(Exception):
    """A pid whose identity cannot be checked: it is never signalled."""


def signal_verified(pid: int, start: str | None, signum: int) -> bool:
    """Send `signum` to `pid` only if it is still the process that started at
    `start` (pinned with a pidfd before the check, so it cannot be recycled
    meanwhile). False if it is gone or a zombie; Unverified, nothing sent, without
    a start time."""
    if start is None or not pid or pid <= 0:
        raise Unverified(f"pid {pid} has no recorded start time: it may name another process now; not signalled")
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if not is_alive(pid, start):
            return False
        signal.pidfd_send_signal(pidfd, signum)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(pidfd)


_BOOT_ID: str | None = None


def output_files(fds=(1, 2)) -> list[tuple[int, int]]:
    """(dev, ino) of the files this process's output goes to: its stdout or stderr
    when it is a file (`> log`), or the files the programs at the other end of its
    output pipe hold open (`| tee log`)."""
    stats = [os.fstat(fd) for fd in fds if _is_open(fd)]
    found = {(st.st_dev, st.st_ino) for st in stats if stat.S_ISREG(st.st_mode)}
    pipes = {f"pipe:[{st.st_ino}]" for st in stats if stat.S_ISFIFO(st.st_mode)}
    for pid in [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()] if pipes else ():
        try:
            fds = {f"/proc/{pid}/fd/{fd}": os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            if pipes & set(fds.values()):
                found |= {(st.st_dev, st.st_ino) for st in (os.stat(path) for path, to in fds.items()
                                                             if to.startswith("/")) if stat.S_ISREG(st.st_mode)}
        except OSError:
            continue   # gone meanwhile, or someone else's
    return sorted(found)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def boot_id() -> str | None:
    """This boot's random id: a pid and start time from another boot mean nothing."""
    global _BOOT_ID
    if _BOOT_ID is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                _BOOT_ID = f.read().strip()
        except OSError:
            return None
    return _BOOT_ID


_BOOT_TIME: float | None = None


def boot_time() -> float:
    """When this machine booted (seconds since the epoch; 0 if unknown): a process
    recorded before then is gone, whatever its pid and start time now name."""
    global _BOOT_TIME
    if _BOOT_TIME is None:
        _BOOT_TIME = 0.0
        try:
            with open("/proc/stat") as f:
                for line in f:
                    if line.startswith("btime "):
                        _BOOT_TIME = float(line.split()[1])
                        break
        except (OSError, ValueError):
            pass
    return _BOOT_TIME


def let_go_inherited(keep: tuple[int, ...] = ()) -> None:
    """In a forked child: let go of every descriptor above 2 but `keep`.

    Each is pointed at /dev/null rather than closed: the parent's Python objects
    came along with the fork, and one collected later would close whatever new
    file took its number. Those objects are frozen so their finalizers never run."""
    gc.freeze()
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
            if fd > 2 and fd != null and fd not in keep:
                try:
                    os.dup2(null, fd, inheritable=False)
                except OSError:
                    pass   # the listing's own descriptor, gone already
    finally:
        os.close(null)


# -- children reaped later -------------------------------------------------------------

# Children told to exit and not waited for: pid -> what to call with its exit code.
_UNREAPED: dict = {}


def reap_later(pid: int, reaped) -> None:
    """Our child `pid` exits by itself soon: reap it then (`reaped(exit code)`), not
    now. reap_children() takes the ones gone."""
    _UNREAPED[pid] = reaped
    reap_children()


def reap_children(timeout: float | None = None, only: int | None = None) -> None:
    """Reap the children given to reap_later (just `only`) that have exited; with
    `timeout`, wait up to that many seconds for the others, then SIGKILL them."""
    deadline = time.monotonic() + (timeout or 0.0)
    for pid in [p for p in _UNREAPED if only in (None, p)]:
        try:
            while (ended := os.waitpid(pid, os.WNOHANG)) == (0, 0):
                if timeout is None:
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    ended = os.waitpid(pid, 0)
                    break
                time.sleep(0.002)
        except ChildProcessError:   # reaped by someone else: its code is not ours to know
            _UNREAPED.pop(pid)
            continue
        if ended[0] == pid:
            _UNREAPED.pop(pid)(os.waitstatus_to_exitcode(ended[1]))
