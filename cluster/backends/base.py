"""The Backend interface: where an instance's process runs.

The JobMaster only ever calls these methods; a backend for other machines (SSH,
Ray) fills in the same ones. Every instance is a process group of its own, and
stopping one is always: SIGTERM to the group, a bounded wait, SIGKILL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Handle:
    pid: int
    pgid: int
    output_fd: int          # the instance's stdout+stderr, read by the master
    host: str
    native: Any = field(default=None, repr=False)   # the backend's own object (a Popen)


class Backend:
    host = "127.0.0.1"

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None) -> Handle:
        raise NotImplementedError

    def poll(self, handle: Handle) -> int | None:
        """The exit status once the instance's main process has ended (negative:
        killed by that signal), else None."""
        raise NotImplementedError

    def wait(self, handle: Handle) -> int:
        """Block until the main process has ended (after SIGKILL: briefly)."""
        raise NotImplementedError

    def signal(self, handle: Handle, signum: int) -> None:
        """Send `signum` to the instance's whole process group."""
        raise NotImplementedError
