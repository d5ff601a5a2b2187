"""What /proc says about a process: its state, group, session and start time.

A pid alone can be recycled; a pid with its start time (clock ticks since boot)
names one process for good, which is how a job's master is recognised later.
"""

from __future__ import annotations

import os
from typing import NamedTuple


class ProcStat(NamedTuple):
    state: str    # R, S, D, Z, ...
    pgid: int
    sid: int
    start: str    # start time in clock ticks since boot


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
    """The process `pid` that started at `start` is still there (zombies are not)."""
    stat = proc_stat(pid)
    return stat is not None and stat.state != "Z" and (start is None or stat.start == start)


def live_groups(pgids: set[int]) -> set[int]:
    """Which of `pgids` still have a live member (zombies excluded), in one pass."""
    found: set[int] = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = proc_stat(name)
            if stat and stat.pgid in pgids and stat.state != "Z":
                found.add(stat.pgid)
                if found == pgids:
                    break
    return found


def live_members(pgid: int) -> bool:
    """True while any process of the group is alive (zombies excluded)."""
    return bool(live_groups({pgid}))


_BOOT_ID: str | None = None


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
